#!/usr/bin/env python3
"""Checkpoint conversion throughput: `mxq quantize` / `mxq qdq` of a synthetic Llama-shaped bf16
checkpoint, timed end to end with its peak memory (issue 13, item 5).

The generator writes a sharded safetensors checkpoint (model-0000i-of-0000n.safetensors, the index,
config.json) shaped like a Llama decoder: per layer q/k/v/o projections, gate/up/down, two norms,
plus embeddings and the LM head, with LLM-like bf16 weights (Gaussian bulk with a few outlier input
channels). Only numpy is needed. Each conversion runs once per (format, device) after one untimed
warm-up run of the first case (the page cache then holds the input: the figures are conversion
speed, not cold-disk speed; the disk is measured separately with a read of every shard).

Throughput = input bytes (the safetensors files) / wall seconds. Peak memory = the child's maximum
resident set (getrusage), minus nothing: it includes the tool's own code and the CUDA context.

    python bench/checkpoint_bench.py --mxq build/tools/mxq/mxq [--gb 2.7] [--dir /tmp/mxq-ckpt-bench]
        [--format mxfp4 --format nvfp4] [--device cpu --device cuda] [--op quantize] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np


def llama_shapes(hidden: int, inter: int, layers: int, vocab: int, kv_heads: int, head_dim: int):
    """(name, rows, cols) of a Llama-style decoder's tensors, in checkpoint order."""
    yield "model.embed_tokens.weight", vocab, hidden
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", 1, hidden
        yield p + "self_attn.q_proj.weight", hidden, hidden
        yield p + "self_attn.k_proj.weight", kv_heads * head_dim, hidden
        yield p + "self_attn.v_proj.weight", kv_heads * head_dim, hidden
        yield p + "self_attn.o_proj.weight", hidden, hidden
        yield p + "post_attention_layernorm.weight", 1, hidden
        yield p + "mlp.gate_proj.weight", inter, hidden
        yield p + "mlp.up_proj.weight", inter, hidden
        yield p + "mlp.down_proj.weight", hidden, inter
    yield "model.norm.weight", 1, hidden
    yield "lm_head.weight", vocab, hidden


def bf16_weights(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """LLM-like bf16 bits (uint16): N(0, 0.02) with 1% of input channels scaled by 20."""
    x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
    if rows > 1:
        cols_out = rng.choice(cols, size=max(1, cols // 100), replace=False)
        x[:, cols_out] *= np.float32(20.0)
    else:
        x = np.abs(x) + np.float32(1.0)  # a norm weight
    b = x.view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16).astype(np.uint16)  # RNE to bf16 (finite)


def write_shard(path: str, tensors: list[tuple[str, np.ndarray]]) -> None:
    header, off = {}, 0
    for name, a in tensors:
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for _, a in tensors:
            f.write(a.tobytes())


def generate(out: str, gb: float, shard_gb: float = 1.0, seed: int = 0) -> int:
    """A Llama-shaped checkpoint of about `gb` GB (hidden 4096, intermediate 14336, GQA 8 x 128, vocab
    32000; the layer count sets the size). Returns the bytes of tensor data written."""
    hidden, inter, vocab, kv, hd = 4096, 14336, 32000, 8, 128
    per_layer = 2 * (2 * hidden * hidden + 2 * kv * hd * hidden + 3 * inter * hidden + 2 * hidden)
    fixed = 2 * (2 * vocab * hidden + hidden)
    layers = max(1, round((gb * 1e9 - fixed) / per_layer))
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = list(llama_shapes(hidden, inter, layers, vocab, kv, hd))
    shards, cur, cur_bytes = [], [], 0
    for name, r, c in shapes:
        if cur and cur_bytes + 2 * r * c > shard_gb * 1e9:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, r, c))
        cur_bytes += 2 * r * c
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = []
        for name, r, c in shard:
            a = bf16_weights(r, c, rng)
            tensors.append((name, a.reshape(c) if r == 1 else a))
            weight_map[name] = fname
            total += a.nbytes
        write_shard(os.path.join(out, fname), tensors)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                   "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": hidden // hd,
                   "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "rms_norm_eps": 1e-5,
                   "torch_dtype": "bfloat16"}, f, indent=1)
    return total


def input_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))


def run_child(cmd: list[str]) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS MiB of this child, return code, the output's tail). Linux's ru_maxrss of
    RUSAGE_CHILDREN is the largest child so far, so each case runs in a fresh wrapper process."""
    wrapper = ("import resource,subprocess,sys,time;t=time.perf_counter();"
               "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
               "w=time.perf_counter()-t;r=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss;"
               "print(w,r,p.returncode);sys.stderr.write((p.stdout+p.stderr)[-2000:])")
    p = subprocess.run([sys.executable, "-c", wrapper] + cmd, capture_output=True, text=True)
    w, r, rc = p.stdout.split()
    return float(w), int(r) / 1024.0, int(rc), p.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mxq", required=True, help="the mxq tool binary (build/tools/mxq/mxq)")
    ap.add_argument("--gb", type=float, default=2.7, help="size of the synthetic checkpoint")
    ap.add_argument("--dir", default="/tmp/mxq-ckpt-bench", help="working directory (input and outputs)")
    ap.add_argument("--format", action="append", help="formats (default mxfp4, nvfp4)")
    ap.add_argument("--device", action="append", help="devices (default cpu, and cuda when --cuda-ok)")
    ap.add_argument("--op", default="quantize", choices=["quantize", "qdq"])
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    formats = args.format or ["mxfp4", "nvfp4"]
    devices = args.device or ["cpu"]
    src = os.path.join(args.dir, "in")
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        generate(src, args.gb)
    gen_s = time.perf_counter() - t0
    nbytes = input_bytes(src)
    # The disk (page cache after the generator): one read of every shard.
    t0 = time.perf_counter()
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass
    read_s = time.perf_counter() - t0
    lines = [f"## Checkpoint conversion: `mxq {args.op}` of a {nbytes / 1e9:.2f} GB Llama-shaped bf16 checkpoint",
             "", f"{os.cpu_count()} CPU cores; reading every shard once: {nbytes / read_s / 1e9:.2f} GB/s "
             f"(page cache; generated in {gen_s:.0f} s). Throughput = input bytes / wall time; one run each.", "",
             "The last column is the tool's own account (its `time:` line): setup (the GPU's context, headers), "
             "planning (NVFP4 amax pass), conversion (staging, kernels and transfers; the time waited for them), "
             "error statistics, writing (the time waited for the writer thread, with the fsync of each shard), the "
             "rest (reading, page faults), seconds; the wall time also counts the process's start and exit.", "",
             "| format | device | wall s | GB/s of input | peak RSS MiB | rc | setup / plan / conv / error / write / rest s |",
             "|---|---|---:|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    out = os.path.join(args.dir, "out")
    first = True
    rc_all = 0
    for fmt in formats:
        for dev in devices:
            cmd = [args.mxq, args.op, src, "-o", out, "--format", fmt, "--device", dev, "--overwrite"]
            if first:  # warm-up: the page cache, the CUDA context's first creation
                run_child(cmd)
                first = False
            w, rss, rc, tail = run_child(cmd)
            rc_all |= rc
            m = re.search(r"setup ([\d.]+) s, planning ([\d.]+) s, conversion ([\d.]+) s(?: \([^)]*\))?, error statistics ([\d.]+) s, "
                          r"writing ([\d.]+) s, the rest \(reading, page faults\) (-?[\d.]+) s", tail)
            phases = " / ".join(m.groups()) if m else "-"
            row = f"| {fmt} | {dev} | {w:.1f} | {nbytes / w / 1e9:.2f} | {rss:.0f} | {rc} | {phases} |"
            lines.append(row)
            print(row, flush=True)
            t = re.search(r"^time: .*$", tail, re.M)
            if t:
                print("    " + t.group(0), flush=True)
            if rc:
                print(tail, file=sys.stderr)
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if rc_all else 0


if __name__ == "__main__":
    sys.exit(main())
