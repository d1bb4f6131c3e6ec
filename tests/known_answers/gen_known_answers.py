#!/usr/bin/env python3
"""Known answers for mxq, computed without mxq: plain Python (no numpy, no torch), exact rational
arithmetic (fractions.Fraction) and the definitions in docs/numerics.md written out from scratch.

Writes, next to this file:
  known_answers.inc   C++ arrays read by tests/known_answer_test.cc
  known_answers.json  the same vectors for tests/python/test_known_answers.py

  python3 tests/known_answers/gen_known_answers.py          # regenerate
  python3 tests/known_answers/gen_known_answers.py --check  # fail if the stored files differ

What is computed, and how it avoids sharing code with mxq:
  * Stochastic rounding: Philox4x32-10 (checked here against Random123's known-answer vectors), the
    random field of element j = offset + row * K + column for 32, 16 and 8 bits, and the element
    rounded up iff rnd < floor(frac * 2^32) where frac = (|v| - lo) / (hi - lo) on the element grid
    (grid enumerated from the format's definition; v, lo, hi exact fractions). MXFP4, MXFP8 (E4M3),
    MXINT8 (floor rule) and NVFP4 (computed tensor scale) over a ragged K, with a non-zero offset.
  * The 128x4 swizzled scale layout, as a reshape/transpose of nested lists (torchao's to_blocked:
    view(n, 128, m, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2)), not the offset formula.
  * The NVFP4 tensor scale RN_f32(2688 / amax), the division exact and rounded once to float32.
"""
import json
import math
import os
import random
import struct
import sys
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))
M32 = 0xFFFFFFFF


# ---- float32 ---------------------------------------------------------------------------------------------
def f32_of_bits(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def bits_of_f32(f):
    return struct.unpack("<I", struct.pack("<f", f))[0]


def exact(u):
    """The exact value of fp32 bits u (finite) as a Fraction, and its sign (0 or 1)."""
    return Fraction(f32_of_bits(u & 0x7FFFFFFF)), u >> 31


def rn_f32(q, sign=0):
    """fp32 bits of the nonnegative Fraction q rounded to nearest even (overflow: Inf), with sign."""
    assert q >= 0
    if q == 0:
        return sign << 31
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    assert Fraction(2) ** e <= q < Fraction(2) ** (e + 1)
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n = q / quantum
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    v = fl * quantum
    if v >= Fraction(2) ** 128:
        return (sign << 31) | 0x7F800000
    return (sign << 31) | bits_of_f32(float(v))  # v is an fp32 value: float() is exact


# ---- element grids ---------------------------------------------------------------------------------------
def grid(fmt):
    """Nonnegative representable values, ascending, with their (positive) codes."""
    if fmt in ("mxfp4", "nvfp4"):  # E2M1
        vals = [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2), Fraction(3), Fraction(4),
                Fraction(6)]
        return list(zip(vals, range(8)))
    if fmt == "mxfp8_e4m3":  # E4M3 (fn): bias 7, 0x7F is NaN
        out = []
        for code in range(0x7F):
            e, m = code >> 3, code & 7
            v = Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
            out.append((v, code))
        return out
    if fmt == "mxint8":  # k * 2^-6, k = 0..127
        return [(Fraction(k, 64), k) for k in range(128)]
    raise ValueError(fmt)


EMAX = {"mxfp4": 2, "mxfp8_e4m3": 8, "mxint8": 0}
SIGN = {"mxfp4": 0x8, "nvfp4": 0x8, "mxfp8_e4m3": 0x80}


def encode(fmt, mag, sign, rnd=None):
    """Code of sign * mag (mag >= 0 exact): stochastic with the comparison word rnd, else RNE; saturating."""
    g = grid(fmt)
    if mag >= g[-1][0]:
        v, code = g[-1]
    else:
        i = max(k for k in range(len(g)) if g[k][0] <= mag)
        (lo, clo), (hi, chi) = g[i], g[i + 1]
        if mag == lo:
            code = clo
        elif rnd is None:
            d = (mag - lo) / (hi - lo)
            code = chi if d > Fraction(1, 2) or (d == Fraction(1, 2) and clo % 2 == 1) else clo
        else:
            t = math.floor((mag - lo) / (hi - lo) * 2 ** 32)
            code = chi if rnd < t else clo
    if fmt == "mxint8":
        return (-code) & 0xFF if sign and code else code  # no negative zero
    return code | (SIGN[fmt] if sign else 0)


def decode(fmt, code):
    """(magnitude Fraction, sign) of an element code."""
    if fmt == "mxint8":
        k = code - 256 if code >= 128 else code
        return Fraction(abs(k), 64), int(k < 0)
    sb = SIGN[fmt]
    mag = dict((c, v) for v, c in grid(fmt))[code & (sb - 1)]
    return mag, int(bool(code & sb))


# ---- Philox4x32-10 ---------------------------------------------------------------------------------------
def philox(ctr, key):
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


# Random123's kat_vectors for philox4x32_10
assert philox((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
assert philox((M32,) * 4, (M32, M32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
assert philox((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
    0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def random_word(seed, j, bits):
    """The 32-bit comparison word of element j: field j % (128 / B) of the 128 output bits (as one
    little-endian integer) at counter j / (128 / B); B high bits, the low 32 - B bits set."""
    per = 128 // bits
    c = j // per
    w = philox((c & M32, c >> 32, 0, 0), (seed & M32, seed >> 32))
    all128 = w[0] | (w[1] << 32) | (w[2] << 64) | (w[3] << 96)
    r = (all128 >> ((j % per) * bits)) & ((1 << bits) - 1)
    return (r << (32 - bits)) | ((1 << (32 - bits)) - 1)


# ---- stochastic-rounding cases -----------------------------------------------------------------------------
def make_input(rng, rows, K):
    """fp32 bits: blocks of differing magnitude, signs, a few zeros (both signs) and grid values."""
    out = []
    for r in range(rows):
        for k in range(K):
            if k % 16 == 0:
                mag = 2.0 ** rng.randint(-12, 12)
            u = rng.random()
            if u < 0.03:
                v = 0.0
            elif u < 0.05:
                v = -0.0
            else:
                v = rng.gauss(0.0, 1.0) * mag
            out.append(bits_of_f32(v))  # struct rounds the double to fp32
    return out


def quantize_sr(fmt, xs, rows, K, seed, offset, bits):
    g = 16 if fmt == "nvfp4" else 32
    nb = (K + g - 1) // g
    codes = [[0] * K for _ in range(rows)]
    scales = []
    S_bits = None
    if fmt == "nvfp4":
        amax = max(exact(u)[0] for u in xs)
        S_bits = rn_f32(Fraction(448 * 6) / amax) if amax > 0 else bits_of_f32(1.0)
        S = exact(S_bits)[0]
    for r in range(rows):
        row = xs[r * K:(r + 1) * K]
        for b in range(nb):
            blk = row[b * g:(b + 1) * g]
            amax = max(exact(u)[0] for u in blk)
            if fmt == "nvfp4":
                t = exact(rn_f32(exact(rn_f32(amax * S))[0] / 6))[0]  # RN(RN(amax * S) / 6)
                sc = encode("mxfp8_e4m3", min(t, Fraction(448)), 0)  # E4M3 RN, saturating
                s = decode("mxfp8_e4m3", sc)[0]
                m = exact(rn_f32(S / s))[0] if s else Fraction(0)
                scales.append(sc)
            else:
                e = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - EMAX[fmt]))
                # floor(log2) of an exact power-of-two-bounded Fraction: fix any float error
                if amax:
                    while Fraction(2) ** (e + EMAX[fmt]) > amax and e > -127:
                        e -= 1
                    while Fraction(2) ** (e + EMAX[fmt] + 1) <= amax and e < 127:
                        e += 1
                scales.append(e + 127)
            for i, u in enumerate(blk):
                k = b * g + i
                mag, sign = exact(u)
                rnd = random_word(seed, offset + r * K + k, bits)
                if fmt == "nvfp4":
                    v = exact(rn_f32(mag * m))[0] if mag else Fraction(0)
                else:
                    v = mag / Fraction(2) ** e
                codes[r][k] = encode(fmt, v, sign, rnd)
    return codes, scales, S_bits, nb


def dequantize(fmt, codes, scales, S_bits, rows, K, nb):
    """fp32 bits of each element decoded (the QDQ output of an fp32 input)."""
    g = 16 if fmt == "nvfp4" else 32
    out = []
    for r in range(rows):
        for k in range(K):
            mag, sign = decode(fmt, codes[r][k])
            sb = scales[r * nb + k // g]
            if fmt == "nvfp4":
                s = decode("mxfp8_e4m3", sb)[0]
                out.append(rn_f32(exact(rn_f32(mag * s))[0] / exact(S_bits)[0], sign))
            else:
                out.append(rn_f32(mag * Fraction(2) ** (sb - 127), sign))
    return out


def pack(fmt, codes, rows, K):
    if fmt not in ("mxfp4", "nvfp4"):
        return [c for row in codes for c in row]
    out = []
    for row in codes:
        for i in range(0, K, 2):
            out.append(row[i] | ((row[i + 1] << 4) if i + 1 < K else 0))
    return out


SR_CASES = [  # format, random bits, seed, offset
    ("mxfp4", 32, 0x0123456789ABCDEF, 1000003),
    ("mxfp4", 16, 7, 5),
    ("mxfp4", 8, 0xFFFFFFFF00000001, (1 << 36) + 99),  # counter's high word 1
    ("mxfp8_e4m3", 32, 42, (1 << 34) + 12345),  # counter's high word 1
    ("mxfp8_e4m3", 16, 0xDEADBEEFCAFEF00D, 3),
    ("mxfp8_e4m3", 8, 1, 77),
    ("mxint8", 32, 0x8000000000000000, 1),
    ("mxint8", 16, 12345, 1 << 20),
    ("mxint8", 8, 99, 11),
    ("nvfp4", 32, 2026, 17),
    ("nvfp4", 16, 0x0123456789ABCDEF, 999),
    ("nvfp4", 8, 3, (1 << 37) + 5),
]
SR_ROWS, SR_K = 3, 45  # K ragged for both group sizes


def sr_cases():
    rng = random.Random(40)
    out = []
    for fmt, bits, seed, offset in SR_CASES:
        xs = make_input(rng, SR_ROWS, SR_K)
        codes, scales, S_bits, nb = quantize_sr(fmt, xs, SR_ROWS, SR_K, seed, offset, bits)
        out.append(dict(format=fmt, random_bits=bits, seed=seed, offset=offset, rows=SR_ROWS, cols=SR_K, x=xs,
                        codes=pack(fmt, codes, SR_ROWS, SR_K), scales=scales,
                        tensor_scale=S_bits if S_bits is not None else 0,
                        qdq=dequantize(fmt, codes, scales, S_bits, SR_ROWS, SR_K, nb)))
    return out


# ---- the 128x4 swizzled layout --------------------------------------------------------------------------
SW_ROWS, SW_COLS = 200, 6  # padded to 256 x 8: two row tiles, two column tiles, padding in both


def to_blocked(mat, rows, cols):
    """torchao's to_blocked on nested lists: pad to (128 n, 4 m), tile (n, 128, m, 4) -> (n, m, 128, 4),
    each 128x4 tile -> (4, 32, 4) -> transpose to (32, 4, 4) -> flattened."""
    R, C = -(-rows // 128) * 128, -(-cols // 4) * 4
    pad = [[mat[r][c] if r < rows and c < cols else 0 for c in range(C)] for r in range(R)]
    flat = []
    for n in range(R // 128):
        for m in range(C // 4):
            tile = [[pad[n * 128 + i][m * 4 + j] for j in range(4)] for i in range(128)]
            t4 = [[tile[a * 32 + b] for b in range(32)] for a in range(4)]  # (4, 32, 4)
            for b in range(32):  # transpose(1, 2): (32, 4, 4)
                for a in range(4):
                    flat.extend(t4[a][b])
    return flat, R, C


def swizzle_case():
    rng = random.Random(128)
    lin = [[rng.randrange(256) for _ in range(SW_COLS)] for _ in range(SW_ROWS)]
    sw, R, C = to_blocked(lin, SW_ROWS, SW_COLS)
    # where each (r, c) of the padded [R, C] lands: to_blocked of the index matrix
    idx, _, _ = to_blocked([[r * C + c for c in range(C)] for r in range(R)], R, C)
    offsets = [0] * (R * C)
    for pos, i in enumerate(idx):
        offsets[i] = pos
    return dict(rows=SW_ROWS, cols=SW_COLS, padded_rows=R, padded_cols=C,
                linear=[v for row in lin for v in row], swizzled=sw, offsets=offsets)


# ---- NVFP4 tensor scale --------------------------------------------------------------------------------------
def tensor_scale_case():
    rng = random.Random(2688)
    amax = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x00000002, 0x00000003,
            0x007FFFFF, 0x00800000, 0x3F800000, 0xBF800000, 0x45280000, 0x7F7FFFFF, 0x7F000000, 0x40C00000]
    # around the overflow boundary 2688 / FLT_MAX-ish: amax of a few ulps near 2688 * 2^-128
    base = rn_f32(Fraction(2688) / (Fraction(2) ** 128))
    amax += [base + d for d in range(-4, 5)]
    amax += [rng.randrange(0x00000001, 0x7F800000) for _ in range(1500)]  # every binade
    amax += [bits_of_f32(rng.uniform(0.01, 100.0)) for _ in range(500)]  # activation-like
    S = []
    for u in amax:
        a = u & 0x7FFFFFFF
        if a == 0 or a >= 0x7F800000:
            S.append(bits_of_f32(1.0))
            continue
        s = rn_f32(Fraction(448 * 6) / exact(a)[0])
        S.append(0x7F7FFFFF if s == 0x7F800000 else s)
    return dict(amax=amax, scale=S)


# ---- output ----------------------------------------------------------------------------------------------
def arr(ctype, name, vals, width=12, fmt="0x{:02X}"):
    lines = []
    for i in range(0, len(vals), width):
        lines.append("    " + ", ".join(fmt.format(v) for v in vals[i:i + width]) + ",")
    return f"inline const {ctype} {name}[] = {{\n" + "\n".join(lines) + "\n};\n"


def render(sr, sw, ts):
    h = ["// Generated by tests/known_answers/gen_known_answers.py (plain Python, independent of mxq): do not edit.",
         "// Read by tests/known_answer_test.cc.", "#pragma once", "#include <cstdint>", "",
         "namespace ka {", ""]
    for i, c in enumerate(sr):
        h.append(f"// {c['format']}, {c['random_bits']} random bits, seed 0x{c['seed']:X}, offset {c['offset']}")
        h.append(arr("std::uint32_t", f"sr{i}_x", c["x"], 6, "0x{:08X}u"))
        h.append(arr("std::uint8_t", f"sr{i}_codes", c["codes"]))
        h.append(arr("std::uint8_t", f"sr{i}_scales", c["scales"]))
        h.append(arr("std::uint32_t", f"sr{i}_qdq", c["qdq"], 6, "0x{:08X}u"))
    h.append("struct SrCase {\n  const char* format;\n  int random_bits;\n  std::uint64_t seed, offset;\n"
             "  int rows, cols;\n  std::uint32_t tensor_scale;  // fp32 bits of the computed S (NVFP4)\n"
             "  const std::uint32_t* x;  // fp32 bits [rows, cols]\n  const std::uint8_t* codes;\n"
             "  int ncodes;\n  const std::uint8_t* scales;  // linear [rows, ceil(cols / g)]\n  int nscales;\n"
             "  const std::uint32_t* qdq;  // fp32 bits [rows, cols]\n};")
    h.append("inline const SrCase sr_cases[] = {")
    for i, c in enumerate(sr):
        h.append(f"    {{\"{c['format']}\", {c['random_bits']}, 0x{c['seed']:X}ull, 0x{c['offset']:X}ull, {c['rows']}, "
                 f"{c['cols']}, 0x{c['tensor_scale']:08X}u, sr{i}_x, sr{i}_codes, {len(c['codes'])}, sr{i}_scales, "
                 f"{len(c['scales'])}, sr{i}_qdq}},")
    h.append("};\n")
    h.append(f"// Swizzled 128x4 layout: linear [{sw['rows']}, {sw['cols']}] -> [{sw['padded_rows']}, {sw['padded_cols']}]")
    h.append(f"inline constexpr int sw_rows = {sw['rows']}, sw_cols = {sw['cols']}, sw_padded_rows = "
             f"{sw['padded_rows']}, sw_padded_cols = {sw['padded_cols']};")
    h.append(arr("std::uint8_t", "sw_linear", sw["linear"]))
    h.append(arr("std::uint8_t", "sw_swizzled", sw["swizzled"]))
    h.append("// byte offset of (r, c) in the swizzled layout, [sw_padded_rows, sw_padded_cols] row-major")
    h.append(arr("std::uint16_t", "sw_offsets", sw["offsets"], 12, "{:d}"))
    h.append("// NVFP4 tensor scale: fp32 bits of amax and of S = RN_f32(2688 / |amax|) (1 for 0 / Inf / NaN, "
             "clamped to FLT_MAX)")
    h.append(arr("std::uint32_t", "ts_amax", ts["amax"], 6, "0x{:08X}u"))
    h.append(arr("std::uint32_t", "ts_scale", ts["scale"], 6, "0x{:08X}u"))
    h.append("}  // namespace ka")
    return "\n".join(h) + "\n"


def main():
    sr, sw, ts = sr_cases(), swizzle_case(), tensor_scale_case()
    inc = render(sr, sw, ts)
    js = json.dumps(dict(generator="tests/known_answers/gen_known_answers.py", stochastic_rounding=sr, swizzle=sw,
                         tensor_scale=ts), separators=(",", ":")) + "\n"
    files = {"known_answers.inc": inc, "known_answers.json": js}
    if "--check" in sys.argv:
        bad = [n for n, t in files.items() if open(os.path.join(HERE, n)).read() != t]
        if bad:
            sys.exit("stale: " + ", ".join(bad) + " (rerun tests/known_answers/gen_known_answers.py)")
        return
    for n, t in files.items():
        with open(os.path.join(HERE, n), "w") as f:
            f.write(t)


if __name__ == "__main__":
    main()
