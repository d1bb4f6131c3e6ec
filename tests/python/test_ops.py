"""The mxq ops on the CPU: values against an independent oracle, shapes, strides, in-place, layouts,
stochastic rounding, errors, torch.library.opcheck and torch.compile."""
from __future__ import annotations

import pytest
import torch

import mxq
from conftest import assert_bytes_equal, llm_like
import oracle

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MX_FLOAT = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8"]


def _data(dtype, rows=37, k=96 + 13, seed=0):
    x = llm_like(rows, k, torch.float32, seed)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


# ---- values -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,rule", [(f, r) for f in MX_FLOAT for r in ("floor", "ceil", "even", "rceil", "even_fp4")
                                      if r in mxq.rules_for(f)])
def test_qdq_mx_matches_oracle(fmt, rule, dtype):
    x = _data(dtype)
    assert_bytes_equal(mxq.qdq(x, fmt, rule=rule), oracle.mx_qdq(x, fmt, rule), f"qdq {fmt}/{rule}")


@pytest.mark.parametrize("group", [2, 16, 64, 256])
def test_qdq_group_sizes_match_oracle(group):
    x = _data(torch.bfloat16, k=300)
    assert_bytes_equal(mxq.qdq(x, "mxfp4", rule="even", group_size=group),
                       oracle.mx_qdq(x, "mxfp4", "even", group), f"group {group}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qdq_nvfp4_matches_oracle(dtype):
    x = _data(dtype)
    assert_bytes_equal(mxq.qdq(x, "nvfp4"), oracle.nvfp4_qdq(x), "nvfp4 computed S")
    S = 448.0 * 6.0 / 20.0
    assert_bytes_equal(mxq.qdq(x, "nvfp4", tensor_scale=S), oracle.nvfp4_qdq(x, S), "nvfp4 given S")
    q = mxq.quantize(x, "nvfp4")
    amax = x.float().abs().max()
    assert q.tensor_scale.dtype == torch.float32 and q.tensor_scale.shape == (1,)
    assert_bytes_equal(q.tensor_scale, (torch.tensor(2688.0) / amax).reshape(1), "computed S")


@pytest.mark.parametrize("fmt,rule", [("mxfp4", "even"), ("mxfp8_e4m3", "rceil"), ("mxfp6_e3m2", "ceil"), ("mxfp4", "quest"),
                                      ("mxint8", "floor"), ("nvfp4", None), ("mxfp4", "qutlass_absmax")])
@pytest.mark.parametrize("layout", ["linear", "swizzled", "padded"])
def test_qdq_equals_dequantize_of_quantize(fmt, rule, layout):
    x = _data(torch.bfloat16, rows=130)
    q = mxq.quantize(x, fmt, rule=rule, layout=layout)
    y = mxq.qdq(x, fmt, rule=rule)
    # (qutlass_absmax: both are 3x the input, QuTLASS's convention; its GEMM applies 1/9)
    assert_bytes_equal(q.dequantize(), y, f"{fmt} {layout}")
    assert q.shape == x.shape and q.dtype == x.dtype and q.layout == layout
    if fmt == "nvfp4":
        assert q.scales_as_float8().dtype == torch.float8_e4m3fn
    else:
        assert q.tensor_scale is None and q.scales_as_float8().dtype == torch.float8_e8m0fnu


def test_quantize_shapes_and_layouts():
    x = _data(torch.bfloat16, rows=130, k=100)
    lin = mxq.quantize(x, "mxfp4", rule="even")
    assert lin.codes.shape == (130, 50) and lin.codes.dtype == torch.uint8
    assert lin.scales.shape == (130, 4)
    sw = mxq.quantize(x, "mxfp4", rule="even", layout="swizzled")
    assert sw.scales.shape == (256, 4)
    assert_bytes_equal(sw.codes, lin.codes, "codes do not depend on the layout")
    assert_bytes_equal(sw.scales, mxq.swizzle_scales(lin.scales), "swizzled == swizzle_scales(linear)")
    pad = mxq.quantize(x, "mxfp4", rule="even", layout="padded")
    assert pad.scales.shape == (256, 4)
    assert_bytes_equal(pad.scales[:130, :4], lin.scales, "padded: linear in the corner")
    assert int(pad.scales[130:].count_nonzero()) == 0, "padded: padding rows are zero"
    x8 = _data(torch.bfloat16, rows=5, k=40)
    p8 = mxq.quantize(x8, "mxfp8", layout="padded")
    assert p8.scales.shape == (128, 4) and int(p8.scales[:, 2:].count_nonzero()) == 0
    assert p8.scales.count_nonzero() == p8.scales[:5, :2].count_nonzero()
    assert_bytes_equal(p8.dequantize(), mxq.qdq(x8, "mxfp8"), "padded dequantize")


def test_swizzle_layout_formula():
    rows, cols = 200, 7
    lin = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    sw = mxq.swizzle_scales(lin)
    Cp = 8
    assert sw.shape == (256, Cp)
    flat = sw.reshape(-1)
    expect = torch.zeros(256 * Cp, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            off = ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            expect[off] = lin[r, c]
    assert_bytes_equal(flat, expect, "swizzled offsets (padding zero)")
    assert_bytes_equal(mxq.unswizzle_scales(sw, rows, cols), lin, "unswizzle")
    e8 = lin.view(torch.float8_e8m0fnu)
    assert mxq.swizzle_scales(e8).dtype == torch.float8_e8m0fnu


def test_dequantize_raw_api():
    x = _data(torch.float16, rows=9, k=33)
    q = mxq.quantize(x, "mxfp4", rule="even")
    y = mxq.dequantize(q.codes, q.scales, format="mxfp4", cols=33, dtype=torch.float16)
    assert_bytes_equal(y, mxq.qdq(x, "mxfp4", rule="even"), "raw dequantize")
    qn = mxq.quantize(x, "nvfp4", layout="swizzled")
    for ts in (qn.tensor_scale, float(qn.tensor_scale)):
        yn = mxq.dequantize(qn.codes, qn.scales, format="nvfp4", cols=33, layout="swizzled", tensor_scale=ts,
                            dtype=torch.float16)
        assert_bytes_equal(yn, mxq.qdq(x, "nvfp4"), "raw nvfp4 dequantize")


# ---- shapes and strides ---------------------------------------------------------------------------
def test_batched_equals_flattened():
    x = _data(torch.bfloat16, rows=24, k=64).reshape(2, 3, 4, 64)
    y = mxq.qdq(x, "mxfp4", rule="even")
    assert y.shape == x.shape
    assert_bytes_equal(y.reshape(24, 64), mxq.qdq(x.reshape(24, 64), "mxfp4", rule="even"), "N-D qdq")
    q = mxq.quantize(x, "nvfp4", clip_mask=True)
    assert q.codes.shape == (2, 3, 4, 32) and q.scales.shape == (2, 3, 4, 4) and q.clip_mask.shape == (2, 3, 4, 8)
    assert_bytes_equal(q.dequantize(), mxq.qdq(x, "nvfp4"), "N-D quantize")


@pytest.mark.parametrize("make", ["row_slice", "transpose", "expand", "step", "batched_strided", "1d"])
def test_non_contiguous_inputs(make):
    base = _data(torch.bfloat16, rows=64, k=160)
    x = {
        "row_slice": lambda: base[3:40, 16:112],       # unit last stride, row stride 160
        "transpose": lambda: base[:, :64].t(),         # last stride != 1: copied
        "expand": lambda: base[0:1, :96].expand(5, 96),  # row stride 0: copied
        "step": lambda: base[:, ::2],                  # last stride 2: copied
        "batched_strided": lambda: base.reshape(4, 16, 160)[:, 2:10, :96],  # not one row stride: copied
        "1d": lambda: base[5, :96],
    }[make]()
    for fmt, rule in [("mxfp4", "even"), ("nvfp4", None), ("mxfp8", "floor")]:
        assert_bytes_equal(mxq.qdq(x, fmt, rule=rule), mxq.qdq(x.contiguous(), fmt, rule=rule), f"{make} {fmt}")
        q, qc = mxq.quantize(x, fmt, rule=rule), mxq.quantize(x.contiguous(), fmt, rule=rule)
        assert_bytes_equal(q.codes, qc.codes, f"{make} codes")
        assert_bytes_equal(q.scales, qc.scales, f"{make} scales")


@pytest.mark.parametrize("make", ["contiguous", "row_slice", "transpose", "batched_strided"])
def test_qdq_inplace(make):
    base = _data(torch.bfloat16, rows=64, k=160)
    orig = base.clone()
    view = {
        "contiguous": lambda b: b,
        "row_slice": lambda b: b[3:40, 16:112],
        "transpose": lambda b: b[:, :64].t(),
        "batched_strided": lambda b: b.reshape(4, 16, 160)[:, 2:10, :96],
    }[make]
    expect = mxq.qdq(view(orig), "mxfp4", rule="even")
    out = mxq.qdq_(view(base), "mxfp4", rule="even")
    assert_bytes_equal(view(base), expect, f"in place ({make})")
    assert out.data_ptr() == view(base).data_ptr()
    untouched = torch.ones_like(base, dtype=torch.bool)
    view(untouched).fill_(False)
    assert_bytes_equal(base, orig, "elements outside the view are untouched", mask=untouched)


def test_empty_tensors():
    for shape in [(0, 64), (4, 0), (2, 0, 32)]:
        x = torch.empty(shape, dtype=torch.bfloat16)
        assert mxq.qdq(x, "mxfp4").shape == shape
        q = mxq.quantize(x, "nvfp4", layout="swizzled")
        assert q.dequantize().shape == shape


# ---- stochastic rounding --------------------------------------------------------------------------
def test_stochastic_rounding_seed_and_offset():
    x = _data(torch.float32, rows=8, k=256)
    a = mxq.qdq(x, "mxfp4", rule="even", stochastic=True, seed=7)
    assert_bytes_equal(a, mxq.qdq(x, "mxfp4", rule="even", stochastic=True, seed=7), "same seed, same bytes")
    b = mxq.qdq(x, "mxfp4", rule="even", stochastic=True, seed=8)
    assert not torch.equal(a, b), "another seed gives other roundings"
    assert not torch.equal(a, mxq.qdq(x, "mxfp4", rule="even")), "stochastic differs from RNE"
    # Element i uses counter offset + i: the bottom half quantized alone with offset 4*256 matches.
    bottom = mxq.qdq(x[4:], "mxfp4", rule="even", stochastic=True, seed=7, offset=4 * 256)
    assert_bytes_equal(bottom, a[4:], "offset = the rows before")
    big = mxq.qdq(x, "mxfp4", rule="even", stochastic=True, seed=2**64 - 1)
    assert big.shape == x.shape
    # Unbiased: the mean over many seeds of a value between two grid points approaches it.
    v = torch.full((1, 32), 1.3)
    v[0, 0] = 6.0  # fixes the scale exponent at 0 (floor rule): 1.3 lies between 1.0 and 1.5
    means = torch.stack([mxq.qdq(v, "mxfp4", stochastic=True, seed=s)[0, 1:] for s in range(200)]).mean()
    assert abs(float(means) - 1.3) < 0.02


# ---- errors -----------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"unknown format 'mxfp5'.*mxfp4"):
        mxq.qdq(x, "mxfp5")
    with pytest.raises(ValueError, match=r"ambiguous"):
        mxq.qdq(x, "mxfp6")
    with pytest.raises(ValueError, match=r"unknown scale rule 'round'"):
        mxq.qdq(x, "mxfp4", rule="round")
    with pytest.raises(ValueError, match=r"argument 'x': dtype torch.float64|dtype Double"):
        mxq.qdq(x.double(), "mxfp4")
    with pytest.raises(ValueError, match=r"group_size"):
        mxq.qdq(x, "mxfp4", group_size=48)
    with pytest.raises(ValueError, match=r"tensor_scale.*nvfp4"):
        mxq.qdq(x, "mxfp4", tensor_scale=3.0)
    with pytest.raises(ValueError, match=r"tensor_scale"):
        mxq.qdq(x, "nvfp4", tensor_scale=-1.0)
    with pytest.raises(ValueError, match=r"rule|qutlass_absmax"):
        mxq.qdq(x, "mxfp8", rule="qutlass_absmax")
    with pytest.raises(ValueError, match=r"layout"):
        mxq.quantize(x, "mxfp4", layout="blocked")
    with pytest.raises(ValueError, match=r"seed"):
        mxq.qdq(x, "mxfp4", stochastic=True, seed=-1)
    with pytest.raises(ValueError, match=r"0-dimensional"):
        mxq.qdq(torch.tensor(1.0), "mxfp4")
    q = mxq.quantize(x, "mxfp4")
    with pytest.raises(ValueError, match=r"argument 'scales': shape \[4, 3\], expected \[4, 2\]"):
        mxq.dequantize(q.codes, q.scales[:, :1].expand(4, 3).contiguous(), format="mxfp4", cols=64)
    with pytest.raises(ValueError, match=r"argument 'codes'"):
        mxq.dequantize(q.codes[:, :5], q.scales, format="mxfp4", cols=64)
    with pytest.raises(ValueError, match=r"tensor_scale.*nvfp4|needs the encode scale"):
        mxq.dequantize(q.codes, torch.zeros(4, 4, dtype=torch.uint8), format="nvfp4", cols=64)
    with pytest.raises(ValueError, match=r"1-byte dtype"):
        mxq.swizzle_scales(torch.zeros(4, 4))
    with pytest.raises(TypeError, match=r"QuantizedTensor"):
        mxq.dequantize(q, q.scales)


def test_format_names_and_aliases():
    assert mxq.FORMATS == ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8", "nvfp4",
                           "nvfp4_e5m3")
    x = _data(torch.bfloat16, rows=4, k=64)
    assert_bytes_equal(mxq.qdq(x, "MXFP8"), mxq.qdq(x, "mxfp8_e4m3"), "mxfp8 alias")
    assert_bytes_equal(mxq.qdq(x, "mxfp8-e5m2"), mxq.qdq(x, "mxfp8_e5m2"), "'-' for '_'")
    assert_bytes_equal(mxq.qdq(x, "mxfp4", rule="abs_max"), mxq.qdq(x, "mxfp4", rule="qutlass_absmax"), "abs_max")
    assert_bytes_equal(mxq.qdq(x, "mxfp4"), mxq.qdq(x, "mxfp4", rule="floor"), "MX default rule: floor")
    for f in mxq.FORMATS:
        info = mxq.format_info(f)
        q = mxq.quantize(torch.ones(3, 2 * info.default_group + 1), f)
        assert q.codes.shape[-1] == ((2 * info.default_group + 2) // 2 if info.bits == 4 else 2 * info.default_group + 1)
        assert q.scales.shape[-1] == 3


# ---- torch.library conventions --------------------------------------------------------------------
def _samples():
    x = _data(torch.bfloat16, rows=6, k=64)
    return [
        (torch.ops.mxq.qdq.default, (x, "mxfp4", "even", 0, False, 0, 0, None)),
        (torch.ops.mxq.qdq.default, (x, "nvfp4", "nvfp4", 0, True, 3, 0, 100.0)),
        # requires grad: opcheck's autograd checks (registration, AOT dispatch of the backward) run
        (torch.ops.mxq.qdq.default, (x.float().requires_grad_(), "mxfp8_e4m3", "rceil", 0, False, 0, 0, None)),
        (torch.ops.mxq.qdq_.default, (x.clone(), "mxfp8_e4m3", "floor", 0, False, 0, 0, None)),
        (torch.ops.mxq.quantize.default, (x, "mxfp4", "even", 0, False, 0, 0, "swizzled", None, True)),
        (torch.ops.mxq.quantize.default, (x, "nvfp4", "nvfp4", 0, False, 0, 0, "padded", None, False)),
        (torch.ops.mxq.swizzle_scales.default, (torch.randint(0, 255, (5, 3), dtype=torch.uint8),)),
        (torch.ops.mxq.unswizzle_scales.default, (torch.randint(0, 255, (128, 4), dtype=torch.uint8), 5, 3)),
    ]


@pytest.mark.parametrize("i", range(8))
def test_opcheck(i):
    op, args = _samples()[i]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                 "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))


def test_opcheck_dequantize():
    x = _data(torch.bfloat16, rows=6, k=64)
    q = mxq.quantize(x, "nvfp4", layout="swizzled")
    torch.library.opcheck(torch.ops.mxq.dequantize.default,
                          (q.codes, q.scales, 64, "nvfp4", 0, "swizzled", float(q.tensor_scale), None, torch.bfloat16),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()

    def f(x):
        y = mxq.qdq(x, "mxfp4", rule="even")
        q = mxq.quantize(y * 2, "nvfp4", layout="swizzled")
        return y, q.codes, q.scales, q.dequantize(torch.float32)

    x = _data(torch.bfloat16, rows=8, k=64)
    got = torch.compile(f, fullgraph=True, backend=backend)(x)
    for g, e, what in zip(got, f(x), ["qdq", "codes", "scales", "dequantize"]):
        assert_bytes_equal(g, e, f"compiled ({backend}) {what}")


def test_torch_compile_inplace():
    torch._dynamo.reset()

    def f(x):
        mxq.qdq_(x, "mxfp8")
        return x + 1

    x = _data(torch.bfloat16, rows=8, k=64)
    x2 = x.clone()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert_bytes_equal(x, mxq.qdq(x2, "mxfp8"), "compiled in-place mutation reaches the input")
    assert_bytes_equal(out, mxq.qdq(x2, "mxfp8") + 1, "compiled in-place result")


def test_fakes_refuse_what_the_kernels_refuse():
    """Under FakeTensor tracing (torch.compile) a bad layout or group size fails at trace time, as the
    kernels fail at run time, instead of producing shapes for a graph that cannot run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for kwargs, what in (({"layout": "bogus"}, "layout"), ({"group_size": 1000}, "group_size"),
                         ({"group_size": 3}, "group_size")):
        args = dict(format="mxfp4", rule="even", group_size=0, stochastic=False, seed=0, offset=0,
                    layout="linear", tensor_scale=None, clip_mask=False)
        args.update(kwargs)
        with pytest.raises(ValueError, match=what):  # the real kernel
            torch.ops.mxq.quantize(torch.ones(4, 64), *args.values())
        with FakeTensorMode():
            x = torch.ones(4, 64)
            with pytest.raises(ValueError, match=what):  # the fake
                torch.ops.mxq.quantize(x, *args.values())


def test_fake_checks_name_options_of_the_schemas():
    """The fakes check options by the names python/csrc/ops.cpp gives them in the schemas: a check whose
    option no schema has (renamed, say) would never run."""
    from mxq import _meta

    names = {a.name for op in ("qdq", "qdq_", "quantize", "dequantize", "rms_norm", "silu_mul")
             for a in getattr(torch.ops.mxq, op).default._schema.arguments}
    assert set(_meta.CHECKS) <= names, set(_meta.CHECKS) - names


@pytest.mark.parametrize("vary", ["rows", "rows_and_k"])
def test_torch_compile_dynamic_does_not_recompile(vary):
    """torch.compile(dynamic=True) traces one graph for every shape: the size arguments (dequantize's
    cols, unswizzle_scales' rows and cols) are SymInts in the schemas and the Python API passes them
    through (an int schema argument or an int() call would specialise the graph to the first shape
    and recompile for each new one)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(x):
        y = mxq.qdq(x, "mxfp4", rule="even")
        q = mxq.quantize(x, "nvfp4", layout="swizzled", tensor_scale=100.0)
        lin = mxq.unswizzle_scales(q.scales, x.shape[0], (x.shape[-1] + 15) // 16)
        d = mxq.dequantize(q.codes, lin, format="nvfp4", cols=x.shape[-1], tensor_scale=100.0)
        return y, q.dequantize(torch.float32), d, lin

    cf = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    shapes = [(5, 64), (9, 64), (13, 64)] if vary == "rows" else [(5, 64), (9, 96), (13, 160)]
    for rows, k in shapes:
        x = _data(torch.bfloat16, rows=rows, k=k, seed=rows)
        for g, e, what in zip(cf(x), f(x), ["qdq", "q.dequantize", "dequantize(unswizzled)", "unswizzled"]):
            assert_bytes_equal(g, e, f"compiled dynamic {what} at {rows}x{k}")
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for {len(shapes)} shapes"


@pytest.mark.parametrize("layout", ["linear", "swizzled", "padded"])
@pytest.mark.parametrize("make", ["permuted_4d", "sliced_3d", "expanded_3d", "channels_last_4d"])
def test_nd_non_contiguous_all_ops(make, layout):
    """Batched (N-D) inputs that are not contiguous, through every op: the same bytes as their
    contiguous copies; in place, the view is written and nothing else."""
    base = _data(torch.bfloat16, rows=2 * 6 * 8, k=96).reshape(2, 6, 8, 96)
    view = {
        "permuted_4d": lambda b: b.permute(1, 0, 2, 3),                 # leading dims out of order
        "sliced_3d": lambda b: b.reshape(12, 8, 96)[::2, 1:7, 16:80],   # steps and offsets
        "expanded_3d": lambda b: b[0, 0, :1].expand(3, 5, 96),          # stride 0
        "channels_last_4d": lambda b: b.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        .permute(0, 2, 3, 1),                                            # last dim contiguous, odd strides
    }[make]
    x = view(base)
    xc = x.contiguous()
    for fmt, rule in [("mxfp4", "even"), ("nvfp4", None), ("mxfp6_e3m2", "rceil")]:
        y = mxq.qdq(x, fmt, rule=rule)
        assert y.shape == x.shape and y.is_contiguous()
        assert_bytes_equal(y, mxq.qdq(xc, fmt, rule=rule), f"{make} qdq {fmt}")
        q, qc = mxq.quantize(x, fmt, rule=rule, layout=layout), mxq.quantize(xc, fmt, rule=rule, layout=layout)
        assert_bytes_equal(q.codes, qc.codes, f"{make} codes {fmt} {layout}")
        assert_bytes_equal(q.scales, qc.scales, f"{make} scales {fmt} {layout}")
        assert q.codes.shape[:-1] == x.shape[:-1]
        assert_bytes_equal(q.dequantize(), y, f"{make} dequantize(quantize) == qdq, {fmt} {layout}")
        # raw dequantize of N-D codes given as a non-contiguous view
        codes_view = q.codes.transpose(0, 1).contiguous().transpose(0, 1)
        ts = None if fmt != "nvfp4" else q.tensor_scale
        raw = mxq.dequantize(codes_view, q.scales, format=fmt, cols=x.shape[-1], layout=layout, tensor_scale=ts,
                             dtype=torch.bfloat16)
        assert_bytes_equal(raw, y, f"{make} raw dequantize of a strided view, {fmt} {layout}")
    if make != "expanded_3d":  # (an expanded tensor cannot be written in place, in torch either)
        b2 = base.clone()
        mxq.qdq_(view(b2), "mxfp4", rule="even")
        assert_bytes_equal(view(b2), mxq.qdq(xc, "mxfp4", rule="even"), f"{make} in place")
        outside = torch.ones_like(base, dtype=torch.bool)
        view(outside).fill_(False)
        assert_bytes_equal(b2, base, f"{make} in place: the rest untouched", mask=outside)


def test_errors_are_python_exceptions_with_mxqs_message():
    """Refusals from the library (not only from the Python wrapper) arrive as ValueError /
    NotImplementedError carrying mxq's message (function, argument, got, expected), with no C++
    backtrace, for N-D and strided inputs too."""
    x = torch.randn(2, 3, 64)
    cases = [
        (lambda: mxq.qdq(x, "nvfp4", tensor_scale=-1.0), ValueError, r"^mxq::qdq: option 'tensor_scale': -1"),
        (lambda: mxq.qdq(x[:, :, ::2], "mxfp8", rule="qutlass_absmax"), ValueError,
         r"^mxq::qdq: option 'rule': rule 'qutlass_absmax' is not defined for format 'mxfp8_e4m3' \(QuTLASS's abs_max"),
        (lambda: mxq.qdq(x, "mxint8", rule="quest"), ValueError,
         r"^mxq::qdq: option 'rule': rule 'quest' is not defined for format 'mxint8' \(its constant 2\.92247856 / 6 fits "
         r"the E2M1 grid; defined for mxfp4, nvfp4\); mxint8 accepts floor, ceil, even, rceil$"),
        (lambda: torch.ops.mxq.qdq(x, "mxfp4", "even", 3, False, 0, 0, None), ValueError,
         r"^mxq::qdq: option 'group_size': 3, expected"),
        (lambda: mxq.dequantize(torch.zeros(2, 3, 32, dtype=torch.uint8), torch.zeros(2, 3, 2, dtype=torch.uint8),
                                format="mxfp4", cols=65), ValueError,
         r"^mxq::dequantize: argument 'codes': shape \[6, 32\], expected \[6, 33\]"),
        (lambda: mxq.unswizzle_scales(torch.zeros(128, 4, dtype=torch.uint8), 129, 4), ValueError,
         r"^mxq::unswizzle_scales: argument 'swizzled': shape \[128, 4\], expected \[256, 4\]"),
        (lambda: mxq.qdq(x.double().transpose(0, 1), "mxfp4"), ValueError, r"^mxq\.qdq: argument 'x': dtype"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern) as info:
            fn()
        msg = str(info.value)
        assert "Exception raised from" not in msg and ".cpp:" not in msg, f"C++ backtrace in the message: {msg}"
    # nothing is written when an argument is refused
    y = x.clone()
    with pytest.raises(ValueError):
        mxq.qdq_(y, "mxfp4", group_size=3)
    assert torch.equal(y, x)


def test_random_bits_and_rotation_reach_the_library():
    """random_bits (16, 8) and rotation ("had<RS>", "rhad<RS>") as the C++ API computes them: the 8-bit
    mode differs from the 32-bit one; a rotated quantize dequantizes back near x; qdq with a rotation
    equals qdq of the rotated tensor (checked through quantize + the rotation's own orthogonality)."""
    x = llm_like(8, 256, torch.float32, 1)
    a = mxq.qdq(x, "mxfp4", stochastic=True, seed=3)
    b = mxq.qdq(x, "mxfp4", stochastic=True, seed=3, random_bits=8)
    assert not torch.equal(a, b)
    assert torch.equal(b, mxq.qdq(x, "mxfp4", stochastic=True, seed=3, random_bits=8))
    with pytest.raises(ValueError, match="random_bits"):
        mxq.qdq(x, "mxfp4", random_bits=4)
    for rot in ("had32", "rhad128"):
        q = mxq.quantize(x, "mxfp4", rule="even", rotation=rot, rotation_seed=5)
        assert q.rotation == rot
        y = q.dequantize()
        err = ((y - x).norm() / x.norm()).item()
        assert err < 0.2, (rot, err)
        # without rotating back the values are in the rotated domain: far from x
        y_rot = mxq.dequantize(q.codes, q.scales, format="mxfp4", cols=256)
        assert ((y_rot - x).norm() / x.norm()).item() > 0.5
        yq = mxq.qdq(x, "mxfp4", rule="even", rotation=rot, rotation_seed=5)
        assert torch.equal(yq, y_rot)
    with pytest.raises(ValueError, match="rotation"):
        mxq.qdq(x, "mxfp4", rotation="had100")
    with pytest.raises(ValueError, match="divide"):
        mxq.qdq(x[:, :96], "mxfp4", rotation="had64")


def test_rotated_qdq_refuses_a_gradient_it_would_get_wrong():
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="rotation"):
        mxq.qdq(x, "mxfp4", rotation="had32")
    with torch.no_grad():
        y = mxq.qdq(x, "mxfp4", rotation="had32")
    assert y.shape == x.shape
    mxq.qdq(x, "mxfp4").sum().backward()  # without a rotation: straight through
    assert torch.equal(x.grad, torch.ones_like(x))


def test_integer_arguments_take_numpy_integers_and_name_the_argument():
    # Issue 35: numpy integer seeds were refused while numpy sizes were accepted; group_size=2**64
    # and tensor_scale=2**1024 failed with errors that named no argument.
    np = pytest.importorskip("numpy")
    x = torch.randn(4, 64)
    want = mxq.qdq(x, "mxfp4", stochastic=True, seed=3, offset=5, group_size=32)
    got = mxq.qdq(x, "mxfp4", stochastic=True, seed=np.int64(3), offset=np.uint64(5), group_size=np.int32(32))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(mxq.qdq(x, "mxfp4", stochastic=True, seed=np.uint64(2**64 - 1)).view(torch.int32),
                       mxq.qdq(x, "mxfp4", stochastic=True, seed=2**64 - 1).view(torch.int32))
    q = mxq.quantize(x, "mxfp4", rotation="rhad32", rotation_seed=np.int64(7))
    assert torch.equal(q.codes, mxq.quantize(x, "mxfp4", rotation="rhad32", rotation_seed=7).codes)
    for bad, arg in ((dict(seed=np.int64(-1), stochastic=True), "seed"), (dict(seed=True, stochastic=True), "seed"),
                     (dict(group_size=2**64), "group_size"), (dict(group_size=-2**70), "group_size"),
                     (dict(group_size=np.float32(32)), "group_size"), (dict(group_size=512), "group_size")):
        with pytest.raises((ValueError, TypeError), match=f"argument '{arg}'"):
            mxq.qdq(x, "mxfp4", **bad)
    with pytest.raises(ValueError, match=r"argument 'tensor_scale'"):
        mxq.qdq(x, "nvfp4", tensor_scale=2**1024)
    with pytest.raises(ValueError, match=r"argument 'tensor_scale'"):
        mxq.quantize(x, "nvfp4", tensor_scale=-2**1100)


def test_flush_denormal_callers_get_ieee_bytes():
    """torch.set_flush_denormal(True) (FTZ / DAZ on x86) leaves mxq's CPU bytes those of IEEE subnormals
    (quantize, QDQ, dequantize and the QuTLASS shim's Hadamard op), and the flag as the caller set it."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 256, generator=g) * 2.0 ** -135).to(torch.bfloat16)  # subnormals and tiny normals
    had = torch.ops.mxq.hadamard_rotate_f64

    def run():
        out = []
        for fmt in ("mxfp4", "mxfp8", "nvfp4"):
            q = mxq.quantize(x, fmt) if fmt != "nvfp4" else mxq.quantize(x, fmt, tensor_scale=1e30)
            out += [q.codes, q.scales, mxq.dequantize(q, dtype=torch.float32).view(torch.int32)]
        out.append(mxq.qdq(x, "mxfp4").view(torch.int16))
        out.append(mxq.qdq(x, "mxfp4", rotation="had32").view(torch.int16))
        out.append(had(x, 32, 0.17677669529663687).view(torch.int32))
        return out

    ieee = run()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode torch can set")
    try:
        ftz = run()
    finally:
        torch.set_flush_denormal(False)
    for i, (a, b) in enumerate(zip(ieee, ftz)):
        assert torch.equal(a, b), f"output {i} differs under flush-to-zero"
