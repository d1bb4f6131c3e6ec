"""End-to-end generation throughput with microscaling emulation (issue 14): tokens/s of transformers
models built from configs with random weights (no download), in bf16 and with MXFP4 weight +
activation QDQ through (a) a plain PyTorch rendering of the QDQ (bench/torch_peers.py, the math of
the vllm-qdq-plugin's reference), (b) torch.compile of that rendering, (c) mxq.

Decode: batch B, one token per step against a static KV cache, one decode step captured in a CUDA
graph and replayed (plain eager generate is launch-bound and hides the kernels); tokens/s = B x
steps / time. Prefill: one forward over [B, L] tokens (8 x 2048 by default: one sequence is launch-bound), eager. Variants alternate and repeat (--rounds)
so that order does not decide; the table reports the median round and each variant against bf16.

    python bench/generate_bench.py --model llama-1.3b --markdown out.md     # on a GPU
    python bench/generate_bench.py --model tiny --device cpu --no-graph     # smoke test (CPU)

The MoE config runs transformers' "grouped_mm" experts function (torch grouped GEMMs, no host
synchronisation), which mxq.QDQExperts follows, so its decode step is captured in a graph too; a
transformers without it falls back to the eager experts loop (a host synchronisation per call),
measured without graphs.

Packed 4-bit weights (W4A16): "mxq.linear mxfp4" / "nvfp4" put every nn.Linear but lm_head on mxq.linear
(random packed bytes); on an MoE model "mxq.linear+moe mxfp4" / "nvfp4" do that (attention, any dense
MLP) and replace every experts module by mxq.QuantExperts (mxq.pack_experts: the experts' bf16 weights
quantized and prepacked, one torch.ops.mxq.moe call per layer; packed once per format, kept across
rounds). A build without the MoE's CUDA kernels refuses the op (NotImplementedError): the variant is then
skipped with the reason printed and the rest of the table still runs. Below the table, each variant's
issue targets (x bf16) and whether the run met them.

    python bench/generate_bench.py --model qwen3-moe --only mxq-linear-moe-mxfp4 mxq-linear-moe-nvfp4
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ops_bench  # noqa: E402  (graphed: one CUDA-graph capture for every benchmark)
import torch_peers  # noqa: E402

import mxq  # noqa: E402

MODELS = {
    # dense, Llama-style: about 1.35B parameters in 20 layers
    "llama-1.3b": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=20,
                                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)),
    # Qwen3-MoE-style, scaled to fit: 128 experts, top-8
    "qwen3-moe": ("qwen3_moe", dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                                    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                    num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                                    head_dim=128, max_position_embeddings=4096)),
    "tiny-moe": ("qwen3_moe", dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                   num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256)),
    # Llama-3.1-8B-shaped (random weights): the packed-weights variants (mxq.linear) against bf16
    "llama-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)),
    "tiny": ("llama", dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
}


def build(name: str, device: str) -> torch.nn.Module:
    import transformers
    kind, kw = MODELS[name]
    if kind != "llama":
        # transformers' grouped experts function (torch grouped GEMMs, no host synchronisation): the
        # step is captured in a CUDA graph; mxq.QDQExperts follows the same implementation
        kw = dict(kw, experts_implementation="grouped_mm")
    cfg = (transformers.LlamaConfig if kind == "llama" else transformers.Qwen3MoeConfig)(**kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = (transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen3MoeForCausalLM)(cfg)
    return model.to(torch.bfloat16).eval()


def reference_qdq(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 ('even' rule) QDQ written in plain PyTorch, any leading dimensions."""
    return torch_peers.qdq_mxfp4_even(x.reshape(-1, x.shape[-1])).view_as(x)


class _Swap:
    """Every nn.Linear but lm_head replaced by mxq.QuantLinear on random packed weights; restore() undoes it."""

    def __init__(self, model: torch.nn.Module, fmt: str):
        self.swapped = []
        g = torch.Generator(device="cuda" if next(model.parameters()).is_cuda else "cpu").manual_seed(0)
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, torch.nn.Linear) or name.endswith("lm_head"):
                continue
            w = random_packed(mod.out_features, mod.in_features, fmt, mod.weight.device, g)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, mxq.QuantLinear(w, mod.bias))
            self.swapped.append((parent, child, mod))

    def restore(self) -> None:
        for parent, child, mod in self.swapped:
            setattr(parent, child, mod)


class _SwapExperts:
    """_Swap's Linears, and every experts module replaced by mxq.QuantExperts (mxq.pack_experts, the model's
    own expert weights quantized to `fmt`); restore() undoes both. The packed modules are made once per model
    and format and kept (packing 7B parameters on the host takes a while), so later rounds only swap them in.
    A tiny mxq.moe call on the model's device first: a build whose MoE refuses the device raises
    NotImplementedError here, before anything is packed or measured."""

    _packed: dict = {}  # (id(model), fmt) -> [(name, QuantExperts)]

    def __init__(self, model: torch.nn.Module, fmt: str):
        _probe_moe(model, fmt)
        key = (id(model), fmt)
        before = dict(model.named_modules())
        if key not in self._packed:
            if mxq.pack_experts(model, fmt) == 0:
                raise NotImplementedError("no experts module in the model (mxq.pack_experts replaced none)")
            self._packed[key] = [(n, m) for n, m in model.named_modules() if isinstance(m, mxq.QuantExperts)]
        self.experts = [(n, before[n]) for n, _ in self._packed[key]]
        for n, m in self._packed[key]:
            _set_submodule(model, n, m)
        self.model = model
        try:
            self.linears = _Swap(model, fmt)
        except BaseException:
            for n, m in self.experts:
                _set_submodule(model, n, m)
            raise

    def restore(self) -> None:
        self.linears.restore()
        for n, m in self.experts:
            _set_submodule(self.model, n, m)


def _set_submodule(model: torch.nn.Module, name: str, mod: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, mod)


def _probe_moe(model: torch.nn.Module, fmt: str) -> None:
    """One mxq.moe call of the model's expert shapes with a single expert of random packed bytes: raises what the
    op raises on this device (NotImplementedError where the build has no MoE kernels for it)."""
    cfg, dev = model.config, next(model.parameters()).device
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device=dev.type).manual_seed(0)

    def one(N, K):
        w = random_packed(N, K, fmt, dev, g)
        return mxq.PackedExperts(w.codes.reshape(1, -1), w.scales.reshape(1, -1),
                                 torch.tensor([w.exp_shift], dtype=torch.int32, device=dev),
                                 torch.tensor([w.tensor_scale], dtype=torch.float32, device=dev), fmt, 1, N, K, w.f16_exact)

    x = torch.zeros((1, H), dtype=torch.bfloat16, device=dev)
    ids = torch.zeros((1, 1), dtype=torch.int64, device=dev)
    mxq.moe(x, one(2 * I, H), one(H, I), ids, torch.ones((1, 1), dtype=torch.bfloat16, device=dev))
    sync(dev.type)


def random_packed(N: int, K: int, fmt: str, device, g) -> "mxq.PackedLinearWeight":
    """A packed weight of random bytes made on the device: the packed layout is a permutation of the codes,
    so random codes there are random codes in the checkpoint; scales from a narrow range of sane values
    (MXFP4: E8M0 115..124, so prepack's shift is 124 - 128; NVFP4: E4M3 bytes 0x28..0x57, S = 100). What a
    kernel reads and how long it takes do not depend on the values."""
    cs, ss = mxq.packed_shapes(fmt, N, K)
    codes = torch.randint(0, 256, cs, dtype=torch.uint8, device=device, generator=g)
    if fmt == "mxfp4":
        scales = torch.randint(115, 125, ss, dtype=torch.uint8, device=device, generator=g)
        return mxq.PackedLinearWeight(codes, scales, "mxfp4", N, K, 124 - 128, True, 1.0)
    scales = torch.randint(0x28, 0x58, ss, dtype=torch.uint8, device=device, generator=g)
    return mxq.PackedLinearWeight(codes, scales, "nvfp4", N, K, 8, True, 100.0)


def variants(moe: bool = False):
    """name -> a function that emulates the variant on a model and returns a handle (restore()), or None.
    moe: the model has experts modules (the packed-experts variants too)."""
    compiled = torch.compile(reference_qdq, dynamic=True)
    mx = {"format": "mxfp4", "rule": "even"}

    def spec(s, **kw):
        return lambda m: mxq.emulate(m, weights=s, activations=s, **kw)

    return {
        "bf16": None,
        "reference": spec(reference_qdq),
        "reference, torch.compile": spec(compiled),
        "mxq": spec(mx),
        # the activation QDQs fused into the RMSNorm and SiLU-and-multiply that produce them
        "mxq, fused": spec(mx, fuse=True),
        # the fair baseline of the fused row: bf16, with mxq's RMSNorm and SiLU-and-multiply kernels
        # (transformers' eager RMSNorm is several kernels)
        "bf16, mxq norm/SiLU": spec(None, fuse=True),
        # packed 4-bit weights run by mxq.linear (W4A16; every Linear but lm_head)
        "mxq.linear mxfp4": lambda m: _Swap(m, "mxfp4"),
        "mxq.linear nvfp4": lambda m: _Swap(m, "nvfp4"),
    } | ({
        # ... and the experts on mxq.moe (mxq.pack_experts: W4A16 experts, one torch.ops.mxq.moe per layer)
        "mxq.linear+moe mxfp4": lambda m: _SwapExperts(m, "mxfp4"),
        "mxq.linear+moe nvfp4": lambda m: _SwapExperts(m, "nvfp4"),
    } if moe else {})


# variant -> (issue, {case prefix: the least x bf16}), checked below the table (stated for the H200)
TARGETS = {
    **{f"mxq.linear {f}": ("36", {"decode B=1": 2.2, "decode B=16": 2.0, "prefill": 0.95}) for f in ("mxfp4", "nvfp4")},
    **{f"mxq.linear+moe {f}": ("38", {"decode B=1": 1.8, "decode B=16": 1.6, "prefill": 0.95}) for f in ("mxfp4", "nvfp4")},
}


def target_lines(ratios: dict[tuple[str, str], float]) -> list[str]:
    """The targets of the variants measured: a markdown table (empty when none applies)."""
    rows = []
    for name, (issue, want) in TARGETS.items():
        for prefix, least in want.items():
            for (n, c), v in ratios.items():
                if n == name and (c == prefix or (prefix == "prefill" and c.startswith("prefill "))):
                    rows.append(f"| issue {issue}: {c} >= {least}x bf16 | {name} | {v:.2f}x | {'yes' if v >= least else 'no'} |")
    return ["", "| target | variant | measured | met |", "|---|---|---:|---|"] + rows if rows else []


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def decode_tokens_per_s(model, batch: int, prompt: int, steps: int, device: str, graph: bool) -> float:
    import transformers
    cache = transformers.StaticCache(config=model.config, max_cache_len=prompt + steps + 8)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    pos = torch.arange(prompt, device=device)
    model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True)  # prefill fills the cache
    tok = torch.zeros((batch, 1), dtype=torch.long, device=device)
    cpos = torch.tensor([prompt], device=device)

    def step():
        return model(input_ids=tok, past_key_values=cache, cache_position=cpos, use_cache=True).logits

    run = torch_ops_bench.graphed(step) if graph else step
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        cpos.fill_(prompt + i)  # the same cache slot sequence every variant
        run()
    sync(device)
    return batch * steps / (time.perf_counter() - t0)


@torch.no_grad()
def prefill_tokens_per_s(model, batch: int, length: int, device: str, reps: int = 3) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    model(input_ids=ids, use_cache=False)
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        sync(device)
        ts.append(time.perf_counter() - t0)
    return batch * length / statistics.median(ts)


@torch.no_grad()
def profile_prefill(a) -> None:
    from torch.profiler import ProfilerActivity, profile
    model = build(a.model, a.device)
    ids = torch.randint(0, model.config.vocab_size, (a.prefill_batch, a.prefill), device=a.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    out = []
    for name, spec in variants(is_moe(a.model)).items():
        try:
            handle = None if spec is None else spec(model)
        except NotImplementedError as e:
            out.append(f"== {name}: skipped: {reason(e)}")
            print(f"{name}: skipped: {reason(e)}", file=sys.stderr, flush=True)
            continue
        try:
            for _ in range(2):  # warm-up (compilation, allocator)
                model(input_ids=ids, use_cache=False)
            sync(a.device)
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                model(input_ids=ids, use_cache=False)
                sync(a.device)
            wall = (time.perf_counter() - t0) * 1e3
            key = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
            ka = prof.key_averages()
            out.append(f"== {name}: prefill {a.prefill} wall {wall:.1f} ms (profiled)\n"
                       + ka.table(sort_by=key, row_limit=12) + "\n"
                       + ka.table(sort_by="self_cpu_time_total", row_limit=8))
        finally:
            if handle is not None:
                handle.restore()
    text = "\n".join(out)
    print(text)
    with open(a.profile, "w") as f:
        f.write(text + "\n")


def is_moe(model: str) -> bool:
    return MODELS[model][0] != "llama"


def reason(e: BaseException) -> str:
    """The first line of an exception's message (what the table says of a skipped variant)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-1.3b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048, help="prefill length (tokens per sequence)")
    # NOTE: measured on the H200 (2026-12-03): one 2048-token sequence of llama-1.3b is launch-bound in
    # eager mode (13 ms of GPU work under 19-23 ms of host time), which hides the kernels; 8 are not.
    ap.add_argument("--prefill-batch", type=int, default=8, help="sequences per prefill")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-graph", action="store_true", help="decode without CUDA graphs")
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--only", nargs="+", metavar="VARIANT",
                    help="these variants (and bf16) only: names or their slugs (mxq-fused, bf16-mxq-norm-silu, ...)")
    ap.add_argument("--profile", metavar="FILE",
                    help="instead of the table: one prefill per variant under torch.profiler, its top operators "
                         "by GPU and by CPU time written to FILE (where the time of a slow variant goes)")
    a = ap.parse_args()
    if a.profile:
        return profile_prefill(a)
    model = build(a.model, a.device)
    experts = getattr(model.config, "_experts_implementation", None) if is_moe(a.model) else None
    # an eager experts loop synchronises with the host on every call: no graph then
    graph = a.device == "cuda" and not a.no_graph and experts in (None, "grouped_mm", "batched_mm")
    results: dict[tuple[str, str], list[float]] = {}
    vs = variants(is_moe(a.model))
    if a.only:
        def slug(n: str) -> str:
            return re.sub(r"[^a-z0-9]+", "-", n.lower()).strip("-")
        known = {n: n for n in vs} | {slug(n): n for n in vs}
        unknown = [o for o in a.only if o not in known]
        if unknown:
            moe_only = "" if is_moe(a.model) else " (the packed-experts variants, mxq-linear-moe-*, exist for MoE models only)"
            ap.error(f"--only: unknown variants {unknown}; known: {list(vs)} or {[slug(n) for n in vs]}{moe_only}")
        want = {known[o] for o in a.only}
        vs = {k: v for k, v in vs.items() if k == "bf16" or k in want}
    skipped: dict[str, str] = {}  # variant -> why (NotImplementedError: e.g. a build without the MoE's CUDA kernels)
    for r in range(a.rounds):
        order = list(vs) if r % 2 == 0 else list(reversed(vs))  # alternate the order between rounds
        for name in order:
            if name in skipped:
                continue
            try:
                handle = None if vs[name] is None else vs[name](model)
            except NotImplementedError as e:
                skipped[name] = reason(e)
                print(f"round {r + 1}: {name}: skipped: {skipped[name]}", file=sys.stderr, flush=True)
                continue
            try:
                for b in a.batch:
                    results.setdefault((name, f"decode B={b}"), []).append(
                        decode_tokens_per_s(model, b, a.prompt, a.steps, a.device, graph))
                results.setdefault((name, f"prefill {a.prefill_batch}x{a.prefill}"), []).append(
                    prefill_tokens_per_s(model, a.prefill_batch, a.prefill, a.device))
                # progress on stderr, so that a run cut short still shows what it measured
                print(f"round {r + 1}: {name}: " + ", ".join(f"{c} {v[-1]:,.0f}" for (n, c), v in results.items()
                                                              if n == name), file=sys.stderr, flush=True)
            except NotImplementedError as e:  # raised while measuring: no row for it
                skipped[name] = reason(e)
                print(f"round {r + 1}: {name}: skipped: {skipped[name]}", file=sys.stderr, flush=True)
            finally:
                if handle is not None:
                    handle.restore()
    for name in skipped:
        for key in [k for k in results if k[0] == name]:
            del results[key]
    cases = list(dict.fromkeys(c for _, c in results))
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    lines = [f"{a.model} on {dev}, torch {torch.__version__}, {'CUDA graph' if graph else 'eager'} decode, "
             + (f"experts_implementation {experts}, " if experts else "") +
             f"median of {a.rounds} rounds (tokens/s; x bf16)", "",
             "| variant | " + " | ".join(cases) + " |", "|---|" + "---:|" * len(cases)]
    ratios = {}
    for name in vs:
        if name in skipped:
            lines.append(f"| {name} | " + " | ".join("skipped" for _ in cases) + " |")
            continue
        cells = []
        for c in cases:
            v, base = statistics.median(results[(name, c)]), statistics.median(results[("bf16", c)])
            ratios[(name, c)] = v / base
            cells.append(f"{v:,.0f} ({v / base:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if skipped:
        lines += [""] + [f"{name}: skipped: {why}" for name, why in skipped.items()]
    lines += target_lines(ratios)
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
