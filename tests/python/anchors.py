"""Independent plain-torch transcriptions of the reference arithmetic of the projects mxq's compat
shims replace, written from their documented recipes (docs/python.md, docs/numerics.md
"Compatibility presets"), not from their code:

- the vllm-qdq-plugin's MXFP4 reference (vLLM's reference_mxfp4): per 32, amax in the input dtype,
  rounded at E2M1's one mantissa bit (half up, by adding half a unit to its bit pattern and
  dropping the mantissa), scale 2^(floor(log2) - 2) in the input dtype, x / scale in the input
  dtype, RNE onto E2M1 saturating at 6, times the scale in the input dtype;
- its MXFP8 reference: in fp32, scale 2^(floor(log2 amax) - 8), clamp to 448, the subnormal range
  rounded on the 2^-9 grid then clamped to 7 * 2^-9, the normal range rounded with a step
  2^(floor(log2 |v|) - 3), the sign reapplied by multiplying with sign(v);
- QuTLASS's test reference with an identity rotation (tests/mxfp4_test.py, tests/nvfp4_test.py):
  float64 statistics, scales 2^floor(log2(...)) (MX) or E4M3(amax + 1e-8) (NV, global scale 6),
  elements by nearest grid value with ties to the even code index, where +0.0 meets the grid's -0.0
  entry first and gets the negative-zero code.

test_upstream.py holds these transcriptions to the upstream code's own outputs, bit for bit
(tests/known_answers/upstream/: run from those repositories at pinned commits).
"""
from __future__ import annotations

import torch

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _rne_e2m1(v: torch.Tensor) -> torch.Tensor:
    """RNE of v onto E2M1 (saturating), returned as v's dtype; the sign kept (copysign)."""
    a = v.double().abs().clamp(max=6.0)
    hi = torch.searchsorted(E2M1_GRID, a).clamp(max=7)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - E2M1_GRID[lo], E2M1_GRID[hi] - a
    q = torch.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), E2M1_GRID[hi], E2M1_GRID[lo])
    return torch.copysign(q, v.double()).to(v.dtype)


def _blocks(x: torch.Tensor, g: int) -> torch.Tensor:
    m, k = x.shape
    return torch.nn.functional.pad(x, (0, (-k) % g)).reshape(m, -1, g)


# ---- vllm-qdq-plugin ------------------------------------------------------------------------------
def plugin_mxfp4_scale(x: torch.Tensor, g: int = 32) -> torch.Tensor:
    """The reference's per-block scale, in x's dtype, [M, K/g]."""
    dt = x.dtype
    mant = 7 if dt == torch.bfloat16 else 10
    amax = _blocks(x, g).abs().amax(-1)
    bits = amax.view(torch.int16).to(torch.int32)
    bits = (bits + (1 << (mant - 2))) & ~((1 << mant) - 1)
    amax_r = bits.to(torch.int16).view(dt).float()
    with torch.no_grad():
        lg = torch.floor(torch.log2(amax_r))
    e = torch.where(torch.isfinite(lg), lg, torch.full_like(lg, -1e9)).clamp(-1e9, 1e9).to(torch.int64) - 2
    e = e.clamp(-127, 127)
    return torch.exp2(e.double()).to(dt)


def plugin_mxfp4_qdq(x: torch.Tensor, g: int = 32) -> torch.Tensor:
    m, k = x.shape
    s = plugin_mxfp4_scale(x, g)[..., None]
    q = _rne_e2m1(_blocks(x, g) / s)
    return (q * s).reshape(m, -1)[:, :k]


def _rne_int(v: torch.Tensor) -> torch.Tensor:
    return torch.round(v)  # half to even


def plugin_mxfp8_qdq(x: torch.Tensor, g: int = 32) -> torch.Tensor:
    m, k = x.shape
    xb = _blocks(x, g).float()
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    e = (torch.floor(torch.log2(amax)) - 8).clamp(-127, 127)
    scale = torch.exp2(e)
    v = xb / scale
    a = v.abs().clamp(max=448.0)
    sub = (_rne_int(a / 2.0**-9) * 2.0**-9).clamp(max=7 * 2.0**-9)
    ex = torch.floor(torch.log2(a.clamp(min=2.0**-6))).clamp(-6, 8)
    step = torch.exp2(ex - 3)
    nrm = (_rne_int(a / step) * step).clamp(2.0**-6, 448.0)
    q = torch.where(a < 2.0**-6, sub, nrm) * torch.sign(v)
    return (q * scale).to(x.dtype).reshape(m, -1)[:, :k]


def plugin_nvfp4_e5m3_qdq(x: torch.Tensor, g: int = 16) -> torch.Tensor:
    """The plugin's NVFP4-with-UE5M3 reference, from its documented recipe (docs/numerics.md, "NVFP4 with
    UE5M3 scales"): K zero-padded to g; per block v = fp32(amax / 6) with amax NaN-propagating; v rounded
    onto UE5M3 on v's fp32 bits (3 mantissa bits, RNE, carry into the exponent) where v >= 2^-14, else
    round(v * 2^17) / 2^17 (torch's half-to-even), then min(., 114688) (a NaN/Inf v's bits give +Inf: the
    clamp); elements 0 where the scale is 0, else RNE_E2M1_sat(fp32(x / s)) with x's sign (copysign), times
    s in fp32, cast to x's dtype."""
    rows, k = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, (-k) % g)).reshape(rows, -1, g)
    v = xp.abs().amax(dim=-1) / 6.0
    b = v.view(torch.int32)
    e = ((b >> 23) & 0xFF) - 112  # the UE5M3 exponent field of a normal v
    m = (b & 0x7FFFFF) >> 20
    rest = b & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((m & 1) == 1))
    m = m + up.to(torch.int32)
    e = e + (m == 8).to(torch.int32)
    m = torch.where(m == 8, torch.zeros_like(m), m)
    normal = torch.ldexp(1.0 + m.float() / 8.0, e - 15)
    s = torch.where(v < 2.0 ** -14, torch.round(v * 131072.0) / 131072.0, normal).clamp(max=114688.0)
    s = s.unsqueeze(-1)
    q = torch.where(s == 0, torch.zeros_like(xp), xp / s)
    a = q.abs()
    r = torch.where(a < 2.0, torch.round(a * 2.0) / 2.0,
                    torch.where(a < 4.0, torch.round(a), 2.0 * torch.round(a / 2.0))).clamp(max=6.0)
    return (torch.copysign(r, q) * s).reshape(rows, -1)[:, :k].to(x.dtype)


# ---- QuTLASS's test reference, identity rotation --------------------------------------------------
_CODE_GRID = torch.tensor([-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                          dtype=torch.float64)
_CODES = torch.tensor([15, 14, 13, 12, 11, 10, 9, 8, 0, 1, 2, 3, 4, 5, 6, 7])


def _e2m1_codes_qutlass(v: torch.Tensor) -> torch.Tensor:
    """Nearest grid entry, ties to the even code, the grid searched from -6 up (so +0.0 lands on -0.0;
    NaN, past the end, gets the code of 6)."""
    idx = torch.searchsorted(_CODE_GRID, v, right=False)
    hi, lo = idx.clamp(0, 15), (idx - 1).clamp(0, 15)
    dlo, dhi = v - _CODE_GRID[lo], _CODE_GRID[hi] - v
    pick = (dhi < dlo) | ((dhi == dlo) & (_CODES[hi] % 2 == 0))
    return torch.where(pick, _CODES[hi], _CODES[lo])


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def qutlass_mx_ref(x: torch.Tensor, quest: bool, scale_bytes=None):
    """(codes uint8 [..., K/2], scale bytes uint8 [rows, K/32], clip mask bool [..., K]); with
    `scale_bytes` given, the elements are computed with those scales instead of the reference's."""
    y = x.double().unflatten(-1, (-1, 32))
    if scale_bytes is not None:
        e = scale_bytes.reshape(y.shape[:-1]).double() - 127
    elif quest:
        e = torch.floor(torch.log2(y.std(dim=-1, correction=0) * (2.92247856 / 6.0) + 1e-8))
    else:
        e = torch.floor(torch.log2(y.abs().amax(dim=-1) + 1e-8))
    v = y / torch.exp2(e)[..., None]
    if not quest:
        v = v * 3
    codes = _e2m1_codes_qutlass(v).flatten(-2)
    scale_bytes = (e + 127).to(torch.uint8).reshape(-1, x.shape[-1] // 32)
    return _pack(codes), scale_bytes, (v.abs() < 6.0).flatten(-2)


def qutlass_nv_ref(x: torch.Tensor):
    """Global scale 6 (as QuTLASS's test): (codes uint8 [..., K/2], scale E4M3 bytes [rows, K/16])."""
    y = x.double().unflatten(-1, (-1, 16))
    # NOTE: the explicit clamp at 448 (E4M3's largest value) is QuTLASS's kernel (cvt.rn.satfinite);
    # a bare .to(float8_e4m3fn) of a larger value depends on torch's version (torch 2.11+cu130
    # gives the NaN code 0x7F, torch 2.15's CPU wheel saturates), so the transcription does not rely on it.
    s = (y.abs().amax(dim=-1) + 1e-8).clamp(max=448.0).to(torch.float8_e4m3fn)
    v = y / s.double()[..., None] * 6.0
    codes = _e2m1_codes_qutlass(v).flatten(-2)
    return _pack(codes), s.view(torch.uint8).reshape(-1, x.shape[-1] // 16)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool [..., K] mask as bytes [..., K/8], element 8j+i in bit i."""
    b = mask.to(torch.uint8).unflatten(-1, (-1, 8))
    return sum((b[..., i] << i) for i in range(8)).to(torch.uint8)


# ---- QuTLASS's fusedQuantizeNv at any global scale ------------------------------------------------
# Its test reference (tests/nvfp4_test.py) only covers global scale 6, where the global scale cancels
# out; its kernels take any gs, with this arithmetic (read from their source), transcribed here in
# IEEE fp32 (the kernels use approximate reciprocals, which nothing can match bit for bit):
#   SF = RN32(gs * RN32(amax * RN32(1/6)));  s = E4M3_RN_satfinite(SF);  m = RN32(1 / RN32(s / gs));
#   codes = E2M1_RNE_sat of RN32(y * m), the sign bit kept (the kernel's cvt: +0.0 -> 0x0, -0.0 -> 0x8;
#   only the test reference's grid search gives +0.0 the code 0x8);
# and it dequantizes as code * s / gs (the reference's _dq_fp4 with alpha = gs).
# Awkward global scales: the test data (amax from 0 to ~1e30) puts blocks below E4M3's smallest
# subnormal (scale byte 0) and above 448 (saturated) at most of these.
NV_GLOBAL_SCALES = [6.0, 1.0, 3.7, 1.0 / 3.0, 2.0**-20, 1e-30, 2.0**40, 1e30]


def qutlass_nv_ref_gs(x: torch.Tensor, gs: float):
    """(codes uint8 [..., K/2], scale bytes uint8 [rows, K/16]) of QuTLASS's kernel arithmetic above."""
    y = x.float().unflatten(-1, (-1, 16))
    g = torch.tensor(gs, dtype=torch.float32)
    sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32)
    amax = y.abs().amax(dim=-1)
    sf = g * (amax * sixth)
    s = sf.clamp(max=448.0).to(torch.float8_e4m3fn)  # satfinite (see qutlass_nv_ref's NOTE)
    m = 1.0 / (s.float() / g)
    v = y * m[..., None]
    codes = e2m1_codes_rne(v.double()).flatten(-2)
    return _pack(codes), s.view(torch.uint8).reshape(-1, x.shape[-1] // 16)


def e2m1_codes_rne(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of v: round to nearest, ties to the even code, saturating at 6, the sign bit kept
    (+0.0 -> 0x0, -0.0 -> 0x8); NaN (0 times an infinite multiplier) -> magnitude 7."""
    a = v.double().abs()
    hi = torch.searchsorted(E2M1_GRID, a.clamp(max=6.0)).clamp(max=7)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - E2M1_GRID[lo], E2M1_GRID[hi] - a
    idx = torch.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    idx = torch.where(torch.isnan(a), torch.full_like(idx, 7), idx)
    return idx | (torch.signbit(v).to(idx.dtype) << 3)


_DQ_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        dtype=torch.float64)


def qutlass_nv_dequant(codes: torch.Tensor, scale_bytes: torch.Tensor, alpha: float) -> torch.Tensor:
    """QuTLASS's test dequantization (_dq_fp4): code * E4M3(scale) / alpha, in float64."""
    c = codes.to(torch.int64)
    v = _DQ_GRID[torch.stack([c & 0xF, c >> 4], -1).flatten(-2)]
    s = scale_bytes.view(torch.float8_e4m3fn).double()
    return (v.unflatten(-1, (-1, 16)) * s[..., None]).flatten(-2) / alpha


def near_e4m3_midpoint(t: torch.Tensor, rel: float) -> torch.Tensor:
    """Where the float64 values t (>= 0) lie within rel (relative) of a rounding boundary of E4M3
    (a midpoint between two neighbouring values, 0 and the smallest subnormal included; above 448
    everything saturates)."""
    t = t.double()
    e = torch.floor(torch.log2(t.clamp(min=2.0**-6)))  # subnormals share the 2^-6 binade's spacing
    ulp = torch.exp2(e - 3)
    mid = (torch.floor(t / ulp) + 0.5) * ulp
    near = torch.minimum((t - mid).abs(), (t - (mid - ulp)).abs()) <= t * rel
    return near & (t < 464.0)
