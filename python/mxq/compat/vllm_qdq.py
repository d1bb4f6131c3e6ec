"""Drop-in replacements of the vllm-qdq-plugin's activation QDQ functions
(`vllm_qdq_plugin.qdq.mxfp4_qdq`, `vllm_qdq_plugin.qdq.mxfp8_qdq`), and of its NVFP4-with-UE5M3-scales
functions (`vllm_qdq_plugin.qdq.nvfp4_e5m3`: nvfp4_e5m3_qdq, _nvfp4_e5m3_qdq_reference, decode_ue5m3;
`vllm_qdq_plugin.qdq.nvfp4_e5m3_cute`: nvfp4_e5m3_qdq_cute, nvfp4_e5m3_weight_dequant_cute).

    from mxq.compat.vllm_qdq import mxfp4_qdq, mxfp8_qdq, nvfp4_e5m3_qdq
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

nvfp4_e5m3: mxq's format nvfp4_e5m3 (docs/numerics.md, "NVFP4 with UE5M3 scales"), whose definition is the
plugin's reference; its output equals the reference's on every input (NaN kept, Inf -> +-688128, fp16
overflow -> Inf; tests/python/test_compat.py compares them on every bf16 and fp16 pattern). The CuTe names run
the same kernels; nvfp4_e5m3_weight_dequant_cute takes CPU tensors too.
"""
from __future__ import annotations

import os

import torch

from .. import ops as _ops

__all__ = ["mxfp4_qdq", "mxfp8_qdq", "cute_requested", "nvfp4_e5m3_qdq", "nvfp4_e5m3_qdq_cute",
           "nvfp4_e5m3_weight_dequant_cute", "decode_ue5m3"]

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


# ---- NVFP4 with UE5M3 scales ----------------------------------------------------------------------------
def _check_e5m3(x: torch.Tensor, group_size: int) -> None:
    """The plugin's checks, its exception types and messages."""
    if x.dim() != 2:
        raise ValueError(f"nvfp4_e5m3_qdq expects a 2D tensor, got {x.dim()}D")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"nvfp4_e5m3_qdq expects BF16/FP16, got {x.dtype}")
    if group_size not in (16, 32):
        raise ValueError(f"nvfp4_e5m3_qdq requires group_size 16 or 32, got {group_size}")


def nvfp4_e5m3_qdq(x: torch.Tensor, group_size: int = 16, *, trace_op_name: str = "nvfp4_e5m3_qdq") -> torch.Tensor:
    """Quantize-dequantize BF16/FP16 activations using E2M1 elements and UE5M3 block scales.

    Args:
        x: 2D tensor [M, K] in bf16/fp16 (K padded with zeros to a multiple of group_size)
        group_size: 16 (default) or 32
        trace_op_name: accepted for compatibility (the plugin's VLLM_QDQ_TRACE label); unused.

    Returns:
        Tensor of x's shape and dtype.
    """
    _check_e5m3(x, group_size)
    return torch.ops.mxq.qdq.default(x, "nvfp4_e5m3", "nvfp4_e5m3", int(group_size), False, 0, 0, None)


def _nvfp4_e5m3_qdq_reference(x: torch.Tensor, group_size: int = 16) -> torch.Tensor:
    """The plugin's reference: the same bytes as nvfp4_e5m3_qdq (mxq's format is its definition)."""
    return nvfp4_e5m3_qdq(x, group_size)


def nvfp4_e5m3_qdq_cute(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The plugin's fused CuTe activation QDQ (torch.ops.vllm.nvfp4_e5m3_qdq_cute there): the same bytes."""
    return nvfp4_e5m3_qdq(x, group_size)


def nvfp4_e5m3_weight_dequant_cute(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Decode packed E2M1 codes (uint8 [N, K/2], element 2i in the low nibble) under UE5M3 scales (uint8
    [N, K/group_size], linear) into bf16 [N, K]. The plugin's checks, except that CPU tensors are accepted."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError("NVFP4_E5M3 packed weights and scales must use uint8")
    if packed.dim() != 2 or scales.dim() != 2:
        raise ValueError("NVFP4_E5M3 packed weights and scales must be 2D")
    if packed.device != scales.device:
        raise ValueError("NVFP4_E5M3 packed weights and scales must be on the same device")
    if group_size not in (16, 32):
        raise ValueError(f"NVFP4_E5M3 requires group_size 16 or 32, got {group_size}")
    if packed.shape[0] != scales.shape[0] or packed.shape[1] * 2 != scales.shape[1] * group_size:
        raise ValueError(
            f"NVFP4_E5M3 weight/scale shapes are incompatible: {tuple(packed.shape)}, {tuple(scales.shape)}")
    return torch.ops.mxq.dequantize.default(packed, scales, packed.shape[1] * 2, "nvfp4_e5m3", int(group_size),
                                            "linear", None, None, torch.bfloat16, "none", 0)


def decode_ue5m3(scale_bits: torch.Tensor) -> torch.Tensor:
    """UE5M3 bytes (uint8, any shape) as float32: e = bits >> 3, m = bits & 7; e = 0: m * 2^-17, else
    (1 + m / 8) * 2^(e - 15). Every byte is finite (0xFF = 122880)."""
    if scale_bits.dtype != torch.uint8:
        raise TypeError(f"decode_ue5m3 expects uint8 scale bits, got {scale_bits.dtype}")
    b = scale_bits.to(torch.int32)
    e, m = b >> 3, (b & 7).to(torch.float32)
    # the significand m (subnormal) or 8 + m, in units of 2^(e - 18) (2^-17 for the subnormals, e = 0)
    sig = torch.where(e == 0, m, m + 8.0)
    return torch.ldexp(sig, torch.clamp(e, min=1) - 18)
