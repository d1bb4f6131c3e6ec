"""Drop-in replacements of QuTLASS's quantization API (`qutlass.fusedQuantizeMx`,
`qutlass.fusedQuantizeNv`, `qutlass.utils.to_blocked`), computed by mxq on the CPU or any CUDA GPU
(QuTLASS itself runs on sm100/sm120 only).

    from mxq.compat.qutlass import fusedQuantizeMx, fusedQuantizeNv, to_blocked
    codes, scales = fusedQuantizeMx(a, None, method="quest")       # a: [..., K], K % 32 == 0
    codes, scales = fusedQuantizeNv(a, None, global_scale)         # K % 16 == 0
    blocked = to_blocked(scales)                                   # for the block-scaled GEMM

Outputs as QuTLASS's: codes uint8 [..., K/2] (element 2i in the low nibble); scales
float8_e8m0fnu (MX) or float8_e4m3fn (NV) of shape [ceil(rows/128)*128, ceil(G/4)*4] holding the
[rows, G] scales row-major at the top left (G = K/32 or K/16), padding zero (QuTLASS leaves it
uninitialised); `to_blocked` turns them into the 128x4 layout, flattened.

The rotation `b`: mxq has no rotations yet, so b must be None or an identity matrix (checked once
per tensor version: a GPU tensor is read back the first time, so call once before capturing a CUDA
graph, or pass None); anything else raises NotImplementedError.

Numerics: docs/python.md, "QuTLASS", lists where mxq differs from QuTLASS's test reference (which
the tests/python/test_compat.py transcription follows): all-zero MX blocks get scale byte 0x00
(QuTLASS: 2^-27); NVFP4 multiplies by m = RN(S/s) where the reference divides exactly.
"""
from __future__ import annotations

import weakref
from typing import Literal, Union

import torch

__all__ = ["fusedQuantizeMx", "fusedQuantizeNv", "to_blocked"]

_identity_checked: "weakref.WeakKeyDictionary[torch.Tensor, tuple]" = weakref.WeakKeyDictionary()


def _is_identity(b: torch.Tensor) -> bool:
    key = (b._version, b.data_ptr(), tuple(b.shape), b.dtype)
    hit = _identity_checked.get(b)
    if hit is not None and hit[0] == key:
        return hit[1]
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "mxq.compat.qutlass: under torch.compile the rotation matrix must be None (mxq has no rotations "
            "yet, and an identity check would read the tensor)")
    if b.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "mxq.compat.qutlass: the rotation matrix must be checked to be the identity before CUDA-graph "
            "capture (call once outside the capture) or be None")
    ok = b.dim() == 2 and b.shape[0] == b.shape[1] and bool(
        torch.equal(b, torch.eye(b.shape[0], dtype=b.dtype, device=b.device)))
    _identity_checked[b] = (key, ok)
    return ok


def _check_rotation(b) -> None:
    if b is None:
        return
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"mxq.compat.qutlass: argument 'b' (the rotation matrix): expected a tensor or None, "
                        f"got {type(b).__name__}")
    if not _is_identity(b):
        raise NotImplementedError(
            f"mxq.compat.qutlass: argument 'b': a {tuple(b.shape)} rotation (Hadamard) matrix; mxq has no "
            "rotations yet: pass None or an identity matrix")


def _check_input(a: torch.Tensor, group: int, fn: str) -> None:
    if not isinstance(a, torch.Tensor) or a.dim() < 1:
        raise ValueError(f"{fn}: argument 'a': expected a tensor [..., K]")
    if a.size(-1) % group != 0:
        raise ValueError(f"{fn}: argument 'a': shape {tuple(a.shape)}, expected K (the last dimension) to be a "
                         f"multiple of {group} (QuTLASS's output shapes assume it)")


def fusedQuantizeMx(
    a: torch.Tensor,
    b: Union[torch.Tensor, None],
    *,
    method: Literal["quest", "abs_max"] = "quest",
    return_mask: bool = False,
):
    """MXFP4 quantization of `a` [..., K] (K % 32 == 0) as QuTLASS's fusedQuantizeMx.

    method "quest": scale 2^floor(log2(std * 2.92247856/6 + 1e-8)) per 32 (mxq rule quest);
    "abs_max": scale 2^floor(log2(amax + 1e-8)), elements E2M1(3 x / scale) (mxq rule qutlass_absmax).
    Returns (codes uint8 [..., K/2], scales float8_e8m0fnu [pad128(rows), pad4(K/32)]), plus the clip
    mask uint8 [..., K/8] (bit 1 where |x/scale| < 6, LSB first) when return_mask (quest only).
    """
    if method not in ("quest", "abs_max"):
        raise ValueError(f"invalid method {method!r}, must be 'quest' or 'abs_max'")
    if return_mask and method != "quest":
        raise ValueError("return_mask is only supported for method 'quest'")
    _check_rotation(b)
    _check_input(a, 32, "fusedQuantizeMx")
    rule = "quest" if method == "quest" else "qutlass_absmax"
    codes, scales, _, mask = torch.ops.mxq.quantize(a, "mxfp4", rule, 32, False, 0, 0, "padded", None,
                                                    bool(return_mask))
    scales = scales.view(torch.float8_e8m0fnu)
    return (codes, scales, mask) if return_mask else (codes, scales)


def _global_scale(global_scale) -> float:
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(f"fusedQuantizeNv: argument 'global_scale': shape {tuple(global_scale.shape)}, "
                             "expected one element")
        if global_scale.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fusedQuantizeNv: a GPU global_scale tensor cannot be read during CUDA-graph capture (mxq takes "
                "the NVFP4 tensor scale as a host float); pass a Python float")
        return float(global_scale.item())
    return float(global_scale)


def fusedQuantizeNv(
    a: torch.Tensor,
    b: Union[torch.Tensor, None],
    global_scale: Union[torch.Tensor, float],
    *,
    method: Literal["quest", "abs_max"] = "abs_max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization of `a` [..., K] (K % 16 == 0) as QuTLASS's fusedQuantizeNv (abs_max):
    E4M3 block scales per 16 from the global encode scale `global_scale` (a 1-element tensor, read to
    the host: a synchronisation for a GPU tensor, or a float).
    Returns (codes uint8 [..., K/2], scales float8_e4m3fn [pad128(rows), pad4(K/16)])."""
    if method not in ("quest", "abs_max"):
        raise ValueError(f"invalid method {method!r}, must be 'quest' or 'abs_max'")
    if method == "quest":
        raise NotImplementedError("fusedQuantizeNv(method='quest'): mxq has no NVFP4 quest rule yet")
    _check_rotation(b)
    _check_input(a, 16, "fusedQuantizeNv")
    gs = _global_scale(global_scale)
    codes, scales, _, _ = torch.ops.mxq.quantize(a, "nvfp4", "nvfp4", 16, False, 0, 0, "padded", gs, False)
    return codes, scales.view(torch.float8_e4m3fn)


def to_blocked(input_matrix: torch.Tensor, use_triton_kernel: bool = False) -> torch.Tensor:
    """The 128x4 blocked (swizzled) layout of a [H, W] scale matrix, flattened, in its dtype (a 1-byte
    dtype). As in QuTLASS, H and W must already be multiples of 128 and 4 unless use_triton_kernel,
    whose path pads (with zeros) itself; mxq's kernel serves both."""
    if input_matrix.dim() != 2:
        raise ValueError(f"to_blocked: argument 'input_matrix': shape {tuple(input_matrix.shape)}, expected [H, W]")
    rows, cols = input_matrix.shape
    if not use_triton_kernel and (rows % 128 or cols % 4):
        raise _ShapeError(f"to_blocked: input of shape {(rows, cols)} must be padded to multiples of (128, 4) "
                          "(QuTLASS asserts it; use_triton_kernel=True pads)")
    if input_matrix.element_size() != 1:
        raise NotImplementedError(f"to_blocked: dtype {input_matrix.dtype}: mxq swizzles 1-byte scales only")
    dt = input_matrix.dtype
    src = input_matrix if dt == torch.uint8 else input_matrix.view(torch.uint8)
    out = torch.ops.mxq.swizzle_scales(src).reshape(-1)
    return out if dt == torch.uint8 else out.view(dt)


class _ShapeError(AssertionError, ValueError):
    """QuTLASS asserts this; an AssertionError there, and a ValueError as mxq's argument errors."""
