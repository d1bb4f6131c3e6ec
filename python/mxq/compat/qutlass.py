"""Drop-in replacements of QuTLASS's quantization API (`qutlass.fusedQuantizeMx`,
`qutlass.fusedQuantizeNv`, `qutlass.utils.to_blocked`), computed by mxq on the CPU or any CUDA GPU
(QuTLASS itself runs on sm100/sm120 only).

    from mxq.compat.qutlass import fusedQuantizeMx, fusedQuantizeNv, to_blocked
    codes, scales = fusedQuantizeMx(a, h, method="quest")          # a: [..., K], K % 32 == 0; h: RS x RS or None
    codes, scales = fusedQuantizeNv(a, None, global_scale)         # K % 16 == 0
    blocked = to_blocked(scales)                                   # for the block-scaled GEMM

Outputs as QuTLASS's: codes uint8 [..., K/2] (element 2i in the low nibble); scales
float8_e8m0fnu (MX) or float8_e4m3fn (NV) of shape [ceil(rows/128)*128, ceil(G/4)*4] holding the
[rows, G] scales row-major at the top left (G = K/32 or K/16), padding zero (QuTLASS leaves it
uninitialised); `to_blocked` turns them into the 128x4 layout, flattened.

The rotation `b` (None, or an RS x RS matrix, RS in 16..256 dividing K; QuTLASS passes the Hadamard
matrix scaled by RS^-0.5 in bf16): each group of RS elements of `a` becomes a_g @ b, computed exactly
(float64 products and sums: exact for bf16 operands) and rounded once to fp32, then quantized (for
QuTLASS's Hadamard matrix, c times the Sylvester +-1 matrix, by the float64 butterfly
torch.ops.mxq.hadamard_rotate_f64 instead of a float64 matmul: the same values; _rotate); QuTLASS
rotates on tensor cores with fp32 accumulation and its test reference in float64 (mismatch rates in
docs/python.md). In this version the rotation is a separate matmul before mxq's kernel (an fp32
intermediate of a's size), not fused; mxq's own fused rotations are `mxq.quantize(..., rotation=...)`.

Numerics: docs/python.md, "QuTLASS", lists where mxq differs from QuTLASS's test reference (which
the tests/python/test_compat.py transcription follows): all-zero MX blocks get scale byte 0x00
(QuTLASS: 2^-27); NVFP4 multiplies by m = RN(S/s) where the reference divides exactly.
"""
from __future__ import annotations

import math
import weakref
from typing import Literal, Union

import torch

__all__ = ["fusedQuantizeMx", "fusedQuantizeNv", "to_blocked"]

_ROTATION_SIZES = (16, 32, 64, 128, 256)


# Hadamard verdicts: b's identity -> (a weak reference to b, c (b == c * H exactly) or None), so that a
# matrix's values are read (to the host) once. Keyed by address, version counter, device, dtype, shape
# and strides: a matrix written in place gets a new version; a hit counts only for the same tensor
# object (the weak reference), since a freed matrix's address is reused by the next allocation, whose
# version counter starts at 0 again. Bounded (cleared when full).
_HADAMARD_VERDICTS: dict = {}
_VERDICTS_MAX = 256


def _sylvester_negative(rs: int) -> torch.Tensor:
    """bool [rs, rs]: True where H[i][j] = (-1)^popcount(i & j) is -1 (src/core/rotation.hpp's sign
    convention, scipy.linalg.hadamard's and QuTLASS's)."""
    i = torch.arange(rs)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for k in range(8):
        parity ^= (bits >> k) & 1
    return parity.bool()


def _hadamard_scale(b: torch.Tensor):
    """c (a float: the value of b's entries, exactly) when every entry of the square matrix `b` equals
    c * (-1)^popcount(i & j) for one finite nonzero c, else None. Reads b to the host once per matrix
    (cached per tensor object and version, _HADAMARD_VERDICTS); during CUDA-graph capture a matrix not seen before gives None (the
    caller then keeps the float64 matmul, which captures) without reading it."""
    key = (b.data_ptr(), b._version, b.device, b.dtype, tuple(b.shape), b.stride())
    hit = _HADAMARD_VERDICTS.get(key)
    if hit is not None and hit[0]() is b:
        return hit[1]
    if b.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # not cached: decided on the first call outside capture
    m = b.detach().to(device="cpu", dtype=torch.float64)
    c = float(m[0, 0])
    verdict = None
    if c != 0.0 and math.isfinite(c):
        want = torch.full_like(m, c).masked_fill_(_sylvester_negative(b.shape[0]), -c)
        if torch.equal(m, want):
            verdict = c
    if len(_HADAMARD_VERDICTS) >= _VERDICTS_MAX:
        _HADAMARD_VERDICTS.clear()
    _HADAMARD_VERDICTS[key] = (weakref.ref(b), verdict)
    return verdict


def _rotate_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The general rotation: float64 matmul of each group by b, rounded once to fp32."""
    rs = b.shape[0]
    return (a.unflatten(-1, (-1, rs)).double() @ b.double()).flatten(-2).float()


def _rotate(a: torch.Tensor, b, fn: str) -> torch.Tensor:
    """`a` [..., K] with each group of RS elements multiplied by the RS x RS matrix `b` (y = a_g @ b, as
    QuTLASS): the products summed in float64 and rounded once to fp32. For bf16 `a` and `b` each product
    is exact in float64 and so is the sum while a group's products span less than about 2^(37 - log2 RS)
    in magnitude (any ordinary activation): y is then the correctly rounded rotation whatever order
    the matmul sums in (for fp32 operands the sum may round, so CPU and GPU can rarely differ). Memory:
    two float64 copies of `a` and an fp32 result, transient. None: `a`.

    Fast path: where `b` is c times the Sylvester +-1 matrix exactly (QuTLASS's Hadamard matrix, any
    dtype; _hadamard_scale), torch.ops.mxq.hadamard_rotate_f64(a, RS, c) instead: the float64
    Walsh-Hadamard butterfly times c, rounded once to fp32, no float64 copies; wherever the matmul's
    sums are exact (the bound above) it gives the same value, hence the same bytes downstream
    (docs/python.md, docs/numerics.md). The matrix is recognised from its values, read to the host
    once per matrix (a synchronisation for a GPU `b` on its first use; cached by address and version).
    The matmul stays: for any other `b`; under torch.compile (the check reads b's values); and during
    CUDA-graph capture for a matrix not seen before outside capture (one seen before takes the fast
    path, which captures)."""
    if b is None:
        return a
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"{fn}: argument 'b' (the rotation matrix): expected a tensor or None, got {type(b).__name__}")
    if b.dim() != 2 or b.shape[0] != b.shape[1] or b.shape[0] not in _ROTATION_SIZES:
        raise ValueError(f"{fn}: argument 'b': shape {tuple(b.shape)}, expected a square RS x RS rotation matrix "
                         f"with RS in {_ROTATION_SIZES}")
    if not b.is_floating_point():
        raise ValueError(f"{fn}: argument 'b': dtype {b.dtype}, expected a floating-point matrix (bf16, fp16 or fp32)")
    if b.device != a.device:
        raise ValueError(f"{fn}: argument 'b' is on {b.device}, argument 'a' on {a.device}: expected one device")
    rs = b.shape[0]
    if a.size(-1) % rs != 0:
        raise ValueError(f"{fn}: argument 'a': shape {tuple(a.shape)}, expected K (the last dimension) to be a "
                         f"multiple of the rotation size {rs} (QuTLASS does not check it)")
    with torch.no_grad():  # the quantization that follows is not differentiable either
        if not torch.compiler.is_compiling():
            c = _hadamard_scale(b)
            if c is not None:
                return torch.ops.mxq.hadamard_rotate_f64(a, rs, c)
        return _rotate_matmul(a, b)


def _check_input(a: torch.Tensor, group: int, fn: str) -> None:
    if not isinstance(a, torch.Tensor) or a.dim() < 1:
        raise ValueError(f"{fn}: argument 'a': expected a tensor [..., K]")
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{fn}: argument 'a': dtype {a.dtype}, expected bfloat16, float16 or float32")
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

    b: None or the RS x RS rotation matrix (module docstring): each group of RS elements of `a` is
    multiplied by it first, exactly, rounded once to fp32.
    method "quest": scale 2^floor(log2(std * 2.92247856/6 + 1e-8)) per 32 (mxq rule quest);
    "abs_max": scale 2^floor(log2(amax + 1e-8)), elements E2M1(3 x / scale) (mxq rule qutlass_absmax).
    Returns (codes uint8 [..., K/2], scales float8_e8m0fnu [pad128(rows), pad4(K/32)]), plus the clip
    mask uint8 [..., K/8] (bit 1 where |x/scale| < 6, LSB first) when return_mask (quest only).
    """
    if method not in ("quest", "abs_max"):
        raise ValueError(f"invalid method {method!r}, must be 'quest' or 'abs_max'")
    if return_mask and method != "quest":
        raise ValueError("return_mask is only supported for method 'quest'")
    _check_input(a, 32, "fusedQuantizeMx")
    a = _rotate(a, b, "fusedQuantizeMx")
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
    """NVFP4 quantization of `a` [..., K] (K % 16 == 0) as QuTLASS's fusedQuantizeNv.

    method "abs_max" (the default, as QuTLASS's): E4M3 block scales per 16 from the global encode
    scale `global_scale` (a 1-element tensor, read to the host: a synchronisation for a GPU tensor,
    or a float); mxq rule "nvfp4".
    method "quest": block scale E4M3_RN_satfinite(sigma * 2.92247856/6 + 1e-8) per 16 (sigma the
    block's population standard deviation), elements E2M1(y * 1/scale); `global_scale` is checked and
    ignored, as QuTLASS ignores it (dequantize: code * scale). mxq rule "quest" with format "nvfp4".
    Where it differs from
    QuTLASS's kernel (its one-pass fp32 statistics, approximate sqrt and reciprocal, flush-to-zero,
    and a NaN scale for a block whose one-pass variance rounds below zero): docs/python.md.
    Returns (codes uint8 [..., K/2], scales float8_e4m3fn [pad128(rows), pad4(K/16)])."""
    if method not in ("quest", "abs_max"):
        raise ValueError(f"invalid method {method!r}, must be 'quest' or 'abs_max'")
    _check_input(a, 16, "fusedQuantizeNv")
    a = _rotate(a, b, "fusedQuantizeNv")
    if method == "quest":  # global_scale checked as QuTLASS checks it, never read (no host sync)
        if isinstance(global_scale, torch.Tensor) and global_scale.numel() != 1:
            raise ValueError(f"fusedQuantizeNv: argument 'global_scale': shape {tuple(global_scale.shape)}, "
                             "expected one element")
        codes, scales, _, _ = torch.ops.mxq.quantize(a, "nvfp4", "quest", 16, False, 0, 0, "padded", None, False)
        return codes, scales.view(torch.float8_e4m3fn)
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
