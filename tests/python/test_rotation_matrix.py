"""Rotation by a matrix given at run time (rotation= an [RS, RS] tensor) in mxq.quantize, qdq, qdq_ and
dequantize: against an independent float64 rotation, the torch-rotated path that GPU tensors take
against mxq's fused CPU kernels (bytes), the arguments' errors, opcheck and torch.compile."""
from __future__ import annotations

import pytest
import torch

import mxq
import mxq.ops as mops
from conftest import assert_bytes_equal, llm_like

CASES = [("mxfp4", "even"), ("mxfp8_e4m3", "floor"), ("nvfp4", None)]


def _orthogonal(rs: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(rs, rs, dtype=torch.float64, generator=g))
    return q.to(dtype)


def _rotated(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The independent rotation: each group times m in float64 (exact for these operands), rounded once."""
    rs = m.shape[0]
    return (x.double().reshape(x.shape[0], -1, rs) @ m.double()).reshape(x.shape).float()


@pytest.mark.parametrize("mdtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rs", [16, 64, 256])
@pytest.mark.parametrize("fmt,rule", CASES)
def test_matrix_rotation_equals_the_float64_rotation(fmt, rule, rs, mdtype):
    x = llm_like(6, 512, torch.bfloat16, rs)
    m = _orthogonal(rs, mdtype, rs + 1)
    xr = _rotated(x, m)
    what = f"{fmt} RS {rs} {mdtype}"
    q = mxq.quantize(x, fmt, rule=rule, rotation=m)
    e = mxq.quantize(xr, fmt, rule=rule)
    assert q.rotation == "matrix" and torch.equal(q.rotation_matrix, m)
    assert_bytes_equal(q.codes, e.codes, what + ": codes")
    assert_bytes_equal(q.scales, e.scales, what + ": scales")
    if fmt == "nvfp4":  # the tensor scale from the rotated tensor's amax
        assert torch.equal(q.tensor_scale, e.tensor_scale), what
    # qdq: the QDQ of the rotated tensor, in the rotated domain, rounded to x's dtype
    assert_bytes_equal(mxq.qdq(x, fmt, rule=rule, rotation=m), mxq.qdq(xr, fmt, rule=rule).to(x.dtype), what + ": qdq")
    x2 = x.clone()
    mxq.qdq_(x2, fmt, rule=rule, rotation=m)
    assert_bytes_equal(x2, mxq.qdq(xr, fmt, rule=rule).to(x.dtype), what + ": qdq_")
    # dequantize: decoded, rotated back by R^-1 (float64), rounded once
    inv = torch.linalg.inv(m.double()).float()
    d = mxq.dequantize(e.codes, e.scales, format=fmt, cols=512, tensor_scale=e.tensor_scale, dtype=torch.float32)
    expect = _rotated(d, inv).to(torch.bfloat16)
    assert_bytes_equal(q.dequantize(), expect, what + ": dequantize")
    assert_bytes_equal(mxq.dequantize(q.codes, q.scales, format=fmt, cols=512, tensor_scale=q.tensor_scale,
                                      dtype=torch.bfloat16, rotation=m), expect, what + ": raw dequantize")
    # the round trip comes back near x (orthogonal R)
    err = ((q.dequantize().float() - x.float()).norm() / x.float().norm()).item()
    assert err < (0.25 if fmt != "mxfp8_e4m3" else 0.05), (what, err)


@pytest.mark.parametrize("mdtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt,rule", CASES)
def test_torch_rotated_path_equals_the_fused_kernels(fmt, rule, mdtype, monkeypatch):
    """GPU tensors are rotated by torch first (mxq.ops._rotate_groups): on the CPU that path gives the
    fused kernels' bytes (float64 sums exact here), including outputs past the dtype's range and NaN."""
    x = llm_like(5, 256, torch.bfloat16, 3)
    x[0, :32] = float("nan")  # a NaN block: NaN outputs, the canonical NaN either way
    m = _orthogonal(64, mdtype, 7)
    inv = torch.linalg.inv(m.double()).float()
    fused_q = mxq.quantize(x, fmt, rule=rule, rotation=m, rotation_inverse=inv, stochastic=True, seed=5)
    fused_y = mxq.qdq(x, fmt, rule=rule, rotation=m)
    fused_d = fused_q.dequantize(torch.float16)
    monkeypatch.setattr(mops, "_UNFUSED", True)
    q = mxq.quantize(x, fmt, rule=rule, rotation=m, rotation_inverse=inv, stochastic=True, seed=5)
    assert_bytes_equal(q.codes, fused_q.codes, "codes")
    assert_bytes_equal(q.scales, fused_q.scales, "scales")
    assert_bytes_equal(mxq.qdq(x, fmt, rule=rule, rotation=m), fused_y, "qdq")
    x2 = x.clone()
    mxq.qdq_(x2, fmt, rule=rule, rotation=m)
    assert_bytes_equal(x2, fused_y, "qdq_")
    assert_bytes_equal(q.dequantize(torch.float16), fused_d, "dequantize to float16")


def test_outputs_round_as_the_kernels_round():
    """mxq.ops._as_dtype (the torch path's output rounding) against the kernels' rule: saturation of
    finite values past the dtype's range, infinities kept, the canonical NaN, ties to even."""
    v = torch.tensor([3.3961e38, -3.3961e38, float("inf"), -float("inf"), float("nan"), -float("nan"),
                      1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 70000.0, 65519.0, 1e-8], dtype=torch.float32)
    def s16(u: int) -> int:
        return u - 0x10000 if u >= 0x8000 else u

    bf = mops._as_dtype(v, torch.bfloat16).view(torch.int16).tolist()
    assert bf[:6] == [0x7F7F, s16(0xFF7F), 0x7F80, s16(0xFF80), 0x7FC0, 0x7FC0]
    assert bf[6:8] == [0x3F80, 0x3F82]  # ties to even
    h = mops._as_dtype(v, torch.float16).view(torch.int16).tolist()
    assert h[4] == h[5] == 0x7E00 and h[8] == 0x7BFF and h[9] == 0x7BFF  # NaN canonical; 70000 saturates
    f = mops._as_dtype(v, torch.float32).view(torch.int32).tolist()
    assert f[5] == 0x7FC00000


def test_matrix_errors_name_the_argument():
    x = llm_like(4, 128, torch.bfloat16, 0)
    m = _orthogonal(32, torch.float32, 1)
    with pytest.raises(ValueError, match="square"):
        mxq.qdq(x, "mxfp4", rotation=torch.zeros(32, 16))
    with pytest.raises(ValueError, match="RS in"):
        mxq.qdq(x, "mxfp4", rotation=torch.eye(24))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mxq.quantize(x, "mxfp4", rotation=m.double())
    with pytest.raises(ValueError, match="rotation_seed"):
        mxq.quantize(x, "mxfp4", rotation=m, rotation_seed=3)
    with pytest.raises(TypeError, match="rotation_inverse"):
        mxq.quantize(x, "mxfp4", rotation="had32", rotation_inverse=m)
    with pytest.raises(ValueError, match="rotation_inverse"):
        mxq.quantize(x, "mxfp4", rotation=m, rotation_inverse=torch.eye(64))
    with pytest.raises(ValueError, match="does not divide"):
        mxq.qdq(x[:, :80], "mxfp4", rotation=m)
    q = mxq.quantize(x, "mxfp4", rotation=torch.ones(32, 32))  # singular: quantizes, cannot rotate back
    with pytest.raises(ValueError, match="singular"):
        q.dequantize()
    # the op itself: a name and a matrix together
    with pytest.raises(ValueError, match="either a rotation name or a matrix"):
        torch.ops.mxq.qdq.default(x, "mxfp4", "even", 0, False, 0, 0, None, 32, "had32", 0, m)
    # float16 matrices are widened exactly
    assert torch.equal(mxq.qdq(x, "mxfp4", rotation=m.half()), mxq.qdq(x, "mxfp4", rotation=m.half().float()))


@pytest.mark.parametrize("fmt,rule", CASES)
def test_bf16_precision_on_the_cpu_is_the_exact_sums(fmt, rule):
    """matrix_precision="bf16" on CPU tensors: the CPU kernels compute the exact sums (within the bf16
    mode's bound), so the bytes of the exact mode; through quantize, qdq, qdq_ and the op itself."""
    x = llm_like(6, 512, torch.bfloat16, 5)
    m = _orthogonal(128, torch.bfloat16, 6)
    q = mxq.quantize(x, fmt, rule=rule, rotation=m, matrix_precision="bf16")
    e = mxq.quantize(x, fmt, rule=rule, rotation=m)
    assert_bytes_equal(q.codes, e.codes, "codes")
    assert_bytes_equal(q.scales, e.scales, "scales")
    assert_bytes_equal(q.dequantize(), e.dequantize(), "dequantize")
    ref = mxq.qdq(x, fmt, rule=rule, rotation=m)
    assert_bytes_equal(mxq.qdq(x, fmt, rule=rule, rotation=m, matrix_precision="bf16"), ref, "qdq")
    x2 = x.clone()
    mxq.qdq_(x2, fmt, rule=rule, rotation=m, matrix_precision="bf16")
    assert_bytes_equal(x2, ref, "qdq_")
    r = rule or "nvfp4"
    assert_bytes_equal(torch.ops.mxq.qdq.default(x, fmt, r, 0, False, 0, 0, None, 32, "none", 0, m, "bf16"), ref, "op")


def test_bf16_precision_errors_name_the_argument():
    x = llm_like(4, 256, torch.bfloat16, 0)
    m = _orthogonal(32, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="'matrix_precision': 'fp16', expected 'exact' or 'bf16'"):
        mxq.qdq(x, "mxfp4", rotation=m, matrix_precision="fp16")
    with pytest.raises(ValueError, match="'matrix_precision': 'bf16' is for rotation= a matrix"):
        mxq.qdq(x, "mxfp4", rotation="had32", matrix_precision="bf16")
    with pytest.raises(ValueError, match="'matrix_precision': 'bf16' is for rotation= a matrix"):
        mxq.quantize(x, "mxfp4", matrix_precision="bf16")
    with pytest.raises(ValueError, match="'matrix_precision': 'bf16' is for rotation= a matrix"):
        mxq.qdq_(x.clone(), "mxfp4", matrix_precision="bf16")
    for unfused in (False, True):  # refused alike on both paths (the torch path computes exact sums)
        mops._UNFUSED = unfused
        try:
            with pytest.raises(ValueError, match="argument 'x': dtype torch.float32 with matrix_precision 'bf16'"):
                mxq.qdq(x.float(), "mxfp4", rotation=m, matrix_precision="bf16")
            with pytest.raises(ValueError, match="argument 'rotation': dtype torch.float32 with matrix_precision 'bf16'"):
                mxq.quantize(x, "mxfp4", rotation=m.float(), matrix_precision="bf16")
            with pytest.raises(ValueError, match="argument 'rotation': dtype torch.float16 with matrix_precision 'bf16'"):
                mxq.qdq_(x.clone(), "mxfp4", rotation=m.half(), matrix_precision="bf16")
            with pytest.raises(ValueError, match="'bf16' with RS = 256"):
                mxq.qdq(x, "mxfp4", rotation=_orthogonal(256, torch.bfloat16, 2), matrix_precision="bf16")
        finally:
            mops._UNFUSED = False
    # the op itself (the library's checks): an unknown value, bf16 without a matrix, f32 operands, RS 256
    op = torch.ops.mxq.qdq.default
    with pytest.raises(ValueError, match="argument 'matrix_precision': 'fp16'"):
        op(x, "mxfp4", "even", 0, False, 0, 0, None, 32, "none", 0, m, "fp16")
    with pytest.raises(ValueError, match="'matrix_precision': 'bf16' with rotation 'none'"):
        op(x, "mxfp4", "even", 0, False, 0, 0, None, 32, "none", 0, None, "bf16")
    with pytest.raises(ValueError, match="argument 'x': dtype f32 with matrix_precision 'bf16', expected bf16"):
        op(x.float(), "mxfp4", "even", 0, False, 0, 0, None, 32, "none", 0, m, "bf16")
    with pytest.raises(ValueError, match="'rotation_matrix': dtype f32 with matrix_precision 'bf16', expected bf16"):
        op(x, "mxfp4", "even", 0, False, 0, 0, None, 32, "none", 0, m.float(), "bf16")
    with pytest.raises(ValueError, match="'bf16' with rotation_size 256"):
        op(x, "mxfp4", "even", 0, False, 0, 0, None, 32, "none", 0, _orthogonal(256, torch.bfloat16, 2), "bf16")


def test_bf16_precision_opcheck_and_compile():
    x = llm_like(8, 256, torch.bfloat16, 4)
    m = _orthogonal(128, torch.bfloat16, 3)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
             "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mxq.qdq.default,
                          (x, "mxfp4", "even", 0, False, 0, 0, None, 32, "none", 0, m, "bf16"), test_utils=utils)
    torch.library.opcheck(torch.ops.mxq.quantize.default,
                          (x, "nvfp4", "nvfp4", 0, False, 0, 0, "linear", None, False, 32, "none", 0, m, "bf16"),
                          test_utils=utils)
    torch._dynamo.reset()
    f = torch.compile(lambda t: mxq.qdq(t, "mxfp4", rule="even", rotation=m, matrix_precision="bf16"), fullgraph=True)
    assert_bytes_equal(f(x), mxq.qdq(x, "mxfp4", rule="even", rotation=m), "compiled bf16-precision matrix qdq")


@pytest.mark.parametrize("unfused", [False, True])
def test_matrix_qdq_refuses_a_gradient_it_would_get_wrong(unfused, monkeypatch):
    monkeypatch.setattr(mops, "_UNFUSED", unfused)
    x = torch.randn(4, 64, requires_grad=True)
    m = _orthogonal(32, torch.float32, 2)
    with pytest.raises(NotImplementedError, match="rotation"):
        mxq.qdq(x, "mxfp4", rotation=m)
    with pytest.raises(NotImplementedError, match="rotation"):
        mxq.qdq_(x * 1, "mxfp4", rotation=m)
    with torch.no_grad():
        assert mxq.qdq(x, "mxfp4", rotation=m).shape == x.shape


def test_matrix_opcheck_and_compile():
    x = llm_like(8, 128, torch.bfloat16, 4)
    m = _orthogonal(64, torch.bfloat16, 3)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
             "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mxq.qdq.default, (x, "mxfp4", "even", 0, False, 0, 0, None, 32, "none", 0, m),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.mxq.quantize.default,
                          (x, "nvfp4", "nvfp4", 0, False, 0, 0, "linear", None, False, 32, "none", 0, m), test_utils=utils)
    q = mxq.quantize(x, "mxfp4", rule="even", rotation=m)
    inv = torch.linalg.inv(m.double()).float()
    torch.library.opcheck(torch.ops.mxq.dequantize.default,
                          (q.codes, q.scales, 128, "mxfp4", 0, "linear", None, None, torch.bfloat16, "none", 0, inv),
                          test_utils=utils)
    torch._dynamo.reset()
    f = torch.compile(lambda t: mxq.qdq(t, "mxfp4", rule="even", rotation=m), fullgraph=True)
    assert_bytes_equal(f(x), mxq.qdq(x, "mxfp4", rule="even", rotation=m), "compiled matrix qdq")


def test_matrix_paths_compile_without_graph_breaks(monkeypatch):
    """Both paths (the fused CPU kernels; the torch rotation GPU tensors take, here on the CPU) traced
    whole by torch.compile: quantize, qdq, qdq_ and the rotated-back dequantize, the same bytes."""
    x = llm_like(8, 128, torch.bfloat16, 5)
    m = _orthogonal(32, torch.bfloat16, 6)
    inv = torch.linalg.inv(m.double()).float()

    def f(t):
        q = mxq.quantize(t, "nvfp4", rotation=m, rotation_inverse=inv)
        u = t.clone()
        mxq.qdq_(u, "mxfp4", rotation=m)
        return q.codes, q.scales, q.dequantize(), mxq.qdq(t, "mxfp8", rotation=m), u

    for unfused in (False, True):
        monkeypatch.setattr(mops, "_UNFUSED", unfused)
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True)(x)
        for g, e, what in zip(got, f(x), ["codes", "scales", "dequantize", "qdq", "qdq_"]):
            assert_bytes_equal(g, e, f"compiled ({'torch rotation' if unfused else 'fused'}) {what}")


def test_matrix_requiring_grad_is_detached():
    x = llm_like(4, 64, torch.bfloat16, 7)
    m = _orthogonal(32, torch.float32, 8).requires_grad_()
    with torch.no_grad():
        expect = mxq.qdq(x, "mxfp4", rotation=m.detach())
    assert torch.equal(mxq.qdq(x, "mxfp4", rotation=m), expect)
    q = mxq.quantize(x, "mxfp4", rotation=m)
    assert not q.rotation_matrix.requires_grad


def test_rotate_quantize_is_quantize_with_a_required_rotation():
    x = llm_like(4, 256, torch.bfloat16, 8)
    m = _orthogonal(64, torch.bfloat16, 9)
    for rot, extra in (("had32", {}), ("rhad64", {"rotation_seed": 5}), (m, {"matrix_precision": "bf16"})):
        q = mxq.rotate_quantize(x, "nvfp4", rot, layout="swizzled", **extra)
        e = mxq.quantize(x, "nvfp4", rotation=rot, layout="swizzled", **extra)
        assert_bytes_equal(q.codes, e.codes, f"{rot if isinstance(rot, str) else 'matrix'}: codes")
        assert_bytes_equal(q.scales, e.scales, "scales")
        assert_bytes_equal(q.dequantize(), e.dequantize(), "dequantize")
        assert q.rotation == e.rotation
    for bad in (None, "none", ""):
        with pytest.raises(ValueError, match="argument 'rotation'"):
            mxq.rotate_quantize(x, "mxfp4", bad)
