#!/usr/bin/env python3
"""W4A16 GEMM peers: y [M, N] = x [M, K] (bf16) @ W^T, W a 4-bit [N, K] weight, timed on one CUDA GPU.

Peers, each on the same quantized weight bytes where the format allows:
  mxq         mxq.linear(x, mxq.prepack(codes=, scales=, format=, tensor_scale=).to("cuda"))
  cuBLAS      torch.matmul(x, Wd.T), Wd the bf16 dequantized weight (same shape, 2 B / element)
  deq+cuBLAS  mxq.dequantize(codes, scales, ..., dtype=bf16) on the GPU, then torch.matmul; timed together
  Humming     humming.layer.HummingLayer with a compressed-tensors weight config
              ("mxfp4-pack-quantized" group 32 / "nvfp4-pack-quantized" tensor_group 16) loaded from
              weight_packed uint8 [N, K/2] (element 2j in the low nibble), weight_scale [N, K/g]
              (MXFP4: uint8 E8M0 bytes; NVFP4: float8_e4m3fn) and, for NVFP4, weight_global_scale
              float32 [1] = the encode scale S (W = e2m1 * e4m3 / S), then .transform(); called as layer(x).

The weights are random bytes (every E2M1 code; MXFP4 scales E8M0 115..125, NVFP4 scales E4M3 bytes
0x28..0x58, S = 100), built on the CPU from a fixed seed; x is randn bf16.

Byte / FLOP model (printed columns):
  FLOPs             = 2 * M * N * K                    -> "mxq TFLOP/s" = FLOPs / mxq time
  weight bytes      = N * K * B, B = 0.5 + 1/g         (MXFP4 g=32: 0.53125 B/elem; NVFP4 g=16: 0.5625)
                      -> "mxq weight GB/s" = weight bytes / mxq time (x, y and the NVFP4 global scale
                      are not counted: at small M the weight stream is the whole cost)
  "x cuBLAS"        = cuBLAS us / mxq us (> 1: mxq faster);  "x Humming" = Humming us / mxq us

Measurement: L2 cold (a buffer of 2x the L2 size is written with zero_() before every timed call; a
short GPU spin, torch.cuda._sleep, precedes it so that the host's launch cost is not timed), CUDA
events around the op alone, median of --reps runs after --warmup untimed calls. Humming compiles its
kernels (JIT) on the first call of each layer: that call and the warm-up are outside the timing.
A correctness line per peer on the first shape: relative Frobenius error of y against
x.float() @ W_ref^T in fp32, W_ref decoded here with torch from the same bytes.
Every peer fails soft: an exception is caught, its reason printed in the table, the run goes on.

Run (GPU; Humming from the humming-kernels package, importable as `humming`, or skipped with its reason):
  python3 bench/linear_peers.py --quick [--formats mxfp4,nvfp4]
      [--reps 30] [--out results.jsonl]
  CPU only (no timing, no Humming kernels): python3 bench/linear_peers.py --dry-run
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

FULL_SHAPES: list[tuple[int, int]] = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192),
                                      (2880, 2880)]
FULL_MS: list[int] = [1, 16, 64, 128, 256, 1024, 4096]
QUICK_SHAPES: list[tuple[int, int]] = [(4096, 4096), (8192, 8192)]
QUICK_MS: list[int] = [1, 16, 64, 256, 1024]
DRY_SHAPE: tuple[int, int] = (256, 512)
DRY_MS: list[int] = [1, 16]

NVFP4_S: float = 100.0  # the NVFP4 encode scale S (compressed-tensors' weight_global_scale): W = e2m1 * e4m3 / S
PEERS: list[str] = ["mxq", "cuBLAS", "deq+cuBLAS", "Humming"]

try:
    import mxq  # type: ignore
    MXQ_ERR: Optional[str] = None
except Exception as e:  # noqa: BLE001 - fail soft: the other peers still run
    mxq = None  # type: ignore
    MXQ_ERR = f"import mxq: {type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------- weights
@dataclass
class Weight:
    """One quantized weight [N, K]: the bytes every peer reads (CPU copies and, on CUDA, device copies)."""

    fmt: str
    N: int
    K: int
    codes: torch.Tensor  # uint8 [N, K/2], element 2j in the low nibble
    scales: torch.Tensor  # uint8 [N, K/g]: E8M0 (mxfp4) or E4M3 (nvfp4) bytes
    S: Optional[float]  # nvfp4 encode scale, None for mxfp4

    @property
    def g(self) -> int:
        return GROUP[self.fmt]


def make_weight(fmt: str, N: int, K: int, seed: int) -> Weight:
    g = GROUP[fmt]
    if K % g or K % 8:
        raise ValueError(f"K = {K} must be a multiple of {g} and of 8")
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    if fmt == "mxfp4":
        scales = torch.randint(115, 126, (N, K // g), dtype=torch.uint8, generator=gen)  # 2^-12 .. 2^-2
        S = None
    else:
        scales = torch.randint(0x28, 0x59, (N, K // g), dtype=torch.uint8, generator=gen)  # E4M3 0.25 .. 18
        S = NVFP4_S
    return Weight(fmt, N, K, codes, scales, S)


def ref_dequant(w: Weight, codes: torch.Tensor, scales: torch.Tensor, swap_nibbles: bool = False) -> torch.Tensor:
    """W_ref float32 [N, K] decoded with torch (independent of mxq and Humming), on codes' device."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    lo, hi = (codes & 0xF).long(), (codes >> 4).long()
    if swap_nibbles:
        lo, hi = hi, lo
    vals = torch.stack((lut[lo], lut[hi]), dim=-1).reshape(w.N, w.K // w.g, w.g)
    if w.fmt == "mxfp4":
        sc = torch.exp2(scales.float() - 127.0)
    else:
        sc = scales.view(torch.float8_e4m3fn).float()
    W = (vals * sc.unsqueeze(-1)).reshape(w.N, w.K)
    if w.S is not None:
        W = W / w.S
    return W


def humming_tensors(w: Weight, codes: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """The compressed-tensors checkpoint tensors of w (same bytes; scales viewed as the schema's dtype)."""
    t: dict[str, torch.Tensor] = {"weight_packed": codes}
    if w.fmt == "mxfp4":
        t["weight_scale"] = scales  # uint8 E8M0 bytes (CompressedTensorsWeightSchema: scale_dtype torch.uint8)
    else:
        t["weight_scale"] = scales.view(torch.float8_e4m3fn)
        t["weight_global_scale"] = torch.tensor([w.S], dtype=torch.float32, device=codes.device)
    return t


# ----------------------------------------------------------------------------------------------- peers
@dataclass
class Peers:
    """The callables x -> y of one (format, shape), or the reason a peer is unavailable."""

    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # objects to free at the end of the shape


def build_peers(w: Weight, device: str, humming_ok: bool, humming_warm_x: Optional[torch.Tensor],
                wanted: list[str]) -> Peers:
    p = _build_peers(w, device, humming_ok, humming_warm_x, wanted)
    for name in PEERS:
        if name not in wanted:
            p.fns.pop(name, None)
            p.errors[name] = "not selected (--peers)"
    return p


def _build_peers(w: Weight, device: str, humming_ok: bool, humming_warm_x: Optional[torch.Tensor],
                 wanted: list[str]) -> Peers:
    p = Peers()
    codes = w.codes.to(device)
    scales = w.scales.to(device)
    p.keep += [codes, scales]
    fmt, K, S = w.fmt, w.K, w.S

    # mxq
    if "mxq" not in wanted:
        pass
    elif mxq is None:
        p.errors["mxq"] = MXQ_ERR or "mxq unavailable"
    else:
        try:
            t0 = time.perf_counter()
            pw = mxq.prepack(codes=w.codes, scales=w.scales, format=fmt, K=K, tensor_scale=S).to(device)
            p.notes.append(f"mxq.prepack {time.perf_counter() - t0:.2f} s")
            p.keep.append(pw)
            p.fns["mxq"] = lambda x, pw=pw: mxq.linear(x, pw)
        except Exception as e:  # noqa: BLE001
            p.errors["mxq"] = short(e)

    # bf16 weight for cuBLAS: mxq's dequantize of the same bytes, else the torch decode
    Wd: Optional[torch.Tensor] = None
    try:
        if mxq is None:
            raise RuntimeError(MXQ_ERR or "mxq unavailable")
        Wd = mxq.dequantize(codes, scales, format=fmt, cols=K, tensor_scale=S, dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        p.notes.append(f"mxq.dequantize failed ({short(e)}); cuBLAS weight from the torch decode")
        try:
            Wd = ref_dequant(w, codes, scales).to(torch.bfloat16)
        except Exception as e2:  # noqa: BLE001
            p.errors["cuBLAS"] = short(e2)
    if Wd is not None:
        p.keep.append(Wd)
        p.fns["cuBLAS"] = lambda x, Wd=Wd: torch.matmul(x, Wd.t())

    # dequantize (mxq, on the device) + cuBLAS, timed together
    if mxq is None:
        p.errors["deq+cuBLAS"] = MXQ_ERR or "mxq unavailable"
    else:
        def deq_mm(x: torch.Tensor, codes: torch.Tensor = codes, scales: torch.Tensor = scales) -> torch.Tensor:
            Wt = mxq.dequantize(codes, scales, format=fmt, cols=K, tensor_scale=S, dtype=torch.bfloat16)
            return torch.matmul(x, Wt.t())
        p.fns["deq+cuBLAS"] = deq_mm

    # Humming
    if not humming_ok:
        p.errors["Humming"] = HUMMING_ERR or "humming unavailable"
    elif device != "cuda":
        p.errors["Humming"] = "skipped (needs CUDA)"
    else:
        try:
            layer, pad = build_humming(w, codes, scales, humming_warm_x)
            p.keep.append(layer)
            if pad != (1, 1):
                p.notes.append(f"Humming needed pad_n/k_to_multiple={pad}")
            p.fns["Humming"] = lambda x, layer=layer: layer(x)
        except Exception as e:  # noqa: BLE001
            p.errors["Humming"] = short(e)
            traceback.print_exc(limit=-6, file=sys.stderr)
    return p


HUMMING_ERR: Optional[str] = None
HUMMING_VERSION: str = "n/a"


def import_humming() -> bool:
    global HUMMING_ERR, HUMMING_VERSION
    try:
        import humming  # type: ignore
        from humming.layer import HummingLayer  # type: ignore  # noqa: F401

        HUMMING_VERSION = str(getattr(humming, "__version__", "?"))
        return True
    except Exception as e:  # noqa: BLE001
        HUMMING_ERR = f"import humming: {short(e)}"
        return False


def build_humming(w: Weight, codes: torch.Tensor, scales: torch.Tensor,
                  warm_x: Optional[torch.Tensor]) -> tuple[torch.nn.Module, tuple[int, int]]:
    """HummingLayer (README "Usage Example" flow: construct, .cuda(), load tensors, .transform(), call) from
    the compressed-tensors tensors. The first call JIT-compiles the layer's kernels (all M intervals of its
    heuristic tuning table): done here, untimed. Retries with padding if the unpadded layer fails."""
    from humming.layer import HummingLayer  # type: ignore

    last: Optional[BaseException] = None
    tried: set[tuple[int, int]] = set()
    for pad in ((1, 1), (128, 128), (256, 256)):
        padded = (-(-w.N // pad[0]) * pad[0], -(-w.K // pad[1]) * pad[1])
        if padded in tried:  # the same layer as one that failed already
            continue
        tried.add(padded)
        layer = None
        try:
            layer = HummingLayer(shape_n=w.N, shape_k=w.K, weight_config=humming_weight_config(w.fmt),
                                 pad_n_to_multiple=pad[0], pad_k_to_multiple=pad[1], torch_dtype=torch.bfloat16).cuda()
            layer.load_from_tensors(humming_tensors(w, codes, scales))
            layer.transform()
            if warm_x is not None:
                t0 = time.perf_counter()
                layer(warm_x)
                torch.cuda.synchronize()
                print(f"    Humming {w.fmt} {w.N}x{w.K}: first call (JIT compile) {time.perf_counter() - t0:.1f} s",
                      flush=True)
            return layer, pad
        except Exception as e:  # noqa: BLE001
            last = e
            print(f"    Humming {w.fmt} {w.N}x{w.K} pad {pad}: {short(e, 200)}", file=sys.stderr, flush=True)
            del layer
            torch.cuda.empty_cache()
    assert last is not None
    raise last


# ----------------------------------------------------------------------------------------------- timing
# ----------------------------------------------------------------------------------------------- checks
def check(w: Weight, peers: Peers, device: str, M: int, seed: int) -> list[str]:
    """Relative error of each peer vs x.float() @ W_ref^T (fp32), plus decode cross-checks."""
    lines: list[str] = []
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    x = torch.randn(M, w.K, dtype=torch.bfloat16, device=device, generator=gen)
    codes, scales = w.codes.to(device), w.scales.to(device)
    Wref = ref_dequant(w, codes, scales)
    ref = x.float() @ Wref.t()
    if mxq is not None:
        try:
            Wm = mxq.dequantize(codes, scales, format=w.fmt, cols=w.K, tensor_scale=w.S, dtype=torch.float32)
            md = (Wm - Wref).abs().max().item()
            lines.append(f"  check decode: mxq.dequantize vs torch decode: max |diff| = {md:.3g}"
                         + ("" if md <= 1e-6 * Wref.abs().max().item() else "  <-- MISMATCH (reference suspect)"))
        except Exception as e:  # noqa: BLE001
            lines.append(f"  check decode: mxq.dequantize failed: {short(e)}")
    if HUMMING_ERR is None:
        hs = ht = None
        try:  # the compressed-tensors schema's view of our tensors (CPU-safe): shapes/dtypes, converted schema
            from humming.schema import BaseWeightSchema  # type: ignore

            sch = BaseWeightSchema.from_config(humming_weight_config(w.fmt))
            tens = humming_tensors(w, codes, scales)
            sch.validate_tensors(tens, shape_n=w.N, shape_k=w.K, param_dtype=torch.bfloat16)
            if device == "cuda":
                hs, ht = sch.convert_humming(tens, shape_n_stacks=[w.N], shape_k_stacks=[w.K],
                                             param_dtype=torch.bfloat16, device=torch.device(device),
                                             convert_symmetric_integer=False)
            else:  # convert_humming enters torch.cuda.device(), which needs CUDA; the conversion itself is torch
                hs, ht = sch._convert_humming(tens, [w.N], [w.K], torch.bfloat16, None)
            desc = ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in ht.items())
            lines.append(f"  check Humming schema: tensors validated; converted: b_dtype={hs.b_dtype} "
                         f"bs_dtype={hs.bs_dtype} group={hs.weight_scale_group_size} "
                         f"scale_2={getattr(hs.weight_scale_2_type, 'value', hs.weight_scale_2_type)}; {desc}")
            if "weight_scale_2" in ht:
                lines.append(f"  check Humming schema: weight_scale_2 = {ht['weight_scale_2'].float().flatten()[:1].item():.6g}"
                             f" (expected 1/S = {1 / w.S if w.S else float('nan'):.6g})")
        except Exception as e:  # noqa: BLE001
            lines.append(f"  check Humming schema: {short(e, 200)}")
    if device == "cuda" and "Humming" in peers.fns and HUMMING_ERR is None:
        try:  # Humming's own decode of the converted checkpoint tensors (its reading of the layout)
            if hs is None or ht is None:
                raise RuntimeError("schema conversion failed (above)")
            Wh = hs.dequant_tensors(ht).float().reshape(w.N, w.K)
            e1 = rel_err(Wh, Wref)
            e2 = rel_err(Wh, ref_dequant(w, codes, scales, swap_nibbles=True))
            msg = f"  check decode: Humming dequant_tensors vs torch decode: rel err {e1:.2e}"
            if e1 > 1e-3:
                msg += f" (vs nibble-swapped decode: {e2:.2e}) <-- Humming reads the bytes differently"
            lines.append(msg)
            del Wh, ht
        except Exception as e:  # noqa: BLE001
            lines.append(f"  check decode: Humming dequant_tensors unavailable: {short(e)}")
    for name in PEERS:
        if name not in peers.fns:
            lines.append(f"  check {name:11s} M={M}: n/a ({peers.errors.get(name, '?')})")
            continue
        try:
            y = peers.fns[name](x)
            if device == "cuda":
                torch.cuda.synchronize()
            if tuple(y.shape) != (M, w.N):
                lines.append(f"  check {name:11s} M={M}: output shape {tuple(y.shape)}, expected {(M, w.N)}  FAIL")
                continue
            e = rel_err(y, ref)
            status = "ok" if e <= CHECK_TOL else "FAIL"
            msg = f"  check {name:11s} M={M}: rel err {e:.2e} {status}"
            if e > CHECK_TOL:
                yf = y.float()
                alpha = (yf * ref).sum().item() / max((ref * ref).sum().item(), 1e-30)
                e_sc = rel_err(yf / alpha, ref) if alpha != 0 else float("nan")
                e_sw = rel_err(yf, x.float() @ ref_dequant(w, codes, scales, swap_nibbles=True).t())
                msg += (f"; best-fit scale {alpha:.4g} -> rel err {e_sc:.2e}; vs nibble-swapped W: {e_sw:.2e}"
                        " (layout/scale interpretation differs; timings still printed)")
            lines.append(msg)
        except Exception as e:  # noqa: BLE001
            lines.append(f"  check {name:11s} M={M}: error {short(e, 160)}")
    del x, ref, Wref, codes, scales
    return lines


def sanity(w: Weight, peers: Peers, device: str, M: int, seed: int) -> str:
    """Later shapes: each peer's relative error vs the cuBLAS output (bf16 weight) at one M (cheap)."""
    if "cuBLAS" not in peers.fns:
        return "  sanity: no cuBLAS reference"
    try:
        gen = torch.Generator(device=device).manual_seed(seed + 11)
        x = torch.randn(M, w.K, dtype=torch.bfloat16, device=device, generator=gen)
        ref = peers.fns["cuBLAS"](x).float()
    except Exception as e:  # noqa: BLE001
        return f"  sanity: cuBLAS failed: {short(e)}"
    parts: list[str] = []
    for name in PEERS:
        if name == "cuBLAS" or name not in peers.fns:
            continue
        try:
            y = peers.fns[name](x)
            e = rel_err(y, ref)
            parts.append(f"{name} {e:.2e}" + ("" if e <= CHECK_TOL else " FAIL"))
        except Exception as ex:  # noqa: BLE001
            parts.append(f"{name} error {short(ex, 60)}")
    return f"  sanity vs cuBLAS (M={M}, rel err): " + (", ".join(parts) or "no other peer")


# ----------------------------------------------------------------------------------------------- table
def fmt_x(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def row_record(fmt: str, N: int, K: int, M: int, us: dict[str, Optional[float]], errs: dict[str, str],
               header: dict[str, str]) -> dict[str, Any]:
    t = us.get("mxq")
    flops = 2.0 * M * N * K
    wbytes = N * K * BYTES_PER_ELEM[fmt]
    return {
        "format": fmt, "N": N, "K": K, "M": M,
        "mxq_us": us.get("mxq"), "cublas_us": us.get("cuBLAS"), "deq_cublas_us": us.get("deq+cuBLAS"),
        "humming_us": us.get("Humming"),
        "mxq_tflops": None if t is None else flops / (t * 1e-6) / 1e12,
        "mxq_weight_gbs": None if t is None else wbytes / (t * 1e-6) / 1e9,
        "x_cublas": None if t is None or us.get("cuBLAS") is None else us["cuBLAS"] / t,  # type: ignore[operator]
        "x_humming": None if t is None or us.get("Humming") is None else us["Humming"] / t,  # type: ignore[operator]
        "errors": errs, **header,
    }


def print_table(fmt: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n### {fmt}: y = x @ W^T, x bf16 [M, K], W {fmt} [N, K] "
          f"({BYTES_PER_ELEM[fmt]} B/elem), L2 cold, median us\n")
    print("| N x K | M | mxq us | cuBLAS us | deq+cuBLAS us | Humming us | mxq TFLOP/s | mxq weight GB/s "
          "| x cuBLAS | x Humming |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        errs = r["errors"]

        def cell(key: str, peer: str) -> str:
            return fmt_us(r[key]) if r[key] is not None or peer not in errs else f"err: {errs[peer]}"
        tf = "-" if r["mxq_tflops"] is None else f"{r['mxq_tflops']:.1f}"
        gb = "-" if r["mxq_weight_gbs"] is None else f"{r['mxq_weight_gbs']:.0f}"
        xc = "-" if r["x_cublas"] is None else f"{r['x_cublas']:.2f}"
        xh = "-" if r["x_humming"] is None else f"{r['x_humming']:.2f}"
        print(f"| {r['N']}x{r['K']} | {r['M']} | {cell('mxq_us', 'mxq')} | {cell('cublas_us', 'cuBLAS')} | "
              f"{cell('deq_cublas_us', 'deq+cuBLAS')} | {cell('humming_us', 'Humming')} | {tf} | {gb} | {xc} | {xh} |")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------- main
def main() -> int:
    global HUMMING_ERR
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shapes 4096x4096, 8192x8192; M 1, 16, 64, 256, 1024")
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the rows as JSON lines")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"subset of {','.join(PEERS)}")
    ap.add_argument("--shapes", default=None, help="override the shapes: NxK[,NxK...]")
    ap.add_argument("--ms", default=None, help="override the M values: M[,M...]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-m", type=int, default=16, help="M of the correctness check (first shape)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: build one small weight, run the checks and the table code, no timing, no Humming kernels")
    args = ap.parse_args()

    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in GROUP:
            ap.error(f"--formats: '{f}', expected mxfp4 and/or nvfp4")
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU checks", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    shapes = [DRY_SHAPE] if dry else (QUICK_SHAPES if args.quick else FULL_SHAPES)
    ms = DRY_MS if dry else (QUICK_MS if args.quick else FULL_MS)
    try:
        if args.shapes:
            shapes = [(int(a), int(b)) for a, b in (t.lower().split("x") for t in args.shapes.split(",") if t.strip())]
        if args.ms:
            ms = [int(t) for t in args.ms.split(",") if t.strip()]
    except ValueError:
        ap.error("--shapes NxK[,NxK...] and --ms M[,M...] take integers")
    wanted = [t.strip() for t in args.peers.split(",") if t.strip()]
    for t in wanted:
        if t not in PEERS:
            ap.error(f"--peers: '{t}', expected a subset of {','.join(PEERS)}")

    humming_ok = import_humming() if "Humming" in wanted else False
    if "Humming" not in wanted:
        HUMMING_ERR = "not selected (--peers)"
    gpu = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    header = {"gpu": gpu, "torch": torch.__version__, "humming": HUMMING_VERSION,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    mxq_ver = getattr(mxq, "__version__", "?") if mxq is not None else "n/a"
    print(f"# W4A16 GEMM peers: {gpu}, torch {torch.__version__}, mxq {mxq_ver}, humming {HUMMING_VERSION}, "
          f"{header['date']}")
    if not dry:
        print(f"# L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MiB (flush buffer 2x), "
              f"reps {args.reps}, warm-up {args.warmup}, median")
    if MXQ_ERR:
        print(f"# {MXQ_ERR}")
    if HUMMING_ERR:
        print(f"# {HUMMING_ERR}")

    timer = None if dry else Timer(args.reps, args.warmup)
    out = open(args.out, "w") if args.out else None
    t_start = time.perf_counter()
    all_rows: dict[str, list[dict[str, Any]]] = {f: [] for f in formats}
    broken: Optional[str] = None
    try:
        for fmt in formats:
            if broken:
                break
            for si, (N, K) in enumerate(shapes):
                if broken:
                    break
                print(f"\n## {fmt} {N}x{K} (elapsed {time.perf_counter() - t_start:.0f} s)", flush=True)
                try:
                    w = make_weight(fmt, N, K, args.seed + si)
                except Exception as e:  # noqa: BLE001
                    print(f"  weight generation failed: {short(e)}")
                    continue
                warm_x = None
                if not dry:
                    warm_x = torch.randn(max(ms), K, dtype=torch.bfloat16, device=device)
                peers = build_peers(w, device, humming_ok, warm_x, wanted)
                del warm_x
                for n in peers.notes:
                    print(f"  note: {n}")
                if si == 0:
                    for line in check(w, peers, device, args.check_m, args.seed):
                        print(line, flush=True)
                else:
                    print(sanity(w, peers, device, args.check_m, args.seed), flush=True)
                gen = torch.Generator(device=device).manual_seed(args.seed + 1000 + si)
                for M in ms:
                    if broken:
                        break
                    x = torch.randn(M, K, dtype=torch.bfloat16, device=device, generator=gen)
                    us: dict[str, Optional[float]] = {}
                    errs = dict(peers.errors)
                    for name in PEERS:
                        fn = peers.fns.get(name)
                        if fn is None:
                            us[name] = None
                            continue
                        try:
                            if timer is None:
                                y = fn(x)  # dry run: exercise the call only
                                assert tuple(y.shape) == (M, N), f"shape {tuple(y.shape)}"
                                us[name] = None
                            else:
                                us[name] = timer(lambda fn=fn, x=x: fn(x))
                        except Exception as e:  # noqa: BLE001
                            us[name] = None
                            errs[name] = short(e)
                            if device == "cuda":
                                try:
                                    torch.cuda.synchronize()
                                except Exception as e2:  # noqa: BLE001 - a sticky CUDA error: nothing more can run
                                    broken = f"CUDA context lost after {name} {fmt} {N}x{K} M={M}: {short(e2)}"
                                    break
                    rec = row_record(fmt, N, K, M, us, errs, header)
                    all_rows[fmt].append(rec)
                    if out is not None:
                        out.write(json.dumps(rec) + "\n")
                        out.flush()
                    del x
                    cells = ", ".join(f"{k} {fmt_us(v)}" for k, v in us.items())
                    print(f"  M={M}: {cells}", flush=True)
                del peers, w
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
