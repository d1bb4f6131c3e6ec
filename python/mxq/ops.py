"""mxq's Python API: quantize, dequantize, QDQ (fake quantization) and scale layouts on torch tensors.

Every function here is a thin wrapper over one torch.library custom op of the namespace `mxq`
(torch.ops.mxq.*): CPU and CUDA kernels in C++, fake implementations for torch.compile, outputs
allocated by torch on the input's device, work enqueued on the current CUDA stream, no host
synchronisation (except where a function says so), so the ops can be captured in CUDA graphs.

Inputs of any rank are quantized along their last dimension (K): leading dimensions are rows.
Results are bit-exact across mxq's backends (CPU reference, fast CPU path, CUDA kernels); the
arithmetic is docs/numerics.md.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from . import _formats as F

__all__ = ["QuantizedTensor", "quantize", "rotate_quantize", "dequantize", "qdq", "qdq_", "swizzle_scales", "unswizzle_scales", "rms_norm",
           "silu_mul"]

_LAYOUTS = ("linear", "swizzled", "padded")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ScaleLike = Union[None, float, int, torch.Tensor]


def _u64(v: int, arg: str) -> int:
    """A uint64 (seed, offset) as the int64 bit pattern the op schema carries. Any integer type (a
    numpy integer too, as for sizes); bool is refused."""
    if type(v) is int and 0 <= v < 1 << 63:
        return v
    if isinstance(v, bool):
        raise TypeError(f"mxq: argument '{arg}': expected an int, got bool")
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"mxq: argument '{arg}': expected an int, got {type(v).__name__}") from None
    if not 0 <= v < 1 << 64:
        raise ValueError(f"mxq: argument '{arg}': {v}, expected an integer in [0, 2**64)")
    return v - (1 << 64) if v >= 1 << 63 else v


def _group(group_size: Optional[int]) -> int:
    if group_size is None:
        return 0
    if isinstance(group_size, bool):
        raise TypeError("mxq: argument 'group_size': expected an int or None, got bool")
    try:
        group_size = operator.index(group_size)  # numpy integers too, as for sizes
    except TypeError:
        raise TypeError(f"mxq: argument 'group_size': expected an int or None, got {type(group_size).__name__}") from None
    # NOTE: the upper bound here too: a value past int64 failed in the op's argument conversion with a
    # message naming no argument
    if not 0 < group_size <= 256:
        raise ValueError(f"mxq: argument 'group_size': {group_size}, expected None (the format's default) "
                         "or a power of two in [2, 256]")
    return group_size


def _scale_value(tensor_scale: ScaleLike) -> Optional[float]:
    """The NVFP4 encode scale as a host float. A tensor is read back (a synchronisation for a GPU tensor)."""
    if tensor_scale is None:
        return None
    if isinstance(tensor_scale, torch.Tensor):
        if tensor_scale.numel() != 1:
            raise ValueError(f"mxq: argument 'tensor_scale': a tensor of shape {tuple(tensor_scale.shape)}, "
                             "expected one element (the encode scale 448*6/amax)")
        return float(tensor_scale.item())
    if isinstance(tensor_scale, bool) or not isinstance(tensor_scale, (float, int)):
        raise TypeError(f"mxq: argument 'tensor_scale': expected a float, a 1-element tensor or None, "
                        f"got {type(tensor_scale).__name__}")
    try:
        return float(tensor_scale)
    except OverflowError:  # an int past the float range
        raise ValueError("mxq: argument 'tensor_scale': an integer too large for a float (the encode scale "
                         "448*6/amax is a finite float32)") from None


def _size(v, arg: str):
    """A size argument (rows, cols): a Python int (numpy integers too), or a torch.SymInt passed
    through untouched, so that torch.compile(dynamic=True) keeps it symbolic (int() would specialise
    the graph to one value and recompile for the next)."""
    # NOTE: under torch.compile a size read from a shape is a SymInt that isinstance() does not see as
    # one when Dynamo traces this (it specialised the graph: one recompilation per shape); the
    # schema's SymInt type checks it there.
    if isinstance(v, torch.SymInt) or torch.compiler.is_compiling():
        return v
    if isinstance(v, bool):
        raise TypeError(f"mxq: argument '{arg}': expected an int, got bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"mxq: argument '{arg}': expected an int, got {type(v).__name__}") from None


# (format, rule) as a caller spells them -> the library's names, for every exact name and alias (the
# per-call fast path: one dict lookup). Built once here and never changed afterwards: torch.compile
# guards on what it reads, and a table that grew would invalidate compiled graphs. Other spellings
# (other case, '-' for '_') and every error go through F.canonical_format / F.canonical_rule.
def _names_table() -> dict:
    table = {}
    fmts = list(F.FORMATS) + list(F._FORMAT_ALIASES)
    rules = [None, *F.RULES, *F._RULE_ALIASES]
    for f in fmts:
        cf = F.canonical_format(f)
        for r in rules:
            table[(f, r)] = (cf, F.canonical_rule(r, cf))
    return table


_NAMES = _names_table()


def _names(format: str, rule: Optional[str]) -> tuple:
    try:
        return _NAMES[format, rule]
    except (KeyError, TypeError):  # another spelling, or not a str: the full checks and their messages
        fmt = F.canonical_format(format)
        return fmt, F.canonical_rule(rule, fmt)


_I63 = 1 << 63
# The ops' overloads, looked up once (torch.ops.mxq.qdq.default is three attribute lookups per call).
_QDQ = torch.ops.mxq.qdq.default
_QDQ_INPLACE = torch.ops.mxq.qdq_.default


def _rotation(rotation: Optional[str]) -> str:
    """None -> "none"; else "had<RS>" / "rhad<RS>" (RS 16, 32, 64, 128, 256), checked by the op."""
    if rotation is None:
        return "none"
    if not isinstance(rotation, str):
        raise TypeError(f"mxq: argument 'rotation': expected a str ('had128', 'rhad64', ...), an RS x RS matrix "
                        f"or None, got {type(rotation).__name__}")
    return rotation


RotationLike = Union[None, str, torch.Tensor]
_ROTATION_SIZES = (16, 32, 64, 128, 256)
# Matrix rotations run in mxq's kernels (fused: the products summed in float64 in index order, on the
# CPU or the GPU's FP64 tensor cores, the same bytes). Tests set this to take the torch path instead
# (_rotate_groups: torch rotates, then mxq quantizes), to compare the two.
_UNFUSED = False


def _matrix(m: torch.Tensor, arg: str) -> torch.Tensor:
    """A rotation matrix argument, checked: [RS, RS], RS in 16..256, float32 or bfloat16 (float16 is
    widened to float32, exactly)."""
    if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] not in _ROTATION_SIZES:
        raise ValueError(f"mxq: argument '{arg}': shape {tuple(m.shape)}, expected a square [RS, RS] matrix with RS in "
                         f"{_ROTATION_SIZES}")
    m = m.detach()  # no gradient reaches R (quantize has none; qdq's straight-through one is for x)
    if m.dtype == torch.float16:
        return m.float()
    if m.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"mxq: argument '{arg}': dtype {m.dtype}, expected float32 or bfloat16 (mxq rounds nothing in "
                         "the matrix: convert it yourself, e.g. .float())")
    return m


def _unfused(t: torch.Tensor) -> bool:
    return _UNFUSED


def _rotate_groups(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each group of RS elements multiplied by m (g @ m): the products exact in float64,
    summed in float64 (in the matmul's order) and rounded once to float32 (the _UNFUSED path). The same
    values as mxq's kernels (index-order float64 sums) whenever the float64 sums are exact, as they are
    for bf16 or fp16 x and a bf16 matrix unless a group's products span more than about 2^29 in
    magnitude."""
    rs = m.shape[0]
    if x.shape[-1] % rs:
        raise ValueError(f"mxq: argument 'rotation': RS = {rs} does not divide K = {x.shape[-1]} (each group of RS "
                         "elements of a row is rotated)")
    return (x.unflatten(-1, (-1, rs)).double() @ m.to(device=x.device, dtype=torch.float64)).flatten(-2).float()


def _inverse(m: torch.Tensor) -> torch.Tensor:
    """R^-1 in float32 (computed in float64), for dequantize when no rotation_inverse was given. The
    singularity check reads a flag back from the matrix's device (a synchronisation for a GPU matrix)
    and is skipped under torch.compile (a singular R then gives Inf/NaN): pass rotation_inverse= to
    quantize to avoid both."""
    # on the CPU whatever R's device: LAPACK's inverse, so that CPU and GPU tensors rotate back by the
    # same R^-1 (the GPU's solver may round differently), then on R's device
    inv, info = torch.linalg.inv_ex(m.double().cpu())
    if not torch.compiler.is_compiling() and int(info) != 0:
        raise ValueError("mxq: argument 'rotation': the matrix is singular, so dequantize cannot rotate back")
    return inv.float().to(m.device)


def _as_dtype(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values rounded to dtype as mxq's kernels round outputs: to nearest even, a finite value
    beyond the dtype's range saturated to its largest finite value (torch's cast gives Inf), infinities
    kept, every NaN the dtype's canonical quiet NaN."""
    y = v if dtype == torch.float32 else v.to(dtype)
    if dtype != torch.float32:
        big = torch.finfo(dtype).max
        y = torch.where(torch.isinf(y) & torch.isfinite(v), torch.where(v > 0, big, -big).to(dtype), y)
    return torch.where(torch.isnan(v), torch.full((), float("nan"), dtype=dtype, device=v.device), y)


def _matrix_args(x: torch.Tensor, rotation: RotationLike, rotation_seed: int, rotation_inverse):
    """(R or None, R^-1 or None, the input the op quantizes, the op's rotation name) of quantize and qdq:
    R on x's device (a copy where it was not); with _UNFUSED the input is x rotated by torch
    (float32)."""
    if not isinstance(rotation, torch.Tensor):
        if rotation_inverse is not None:
            raise TypeError("mxq: argument 'rotation_inverse' is for rotation= a matrix")
        return None, None, x, _rotation(rotation)
    if rotation_seed != 0:
        raise ValueError("mxq: argument 'rotation_seed' is for 'rhad<RS>' rotations, not a matrix")
    mat = _matrix(rotation, "rotation").to(x.device)
    inv = None
    if rotation_inverse is not None:
        if not isinstance(rotation_inverse, torch.Tensor):
            raise TypeError(f"mxq: argument 'rotation_inverse': expected a tensor, got {type(rotation_inverse).__name__}")
        inv = _matrix(rotation_inverse, "rotation_inverse")
        if inv.shape != mat.shape:
            raise ValueError(f"mxq: argument 'rotation_inverse': shape {tuple(inv.shape)}, expected rotation's "
                             f"{tuple(mat.shape)}")
    return mat, inv, (_rotate_groups(x, mat) if _unfused(x) else x), "none"


def _precision(matrix_precision: str, rotation: RotationLike, x: Optional[torch.Tensor]) -> str:
    """matrix_precision, checked (on every path, fused or not): "exact", or "bf16" with a bfloat16
    rotation matrix of RS <= 128 and bfloat16 x (the tensor cores' operands). x None: no data yet
    (mxq.emulate checks R before it quantizes anything)."""
    if matrix_precision == "exact":
        return matrix_precision
    if matrix_precision != "bf16":
        raise ValueError(f"mxq: argument 'matrix_precision': {matrix_precision!r}, expected 'exact' or 'bf16'")
    if not isinstance(rotation, torch.Tensor):
        raise ValueError("mxq: argument 'matrix_precision': 'bf16' is for rotation= a matrix")
    if rotation.dtype != torch.bfloat16:
        raise ValueError(f"mxq: argument 'rotation': dtype {rotation.dtype} with matrix_precision 'bf16', expected "
                         "torch.bfloat16 (round R to bf16 first, or use 'exact')")
    if x is not None and x.dtype != torch.bfloat16:
        raise ValueError(f"mxq: argument 'x': dtype {x.dtype} with matrix_precision 'bf16', expected torch.bfloat16 "
                         "(use 'exact' for other dtypes)")
    if rotation.dim() == 2 and rotation.shape[0] > 128:
        raise ValueError(f"mxq: argument 'matrix_precision': 'bf16' with RS = {rotation.shape[0]}, expected 16, 32, 64 "
                         "or 128 (use 'exact')")
    return matrix_precision


def _check_layout(layout: str) -> str:
    if layout not in _LAYOUTS:
        raise ValueError(f"mxq: argument 'layout': '{layout}', expected one of: {', '.join(_LAYOUTS)}")
    return layout


@dataclass(frozen=True)
class QuantizedTensor:
    """The result of :func:`quantize`.

    codes:        uint8 [..., code_cols]: FP4 two codes per byte (element 2i in the low nibble),
                  other formats one code per byte (FP6 in the low 6 bits).
    scales:       uint8 block scales: E8M0 bytes (MX) or E4M3 bytes (NVFP4). layout "linear":
                  [..., ceil(K/g)]; "swizzled": the 128x4 layout of block-scaled GEMMs,
                  [ceil(rows/128)*128, ceil(G/4)*4]; "padded": the linear layout in a zero-padded
                  buffer of that same shape (QuTLASS's output).
    tensor_scale: NVFP4: float32 [1] on the input's device, the encode scale S = 448*6/amax used
                  (given or computed); None for MX formats.
    clip_mask:    uint8 [..., ceil(K/8)], 1 bit per element (LSB first), 1 where the element was not
                  clipped; None unless quantize(..., clip_mask=True).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: Optional[torch.Tensor]
    format: str
    rule: str
    layout: str
    group_size: int
    shape: torch.Size
    dtype: torch.dtype
    clip_mask: Optional[torch.Tensor] = None
    # The encode scale as a host float when the caller gave one (dequantize then needs no read-back).
    tensor_scale_value: Optional[float] = field(default=None, repr=False)
    # The rotation applied before quantizing ("none", "had<RS>", "rhad<RS>") and its seed: dequantize
    # rotates back.
    rotation: str = "none"
    rotation_seed: int = 0
    # rotation "matrix": R (checked, detached) and R^-1 when given (else dequantize computes it).
    rotation_matrix: Optional[torch.Tensor] = field(default=None, repr=False)
    rotation_inverse: Optional[torch.Tensor] = field(default=None, repr=False)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Decode to `dtype` (default: the dtype that was quantized), shape `self.shape`.

        NVFP4 with a computed tensor scale on a GPU reads the scale back to the host (a synchronisation):
        pass `tensor_scale=` to quantize to avoid it."""
        return dequantize(self, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def scales_as_float8(self) -> torch.Tensor:
        """The scales viewed as torch.float8_e8m0fnu (MX) or torch.float8_e4m3fn (NVFP4). nvfp4_e5m3's UE5M3
        scales have no torch dtype: ValueError (mxq.compat.vllm_qdq.decode_ue5m3 decodes them)."""
        if self.format == "nvfp4_e5m3":
            raise ValueError("mxq: nvfp4_e5m3's UE5M3 scales have no torch float8 dtype (decode them with "
                             "mxq.compat.vllm_qdq.decode_ue5m3)")
        return self.scales.view(torch.float8_e4m3fn if self.format == "nvfp4" else torch.float8_e8m0fnu)


def quantize(
    x: torch.Tensor,
    format: str,
    *,
    rule: Optional[str] = None,
    layout: str = "linear",
    group_size: Optional[int] = None,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    tensor_scale: ScaleLike = None,
    clip_mask: bool = False,
    random_bits: int = 32,
    rotation: RotationLike = None,
    rotation_seed: int = 0,
    rotation_inverse: Optional[torch.Tensor] = None,
    matrix_precision: str = "exact",
) -> QuantizedTensor:
    """Quantize `x` (float32, float16 or bfloat16, any rank) along its last dimension.

    format:       mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3 (alias mxfp8), mxfp8_e5m2, mxint8, nvfp4,
                  nvfp4_e5m3 (the vllm-qdq-plugin's UE5M3 block scales: group_size 16 or 32, no tensor
                  scale, round to nearest only, no rotation; its scales are uint8 UE5M3 bytes).
    rule:         block scale rule: floor (default for MX), ceil, even, rceil (every MX format), even_fp4
                  (mxfp4, mxfp8_e4m3), quest and qutlass_absmax (alias abs_max; mxfp4), nvfp4 (the default
                  rule of nvfp4); nvfp4 also takes quest (QuTLASS's NVFP4 quest: tensor scale 1);
                  nvfp4_e5m3 (the only and default rule of nvfp4_e5m3).
                  mxq.rules_for(format) lists them; any other pairing raises ValueError.
    layout:       "linear" (default), "swizzled" (128x4, for block-scaled GEMMs) or "padded".
    group_size:   elements per block scale: None for the format's (32 MX, 16 NVFP4), or a power of
                  two in [2, 256].
    stochastic:   stochastic rounding of the elements (Philox4x32-10 keyed by `seed`; element i of the
                  tensor uses counter `offset + i`): the same bytes on every backend.
    tensor_scale: NVFP4 only: the encode scale S (448*6/amax of a calibration); None computes it
                  from x (one extra pass, no synchronisation).
    clip_mask:    also return the 1-bit clip mask.
    random_bits:  stochastic rounding: 32 (exact probabilities), 16 or 8 random bits per element
                  (docs/numerics.md; fewer bits, faster kernels).
    rotation:     None, or "had<RS>" / "rhad<RS>" (RS 16, 32, 64, 128, 256, dividing K): each group of RS
                  elements is rotated by the normalised (or randomised, signs from `rotation_seed`)
                  Hadamard transform before quantizing; the result's dequantize rotates back. The
                  same bytes on CPU and CUDA (on CUDA, groups of 8 or more elements).
                  Or a matrix R (float32 or bfloat16, [RS, RS]): each group g becomes g @ R, products
                  exact and summed in float64 in index order, rounded once to float32
                  (docs/numerics.md): in mxq's kernels on CPU and GPU tensors alike (on the GPU, the
                  FP64 tensor cores; the same bytes), R moved to x's device (a copy: under CUDA-graph
                  capture pass R on x's device).
    rotation_inverse: with a matrix R, R^-1 (R.T for an orthogonal R) for the result's dequantize;
                  None computes it then (in float64, rounded to float32).
    matrix_precision: with a matrix R: "exact" (default; the float64 sums above) or "bf16" (bf16 x
                  and a bf16 R, RS <= 128): on a GPU the bf16 tensor cores sum the exact products in
                  fp32, within RS * 2^-20 * sum_i |x_i R_ij| (+ RS * 2^-126) of the exact value,
                  seven times faster at RS = 128 (docs/numerics.md); codes and scales may then differ
                  from the CPU's where a value lies that close to a rounding boundary. CPU tensors get
                  the exact sums (within the bound). The result's dequantize is exact either way.

    Not differentiable (the codes are integers): raises RuntimeError if x requires grad while grad
    mode is on; call it under torch.no_grad() or on x.detach(), or train with :func:`qdq`.
    """
    fmt, r = _names(format, rule)
    _check_layout(layout)
    ts = None if tensor_scale is None else _scale_value(tensor_scale)
    mat, inv, xin, rot = _matrix_args(x, rotation, rotation_seed, rotation_inverse)
    prec = _precision(matrix_precision, rotation, x)
    extra = (int(random_bits), rot, _u64(rotation_seed, "rotation_seed"))
    if mat is not None and xin is x:
        extra += (mat, prec)  # fused: mxq's kernels rotate
    codes, scales, tsc, mask = torch.ops.mxq.quantize.default(
        xin, fmt, r, 0 if group_size is None else _group(group_size), bool(stochastic),
        seed if type(seed) is int and 0 <= seed < _I63 else _u64(seed, "seed"),
        offset if type(offset) is int and 0 <= offset < _I63 else _u64(offset, "offset"), layout, ts, bool(clip_mask),
        *extra)
    fields = dict(codes=codes, scales=scales, tensor_scale=tsc if fmt == "nvfp4" else None, format=fmt, rule=r,
                  layout=layout, group_size=F.group_of(fmt, group_size), shape=x.shape, dtype=x.dtype,
                  clip_mask=mask if clip_mask else None, tensor_scale_value=ts,
                  rotation="matrix" if mat is not None else rot, rotation_seed=_u64(rotation_seed, "rotation_seed"),
                  rotation_matrix=mat, rotation_inverse=inv)
    if torch.compiler.is_compiling():
        return QuantizedTensor(**fields)
    # NOTE: a frozen dataclass's __init__ sets each of its 11 fields through object.__setattr__: 1-2 us
    # per call on the 2-core CI machine (measured 2026-12-03: mxq.quantize 9.0 -> 7.8 us per call
    # without it); filling __dict__ gives the same object. Under Dynamo the constructor is traced.
    q = object.__new__(QuantizedTensor)
    q.__dict__.update(fields)
    return q


def rotate_quantize(
    x: torch.Tensor,
    format: str,
    rotation: Union[str, torch.Tensor],
    **kwargs,
) -> QuantizedTensor:
    """Rotate each group of RS elements of x's rows, then quantize, in one fused pass: :func:`quantize`
    with a required rotation (the same op underneath).

    rotation: "had<RS>" (the normalised Hadamard transform), "rhad<RS>" (randomised signs from
              `rotation_seed=`), or an [RS, RS] float32 / bfloat16 matrix R (each group g becomes g @ R;
              `matrix_precision="bf16"` for the GPU's bf16 tensor cores within a stated bound).
    kwargs:   as :func:`quantize` (rule, layout, group_size, tensor_scale, rotation_seed,
              rotation_inverse, matrix_precision, ...).

    The result's dequantize() rotates back. Raises ValueError for a missing rotation ("none" / None).
    """
    if rotation is None or (isinstance(rotation, str) and rotation in ("", "none")):
        raise ValueError("mxq.rotate_quantize: argument 'rotation': expected 'had<RS>', 'rhad<RS>' or an [RS, RS] "
                         f"matrix, got {rotation!r} (use mxq.quantize without a rotation)")
    return quantize(x, format, rotation=rotation, **kwargs)


def dequantize(
    q: Union[QuantizedTensor, torch.Tensor],
    scales: Optional[torch.Tensor] = None,
    *,
    format: Optional[str] = None,
    cols: Optional[int] = None,
    layout: str = "linear",
    group_size: Optional[int] = None,
    tensor_scale: ScaleLike = None,
    dtype: Optional[torch.dtype] = None,
    rotation: RotationLike = None,
    rotation_seed: int = 0,
    rotation_inverse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode quantized data to float32, float16 or bfloat16 (rounded once, saturating).

    dequantize(q: QuantizedTensor, dtype=None): `dtype` defaults to the dtype that was quantized.
    dequantize(codes, scales, format=..., cols=K, layout=..., group_size=..., tensor_scale=S,
    dtype=torch.float32): raw codes and scales as quantize writes them; `cols` is the number of
    elements per row (FP4 packs two per byte, so it cannot be inferred for odd K); NVFP4 needs the
    encode scale S (a float, or a 1-element tensor: a GPU tensor is read back, a synchronisation).
    rotation, rotation_seed: raw codes of a rotated quantize are rotated back (a QuantizedTensor carries
    its own); rotation= a matrix R: back by rotation_inverse (R^-1; None: computed in float64 from R).
    """
    if isinstance(q, QuantizedTensor):
        if scales is not None or format is not None or cols is not None:
            raise TypeError("mxq.dequantize: given a QuantizedTensor, pass only dtype=")
        out_dtype = q.dtype if dtype is None else dtype
        ts_f = q.tensor_scale_value
        ts_t = q.tensor_scale if (q.format == "nvfp4" and ts_f is None) else None
        if rotation is not None or rotation_inverse is not None:
            raise TypeError("mxq.dequantize: given a QuantizedTensor, pass only dtype= (it carries its rotation)")
        if q.rotation_matrix is not None:
            inv = q.rotation_inverse if q.rotation_inverse is not None else _inverse(q.rotation_matrix)
            return _dequantize_matrix(q.codes, q.scales, q.shape[-1], q.format, q.group_size, q.layout, ts_f, ts_t,
                                      out_dtype, inv)
        return torch.ops.mxq.dequantize.default(q.codes, q.scales, q.shape[-1], q.format, q.group_size, q.layout,
                                                ts_f, ts_t, out_dtype, q.rotation, q.rotation_seed)
    if scales is None or format is None or cols is None:
        raise TypeError("mxq.dequantize: with raw codes, pass scales, format= and cols=")
    scales = _bytes(scales, "scales")  # uint8, or the float8 view of the scales (QuTLASS's outputs)
    fmt = F.canonical_format(format)
    _check_layout(layout)
    ts_f, ts_t = None, None
    if isinstance(tensor_scale, torch.Tensor):
        if tensor_scale.numel() != 1:
            raise ValueError(f"mxq.dequantize: argument 'tensor_scale': a tensor of shape {tuple(tensor_scale.shape)}, "
                             "expected one element (the encode scale 448*6/amax)")
        ts_t = tensor_scale.reshape(1).to(torch.float32)
    else:
        ts_f = _scale_value(tensor_scale)
    out_dtype = torch.float32 if dtype is None else dtype
    if isinstance(rotation, torch.Tensor):
        if rotation_seed != 0:
            raise ValueError("mxq: argument 'rotation_seed' is for 'rhad<RS>' rotations, not a matrix")
        mat = _matrix(rotation, "rotation")
        inv = _inverse(mat) if rotation_inverse is None else _matrix(rotation_inverse, "rotation_inverse")
        return _dequantize_matrix(q, scales, _size(cols, "cols"), fmt, _group(group_size), layout, ts_f, ts_t, out_dtype,
                                  inv)
    if rotation_inverse is not None:
        raise TypeError("mxq: argument 'rotation_inverse' is for rotation= a matrix")
    return torch.ops.mxq.dequantize.default(q, scales, _size(cols, "cols"), fmt, _group(group_size), layout, ts_f,
                                            ts_t, out_dtype, _rotation(rotation), _u64(rotation_seed, "rotation_seed"))


def _dequantize_matrix(codes, scales, cols, fmt, g, layout, ts_f, ts_t, dtype, inv) -> torch.Tensor:
    """dequantize, then each group times R^-1 (float64 products and sums, rounded to float32), rounded to
    dtype: in mxq's kernels (R^-1 moved to the codes' device), or (_UNFUSED) dequantized to float32
    by mxq and rotated by torch."""
    if not _unfused(codes):
        return torch.ops.mxq.dequantize.default(codes, scales, cols, fmt, g, layout, ts_f, ts_t, dtype, "none", 0,
                                                inv.to(codes.device))
    y = torch.ops.mxq.dequantize.default(codes, scales, cols, fmt, g, layout, ts_f, ts_t, torch.float32)
    return _as_dtype(_rotate_groups(y, inv), dtype)


def _qdq_args(x, format, rule, group_size, stochastic, seed, offset, tensor_scale, random_bits, rotation,
              rotation_seed) -> tuple:
    """The op arguments of qdq and qdq_, checked. The common ones take inline fast paths (a dict lookup for
    the names, type checks for the ints): this is part of every call's host overhead
    (bench/torch_ops_bench.py). The trailing arguments are passed only when not the schema's defaults."""
    try:
        fmt, r = _NAMES[format, rule]
    except (KeyError, TypeError):
        fmt, r = _names(format, rule)
    args = (x, fmt, r, 0 if group_size is None else _group(group_size), bool(stochastic),
            seed if type(seed) is int and 0 <= seed < _I63 else _u64(seed, "seed"),
            offset if type(offset) is int and 0 <= offset < _I63 else _u64(offset, "offset"),
            None if tensor_scale is None else _scale_value(tensor_scale))
    if random_bits != 32 or rotation is not None or rotation_seed != 0:
        args += (int(random_bits), _rotation(rotation), _u64(rotation_seed, "rotation_seed"))
    return args


def qdq(
    x: torch.Tensor,
    format: str,
    *,
    rule: Optional[str] = None,
    group_size: Optional[int] = None,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    tensor_scale: ScaleLike = None,
    random_bits: int = 32,
    rotation: RotationLike = None,
    rotation_seed: int = 0,
    matrix_precision: str = "exact",
) -> torch.Tensor:
    """Fake-quantize: quantize and dequantize in one pass; the result has x's shape and dtype
    (contiguous). Arguments as in :func:`quantize`. NVFP4 without `tensor_scale` computes the
    tensor scale from x (an extra pass; on a GPU, in a 4-byte buffer: no synchronisation). With a
    `rotation`, the result is the QDQ of the rotated tensor (it stays in the rotated domain, as a rotated
    activation meets a rotated weight).

    Differentiable with the straight-through estimator: the gradient with respect to x is the
    gradient of the result, unchanged (grad_x = grad_y), as quantization-aware training expects.
    With a `rotation` that gradient would be grad_y @ R^T, which is not implemented: a rotated qdq of
    a tensor that requires grad raises NotImplementedError (use torch.no_grad() or x.detach()). A matrix
    rotation (rotation= R, as in :func:`quantize`, with its `matrix_precision`) runs in mxq's kernels on
    either device."""
    if isinstance(rotation, torch.Tensor):
        return _qdq_matrix(x, format, rule, group_size, stochastic, seed, offset, tensor_scale, random_bits, rotation,
                           rotation_seed, False, matrix_precision)
    if matrix_precision != "exact":
        _precision(matrix_precision, None, x)
    args = _qdq_args(x, format, rule, group_size, stochastic, seed, offset, tensor_scale, random_bits, rotation,
                     rotation_seed)
    return _QDQ(*args)


def _qdq_matrix(x, format, rule, group_size, stochastic, seed, offset, tensor_scale, random_bits, rotation,
                rotation_seed, inplace: bool, matrix_precision: str) -> torch.Tensor:
    """qdq / qdq_ with a rotation matrix: in mxq's kernels, or (_UNFUSED) the QDQ of x rotated by
    torch (float32), rounded to x's dtype as the kernels round (the exact sums, whatever the precision)."""
    mat, _, xin, _ = _matrix_args(x, rotation, rotation_seed, None)
    prec = _precision(matrix_precision, rotation, x)
    args = _qdq_args(xin, format, rule, group_size, stochastic, seed, offset, tensor_scale, random_bits, None, 0)[:8]
    if xin is x:  # fused
        full = args + (int(random_bits), "none", 0, mat, prec)
        if inplace:
            _QDQ_INPLACE(*full)
            return x
        return _QDQ(*full)
    if x.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"mxq.{'qdq_' if inplace else 'qdq'}: argument 'rotation' = a matrix with x requiring "
                                  "grad: the gradient of a rotated qdq (grad_y @ R^T) is not implemented; call it "
                                  "under torch.no_grad() or on x.detach()")
    _QDQ_INPLACE(*(args + (int(random_bits),)))
    y = _as_dtype(xin, x.dtype)
    if inplace:
        x.copy_(y)
        return x
    return y


def qdq_(
    x: torch.Tensor,
    format: str,
    *,
    rule: Optional[str] = None,
    group_size: Optional[int] = None,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    tensor_scale: ScaleLike = None,
    random_bits: int = 32,
    rotation: RotationLike = None,
    rotation_seed: int = 0,
    matrix_precision: str = "exact",
) -> torch.Tensor:
    """In-place :func:`qdq`: overwrites x and returns it. A non-contiguous x whose rows cannot be
    addressed with one row stride is computed in a temporary and copied back.

    As torch's in-place ops: refused (RuntimeError) on a leaf tensor that requires grad unless under
    torch.no_grad(); on other tensors that require grad the gradient passes straight through."""
    if isinstance(rotation, torch.Tensor):
        return _qdq_matrix(x, format, rule, group_size, stochastic, seed, offset, tensor_scale, random_bits, rotation,
                           rotation_seed, True, matrix_precision)
    if matrix_precision != "exact":
        _precision(matrix_precision, None, x)
    args = _qdq_args(x, format, rule, group_size, stochastic, seed, offset, tensor_scale, random_bits, rotation,
                     rotation_seed)
    _QDQ_INPLACE(*args)
    return x


def _bytes(t: torch.Tensor, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mxq: argument '{arg}': expected a tensor, got {type(t).__name__}")
    if t.element_size() != 1:
        raise ValueError(f"mxq: argument '{arg}': dtype {t.dtype}, expected a 1-byte dtype "
                         "(uint8, float8_e8m0fnu, float8_e4m3fn)")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def swizzle_scales(linear: torch.Tensor) -> torch.Tensor:
    """Linear [rows, C] block scales -> the 128x4 swizzled layout [ceil(rows/128)*128, ceil(C/4)*4]
    (padding zero), in the input's dtype (any 1-byte dtype)."""
    out = torch.ops.mxq.swizzle_scales.default(_bytes(linear, "linear"))
    return out if linear.dtype == torch.uint8 else out.view(linear.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of :func:`swizzle_scales`: the [rows, cols] linear scales, in the input's dtype."""
    out = torch.ops.mxq.unswizzle_scales.default(_bytes(swizzled, "swizzled"), _size(rows, "rows"),
                                                 _size(cols, "cols"))
    return out if swizzled.dtype == torch.uint8 else out.view(swizzled.dtype)


# ---- fused producers ---------------------------------------------------------------------------------
_RMS_NORM = torch.ops.mxq.rms_norm.default
_SILU_MUL = torch.ops.mxq.silu_mul.default


def _fused_qdq_args(format: Optional[str], rule: Optional[str], group_size: Optional[int],
                    tensor_scale: ScaleLike) -> tuple:
    if format is None:
        if rule is not None or group_size is not None or tensor_scale is not None:
            raise ValueError("mxq: 'rule', 'group_size' and 'tensor_scale' need a 'format' (the QDQ of the output)")
        return None, "", 0, None
    fmt, r = _names(format, rule)
    return fmt, r, 0 if group_size is None else _group(group_size), \
        None if tensor_scale is None else _scale_value(tensor_scale)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    format: Optional[str] = None,
    rule: Optional[str] = None,
    group_size: Optional[int] = None,
    tensor_scale: ScaleLike = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension, as transformers' LlamaRMSNorm computes it
    (weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in fp32), optionally followed by a QDQ of the
    result in the same kernel: ``rms_norm(x, w, eps, format="mxfp4")`` is bit-identical to
    ``qdq(rms_norm(x, w, eps), "mxfp4")`` with one pass over memory instead of two.

    weight: [K] in x's dtype. The arithmetic is fixed (docs/numerics.md, "Fused producers"): bit-exact across
    mxq's CPU and CUDA backends; against torch's own RMSNorm it differs by at most one unit in the
    last place of x's dtype on a small fraction of elements (the order of the sum of squares, the
    correctly rounded 1/sqrt). The QDQ: an MX format with any rule, or "nvfp4" with `tensor_scale`
    given; round to nearest even (stochastic rounding: call qdq on the result). No gradient."""
    fmt, r, g, ts = _fused_qdq_args(format, rule, group_size, tensor_scale)
    return _RMS_NORM(x, weight, float(eps), fmt, r, g, ts)


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    format: Optional[str] = None,
    rule: Optional[str] = None,
    group_size: Optional[int] = None,
    tensor_scale: ScaleLike = None,
) -> torch.Tensor:
    """SiLU-and-multiply, as transformers' LlamaMLP computes ``act_fn(gate) * up`` (SiLU in fp32 cast
    to the dtype, then the product cast to the dtype), optionally followed by a QDQ of the result in
    the same kernel (bit-identical to ``qdq(silu_mul(gate, up), format)``). gate and up: one shape and
    dtype; the halves of a concatenated gate_up tensor (``gu.chunk(2, -1)``) are read in place.

    SiLU uses mxq's own exp (within 2 ulp in fp32; docs/numerics.md, "Fused producers"), so results are
    bit-exact across mxq's backends and within one unit in the last place of torch's. The QDQ as in
    :func:`rms_norm`. No gradient."""
    fmt, r, g, ts = _fused_qdq_args(format, rule, group_size, tensor_scale)
    return _SILU_MUL(gate, up, fmt, r, g, ts)
