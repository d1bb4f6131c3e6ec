"""Quantize a model with the mxq CLI, load its packed 4-bit weights with mxq.load_quantized, generate, and
compare tokens/s with bf16.

    python examples/generate_packed.py --mxq build/tools/mxq/mxq                  # a small random Llama
    python examples/generate_packed.py --mxq build/tools/mxq/mxq --model ~/models/Llama-3.1-8B --format nvfp4

Without --model a Llama-style model with random weights (hidden 2048, 16 layers) is built from a config
and saved first, so the example needs no download. Decode runs eagerly (model.generate), so at small
sizes the host's launch overhead, not the GEMM, sets the pace: bench/generate_bench.py measures with a
static cache and CUDA graphs.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import transformers

import mxq


def tokens_per_s(model, ids: torch.Tensor, new: int) -> tuple[float, torch.Tensor]:
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    return ids.shape[0] * new / (time.perf_counter() - t0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mxq", default="build/tools/mxq/mxq", help="the mxq command-line tool")
    ap.add_argument("--model", help="a transformers checkpoint directory (default: a random Llama)")
    ap.add_argument("--format", default="mxfp4", choices=["mxfp4", "nvfp4"])
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mxq-example-"))
    src = Path(a.model) if a.model else work / "bf16"
    if not a.model:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    q = work / a.format
    subprocess.run([a.mxq, "quantize", str(src), "-o", str(q), "--format", a.format], check=True)

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        bf16, _ = tokens_per_s(model, ids, a.new_tokens)
        n = mxq.load_quantized(model, str(q))  # every quantized Linear -> mxq.QuantLinear (weights stay on the GPU)
        packed, out = tokens_per_s(model, ids, a.new_tokens)
    print(f"{n} Linear layers on packed {a.format} weights")
    print(f"bf16 {bf16:.1f} tokens/s, packed {a.format} {packed:.1f} tokens/s ({packed / bf16:.2f}x), eager generate")
    print("tokens:", out[0, ids.shape[1]:].tolist()[:16], "...")


if __name__ == "__main__":
    main()
