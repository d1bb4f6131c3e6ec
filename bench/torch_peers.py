#!/usr/bin/env python3
"""Time torch eager and torch.compile implementations of the math cuda_bench times, on the same GPU,
with the same method (bf16 LLM-like input, L2 flushed before every timed run for the large shapes,
CUDA events, median), and print one table merging them with cuda_bench's JSON lines.

The torch functions are straightforward PyTorch renderings of each operation (the way the code in
the seed pull requests is written); they compute the same math up to tie and saturation details, so
they are speed peers, not bit-exactness references (mxq's reference is its CPU backend).

usage: torch_peers.py MXQ_JSON [--reps N] [--markdown FILE] [--quick]
"""
import argparse
import json
import statistics
import sys

import torch

F8 = torch.float8_e4m3fn


def fp4_round(a):
    """RNE of a >= 0 onto the E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating."""
    a = a.clamp(max=6.0)
    return torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))


def mx_exponent(amax, rule, emax, mbits):
    if rule == "floor":
        e = torch.floor(torch.log2(amax)) - emax
    else:  # even: round amax's significand to mbits first
        m, ex = torch.frexp(amax)
        mr = torch.round(m * 2.0 ** (mbits + 1)) / 2.0 ** (mbits + 1)
        e = (ex - 1 + (mr >= 1.0).to(ex.dtype)).float() - emax
    return torch.where(amax == 0, torch.full_like(e, -127.0), e.clamp(-127, 127))


def qdq_mxfp4_even(x):
    R, K = x.shape
    xf = x.float().view(R, K // 32, 32)
    scale = torch.exp2(mx_exponent(xf.abs().amax(-1, keepdim=True), "even", 2, 1))
    xs = xf / scale
    return (torch.sign(xs) * fp4_round(xs.abs()) * scale).view(R, K).to(x.dtype)


def qdq_mxfp8_floor(x):
    R, K = x.shape
    xf = x.float().view(R, K // 32, 32)
    scale = torch.exp2(mx_exponent(xf.abs().amax(-1, keepdim=True), "floor", 8, 3))
    q = (xf / scale).clamp(-448, 448).to(F8).float()
    return (q * scale).view(R, K).to(x.dtype)


def qdq_mxfp4_sr(x):
    R, K = x.shape
    xf = x.float().view(R, K // 32, 32)
    scale = torch.exp2(mx_exponent(xf.abs().amax(-1, keepdim=True), "even", 2, 1))
    a = (xf / scale).abs().clamp(max=6.0)
    q = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    lo = torch.floor(a / q) * q
    r = lo + q * (torch.rand_like(a) < (a - lo) / q).float()
    return (torch.sign(xf) * r.clamp(max=6.0) * scale).view(R, K).to(x.dtype)


def qdq_nvfp4(x, S=None):
    R, K = x.shape
    xf = x.float().view(R, K // 16, 16)
    if S is None:
        S = 448.0 * 6.0 / xf.abs().amax()
    s = (xf.abs().amax(-1, keepdim=True) * S / 6).clamp(max=448).to(F8).float()
    m = torch.where(s == 0, torch.zeros_like(s), S / s)
    xm = xf * m
    return (torch.sign(xm) * fp4_round(xm.abs()) * s / S).view(R, K).to(x.dtype)


def to_blocked(s):
    """Linear [R, C] scales -> the 128x4 swizzled layout, rows padded to 128 and columns to 4 with zeros."""
    R, C = s.shape
    Rp, Cp = (R + 127) // 128 * 128, (C + 3) // 4 * 4
    if (Rp, Cp) != (R, C):
        s = torch.nn.functional.pad(s, (0, Cp - C, 0, Rp - R))
        R, C = Rp, Cp
    b = s.view(R // 128, 128, C // 4, 4).permute(0, 2, 1, 3)
    return b.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def quantize_mxfp4_swizzled(x):
    R, K = x.shape
    xf = x.float().view(R, K // 32, 32)
    e = mx_exponent(xf.abs().amax(-1, keepdim=True), "even", 2, 1)
    v = fp4_round((xf / torch.exp2(e)).abs())
    code = torch.where(v < 2, v * 2, torch.where(v < 4, v + 2, v / 2 + 4)).to(torch.uint8)
    code = code | ((xf < 0).to(torch.uint8) << 3)
    code = code.view(R, K)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, to_blocked((e + 127).to(torch.uint8).view(R, K // 32))


_HAD = {}


def hadamard(x, rs):
    """x @ (H / sqrt(RS)) per group of RS elements of a row (the rotation mxq fuses), in fp32."""
    key = (rs, x.device)
    if key not in _HAD:
        i = torch.arange(rs, device=x.device)
        bits = torch.bitwise_and(i[:, None], i[None, :])
        par = torch.zeros_like(bits)
        for k in range(8):
            par ^= (bits >> k) & 1
        _HAD[key] = (1.0 - 2.0 * par.float()) / rs ** 0.5
    R, K = x.shape
    return (x.float().view(R, K // rs, rs) @ _HAD[key]).view(R, K)


PEERS = {
    ("qdq", "mxfp4", "even"): lambda x, S: qdq_mxfp4_even(x),
    ("qdq", "mxfp8_e4m3", "floor"): lambda x, S: qdq_mxfp8_floor(x),
    ("qdq", "nvfp4", "given S"): lambda x, S: qdq_nvfp4(x, S),
    ("qdq", "nvfp4", "computed S"): lambda x, S: qdq_nvfp4(x),
    ("qdq", "mxfp4", "even, stochastic"): lambda x, S: qdq_mxfp4_sr(x),
    ("quantize", "mxfp4", "even, swizzled"): lambda x, S: quantize_mxfp4_swizzled(x),
    ("qdq", "mxfp4", "even, graph"): lambda x, S: qdq_mxfp4_even(x),
    ("qdq", "nvfp4", "computed S, graph"): lambda x, S: qdq_nvfp4(x),
    # rotate, then QDQ / quantize (the rotated fp32 tensor; mxq rounds only the QDQ output to bf16)
    ("qdq", "mxfp4", "even, had32"): lambda x, S: qdq_mxfp4_even(hadamard(x, 32)).to(x.dtype),
    ("qdq", "mxfp4", "even, had128"): lambda x, S: qdq_mxfp4_even(hadamard(x, 128)).to(x.dtype),
    ("qdq", "mxfp4", "even, had256"): lambda x, S: qdq_mxfp4_even(hadamard(x, 256)).to(x.dtype),
    ("qdq", "nvfp4", "given S, had128"): lambda x, S: qdq_nvfp4(hadamard(x, 128), S).to(x.dtype),
    ("quantize", "mxfp4", "even, swizzled, had128"): lambda x, S: quantize_mxfp4_swizzled(hadamard(x, 128)),
    ("qdq", "mxfp4", "even, had128, graph"): lambda x, S: qdq_mxfp4_even(hadamard(x, 128)).to(x.dtype),
}


def llm_like(R, K):
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(R, K, device="cuda", generator=g) * 0.02
    x[:, 13::97] *= 150.0
    return x.to(torch.bfloat16)


def bench(fn, reps, flush):
    cache = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        if flush:
            cache.zero_()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mxq_json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--markdown")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    lines = [json.loads(l) for l in open(args.mxq_json) if l.strip()]
    copy = next(l for l in lines if l["kind"] == "copy")
    rows = [l for l in lines if l["kind"] == "mxq"]
    torch._dynamo.config.cache_size_limit = 64
    inputs = {}
    out = []
    for r in rows:
        key = (r["op"], r["format"], r["mode"])
        eager_us = compile_us = None
        if key in PEERS:
            R, K = map(int, r["shape"].split("x"))
            if (R, K) not in inputs:
                x = llm_like(R, K)
                inputs[(R, K)] = (x, (448.0 * 6.0 / x.float().abs().amax()).item())
            x, S = inputs[(R, K)]
            fn = PEERS[key]
            flush = "graph" not in r["mode"]  # decode shapes: per call, L2 warm
            eager_us = bench(lambda: fn(x, S), args.reps, flush)
            if not args.no_compile:
                cfn = torch.compile(fn, dynamic=False)
                compile_us = bench(lambda: cfn(x, S), args.reps, flush)
            print(f"  peers {key} {r['shape']}: eager {eager_us:.1f} us, compile {compile_us} us", file=sys.stderr, flush=True)
        out.append((r, eager_us, compile_us))

    gpu = copy["gpu"]
    hdr = f"GPU: {gpu}; device copy bandwidth {copy['gbs']:.0f} GB/s (read + write); bf16 input"
    table = ["| op | format | shape | mode | us | GB/s | % of copy | x torch.compile | x eager |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r, e, c in out:
        gbs = r["bytes"] / r["us"] / 1e3
        xc = f"{c / r['us']:.1f}" if c else "-"
        xe = f"{e / r['us']:.1f}" if e else "-"
        table.append(f"| {r['op']} | {r['format']} | {r['shape']} | {r['mode']} | {r['us']:.1f} | {gbs:.0f} | "
                     f"{100 * gbs / copy['gbs']:.1f}% | {xc} | {xe} |")
    print(hdr)
    print("\n".join(table))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(hdr + "\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
