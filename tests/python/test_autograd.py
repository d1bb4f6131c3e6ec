"""Gradients through the mxq ops: qdq and qdq_ pass them straight through (the straight-through
estimator, grad_x = grad_y exactly), eagerly and under torch.compile(fullgraph=True); quantize and
dequantize, whose codes are integers, refuse inputs that require grad with an error (never a silent
None); in-place qdq_ behaves as torch's in-place ops do."""
from __future__ import annotations

import pytest
import torch

import mxq
from conftest import assert_bytes_equal, llm_like


def _x(rows=6, k=96, dtype=torch.float32, seed=0):
    return llm_like(rows, k, dtype, seed)


SPECS = [("mxfp4", dict(rule="even")), ("mxfp8", {}), ("nvfp4", {}), ("nvfp4", dict(tensor_scale=100.0)),
         ("mxint8", dict(stochastic=True, seed=3)), ("mxfp6_e2m3", dict(group_size=16))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt,kw", SPECS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(SPECS)])
def test_qdq_gradient_is_straight_through(fmt, kw, dtype):
    x = _x(dtype=dtype).requires_grad_()
    y = mxq.qdq(x, fmt, **kw)
    assert y.requires_grad and y.grad_fn is not None
    assert_bytes_equal(y.detach(), mxq.qdq(x.detach(), fmt, **kw), "forward unchanged by autograd")
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    assert_bytes_equal(gx, g, "grad_x == grad_y (straight-through)")


def test_qdq_gradient_reaches_leaves_through_a_graph():
    """Upstream parameters get the gradients they would get with qdq replaced by the identity."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    w = torch.randn(32, 16, requires_grad=True)
    x = _x(4, 64)

    def run(q):
        h = q(lin(x))
        return (q(h) @ w).square().sum()

    run(lambda t: mxq.qdq(t, "mxfp4", rule="even")).backward()
    got = [p.grad.clone() for p in (lin.weight, lin.bias, w)]
    for p in (lin.weight, lin.bias, w):
        p.grad = None
    # the same graph with the forward values of qdq but an identity backward, written with detach()
    run(lambda t: t + (mxq.qdq(t.detach(), "mxfp4", rule="even") - t.detach())).backward()
    for g, p, what in zip(got, (lin.weight, lin.bias, w), ("weight", "bias", "w")):
        assert g is not None and p.grad is not None, what
        assert_bytes_equal(g, p.grad, f"grad of {what}")


def test_gradcheck_straight_through():
    """torch.autograd.gradcheck against the STE's Jacobian (the identity): gradcheck's numerical
    derivative of a step function is meaningless, so the check is of the analytical one, in float64
    via the identity's vector-Jacobian products."""
    x = _x(3, 32).double().requires_grad_()
    y = mxq.qdq(x.float(), "mxfp4").double()
    eye = torch.eye(x.numel(), dtype=torch.float64)
    jac = torch.stack([torch.autograd.grad(y.reshape(-1), x, e, retain_graph=True)[0].reshape(-1) for e in eye])
    assert torch.equal(jac, eye)


def test_qdq_inplace_follows_torch_inplace_rules():
    leaf = _x().requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad.*in-place"):
        mxq.qdq_(leaf, "mxfp4")
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad.*in-place"):
        torch.ops.mxq.qdq_(leaf, "mxfp4", "floor", 0, False, 0, 0, None)
    with pytest.raises(RuntimeError, match="view of a leaf Variable"):
        mxq.qdq_(leaf[1:3], "mxfp4")
    assert leaf.grad is None
    # Under no_grad a leaf may be overwritten (as w.add_(1) may), and its version counter moves.
    v0 = leaf._version
    expect = mxq.qdq(leaf.detach(), "mxfp8")
    with torch.no_grad():
        mxq.qdq_(leaf, "mxfp8")
    assert leaf._version > v0
    assert_bytes_equal(leaf.detach(), expect, "no_grad in place")
    # A non-leaf: the in-place QDQ joins its history, and the gradient passes straight through.
    a = _x().requires_grad_()
    h = a * 3
    out = mxq.qdq_(h, "mxfp4", rule="even")
    assert out is h and h.grad_fn is not None
    assert_bytes_equal(h.detach(), mxq.qdq(a.detach() * 3, "mxfp4", rule="even"), "in-place values")
    g = torch.randn(h.shape, generator=torch.Generator().manual_seed(2))
    h.backward(g)
    assert_bytes_equal(a.grad, g * 3, "d(qdq_(3a))/da = 3 (straight-through)")
    # A non-leaf whose producer saved its output for backward: modifying it in place must fail
    # loudly at backward, as for torch's in-place ops (the version counter).
    b = _x().requires_grad_()
    e = b.exp()
    with torch.no_grad():
        mxq.qdq_(e, "mxfp4")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()


def test_qdq_inplace_version_counter_without_grad():
    """As torch's in-place ops (x.add_(1) alike): the version moves without grad mode, under no_grad,
    under inference_mode (on a normal tensor) and through torch.ops directly."""
    x = _x()
    for ctx in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        v0 = x._version
        with ctx():
            mxq.qdq_(x, "mxfp4")
        assert x._version == v0 + 1, ctx.__name__
        with ctx():
            x.add_(0)
        assert x._version == v0 + 2, f"{ctx.__name__}: torch's own in-place op, for comparison"
    v0 = x._version
    torch.ops.mxq.qdq_(x, "mxfp4", "floor", 0, False, 0, 0, None)
    assert x._version == v0 + 1
    with torch.inference_mode():
        t = torch.ones(4, 64)  # an inference tensor: no version counter, nothing to bump
        mxq.qdq_(t, "mxfp4")
    assert torch.equal(t, mxq.qdq(torch.ones(4, 64), "mxfp4"))


def test_quantize_and_dequantize_refuse_grad():
    x = _x().requires_grad_()
    with pytest.raises(RuntimeError, match=r"mxq\.quantize is not differentiable.*no_grad.*mxq\.qdq"):
        mxq.quantize(x, "mxfp4")
    with pytest.raises(RuntimeError, match=r"mxq\.quantize is not differentiable"):
        torch.ops.mxq.quantize(x, "nvfp4", "nvfp4", 0, False, 0, 0, "linear", None, False)
    from mxq.compat import qutlass as Q
    with pytest.raises(RuntimeError, match=r"not differentiable"):
        Q.fusedQuantizeMx(x[:, :64], None)
    # Fine without a gradient to compute: under no_grad, detached, in inference mode.
    with torch.no_grad():
        q = mxq.quantize(x, "nvfp4")
    mxq.quantize(x.detach(), "mxfp4")
    with torch.inference_mode():
        mxq.quantize(x, "mxfp4")
    ts = q.tensor_scale.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"mxq\.dequantize is not differentiable.*tensor_scale"):
        mxq.dequantize(q.codes, q.scales, format="nvfp4", cols=x.shape[-1], tensor_scale=ts)
    y = mxq.dequantize(q.codes, q.scales, format="nvfp4", cols=x.shape[-1], tensor_scale=ts.detach())
    assert not y.requires_grad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_backward(backend):
    torch._dynamo.reset()
    w = torch.randn(96, 8, requires_grad=True)

    def f(x, w):
        h = mxq.qdq(x * 2, "mxfp4", rule="even")
        return (mxq.qdq(h @ w, "mxfp8") ** 2).sum()

    x = _x(8, 96).requires_grad_()
    loss = torch.compile(f, fullgraph=True, backend=backend)(x, w)
    gx, gw = torch.autograd.grad(loss, (x, w))
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss2 = f(x2, w2)
    ex, ew = torch.autograd.grad(loss2, (x2, w2))
    assert_bytes_equal(loss.detach(), loss2.detach(), f"compiled ({backend}) loss")
    # (inductor may fuse the plain-torch arithmetic around the ops differently: compare with a bound
    # derived from the eager result rather than bytes; the STE itself is checked exactly above)
    torch.testing.assert_close(gx, ex, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, ew, rtol=1e-5, atol=1e-5)
    # The gradient through both QDQs is exactly the one with identities in their place.
    assert_bytes_equal(torch.autograd.grad(f(x, w), x)[0], ex, "eager STE grads are deterministic")


def test_torch_compile_fullgraph_backward_is_ste():
    """Under compile, d/dx of sum(g * qdq(x)) is g exactly."""
    torch._dynamo.reset()
    g = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))

    def f(x):
        return (mxq.qdq(x, "nvfp4") * g).sum()

    x = _x(8, 64).requires_grad_()
    (gx,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x), x)
    assert_bytes_equal(gx, g, "compiled STE")


def test_torch_compile_quantize_under_grad_raises():
    torch._dynamo.reset()

    def f(x):
        return mxq.quantize(x, "mxfp4").codes

    x = _x().requires_grad_()
    with pytest.raises(Exception, match="not differentiable"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(x)


def test_emulated_linear_trains_through_activations():
    """mxq.emulate's QDQLinear: the input QDQ passes gradients straight through to earlier layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    first = model[0].weight
    mxq.emulate(model, weights="mxfp4", activations="mxfp4", include=[r"^2$"])
    out = model(_x(4, 32))
    out.sum().backward()
    assert first.grad is not None and bool(first.grad.abs().sum() > 0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_inplace_on_a_non_leaf_with_backward(backend):
    torch._dynamo.reset()

    def f(x):
        h = x * 2
        mxq.qdq_(h, "mxfp4", rule="even")
        return (h * h).sum()

    x = _x(8, 64).requires_grad_()
    loss = torch.compile(f, fullgraph=True, backend=backend)(x)
    (g,) = torch.autograd.grad(loss, x)
    x2 = x.detach().clone().requires_grad_()
    (e,) = torch.autograd.grad(f(x2), x2)
    # (the loss is a sum, which inductor may reduce in another order: close, not equal)
    torch.testing.assert_close(loss.detach(), f(x.detach()), rtol=1e-6, atol=0)
    assert torch.equal(g, e), f"compiled ({backend}) in-place gradient"
    h = x.detach() * 2
    # d/dx sum(qdq(2x)^2) = 4 qdq(2x) with the STE (compared as values: where qdq gives -0.0 the
    # eager gradient sums the copy's zero and the STE's -0.0 into +0.0)
    assert torch.equal(e, 2 * 2 * mxq.qdq(h, "mxfp4", rule="even"))
