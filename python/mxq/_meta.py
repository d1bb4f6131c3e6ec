"""Fake (meta) implementations of the mxq ops, for torch.compile and FakeTensor tracing: they give
the output shapes, dtypes and devices of the C++ kernels (python/csrc/ops.cpp) without computing, and
refuse what the kernels refuse. The ops' options are declared in python/csrc/ops.cpp; the fakes take
their names from the registered schemas and check each option once, in CHECKS.
tests/python/test_ops.py checks them against the kernels with torch.library.opcheck."""
from __future__ import annotations

import re

import torch

from . import _formats as F
from .linear import packed_shapes


def _rows(x: torch.Tensor) -> int:
    n = 1
    for s in x.shape[:-1]:
        n *= s
    return n


def _check_float(x: torch.Tensor, op: str, arg: str) -> None:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"mxq.{op}: argument '{arg}': dtype {x.dtype}, expected float32, float16 or bfloat16")
    if x.dim() < 1:
        raise ValueError(f"mxq.{op}: argument '{arg}': a 0-dimensional tensor, expected at least 1 dimension")


# ---- the options' checks ---------------------------------------------------------------------------
# The checks the kernels make on each option (python/csrc/ops.cpp declares the options and their
# setters), by option name: check(value, a, op) with `a` every argument of the call by name. Every fake
# of an op runs the checks of the options its schema has, in schema order, so that tracing fails where
# running would.
def _format(v, a: dict, op: str) -> None:
    if v is None:  # the fused producers: no QDQ of the output
        if a["rule"] or a["group_size"] or a["tensor_scale"] is not None:
            raise ValueError(f"mxq.{op}: 'rule', 'group_size' and 'tensor_scale' need a 'format' (the QDQ of the output)")
        return
    F.canonical_format(v)


def _rule(v: str, a: dict, op: str) -> None:
    """A rule the format does not define, with the library's message (a name the library does not know
    is refused by its parser at run time)."""
    if a["format"] is None or v not in F.RULES:  # no QDQ of the output (checked above), or "" (the default)
        return
    fmt = F.canonical_format(a["format"])
    why = F.rule_refusal(fmt, v)
    if why:
        raise ValueError(f"mxq::{op.rstrip('_')}: option 'rule': {why}")


def _e5m3(a: dict) -> bool:
    f = a.get("format")
    return isinstance(f, str) and F.canonical_format(f) == "nvfp4_e5m3"


def _group_size(v: int, a: dict, op: str) -> None:
    if v != 0 and (v < 2 or v > 256 or v & (v - 1)):
        raise ValueError(f"mxq.{op}: argument 'group_size': {v}, expected 0 (the format's default) "
                         "or a power of two in [2, 256]")
    if _e5m3(a) and v not in (0, 16, 32):
        raise ValueError(f"mxq::{op.rstrip('_')}: option 'group_size': {v} with format 'nvfp4_e5m3', expected 0 (16), "
                         "16 or 32 (the vllm-qdq-plugin's group sizes)")


def _stochastic(v: bool, a: dict, op: str) -> None:
    if v and _e5m3(a):
        raise ValueError(f"mxq::{op.rstrip('_')}: option 'rounding': 'stochastic' with format 'nvfp4_e5m3', expected rne "
                         "(the format rounds to nearest even only)")


def _layout(v: str, a: dict, op: str) -> None:
    if v not in ("linear", "swizzled", "padded"):
        raise ValueError(f"mxq.{op}: argument 'layout': '{v}', expected one of: linear, swizzled, padded")


def _random_bits(v: int, a: dict, op: str) -> None:
    if v not in (32, 16, 8):
        raise ValueError(f"mxq: argument 'random_bits': {v}, expected 32, 16 or 8")


_ROTATION = re.compile(r"(r?had)(16|32|64|128|256)")


def _rotation(v: str, a: dict, op: str) -> None:
    if v != "none" and not _ROTATION.fullmatch(v):
        raise ValueError(f"mxq: rotation '{v}': expected none, had<RS> or rhad<RS> with RS 16, 32, 64, 128 or 256")
    if v != "none" and _e5m3(a):
        name = "random_hadamard" if v.startswith("r") else "hadamard"
        raise ValueError(f"mxq::{op.rstrip('_')}: option 'rotation': '{name}' with format 'nvfp4_e5m3', expected none "
                         "(no rotation is defined for this format)")


def _tensor_scale_tensor(t, a: dict, op: str) -> None:
    if t is None:
        return
    if a["tensor_scale"] is not None:
        raise ValueError(f"mxq.{op}: pass the tensor scale either as a float or as a tensor, not both")
    if t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"mxq.{op}: argument 'tensor_scale': expected a float32 tensor of one element, got {t.dtype} "
                         f"of shape {list(t.shape)}")


def _matrix(arg: str):
    def check(m, a: dict, op: str) -> None:
        """A rotation matrix instead of a named rotation, on the data's device (the op's first argument)."""
        if m is None:
            return
        if a["rotation"] != "none":
            name = "random_hadamard" if a["rotation"].startswith("r") else "hadamard"
            raise ValueError(f"mxq.{op}: argument '{arg}' given with rotation '{name}': pass either a rotation name or "
                             "a matrix")
        like = next(iter(a.values()))
        if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] not in (16, 32, 64, 128, 256):
            raise ValueError(f"mxq.{op}: argument '{arg}': shape {tuple(m.shape)}, expected a square [RS, RS] matrix "
                             "with RS = 16, 32, 64, 128 or 256")
        if m.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"mxq.{op}: argument '{arg}': dtype {m.dtype}, expected float32 or bfloat16")
        if m.device != like.device:
            raise ValueError(f"mxq.{op}: argument '{arg}' is on {m.device}, expected the data's device {like.device}")
    return check


def _matrix_precision(v: str, a: dict, op: str) -> None:
    """As the kernels check it (the op, then the library's options)."""
    x, m = a["x"], a["rotation_matrix"]
    if v not in ("exact", "bf16"):
        raise ValueError(f"mxq.{op}: argument 'matrix_precision': '{v}', expected 'exact' or 'bf16'")
    if v == "bf16":
        if m is None:
            raise ValueError(f"mxq.{op}: option 'matrix_precision': 'bf16' with rotation 'none' (it chooses how a "
                             "rotation matrix is summed)")
        if m.dtype != torch.bfloat16:
            raise ValueError(f"mxq.{op}: option 'rotation_matrix': dtype {m.dtype} with matrix_precision 'bf16', "
                             "expected bf16")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"mxq.{op}: argument 'x': dtype {x.dtype} with matrix_precision 'bf16', expected bf16")
        if m.shape[0] > 128:
            raise ValueError(f"mxq.{op}: option 'matrix_precision': 'bf16' with rotation_size {m.shape[0]}, "
                             "expected 16, 32, 64 or 128")


def _dtype(v: torch.dtype, a: dict, op: str) -> None:
    if v not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"mxq.{op}: argument 'dtype': {v}, expected float32, float16 or bfloat16")


CHECKS = {
    "format": _format,
    "rule": _rule,
    "group_size": _group_size,
    "stochastic": _stochastic,
    "layout": _layout,
    "dtype": _dtype,
    "tensor_scale_tensor": _tensor_scale_tensor,
    "random_bits": _random_bits,
    "rotation": _rotation,
    "rotation_matrix": _matrix("rotation_matrix"),
    "rotation_inverse": _matrix("rotation_inverse"),
    "matrix_precision": _matrix_precision,
}


def _fake(name: str):
    """Registers the decorated function as the fake of mxq::<name>. It is called with the arguments by
    name (bound from the registered schema, defaults filled in: a caller may omit trailing ones) after the
    option checks, and gives the outputs; unused arguments land in its **_."""
    args = getattr(torch.ops.mxq, name).default._schema.arguments
    names = [p.name for p in args]
    defaults = {p.name: p.default_value for p in args if p.has_default_value()}
    checks = [(n, CHECKS[n]) for n in names if n in CHECKS]

    def register(outputs):
        def fake(*pos, **kw):
            given = {**dict(zip(names, pos)), **kw}
            a = {n: given[n] if n in given else defaults[n] for n in names}
            for n, check in checks:
                check(a[n], a, name)
            return outputs(**a)

        torch.library.register_fake(f"mxq::{name}")(fake)
        return outputs

    return register


@_fake("qdq")
def _qdq_fake(x, **_):
    _check_float(x, "qdq", "x")
    return x.new_empty(x.shape)


@_fake("qdq_")
def _qdq_inplace_fake(x, **_):
    _check_float(x, "qdq_", "x")
    return None


@_fake("quantize")
def _quantize_fake(x, format: str, group_size: int, layout: str, clip_mask: bool, **_):
    _check_float(x, "quantize", "x")
    fmt = F.canonical_format(format)
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    g = F.scale_cols(fmt, k, group_size)
    codes = x.new_empty(lead + (F.code_cols(fmt, k),), dtype=torch.uint8)
    if layout == "linear":
        scales = x.new_empty(lead + (g,), dtype=torch.uint8)
    else:
        scales = x.new_empty(F.padded_scale_shape(_rows(x), g), dtype=torch.uint8)
    ts = x.new_empty((1 if fmt == "nvfp4" else 0,), dtype=torch.float32)
    mask = x.new_empty(lead + ((k + 7) // 8,) if clip_mask else (0,), dtype=torch.uint8)
    return codes, scales, ts, mask


@_fake("dequantize")
def _dequantize_fake(codes, cols: int, dtype: torch.dtype, **_):
    return codes.new_empty(tuple(codes.shape[:-1]) + (cols,), dtype=dtype)


@torch.library.register_fake("mxq::swizzle_scales")
def _swizzle_fake(linear):
    if linear.dim() != 2:
        raise ValueError(f"mxq.swizzle_scales: argument 'linear': shape {tuple(linear.shape)}, expected 2 dimensions")
    return linear.new_empty(F.padded_scale_shape(linear.shape[0], linear.shape[1]))


@torch.library.register_fake("mxq::unswizzle_scales")
def _unswizzle_fake(swizzled, rows: int, cols: int):
    return swizzled.new_empty((rows, cols))


@_fake("rms_norm")
def _rms_norm_fake(x, weight, **_):
    _check_float(x, "rms_norm", "x")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.dtype != x.dtype:
        raise ValueError(f"mxq.rms_norm: argument 'weight': {weight.dtype} {tuple(weight.shape)}, expected "
                         f"{x.dtype} ({x.shape[-1]},)")
    return x.new_empty(x.shape)


@_fake("silu_mul")
def _silu_mul_fake(gate, up, **_):
    _check_float(gate, "silu_mul", "gate")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"mxq.silu_mul: argument 'up': {up.dtype} {tuple(up.shape)}, expected gate's "
                         f"{gate.dtype} {tuple(gate.shape)}")
    return gate.new_empty(gate.shape)


@torch.library.register_fake("mxq::prepack")
def _prepack_fake(codes, scales, N: int, K: int, format: str, layout: str):
    if format not in ("mxfp4", "nvfp4"):
        raise NotImplementedError(f"mxq.prepack: format '{format}': the W4A16 linear takes mxfp4 or nvfp4")
    cs, ss = packed_shapes(format, N, K)
    return codes.new_empty(cs), codes.new_empty(ss), codes.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("mxq::unpack")
def _unpack_fake(codes, scales, N: int, K: int, format: str, exp_shift: int):
    g = 16 if format == "nvfp4" else 32
    return codes.new_empty((N, (K + 1) // 2)), codes.new_empty((N, K // g))


@torch.library.register_fake("mxq::linear")
def _linear_fake(x, codes, scales, bias, format: str, N: int, K: int, exp_shift: int, f16_exact: bool, tensor_scale: float):
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"mxq.linear: argument 'x': dtype {x.dtype}, expected bfloat16 or float16")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"mxq.linear: argument 'x': shape {tuple(x.shape)}, expected [..., {K}] (the weight's K)")
    cs, ss = packed_shapes(format, N, K)
    if tuple(codes.shape) != cs or tuple(scales.shape) != ss:
        raise ValueError(f"mxq.linear: packed weight {tuple(codes.shape)} / {tuple(scales.shape)}, expected {cs} / {ss}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"mxq.linear: argument 'bias': {bias.dtype} {tuple(bias.shape)}, expected {x.dtype} ({N},)")
    return x.new_empty((*x.shape[:-1], N))


@torch.library.register_fake("mxq::moe")
def _moe_fake(x, w13_codes, w13_scales, w13_exp_shift, w13_tensor_scale, b13, w2_codes, w2_scales, w2_exp_shift, w2_tensor_scale, b2,
              topk_ids, topk_weights, format: str, I: int, f16_exact: bool, activation: str, alpha: float, limit: float):
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"mxq.moe: argument 'x': dtype {x.dtype}, expected bfloat16 or float16")
    if activation not in ("none", "swiglu", "swiglu_oai"):
        raise ValueError(f"mxq.moe: argument 'activation': '{activation}', expected one of: none, swiglu, swiglu_oai")
    if format not in ("mxfp4", "nvfp4"):
        raise NotImplementedError(f"mxq.moe: format '{format}': the W4A16 MoE takes mxfp4 or nvfp4 experts")
    H = x.shape[-1]
    N13 = I if activation == "none" else 2 * I
    E = w13_codes.shape[0]
    for name, c, s, N, K in (("w13", w13_codes, w13_scales, N13, H), ("w2", w2_codes, w2_scales, H, I)):
        cs, ss = packed_shapes(format, N, K)
        if tuple(c.shape) != (E, cs[0] * cs[1]) or tuple(s.shape) != (E, ss[0] * ss[1]):
            raise ValueError(f"mxq.moe: {name}'s packed experts {tuple(c.shape)} / {tuple(s.shape)}, expected "
                             f"{(E, cs[0] * cs[1])} / {(E, ss[0] * ss[1])}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"mxq.moe: topk_ids {topk_ids.dtype} {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)}, "
                         "expected int32 / int64 [..., k] and the same shape")
    return x.new_empty(x.shape), x.new_empty((1,), dtype=torch.int32)


@torch.library.register_fake("mxq::hadamard_rotate_f64")
def _hadamard_rotate_f64(a, rs, c):
    _check_float(a, "hadamard_rotate_f64", "a")
    if not (16 <= rs <= 256 and rs & (rs - 1) == 0):
        raise ValueError(f"mxq.hadamard_rotate_f64: argument 'rs': {rs}, expected a power of two in [16, 256]")
    torch._check(a.shape[-1] % rs == 0, lambda: f"mxq.hadamard_rotate_f64: argument 'a': shape {tuple(a.shape)}, "
                 f"expected K (the last dimension) to be a multiple of rs = {rs}")
    return a.new_empty(a.shape, dtype=torch.float32)
