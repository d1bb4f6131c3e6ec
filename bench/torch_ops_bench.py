#!/usr/bin/env python3
"""Time mxq's PyTorch ops against plain-torch renderings of the same math (bench/torch_peers.py:
eager, and torch.compile of it), at decode (16 rows) and prefill (8192 rows) shapes, eagerly and as
CUDA-graph replays, and the per-call host overhead of the Python wrappers; print a markdown table.

Method: CUDA events around each call, median of --reps runs; for the prefill shapes the L2 is
flushed (a write of 2x its size) before every timed run (cold L2); decode shapes run warm, as in a
decode loop. The graph columns at decode shapes replay a graph of 20 back-to-back calls and divide
by 20: the time one node adds inside a model's graph (one replay per event pair would mostly time
the graph launch, about 8 us); at prefill shapes the graph holds one call. Byte model (GB/s column): QDQ reads and writes x (2 bytes/element each for bf16);
quantize reads x and writes the codes (FP4: 1/2 byte/element) and scales (1/32 byte/element).
"x peer" is the fastest torch time (eager, compiled, compiled in a graph) over mxq's time.

    python bench/torch_ops_bench.py [--reps 50] [--quick] [--markdown FILE] [--no-compile]
Without a GPU only the CPU per-call overhead is measured.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import mxq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peers as P  # noqa: E402  (the plain-torch renderings the C++ benchmark compares with)

SHAPES = [(16, 4096), (16, 8192), (8192, 4096), (8192, 8192)]
QUICK_SHAPES = [(16, 4096), (8192, 4096)]


def cases(S_of):
    """(name, mxq call, torch peer, bytes per element written) per case."""
    return [
        ("qdq mxfp4 even", lambda x: mxq.qdq(x, "mxfp4", rule="even"), P.qdq_mxfp4_even, 2.0),
        ("qdq mxfp8 floor", lambda x: mxq.qdq(x, "mxfp8", rule="floor"), P.qdq_mxfp8_floor, 2.0),
        ("qdq nvfp4 given S", lambda x: mxq.qdq(x, "nvfp4", tensor_scale=S_of(x)), lambda x: P.qdq_nvfp4(x, S_of(x)),
         2.0),
        ("qdq nvfp4 computed S", lambda x: mxq.qdq(x, "nvfp4"), P.qdq_nvfp4, 2.0),
        ("qdq mxfp4 even stochastic", lambda x: mxq.qdq(x, "mxfp4", rule="even", stochastic=True, seed=1),
         P.qdq_mxfp4_sr, 2.0),
        ("quantize mxfp4 even swizzled", lambda x: mxq.quantize(x, "mxfp4", rule="even", layout="swizzled"),
         P.quantize_mxfp4_swizzled, 0.5 + 1 / 32),
    ]


def timed(fn, reps, flush_buf, per=1):
    """Median GPU microseconds of fn() over reps runs, divided by per (the calls one fn() makes)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        if flush_buf is not None:
            flush_buf.zero_()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / per)
    return statistics.median(ts)


def graphed(fn, calls=1):
    """`calls` back-to-back calls of fn captured in one CUDA graph (after a warm-up on a side
    stream); returns the replay callable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def per_call_overhead(device, calls, trials=20):
    """Host microseconds per call of a tiny op: the Python wrapper, the raw torch.ops call, and trivial
    torch ops for scale (torch.add through its generated binding, and aten.add through the same
    torch.ops path as mxq's ops). On CUDA the calls are enqueued back to back, then synchronised.
    The best of `trials` batches of calls/trials (other processes only ever add time)."""
    x = torch.randn(1, 32, device=device, dtype=torch.bfloat16)
    add = torch.ops.aten.add.Tensor
    fns = {
        "mxq.qdq (Python API)": lambda: mxq.qdq(x, "mxfp4", rule="even"),
        "torch.ops.mxq.qdq (op)": lambda: torch.ops.mxq.qdq(x, "mxfp4", "even", 0, False, 0, 0, None),
        "mxq.quantize (Python API)": lambda: mxq.quantize(x, "mxfp4", rule="even"),
        "torch.add (baseline)": lambda: torch.add(x, 1),
        "torch.ops.aten.add.Tensor (baseline, the torch.ops path)": lambda: add(x, x),
    }
    n = max(1, calls // trials)
    out = {}
    for name, fn in fns.items():
        for _ in range(200):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        out[name] = best
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer reps")
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile peers")
    ap.add_argument("--calls", type=int, default=10000, help="calls for the per-call overhead")
    args = ap.parse_args()
    lines = ["## Per-call host overhead (1x32 bf16, us per call)", "", "| device | op | us/call |", "|---|---|---|"]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and mxq.cuda_available() else [])
    for dev in devices:
        for name, us in per_call_overhead(dev, args.calls).items():
            lines.append(f"| {dev} | {name} | {us:.2f} |")
    print("\n".join(lines), flush=True)
    if "cuda" not in devices:
        print("\n(no usable CUDA GPU: the op timings need one)")
        return _write(args, lines)
    reps = 20 if args.quick else args.reps
    props = torch.cuda.get_device_properties(0)
    flush_buf = torch.empty(2 * props.L2_cache_size, dtype=torch.uint8, device="cuda")
    torch._dynamo.config.cache_size_limit = 256
    tab = ["", f"## mxq ops vs torch on {props.name} (median of {reps}; us; cold L2 for 8192 rows; "
           f"graph columns at 16 rows: per call in a graph of 20)", "",
           "| op | shape | mxq eager | mxq graph | GB/s (graph) | torch eager | torch.compile | compile graph | x peer |",
           "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(tab), flush=True)
    for R, K in (QUICK_SHAPES if args.quick else SHAPES):
        x = P.llm_like(R, K)
        S = 448.0 * 6.0 / x.float().abs().amax().item()
        cold = flush_buf if R >= 1024 else None
        per = 1 if R >= 1024 else 20  # calls per graph (module docstring)
        for name, fm, fp, out_bytes in cases(lambda _x: S):
            m_e = timed(lambda: fm(x), reps, cold)
            m_g = timed(graphed(lambda: fm(x), per), reps, cold, per)
            p_e = timed(lambda: fp(x), reps, cold)
            p_c = p_cg = None
            if not args.no_compile:
                torch._dynamo.reset()
                cf = torch.compile(fp, dynamic=False)
                p_c = timed(lambda: cf(x), reps, cold)
                try:
                    p_cg = timed(graphed(lambda: cf(x), per), reps, cold, per)
                except Exception as e:  # noqa: BLE001  (a peer that cannot be captured is reported, not fatal)
                    print(f"  ({name}: compiled peer not capturable: {type(e).__name__})", file=sys.stderr)
            gbs = R * K * (2.0 + out_bytes) / (m_g * 1e-6) / 1e9
            best_peer = min(t for t in (p_e, p_c, p_cg) if t is not None)
            fmt = lambda t: "-" if t is None else f"{t:.1f}"
            row = (f"| {name} | {R}x{K} | {m_e:.1f} | {m_g:.1f} | {gbs:.0f} | {p_e:.1f} | {fmt(p_c)} | {fmt(p_cg)} | "
                   f"{best_peer / m_g:.2f} |")
            print(row, flush=True)
            tab.append(row)
    _write(args, lines + tab)


def _write(args, lines):
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
