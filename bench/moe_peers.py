#!/usr/bin/env python3
"""W4A16 MoE peers: the experts of one MoE block, y [T, H] from x [T, H] (bf16) routed top-k over E experts
with w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] 4-bit, timed on one CUDA GPU (issue 38, item 5).

The block every peer computes (the same weight bytes, routing and x):
    y[t] = sum_j topk_weights[t, j] * W2[e] (silu(G[e] x[t]) * U[e] x[t]),   e = topk_ids[t, j],
    W13[e] = [G[e]; U[e]]  (plain SwiGLU, no biases; gpt-oss's clamped interleaved variant costs the same bytes)

Peers:
  mxq           mxq.moe(x, w13, w2, topk_ids, topk_weights) on mxq.prepack_experts(...).to("cuda"): the whole
                block in torch.ops.mxq.moe (route, w13 GEMM, SwiGLU, w2 GEMM with the routing weight, combine)
  bf16 grouped  the same block in bf16 on the dequantized weights (mxq.dequantize of the same bytes, 2 B/elem):
                argsort of the pair ids by expert, per-expert offsets (scatter_add + cumsum, no host sync),
                gather of x's rows, torch._grouped_mm(x_sorted, W13.transpose(1, 2), offs=offsets), SwiGLU
                in fp32 (rounded once to bf16), torch._grouped_mm with W2, the routing weight, unsort and the
                fp32 slot sum. Without torch._grouped_mm: a per-expert loop of torch.matmul ("bf16 loop").
  Humming       humming-kernels (importable as `humming`): two humming.layer.HummingLayer(num_experts=E) with a
                compressed-tensors weight config ("mxfp4-pack-quantized" group 32 / "nvfp4-pack-quantized"
                tensor_group 16; weight_packed [E, N, K/2], weight_scale [E, N, K/g], NVFP4 weight_global_scale
                [E] = S), called as its indexed (MoE) GEMM: compute_config {"gemm_type": "indexed"}, sorted_ids /
                expert_ids / num_tokens_padded (vLLM's moe_align_block_size layout, block = the tuning
                config's block M, the tuning config fixed per T from humming.tune.get_heuristics_config), top_k
                = k for w13 (T rows in, T*k rows out), 1 for w2; the SwiGLU with Humming's process_input
                (binary_split) where it builds, else torch; the routing weights and slot sum in torch.
                Humming ships no alignment kernel (its testing helper is a Python loop): the routing
                metadata is built per T outside the timing (sync-free torch, `humming_align`), so Humming's
                times omit a step the other peers pay for (a lower bound on its block time).
  triton        triton_kernels' matmul_ogs (MXFP4 only; "not installed" unless importable): routing from
                logits that select the same ids and weights, w13 rows interleaved with an up-bias of -1 and
                alpha 1, limit 1e30 so that its fused gpt-oss SwiGLU is the plain one, w2 with the gammas.
                A best-effort wrapper of an API that moves between triton versions: it fails soft.

Routing: topk_ids int32 [T, k], k distinct experts per token, uniform over E (--routing uniform; Gumbel top-k of
zero logits) or Zipf-skewed (--routing zipf: expert e drawn with weight 1 / (rank(e) + 1)^s, --zipf-s, a fixed
random rank order); topk_weights float32 = softmax of randn logits over the k slots; from a fixed seed per
(shape, T), the same tensors for every peer.

Byte / FLOP model (printed columns; N13 = 2I):
  active experts    = distinct ids in the batch (topk_ids of this T)
  weight bytes      = active x (N13 * H + H * I) * B, B = 0.5 + 1/g (MXFP4 0.53125 B/elem, NVFP4 0.5625)
                      -> "TB/s" = weight bytes / mxq time (x, y, scales of NVFP4's tensor and the routing
                      are not counted: at small T the active experts' weight stream is the whole cost)
  FLOPs             = 2 * T * k * (N13 * H + H * I)          -> "TFLOP/s" = FLOPs / mxq time
  "x bf16"          = bf16 grouped us / mxq us (> 1: mxq faster); "x Humming", "x triton" likewise
Targets (issue 38, H200), column "target": decode T <= 16: TB/s >= 3.4; T = 256: x bf16 >= 1.5; prefill
T >= 4096: x bf16 >= 0.95; every row: x Humming >= 1.5 (its own column; "met" says yes / no for the regime
target and the Humming one, "-" where a number is missing).

Measurement (as bench/linear_peers.py): L2 cold (a buffer of 2x the L2 size is written with zero_() before every
timed call, after a short GPU spin so that the host's launch cost is not timed), CUDA events around the block
alone, median of --reps after --warmup untimed calls (Humming's JIT compile happens in an untimed first call).
A correctness line per peer on the first shape at T = --check-t: relative Frobenius error of y against an fp32
torch reference (weights decoded here with torch from the same bytes, only the routed experts, SwiGLU in fp32);
later shapes: a sanity line against bf16 grouped. Every peer fails soft: its reason goes into the table.

Shapes (E, top-k, H, I): gpt-oss-120b (128, 4, 2880, 2880), qwen3-30b-a3b (128, 8, 2048, 768),
deepseek-v3 (256, 8, 7168, 2048); T in 1, 16, 64, 256, 4096, 16384 (--quick: the first two, T 1, 16, 256, 4096).

Run (GPU; Humming from the humming-kernels package, or skipped with its reason):
  python3 bench/moe_peers.py --quick [--formats mxfp4,nvfp4] [--routing uniform,zipf] [--reps 30]
      [--out results.jsonl] [--shapes gpt-oss-120b,E:k:H:I] [--ts 1,16]
  CPU only (tiny shape, mxq's reference op, bf16 grouped on the CPU, no timing): python3 bench/moe_peers.py --dry-run
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from peers_common import BYTES_PER_ELEM, CHECK_TOL, E2M1, GROUP, Timer, fmt_us, humming_weight_config, rel_err, short

# name: (E, k, H, I)
MODELS: dict[str, tuple[int, int, int, int]] = {
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
}
FULL_SHAPES: list[str] = ["gpt-oss-120b", "qwen3-30b-a3b", "deepseek-v3"]
FULL_TS: list[int] = [1, 16, 64, 256, 4096, 16384]
QUICK_SHAPES: list[str] = ["gpt-oss-120b", "qwen3-30b-a3b"]
QUICK_TS: list[int] = [1, 16, 256, 4096]
DRY_SHAPE: tuple[str, tuple[int, int, int, int]] = ("tiny", (8, 2, 64, 32))
DRY_TS: list[int] = [1, 16]

NVFP4_S: float = 100.0  # the NVFP4 encode scale S (compressed-tensors' weight_global_scale): W = e2m1 * e4m3 / S
PEERS: list[str] = ["mxq", "bf16 grouped", "Humming", "triton"]
TARGET_DECODE_TBS: float = 3.4
TARGET_X_BF16_256: float = 1.5
TARGET_X_BF16_PREFILL: float = 0.95
TARGET_X_HUMMING: float = 1.5

try:
    import mxq  # type: ignore
    MXQ_ERR: Optional[str] = None
except Exception as e:  # noqa: BLE001 - fail soft: the other peers still run
    mxq = None  # type: ignore
    MXQ_ERR = f"import mxq: {type(e).__name__}: {e}"

HAS_GROUPED_MM: bool = hasattr(torch, "_grouped_mm")
BF16_LABEL: str = "torch._grouped_mm" if HAS_GROUPED_MM else "per-expert torch.matmul loop (no torch._grouped_mm)"


# ----------------------------------------------------------------------------------------------- weights
@dataclass
class Experts:
    """E quantized weights [N, K] (codes uint8 [E, N, K/2], element 2j in the low nibble; scales uint8
    [E, N, K/g], E8M0 or E4M3 bytes), on the bench device; S the NVFP4 encode scale (one for every expert)."""

    fmt: str
    E: int
    N: int
    K: int
    codes: torch.Tensor
    scales: torch.Tensor
    S: Optional[float]

    @property
    def g(self) -> int:
        return GROUP[self.fmt]


def make_experts(fmt: str, E: int, N: int, K: int, seed: int, device: str) -> Experts:
    g = GROUP[fmt]
    if K % g or K % 8:
        raise ValueError(f"K = {K} must be a multiple of {g} and of 8")
    gen = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen, device=device)
    if fmt == "mxfp4":
        scales = torch.randint(115, 126, (E, N, K // g), dtype=torch.uint8, generator=gen, device=device)  # 2^-12..2^-2
        S = None
    else:
        scales = torch.randint(0x28, 0x59, (E, N, K // g), dtype=torch.uint8, generator=gen, device=device)  # 0.25..18
        S = NVFP4_S
    return Experts(fmt, E, N, K, codes, scales, S)


def ref_dequant(w: Experts, e: int) -> torch.Tensor:
    """Expert e's W_ref float32 [N, K] decoded with torch (independent of mxq and the peers)."""
    codes, scales = w.codes[e], w.scales[e]
    lut = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    vals = torch.stack((lut[(codes & 0xF).long()], lut[(codes >> 4).long()]), dim=-1).reshape(w.N, w.K // w.g, w.g)
    sc = torch.exp2(scales.float() - 127.0) if w.fmt == "mxfp4" else scales.view(torch.float8_e4m3fn).float()
    W = (vals * sc.unsqueeze(-1)).reshape(w.N, w.K)
    return W / w.S if w.S is not None else W


def dequant_bf16(w: Experts) -> torch.Tensor:
    """[E, N, K] bf16 of the same bytes: mxq.dequantize over the E*N rows at once, else the torch decode."""
    if mxq is not None:
        try:
            return mxq.dequantize(w.codes.reshape(w.E * w.N, -1), w.scales.reshape(w.E * w.N, -1), format=w.fmt, cols=w.K,
                                  tensor_scale=w.S, dtype=torch.bfloat16).reshape(w.E, w.N, w.K)
        except Exception as e:  # noqa: BLE001
            print(f"  note: mxq.dequantize failed ({short(e)}); bf16 weights from the torch decode", flush=True)
    return torch.stack([ref_dequant(w, e).to(torch.bfloat16) for e in range(w.E)])


# ----------------------------------------------------------------------------------------------- routing
def make_routing(kind: str, T: int, E: int, k: int, seed: int, zipf_s: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids int32 [T, k] (k distinct experts per token) and topk_weights float32 [T, k] (softmax), on device."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        logits = torch.zeros(T, E)
    else:  # zipf: Gumbel top-k samples k distinct experts with probabilities proportional to 1/(rank+1)^s
        rank = torch.randperm(E, generator=torch.Generator().manual_seed(12345))
        logits = (-zipf_s * torch.log(rank.double() + 1.0)).float().expand(T, E)
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=gen).clamp_(1e-20, 1.0 - 1e-7)))
    ids = (logits + gumbel).topk(k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=1).float()
    return ids.to(device), weights.to(device)


def humming_align(ids: torch.Tensor, E: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size layout in torch, without a host synchronisation: sorted_ids int32 [P + E*(block-1)]
    (each expert's pair ids, padded to a multiple of block with the sentinel P), expert_ids int32 (one per block;
    blocks past the end repeat the last expert), num_tokens_padded int32 [] (the padded length used)."""
    flat = ids.reshape(-1).long()
    P = flat.numel()
    counts = torch.zeros(E, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    end_pad = padded.cumsum(0)
    start_pad = end_pad - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = start_pad[e_sorted] + torch.arange(P, device=ids.device) - start[e_sorted]
    cap = P + E * (block - 1)
    sorted_ids = torch.full((cap,), P, dtype=torch.int32, device=ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    nblocks = (cap + block - 1) // block
    expert_ids = torch.searchsorted(end_pad, torch.arange(nblocks, device=ids.device) * block, right=True)
    expert_ids = expert_ids.clamp_(max=E - 1).to(torch.int32)
    return sorted_ids, expert_ids, end_pad[-1].to(torch.int32)


def humming_align_loop(ids: torch.Tensor, E: int, block: int) -> tuple[list[int], list[int], int]:
    """The same layout as humming.testing.data.generate_moe_tensors builds it (a Python loop): the dry run's check."""
    flat = ids.reshape(-1).cpu()
    P = flat.numel()
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for e in range(E):
        part = torch.where(flat == e)[0].tolist()
        nb = -(-len(part) // block)
        sorted_ids += part + [P] * (nb * block - len(part))
        expert_ids += [e] * nb
    return sorted_ids, expert_ids, len(sorted_ids)


# ----------------------------------------------------------------------------------------------- peers
# A peer is prepare(ids, weights) -> fn(x) (per T: Humming builds its routing metadata there, untimed).
Prepare = Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


@dataclass
class Peers:
    prep: dict[str, Prepare] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)


def swiglu_torch(h: torch.Tensor, I: int) -> torch.Tensor:
    hf = h.float()
    return (torch.nn.functional.silu(hf[:, :I]) * hf[:, I:]).to(h.dtype)


def bf16_block_fn(W13: torch.Tensor, W2: torch.Tensor, k: int) -> Callable[..., torch.Tensor]:
    E, N13, H = W13.shape
    I = N13 // 2
    W13t, W2t = W13.transpose(1, 2), W2.transpose(1, 2)  # [E, K, N] column-major: _grouped_mm's mat_b

    def block(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        tok = order // k
        xs = x.index_select(0, tok)
        if HAS_GROUPED_MM:
            counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(xs, W13t, offs=offs)
            o = torch._grouped_mm(swiglu_torch(h, I), W2t, offs=offs)
        else:  # one host sync for the counts, then a matmul per expert with rows
            counts_l = torch.bincount(flat, minlength=E).tolist()
            o = torch.empty(flat.numel(), H, dtype=x.dtype, device=x.device)
            s = 0
            for e, c in enumerate(counts_l):
                if c:
                    o[s:s + c] = swiglu_torch(xs[s:s + c] @ W13[e].t(), I) @ W2[e].t()
                    s += c
        o = o.float() * weights.reshape(-1)[order].float().unsqueeze(1)
        y = torch.empty_like(o)
        y[order] = o
        return y.view(T, k, H).sum(1).to(x.dtype)
    return block


def build_peers(w13: Experts, w2: Experts, k: int, device: str, wanted: list[str], humming_ok: bool,
                triton_ok: bool) -> Peers:
    p = Peers()
    fmt, H, I = w13.fmt, w13.K, w2.K

    # mxq
    if "mxq" not in wanted:
        p.errors["mxq"] = "not selected (--peers)"
    elif mxq is None:
        p.errors["mxq"] = MXQ_ERR or "mxq unavailable"
    else:
        try:
            t0 = time.perf_counter()
            pw13 = mxq.prepack_experts(codes=w13.codes.cpu(), scales=w13.scales.cpu(), format=fmt, K=H,
                                       tensor_scale=w13.S).to(device)
            pw2 = mxq.prepack_experts(codes=w2.codes.cpu(), scales=w2.scales.cpu(), format=fmt, K=I,
                                      tensor_scale=w2.S).to(device)
            p.notes.append(f"mxq.prepack_experts (w13 + w2) {time.perf_counter() - t0:.1f} s")
            p.keep += [pw13, pw2]
            p.prep["mxq"] = lambda ids, wt, a=pw13, b=pw2: (lambda x: mxq.moe(x, a, b, ids, wt))
        except Exception as e:  # noqa: BLE001
            p.errors["mxq"] = short(e)

    # bf16 grouped (also the source of the triton peer's nothing: that one reads the packed bytes)
    if "bf16 grouped" not in wanted:
        p.errors["bf16 grouped"] = "not selected (--peers)"
    else:
        try:
            W13, W2 = dequant_bf16(w13), dequant_bf16(w2)
            p.keep += [W13, W2]
            blk = bf16_block_fn(W13, W2, k)
            p.prep["bf16 grouped"] = lambda ids, wt, blk=blk: (lambda x: blk(x, ids, wt))
        except Exception as e:  # noqa: BLE001
            p.errors["bf16 grouped"] = short(e)

    # Humming
    if "Humming" not in wanted:
        p.errors["Humming"] = "not selected (--peers)"
    elif not humming_ok:
        p.errors["Humming"] = HUMMING_ERR or "humming unavailable"
    elif device != "cuda":
        p.errors["Humming"] = "skipped (needs CUDA)"
    else:
        try:
            p.prep["Humming"] = build_humming(w13, w2, k, p)
        except Exception as e:  # noqa: BLE001
            p.errors["Humming"] = short(e)
            traceback.print_exc(limit=-6, file=sys.stderr)

    # triton_kernels matmul_ogs
    if "triton" not in wanted:
        p.errors["triton"] = "not selected (--peers)"
    elif not triton_ok:
        p.errors["triton"] = TRITON_ERR or "triton_kernels unavailable"
    elif device != "cuda":
        p.errors["triton"] = "skipped (needs CUDA)"
    elif fmt != "mxfp4":
        p.errors["triton"] = "n/a (matmul_ogs takes MXFP4 weights here)"
    else:
        try:
            p.prep["triton"] = build_triton(w13, w2, k, p)
        except Exception as e:  # noqa: BLE001
            p.errors["triton"] = short(e)
            traceback.print_exc(limit=-6, file=sys.stderr)
    return p


# ---- Humming
HUMMING_ERR: Optional[str] = None
HUMMING_VERSION: str = "n/a"


def import_humming() -> bool:
    global HUMMING_ERR, HUMMING_VERSION
    try:
        import humming  # type: ignore
        from humming.layer import HummingLayer  # type: ignore  # noqa: F401
        from humming.tune import get_heuristics_config  # type: ignore  # noqa: F401

        HUMMING_VERSION = str(getattr(humming, "__version__", "?"))
        return True
    except Exception as e:  # noqa: BLE001
        HUMMING_ERR = f"import humming: {short(e)}"
        return False


def humming_tensors(w: Experts) -> dict[str, torch.Tensor]:
    """The compressed-tensors checkpoint tensors of E experts (same bytes; an expert dimension in front)."""
    t: dict[str, torch.Tensor] = {"weight_packed": w.codes}
    if w.fmt == "mxfp4":
        t["weight_scale"] = w.scales
    else:
        t["weight_scale"] = w.scales.view(torch.float8_e4m3fn)
        t["weight_global_scale"] = torch.full((w.E,), float(w.S or 1.0), dtype=torch.float32, device=w.codes.device)
    return t


def humming_layer(w: Experts) -> torch.nn.Module:
    from humming.layer import HummingLayer  # type: ignore

    layer = HummingLayer(shape_n=w.N, shape_k=w.K, weight_config=humming_weight_config(w.fmt), num_experts=w.E,
                         torch_dtype=torch.bfloat16).cuda()
    layer.load_from_tensors(humming_tensors(w))
    layer.transform()
    return layer


HUMMING_SWIGLU = "a / (1.0f + __expf(-a)) * b"  # process_input binary_split: a the first half (gate), b the second


def build_humming(w13: Experts, w2: Experts, k: int, p: Peers) -> Prepare:
    from humming import ops as hops  # type: ignore
    from humming.tune import get_heuristics_config  # type: ignore

    t0 = time.perf_counter()
    l13, l2 = humming_layer(w13), humming_layer(w2)
    p.keep += [l13, l2]
    p.notes.append(f"Humming layers (load + transform) {time.perf_counter() - t0:.1f} s")
    E, H, I = w13.E, w13.K, w2.K
    compute = {"gemm_type": "indexed"}
    act_state: dict[str, Any] = {"fn": None, "note": None}

    def act(h: torch.Tensor) -> torch.Tensor:
        if act_state["fn"] is None:  # first call: Humming's fused SwiGLU if it builds and agrees with torch
            ref = swiglu_torch(h, I)
            try:
                out = hops.process_input(h, activation_type="binary_split", activation_impl=HUMMING_SWIGLU)[0]
                err = (out.float() - ref.float()).norm().item() / max(ref.float().norm().item(), 1e-30)
                if tuple(out.shape) != tuple(ref.shape) or err > 1e-2:
                    raise RuntimeError(f"output {tuple(out.shape)}, rel err {err:.2e} vs torch")
                act_state["fn"] = lambda h: hops.process_input(h, activation_type="binary_split",
                                                               activation_impl=HUMMING_SWIGLU)[0]
                p.notes.append("Humming SwiGLU: its process_input kernel (binary_split)")
            except Exception as e:  # noqa: BLE001
                act_state["fn"] = lambda h: swiglu_torch(h, I)
                p.notes.append(f"Humming SwiGLU: torch (process_input: {short(e, 120)})")
            return ref
        return act_state["fn"](h)

    def tuning(layer: torch.nn.Module, shape_m: int) -> dict[str, Any]:
        cfg = get_heuristics_config(layer.humming_config, shape_m=shape_m, gemm_type="indexed",
                                    device=torch.device("cuda", torch.cuda.current_device()))
        return dict(cfg)

    def prepare(ids: torch.Tensor, weights: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        T = ids.shape[0]
        P = T * k
        c1, c2 = tuning(l13, P), tuning(l2, P)
        b1, b2 = int(c1["block_shape"][0]), int(c2["block_shape"][0])
        s1, e1, n1 = humming_align(ids, E, b1)
        s2, e2, n2 = (s1, e1, n1) if b2 == b1 else humming_align(ids, E, b2)
        wcol = weights.reshape(T, k, 1).float()

        def block(x: torch.Tensor) -> torch.Tensor:
            h = l13(x, sorted_ids=s1, expert_ids=e1, num_tokens_padded=n1, top_k=k, compute_config=compute,
                    tuning_config=c1)
            o = l2(act(h), sorted_ids=s2, expert_ids=e2, num_tokens_padded=n2, top_k=1, compute_config=compute,
                   tuning_config=c2)
            return (o.view(T, k, H).float() * wcol).sum(1).to(x.dtype)
        return block
    return prepare


# ---- triton_kernels
TRITON_ERR: Optional[str] = None
TRITON_VERSION: str = "n/a"


def import_triton() -> bool:
    global TRITON_ERR, TRITON_VERSION
    try:
        import triton  # type: ignore
        import triton_kernels.matmul_ogs  # type: ignore  # noqa: F401
        import triton_kernels.routing  # type: ignore  # noqa: F401

        TRITON_VERSION = f"triton {getattr(triton, '__version__', '?')}"
        return True
    except ModuleNotFoundError as e:
        TRITON_ERR = f"not installed (no module {e.name})"
        return False
    except Exception as e:  # noqa: BLE001
        TRITON_ERR = f"import triton_kernels: {short(e, 70)}"
        return False


def build_triton(w13: Experts, w2: Experts, k: int, p: Peers) -> Prepare:
    """gpt-oss's triton MoE recipe: weights [E, K/2, N] FP4 (mx along K) in the default matmul layouts, routing()
    on logits, matmul_ogs with gather / scatter indices and its fused SwiGLU."""
    from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs  # type: ignore
    from triton_kernels.numerics import InFlexData  # type: ignore
    from triton_kernels.routing import routing  # type: ignore
    from triton_kernels.swiglu import swiglu_fn  # type: ignore
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor  # type: ignore
    from triton_kernels.tensor_details import layout  # type: ignore

    E, I = w13.E, w2.K
    # w13 rows interleaved (gate i -> 2i, up i -> 2i+1) for the fused gpt-oss SwiGLU; bias -1 on the up lanes
    perm = torch.stack((torch.arange(I), torch.arange(I) + I), dim=1).reshape(-1).to(w13.codes.device)

    def wrap(codes: torch.Tensor, scales: torch.Tensor) -> tuple[Any, Any]:
        vl, vopts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        sl, sopts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        wq = convert_layout(wrap_torch_tensor(codes.transpose(1, 2).contiguous(), dtype=FP4), vl, **vopts)
        ws = convert_layout(wrap_torch_tensor(scales.transpose(1, 2).contiguous()), sl, **sopts)
        return wq, PrecisionConfig(weight_scale=ws, flex_ctx=FlexCtx(rhs_data=InFlexData()))

    q13, pc13 = wrap(w13.codes[:, perm], w13.scales[:, perm])
    q2, pc2 = wrap(w2.codes, w2.scales)
    b13 = torch.zeros(E, 2 * I, dtype=torch.float32, device=w13.codes.device)
    b13[:, 1::2] = -1.0
    p.keep += [q13, q2, b13]
    act = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (1.0, 1e30), 2)

    def prepare(ids: torch.Tensor, weights: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        T = ids.shape[0]
        logits = torch.full((T, E), -1e4, dtype=torch.float32, device=ids.device)
        logits.scatter_(1, ids.long(), torch.log(weights.float()) + 100.0)  # top-k then softmax gives ids, weights
        rdata, gather, scatter = routing(logits, k, sm_first=False)

        def block(x: torch.Tensor) -> torch.Tensor:
            h = matmul_ogs(x, q13, b13, rdata, gather_indx=gather, precision_config=pc13, fused_activation=act)
            return matmul_ogs(h, q2, None, rdata, scatter_indx=scatter, precision_config=pc2, gammas=rdata.gate_scal)
        return block
    return prepare


# ----------------------------------------------------------------------------------------------- timing
# ----------------------------------------------------------------------------------------------- checks
def reference(x: torch.Tensor, w13: Experts, w2: Experts, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 y [T, H]: the routed experts decoded with torch, SwiGLU in fp32, the weighted slot sum in fp32."""
    T, k = ids.shape
    I = w2.K
    y = torch.zeros(T, w2.N, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1).long()
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().reshape(-1)
        tok = pairs // k
        h = x[tok].float() @ ref_dequant(w13, e).t()
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        o = a @ ref_dequant(w2, e).t()
        y.index_add_(0, tok, o * weights.reshape(-1)[pairs].float().unsqueeze(1))
    return y


def run_peer(p: Peers, name: str, ids: torch.Tensor, wt: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return p.prep[name](ids, wt)(x)


def check(w13: Experts, w2: Experts, k: int, peers: Peers, device: str, T: int, seed: int, routing: str,
          zipf_s: float) -> list[str]:
    lines: list[str] = []
    ids, wt = make_routing(routing, T, w13.E, k, seed + 7, zipf_s, device)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    x = torch.randn(T, w13.K, dtype=torch.bfloat16, device=device, generator=gen)
    ref = reference(x, w13, w2, ids, wt)
    if mxq is not None:
        try:  # mxq's decode against the torch decode (the reference's own footing)
            Wm = mxq.dequantize(w13.codes[0], w13.scales[0], format=w13.fmt, cols=w13.K, tensor_scale=w13.S,
                                dtype=torch.float32)
            Wr = ref_dequant(w13, 0)
            md = (Wm - Wr).abs().max().item()
            lines.append(f"  check decode: mxq.dequantize vs torch decode (w13 expert 0): max |diff| = {md:.3g}"
                         + ("" if md <= 1e-6 * Wr.abs().max().item() else "  <-- MISMATCH (reference suspect)"))
        except Exception as e:  # noqa: BLE001
            lines.append(f"  check decode: mxq.dequantize failed: {short(e)}")
    for name in PEERS:
        if name not in peers.prep:
            lines.append(f"  check {name:12s} T={T}: n/a ({peers.errors.get(name, '?')})")
            continue
        try:
            y = run_peer(peers, name, ids, wt, x)
            if device == "cuda":
                torch.cuda.synchronize()
            if tuple(y.shape) != (T, w2.N):
                lines.append(f"  check {name:12s} T={T}: output shape {tuple(y.shape)}, expected {(T, w2.N)}  FAIL")
                continue
            e = rel_err(y, ref)
            msg = f"  check {name:12s} T={T}: rel err {e:.2e} {'ok' if e <= CHECK_TOL else 'FAIL'}"
            if e > CHECK_TOL:
                yf = y.float()
                alpha = (yf * ref).sum().item() / max((ref * ref).sum().item(), 1e-30)
                msg += f"; best-fit scale {alpha:.4g} (layout/scale interpretation differs; timings still printed)"
            lines.append(msg)
        except Exception as e:  # noqa: BLE001
            lines.append(f"  check {name:12s} T={T}: error {short(e, 160)}")
            if device == "cuda":
                traceback.print_exc(limit=-6, file=sys.stderr)
    return lines


def check_align(E: int, k: int, device: str, seed: int) -> str:
    """humming_align (the sync-free torch build of Humming's routing metadata) against the Python-loop layout."""
    try:
        bad = []
        for T, block in ((1, 8), (5, 16), (33, 8), (64, 64)):
            ids, _ = make_routing("uniform", T, E, min(k, E), seed + T, 1.0, device)
            s, e, n = humming_align(ids, E, block)
            s_ref, e_ref, n_ref = humming_align_loop(ids, E, block)
            ok = int(n) == n_ref and s[:n_ref].tolist() == s_ref and e[: n_ref // block].tolist() == e_ref
            ok = ok and bool((s[n_ref:] == T * ids.shape[1]).all())
            if not ok:
                bad.append(f"T={T} block={block}")
        return "  check humming_align vs Python-loop layout: " + ("ok" if not bad else "MISMATCH " + ", ".join(bad))
    except Exception as ex:  # noqa: BLE001
        return f"  check humming_align: error {short(ex)}"


def sanity(w13: Experts, k: int, peers: Peers, device: str, T: int, seed: int, routing: str, zipf_s: float) -> str:
    if "bf16 grouped" not in peers.prep:
        return "  sanity: no bf16 grouped reference"
    try:
        ids, wt = make_routing(routing, T, w13.E, k, seed + 11, zipf_s, device)
        gen = torch.Generator(device=device).manual_seed(seed + 11)
        x = torch.randn(T, w13.K, dtype=torch.bfloat16, device=device, generator=gen)
        ref = run_peer(peers, "bf16 grouped", ids, wt, x).float()
    except Exception as e:  # noqa: BLE001
        return f"  sanity: bf16 grouped failed: {short(e)}"
    parts: list[str] = []
    for name in PEERS:
        if name == "bf16 grouped" or name not in peers.prep:
            continue
        try:
            e = rel_err(run_peer(peers, name, ids, wt, x), ref)
            parts.append(f"{name} {e:.2e}" + ("" if e <= CHECK_TOL else " FAIL"))
        except Exception as ex:  # noqa: BLE001
            parts.append(f"{name} error {short(ex, 60)}")
    return f"  sanity vs bf16 grouped (T={T}, rel err): " + (", ".join(parts) or "no other peer")


def humming_schema_check(w13: Experts) -> str:
    """CPU-safe: Humming's compressed-tensors schema validates our expert tensors (shapes, dtypes) with num_experts."""
    try:
        from humming.schema import BaseWeightSchema  # type: ignore

        sch = BaseWeightSchema.from_config(humming_weight_config(w13.fmt))
        tens = humming_tensors(w13)
        sch.validate_tensors(tens, shape_n=w13.N, shape_k=w13.K, param_dtype=torch.bfloat16, num_experts=w13.E)
        # the conversion HummingLayer.transform does (convert_humming enters torch.cuda.device(): its torch part)
        hs, ht = sch._convert_humming(tens, [w13.N], [w13.K], torch.bfloat16, w13.E)
        desc = ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in ht.items())
        line = (f"  check Humming schema: w13 tensors validated (num_experts={w13.E}); converted: b_dtype={hs.b_dtype} "
                f"group={hs.weight_scale_group_size}; {desc}")
        if "weight_scale_2" in ht:
            line += (f"; weight_scale_2[0] = {ht['weight_scale_2'].float().flatten()[0].item():.6g}"
                     f" (expected 1/S = {1 / w13.S if w13.S else float('nan'):.6g})")
        return line
    except Exception as e:  # noqa: BLE001
        return f"  check Humming schema: {short(e, 200)}"


# ----------------------------------------------------------------------------------------------- table
def regime_target(T: int) -> tuple[str, Optional[str]]:
    """(label, key of the record it reads)."""
    if T <= 16:
        return f"TB/s >= {TARGET_DECODE_TBS}", "mxq_weight_tbs"
    if T == 256:
        return f"x bf16 >= {TARGET_X_BF16_256}", "x_bf16"
    if T >= 4096:
        return f"x bf16 >= {TARGET_X_BF16_PREFILL}", "x_bf16"
    return "-", None


def row_record(fmt: str, model: str, shape: tuple[int, int, int, int], routing: str, T: int, active: int,
               us: dict[str, Optional[float]], errs: dict[str, str], header: dict[str, Any]) -> dict[str, Any]:
    E, k, H, I = shape
    t = us.get("mxq")
    per_expert = 2 * I * H + H * I
    flops = 2.0 * T * k * per_expert
    wbytes = active * per_expert * BYTES_PER_ELEM[fmt]

    def x_over(peer: str) -> Optional[float]:
        v = us.get(peer)
        return None if t is None or v is None or t == 0 else v / t

    rec: dict[str, Any] = {
        "format": fmt, "model": model, "E": E, "k": k, "H": H, "I": I, "routing": routing, "T": T,
        "active_experts": active, "weight_bytes": wbytes, "flops": flops,
        "mxq_us": t, "bf16_us": us.get("bf16 grouped"), "humming_us": us.get("Humming"), "triton_us": us.get("triton"),
        "mxq_tflops": None if t is None else flops / (t * 1e-6) / 1e12,
        "mxq_weight_tbs": None if t is None else wbytes / (t * 1e-6) / 1e12,
        "x_bf16": x_over("bf16 grouped"), "x_humming": x_over("Humming"), "x_triton": x_over("triton"),
        "bf16_impl": BF16_LABEL, "errors": errs, **header,
    }
    label, key = regime_target(T)
    thresholds = {"mxq_weight_tbs": TARGET_DECODE_TBS, "x_bf16": TARGET_X_BF16_256 if T == 256 else TARGET_X_BF16_PREFILL}
    rec["target"] = label
    rec["target_met"] = None if key is None or rec[key] is None else bool(rec[key] >= thresholds[key])
    rec["humming_target_met"] = None if rec["x_humming"] is None else bool(rec["x_humming"] >= TARGET_X_HUMMING)
    return rec


def print_table(fmt: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n### {fmt}: MoE block (route, w13, SwiGLU, w2, combine), x bf16 [T, H], experts {fmt} "
          f"({BYTES_PER_ELEM[fmt]} B/elem), L2 cold, median us; bf16 = {BF16_LABEL}\n")
    print("| model | routing | T | active E | mxq us | bf16 us | Humming us | triton us | TFLOP/s | TB/s | x bf16 "
          "| x Humming | x triton | target | met (target / Humming >= 1.5) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")

    def yn(v: Optional[bool]) -> str:
        return "-" if v is None else ("yes" if v else "no")

    def fx(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        errs = r["errors"]

        def cell(key: str, peer: str) -> str:
            return fmt_us(r[key]) if r[key] is not None or peer not in errs else f"err: {errs[peer]}"
        tf = "-" if r["mxq_tflops"] is None else f"{r['mxq_tflops']:.1f}"
        tb = "-" if r["mxq_weight_tbs"] is None else f"{r['mxq_weight_tbs']:.2f}"
        print(f"| {r['model']} | {r['routing']} | {r['T']} | {r['active_experts']} | {cell('mxq_us', 'mxq')} | "
              f"{cell('bf16_us', 'bf16 grouped')} | {cell('humming_us', 'Humming')} | {cell('triton_us', 'triton')} | "
              f"{tf} | {tb} | {fx(r['x_bf16'])} | {fx(r['x_humming'])} | {fx(r['x_triton'])} | {r['target']} | "
              f"{yn(r['target_met'])} / {yn(r['humming_target_met'])} |")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------- main
def parse_shapes(text: str) -> list[tuple[str, tuple[int, int, int, int]]]:
    out = []
    for tok in (t.strip() for t in text.split(",") if t.strip()):
        if tok in MODELS:
            out.append((tok, MODELS[tok]))
            continue
        parts = tok.split(":")
        if len(parts) != 4:
            raise ValueError(f"shape '{tok}': a model name ({', '.join(MODELS)}) or E:k:H:I")
        E, k, H, I = (int(v) for v in parts)
        out.append((f"E{E}-k{k}-H{H}-I{I}", (E, k, H, I)))
    return out


def main() -> int:
    global HUMMING_ERR, TRITON_ERR
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gpt-oss-120b and qwen3-30b-a3b; T 1, 16, 256, 4096")
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--routing", default="uniform", help="uniform and/or zipf (comma-separated: each a case)")
    ap.add_argument("--zipf-s", type=float, default=1.0, help="the Zipf exponent of --routing zipf")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the rows as JSON lines")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"subset of {','.join(PEERS)}")
    ap.add_argument("--shapes", default=None, help=f"override the shapes: names ({', '.join(MODELS)}) or E:k:H:I, comma-separated")
    ap.add_argument("--ts", default=None, help="override the token counts: T[,T...]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-t", type=int, default=4, help="T of the correctness check (first shape)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: a tiny shape, the checks, mxq's reference op and bf16 grouped on the CPU, the table code; no timing")
    args = ap.parse_args()

    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in GROUP:
            ap.error(f"--formats: '{f}', expected mxfp4 and/or nvfp4")
    routings = [r.strip().lower() for r in args.routing.split(",") if r.strip()]
    for r in routings:
        if r not in ("uniform", "zipf"):
            ap.error(f"--routing: '{r}', expected uniform and/or zipf")
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU checks", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    shapes = [DRY_SHAPE] if dry else [(n, MODELS[n]) for n in (QUICK_SHAPES if args.quick else FULL_SHAPES)]
    ts = DRY_TS if dry else (QUICK_TS if args.quick else FULL_TS)
    try:
        if args.shapes:
            shapes = parse_shapes(args.shapes)
        if args.ts:
            ts = [int(t) for t in args.ts.split(",") if t.strip()]
    except ValueError as e:
        ap.error(f"--shapes / --ts: {e}")
    wanted = [t.strip() for t in args.peers.split(",") if t.strip()]
    for t in wanted:
        if t not in PEERS:
            ap.error(f"--peers: '{t}', expected a subset of {','.join(PEERS)}")

    humming_ok = import_humming() if "Humming" in wanted else False
    if "Humming" not in wanted:
        HUMMING_ERR = "not selected (--peers)"
    triton_ok = import_triton() if "triton" in wanted else False
    if "triton" not in wanted:
        TRITON_ERR = "not selected (--peers)"
    gpu = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    header = {"gpu": gpu, "torch": torch.__version__, "humming": HUMMING_VERSION, "triton_kernels": TRITON_VERSION,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    mxq_ver = getattr(mxq, "__version__", "?") if mxq is not None else "n/a"
    print(f"# W4A16 MoE peers: {gpu}, torch {torch.__version__}, mxq {mxq_ver}, humming {HUMMING_VERSION}, "
          f"triton_kernels {TRITON_VERSION}, {header['date']}")
    print(f"# bf16 grouped: {BF16_LABEL}; routing {', '.join(routings)}"
          + (f" (zipf s = {args.zipf_s})" if "zipf" in routings else ""))
    if not dry:
        print(f"# L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MiB (flush buffer 2x), "
              f"reps {args.reps}, warm-up {args.warmup}, median")
    for err in (MXQ_ERR, HUMMING_ERR, TRITON_ERR):
        if err:
            print(f"# {err}")

    timer = None if dry else Timer(args.reps, args.warmup)
    out = open(args.out, "w") if args.out else None
    t_start = time.perf_counter()
    all_rows: dict[str, list[dict[str, Any]]] = {f: [] for f in formats}
    broken: Optional[str] = None
    try:
        for fmt in formats:
            if broken:
                break
            for si, (model, shape) in enumerate(shapes):
                if broken:
                    break
                E, k, H, I = shape
                print(f"\n## {fmt} {model}: E {E}, top-{k}, H {H}, I {I} (elapsed {time.perf_counter() - t_start:.0f} s)",
                      flush=True)
                try:
                    w13 = make_experts(fmt, E, 2 * I, H, args.seed + 100 * si, device)
                    w2 = make_experts(fmt, E, H, I, args.seed + 100 * si + 1, device)
                except Exception as e:  # noqa: BLE001
                    print(f"  weight generation failed: {short(e)}")
                    continue
                peers = build_peers(w13, w2, k, device, wanted, humming_ok, triton_ok)
                for n in peers.notes:
                    print(f"  note: {n}")
                if si == 0:
                    for line in check(w13, w2, k, peers, device, args.check_t, args.seed, routings[0], args.zipf_s):
                        print(line, flush=True)
                    print(check_align(E, k, device, args.seed), flush=True)
                    if humming_ok:
                        print(humming_schema_check(w13), flush=True)
                else:
                    print(sanity(w13, k, peers, device, args.check_t, args.seed, routings[0], args.zipf_s), flush=True)
                for routing in routings:
                    for T in ts:
                        if broken:
                            break
                        ids, wt = make_routing(routing, T, E, k, args.seed + 1000 * si + T, args.zipf_s, device)
                        active = int(torch.unique(ids).numel())
                        gen = torch.Generator(device=device).manual_seed(args.seed + 2000 + T)
                        x = torch.randn(T, H, dtype=torch.bfloat16, device=device, generator=gen)
                        us: dict[str, Optional[float]] = {}
                        errs = dict(peers.errors)
                        for name in PEERS:
                            us[name] = None
                            if name not in peers.prep:
                                continue
                            try:
                                t0 = time.perf_counter()
                                fn = peers.prep[name](ids, wt)
                                y = fn(x)  # untimed first call (Humming / triton JIT compiles here)
                                if device == "cuda":
                                    torch.cuda.synchronize()
                                first = time.perf_counter() - t0
                                if first > 2.0:
                                    print(f"    {name} T={T}: first call {first:.1f} s", flush=True)
                                assert tuple(y.shape) == (T, H), f"shape {tuple(y.shape)}"
                                if timer is not None:
                                    us[name] = timer(lambda fn=fn, x=x: fn(x))
                                del fn, y
                            except Exception as e:  # noqa: BLE001
                                errs[name] = short(e)
                                if device == "cuda":
                                    try:
                                        torch.cuda.synchronize()
                                    except Exception as e2:  # noqa: BLE001 - a sticky CUDA error: nothing more can run
                                        broken = f"CUDA context lost after {name} {fmt} {model} T={T}: {short(e2)}"
                                        break
                        rec = row_record(fmt, model, shape, routing, T, active, us, errs, header)
                        all_rows[fmt].append(rec)
                        if out is not None:
                            out.write(json.dumps(rec) + "\n")
                            out.flush()
                        del x
                        cells = ", ".join(f"{n} {fmt_us(v)}" for n, v in us.items())
                        print(f"  {routing} T={T} (active {active}): {cells}", flush=True)
                del peers, w13, w2
                gc.collect()
                if device == "cuda" and not broken:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            print_table(fmt, all_rows[fmt])
    finally:
        if out is not None:
            out.close()
    if broken:
        print(f"\n# STOPPED: {broken}")
    print("\n# summary")
    for fmt in formats:
        print_table(fmt, all_rows[fmt])
    print(f"\n# total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
