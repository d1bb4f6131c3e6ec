"""Drop-in replacements of the vllm-qdq-plugin's activation QDQ functions
(`vllm_qdq_plugin.qdq.mxfp4_qdq`, `vllm_qdq_plugin.qdq.mxfp8_qdq`).

    from mxq.compat.vllm_qdq import mxfp4_qdq, mxfp8_qdq
    y = mxfp4_qdq(x)          # x: 2-D fp16/bf16 [M, K]; y: same shape and dtype

Numerics: the plugin's reference recipes, computed by mxq's kernels (CPU or CUDA, the same bytes):
mxfp4_qdq = MXFP4 (E2M1) with the "even" scale rule, mxfp8_qdq = MXFP8 E4M3 with the "floor" rule,
round to nearest even, group 32 (or `group_size`, a power of two in [2, 256]), K padded with zeros.
Differences from the plugin's reference (docs/python.md, "vllm-qdq-plugin"): E4M3 values in
[7.5, 8) * 2^-9 (after scaling) round to 2^-6 as true RNE does, where the reference gives 7 * 2^-9;
blocks whose amax rounds past the dtype's largest finite value (|x| near 65504 in fp16, near
3.39e38 in bf16) get a finite scale and saturate instead of producing Inf/NaN.

The environment switch VLLM_QDQ_CUTE (read on each call, truthy: 1, true, yes) selects the
plugin's fused CuTe kernel over its reference; both are exact transcriptions of one recipe, and
mxq's fused kernel serves both settings, so the switch is accepted and changes nothing: no CUTLASS
DSL is needed, no fallback warning is given, and CPU tensors, non-contiguous inputs and K not a
multiple of 32 take the fast path too.
"""
from __future__ import annotations

import os

import torch

from .. import ops as _ops

__all__ = ["mxfp4_qdq", "mxfp8_qdq", "cute_requested"]

_TRUTHY = ("1", "true", "yes")


class _InputError(AssertionError, ValueError):
    """The plugin rejects these inputs with an assert; this is both an AssertionError (as there) and
    a ValueError (as mxq's other argument errors)."""


def cute_requested() -> bool:
    """Whether VLLM_QDQ_CUTE asks for the fused kernel (the plugin's parsing). It changes nothing here."""
    return os.getenv("VLLM_QDQ_CUTE", "0").lower() in _TRUTHY


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise _InputError(f"{name} only supports 2D tensors for now, but got {x.dim()}D")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise _InputError(f"{name} only supports fp16/bf16 tensors, but got {x.dtype}")


def mxfp4_qdq(x: torch.Tensor, group_size: int = 32, *, trace_op_name: str = "mxfp4_qdq") -> torch.Tensor:
    """Quantize-dequantize input to MXFP4 (E2M1 + E8M0 scales, the "even" rule).

    Args:
        x: 2D tensor [M, K] in bf16/fp16
        group_size: number of elements per scale group (default 32)
        trace_op_name: accepted for compatibility (the plugin's VLLM_QDQ_TRACE label); unused.

    Returns:
        Tensor of x's shape and dtype, with MXFP4 quantization noise applied.
    """
    _check(x, "mxfp4_qdq")
    return torch.ops.mxq.qdq.default(x, "mxfp4", "even", _ops._group(group_size), False, 0, 0, None)


def mxfp8_qdq(x: torch.Tensor, group_size: int = 32, *, trace_op_name: str = "mxfp8_qdq") -> torch.Tensor:
    """Quantize-dequantize input to MXFP8 (E4M3 + E8M0 scales, the "floor" rule).

    Args:
        x: 2D tensor [M, K] in bf16/fp16
        group_size: number of elements per scale group (default 32)
        trace_op_name: accepted for compatibility; unused.

    Returns:
        Tensor of x's shape and dtype, with MXFP8 E4M3 quantization noise applied.
    """
    _check(x, "mxfp8_qdq")
    return torch.ops.mxq.qdq.default(x, "mxfp8_e4m3", "floor", _ops._group(group_size), False, 0, 0, None)
