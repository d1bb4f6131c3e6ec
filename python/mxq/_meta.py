"""Fake (meta) implementations of the mxq ops, for torch.compile and FakeTensor tracing: they give
the output shapes, dtypes and devices of the C++ kernels (python/csrc/ops.cpp) without computing.
tests/python/test_ops.py checks them against the kernels with torch.library.opcheck."""
from __future__ import annotations

from typing import Optional

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


def _check_layout_group(op: str, layout: Optional[str], group_size: int) -> None:
    """The checks the kernels make on these arguments, so that tracing fails where running would."""
    if layout is not None and layout not in ("linear", "swizzled", "padded"):
        raise ValueError(f"mxq.{op}: argument 'layout': '{layout}', expected linear, swizzled or padded")
    if group_size != 0 and (group_size < 2 or group_size > 256 or group_size & (group_size - 1)):
        raise ValueError(f"mxq.{op}: argument 'group_size': {group_size}, expected 0 (the format's default) "
                         "or a power of two in [2, 256]")


def _check_matrix(m, op: str, arg: str, like: torch.Tensor) -> None:
    """The op's checks of a rotation matrix (python/csrc/ops.cpp, set_matrix)."""
    if m is None:
        return
    if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] not in (16, 32, 64, 128, 256):
        raise ValueError(f"mxq.{op}: argument '{arg}': shape {tuple(m.shape)}, expected a square [RS, RS] matrix "
                         "with RS = 16, 32, 64, 128 or 256")
    if m.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"mxq.{op}: argument '{arg}': dtype {m.dtype}, expected float32 or bfloat16")
    if m.device != like.device:
        raise ValueError(f"mxq.{op}: argument '{arg}' is on {m.device}, expected the data's device {like.device}")


def _check_precision(v: str, op: str, x, m) -> None:
    """matrix_precision, as the kernels check it (python/csrc/ops.cpp and the library's options)."""
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


@torch.library.register_fake("mxq::qdq")
def _qdq_fake(x, format: str, rule: str, group_size: int, stochastic: bool, seed: int, offset: int,
              tensor_scale: Optional[float], random_bits: int = 32, rotation: str = "none", rotation_seed: int = 0,
              rotation_matrix=None, matrix_precision: str = "exact"):
    _check_float(x, "qdq", "x")
    _check_matrix(rotation_matrix, "qdq", "rotation_matrix", x)
    _check_precision(matrix_precision, "qdq", x, rotation_matrix)
    F.canonical_format(format)
    _check_layout_group("qdq", None, group_size)
    return x.new_empty(x.shape)


@torch.library.register_fake("mxq::qdq_")
def _qdq_inplace_fake(x, format: str, rule: str, group_size: int, stochastic: bool, seed: int, offset: int,
                      tensor_scale: Optional[float], random_bits: int = 32, rotation: str = "none",
                      rotation_seed: int = 0, rotation_matrix=None, matrix_precision: str = "exact"):
    _check_float(x, "qdq_", "x")
    _check_matrix(rotation_matrix, "qdq_", "rotation_matrix", x)
    _check_precision(matrix_precision, "qdq_", x, rotation_matrix)
    F.canonical_format(format)
    _check_layout_group("qdq_", None, group_size)
    return None


@torch.library.register_fake("mxq::quantize")
def _quantize_fake(x, format: str, rule: str, group_size: int, stochastic: bool, seed: int, offset: int,
                   layout: str, tensor_scale: Optional[float], clip_mask: bool, random_bits: int = 32,
                   rotation: str = "none", rotation_seed: int = 0, rotation_matrix=None,
                   matrix_precision: str = "exact"):
    _check_float(x, "quantize", "x")
    _check_matrix(rotation_matrix, "quantize", "rotation_matrix", x)
    _check_precision(matrix_precision, "quantize", x, rotation_matrix)
    fmt = F.canonical_format(format)
    _check_layout_group("quantize", layout, group_size)
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


@torch.library.register_fake("mxq::dequantize")
def _dequantize_fake(codes, scales, cols: int, format: str, group_size: int, layout: str,
                     tensor_scale: Optional[float], tensor_scale_tensor, dtype: torch.dtype, rotation: str = "none",
                     rotation_seed: int = 0, rotation_inverse=None):
    F.canonical_format(format)
    _check_matrix(rotation_inverse, "dequantize", "rotation_inverse", codes)
    _check_layout_group("dequantize", layout, group_size)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"mxq.dequantize: argument 'dtype': {dtype}, expected float32, float16 or bfloat16")
    return codes.new_empty(tuple(codes.shape[:-1]) + (cols,), dtype=dtype)


@torch.library.register_fake("mxq::swizzle_scales")
def _swizzle_fake(linear):
    if linear.dim() != 2:
        raise ValueError(f"mxq.swizzle_scales: argument 'linear': shape {tuple(linear.shape)}, expected 2 dimensions")
    return linear.new_empty(F.padded_scale_shape(linear.shape[0], linear.shape[1]))


@torch.library.register_fake("mxq::unswizzle_scales")
def _unswizzle_fake(swizzled, rows: int, cols: int):
    return swizzled.new_empty((rows, cols))


def _check_fused_qdq(op: str, format: Optional[str], rule: str, group_size: int, tensor_scale) -> None:
    if format is None:
        if rule or group_size or tensor_scale is not None:
            raise ValueError(f"mxq.{op}: 'rule', 'group_size' and 'tensor_scale' need a 'format' (the QDQ of the output)")
        return
    F.canonical_format(format)
    _check_layout_group(op, None, group_size)


@torch.library.register_fake("mxq::rms_norm")
def _rms_norm_fake(x, weight, eps: float, format: Optional[str], rule: str, group_size: int,
                   tensor_scale: Optional[float]):
    _check_float(x, "rms_norm", "x")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.dtype != x.dtype:
        raise ValueError(f"mxq.rms_norm: argument 'weight': {weight.dtype} {tuple(weight.shape)}, expected "
                         f"{x.dtype} ({x.shape[-1]},)")
    _check_fused_qdq("rms_norm", format, rule, group_size, tensor_scale)
    return x.new_empty(x.shape)


@torch.library.register_fake("mxq::silu_mul")
def _silu_mul_fake(gate, up, format: Optional[str], rule: str, group_size: int, tensor_scale: Optional[float]):
    _check_float(gate, "silu_mul", "gate")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"mxq.silu_mul: argument 'up': {up.dtype} {tuple(up.shape)}, expected gate's "
                         f"{gate.dtype} {tuple(gate.shape)}")
    _check_fused_qdq("silu_mul", format, rule, group_size, tensor_scale)
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
