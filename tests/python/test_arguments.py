"""Every argument of the Python API observably reaches the op: for each argument of quantize, qdq,
qdq_, dequantize, rotate_quantize and the compat shims, a call with a non-default value must give
what the library gives for that value (an independent oracle or the stored known answers where one
exists) and must differ from the default's result, so a wrapper that drops the argument fails here.
Then NaN, Inf and huge blocks through every op. On the fast CPU path, the reference backend
(MXQ_BACKEND=reference) and CUDA."""
from __future__ import annotations

import pytest
import torch

import mxq
import oracle
from conftest import BACKENDS, CUDA, assert_bytes_equal
from mxq.compat import qutlass, vllm_qdq


def data(rows=16, k=128, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    return x.to(dtype).to(device)


def differs(a: torch.Tensor, b: torch.Tensor, what: str):
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    assert a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
        f"{what}: the same bytes as the default's: the argument did not reach the op"


# ---- quantize ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", BACKENDS, indirect=True)
def test_quantize_arguments_reach_the_op(device):
    x = data(device=device)
    base = mxq.quantize(x, "mxfp8_e4m3")
    # rule
    q = mxq.quantize(x, "mxfp8_e4m3", rule="ceil")
    assert_bytes_equal(q.dequantize().cpu(), oracle.mx_qdq(x.cpu(), "mxfp8_e4m3", "ceil"), "rule=ceil")
    differs(q.scales, base.scales, "rule")
    # group_size
    q = mxq.quantize(x, "mxfp4", group_size=16)
    assert q.scales.shape == (16, 8)
    assert_bytes_equal(q.dequantize().cpu(), oracle.mx_qdq(x.cpu(), "mxfp4", "floor", 16), "group_size=16")
    # tensor_scale (NVFP4): used, reported, and not the computed one
    S = 123.5
    q = mxq.quantize(x, "nvfp4", tensor_scale=S)
    assert q.tensor_scale.cpu().item() == S
    assert_bytes_equal(q.dequantize().cpu(), oracle.nvfp4_qdq(x.cpu(), S), "tensor_scale")
    differs(q.codes, mxq.quantize(x, "nvfp4").codes, "tensor_scale")
    # layout
    lin = mxq.quantize(x, "mxfp4")
    q = mxq.quantize(x, "mxfp4", layout="swizzled")
    assert q.scales.shape == (128, 4)
    assert_bytes_equal(q.scales.cpu(), mxq.swizzle_scales(lin.scales.cpu()), "layout=swizzled")
    # stochastic, seed, offset, random_bits (their bytes: test_known_answers.py)
    sr = mxq.quantize(x, "mxfp4", stochastic=True, seed=1)
    differs(sr.codes, lin.codes, "stochastic")
    differs(mxq.quantize(x, "mxfp4", stochastic=True, seed=2).codes, sr.codes, "seed")
    differs(mxq.quantize(x, "mxfp4", stochastic=True, seed=1, offset=5).codes, sr.codes, "offset")
    differs(mxq.quantize(x, "mxfp4", stochastic=True, seed=1, random_bits=8).codes, sr.codes, "random_bits")
    # rotation, rotation_seed: the codes of the rotated tensor, and the dequantize rotates back
    had = mxq.quantize(x, "mxfp4", rotation="had32")
    differs(had.codes, lin.codes, "rotation")
    r1 = mxq.quantize(x, "mxfp4", rotation="rhad32", rotation_seed=1)
    differs(r1.codes, mxq.quantize(x, "mxfp4", rotation="rhad32").codes, "rotation_seed")
    assert r1.rotation_seed == 1
    # clip_mask
    assert mxq.quantize(x, "mxfp4", clip_mask=True).clip_mask is not None


# ---- qdq and qdq_: each argument gives quantize's bytes for it, and not the default's ---------------------------
CASES = [  # (format, keyword arguments)
    ("mxfp8_e4m3", dict(rule="ceil")),
    ("mxfp4", dict(group_size=16)),
    ("nvfp4", dict(tensor_scale=123.5)),
    ("mxfp4", dict(stochastic=True)),
    ("mxfp4", dict(stochastic=True, seed=3)),
    ("mxfp4", dict(stochastic=True, offset=7)),
    ("mxint8", dict(stochastic=True, random_bits=8)),
    ("mxfp4", dict(rotation="had32")),
    ("mxfp4", dict(rotation="rhad32", rotation_seed=9)),
]
DEFAULT_OF = dict(rule=None, group_size=None, tensor_scale=None, stochastic=False, seed=0, offset=0, random_bits=32,
                  rotation=None, rotation_seed=0)


def _baseline(kw):
    """The arguments with the last one back at its default (stochastic kept where it enables the rest)."""
    name = list(kw)[-1]
    b = dict(kw)
    b[name] = DEFAULT_OF[name]
    if name == "rotation_seed":
        b["rotation_seed"] = 0
    if name in ("seed", "offset", "random_bits"):
        b["stochastic"] = True
    return b


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
@pytest.mark.parametrize("op", ["qdq", "qdq_"])
@pytest.mark.parametrize("fmt,kw", CASES, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.items())))
def test_qdq_arguments_reach_the_op(op, fmt, kw, device):
    x = data(device=device, seed=1)

    def run(**a):
        if op == "qdq":
            return mxq.qdq(x, fmt, **a)
        y = x.clone()
        assert mxq.qdq_(y, fmt, **a) is y
        return y

    y = run(**kw)
    q = mxq.quantize(x, fmt, **kw)
    # QDQ of a rotated tensor stays rotated: the raw dequantize of the codes (no rotation back)
    ts = kw.get("tensor_scale")
    want = mxq.dequantize(q.codes, q.scales, format=fmt, cols=x.shape[-1], group_size=kw.get("group_size"),
                          tensor_scale=ts if ts is not None else q.tensor_scale, dtype=x.dtype)
    assert_bytes_equal(y.cpu(), want.cpu(), f"{op}({kw}) vs quantize")
    differs(y, run(**_baseline(kw)), f"{op}: {list(kw)[-1]}")


# ---- dequantize -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", BACKENDS, indirect=True)
def test_dequantize_arguments_reach_the_op(device):
    x = data(device=device, seed=2)
    k = x.shape[-1]
    # tensor_scale: twice S gives exactly half (normal results)
    q = mxq.quantize(x, "nvfp4", tensor_scale=100.0)
    y1 = mxq.dequantize(q.codes, q.scales, format="nvfp4", cols=k, tensor_scale=100.0)
    y2 = mxq.dequantize(q.codes, q.scales, format="nvfp4", cols=k, tensor_scale=200.0)
    assert_bytes_equal(y1.cpu(), oracle.nvfp4_qdq(x.cpu(), 100.0), "tensor_scale")
    assert_bytes_equal(y2.cpu(), (y1 / 2).cpu(), "tensor_scale 2S")
    # tensor_scale as a tensor
    y3 = mxq.dequantize(q.codes, q.scales, format="nvfp4", cols=k, tensor_scale=torch.tensor([200.0], device=device))
    assert_bytes_equal(y3.cpu(), y2.cpu(), "tensor_scale tensor")
    # group_size
    q = mxq.quantize(x, "mxfp4", group_size=16)
    y = mxq.dequantize(q.codes, q.scales, format="mxfp4", cols=k, group_size=16)
    assert_bytes_equal(y.cpu(), oracle.mx_qdq(x.cpu(), "mxfp4", "floor", 16), "group_size")
    # layout
    q = mxq.quantize(x, "mxfp4", layout="swizzled")
    y = mxq.dequantize(q.codes, q.scales, format="mxfp4", cols=k, layout="swizzled")
    assert_bytes_equal(y.cpu(), oracle.mx_qdq(x.cpu(), "mxfp4", "floor"), "layout")
    # format, cols, dtype
    q = mxq.quantize(x, "mxfp8_e5m2")
    y = mxq.dequantize(q.codes, q.scales, format="mxfp8_e5m2", cols=k, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert_bytes_equal(y.cpu(), oracle.mx_qdq(x.cpu(), "mxfp8_e5m2", "floor").to(torch.bfloat16), "format, dtype")
    # rotation, rotation_seed of raw codes: back to the rotated quantize's own dequantize
    q = mxq.quantize(x, "mxfp4", rotation="rhad32", rotation_seed=11)
    y = mxq.dequantize(q.codes, q.scales, format="mxfp4", cols=k, rotation="rhad32", rotation_seed=11)
    assert_bytes_equal(y.cpu(), q.dequantize().cpu(), "rotation, rotation_seed")
    differs(y, mxq.dequantize(q.codes, q.scales, format="mxfp4", cols=k, rotation="rhad32"), "rotation_seed")
    differs(y, mxq.dequantize(q.codes, q.scales, format="mxfp4", cols=k), "rotation")


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
def test_rotate_quantize_passes_every_argument(device):
    x = data(device=device, seed=3)
    kw = dict(rotation_seed=5, stochastic=True, seed=6, offset=7, random_bits=16, group_size=16, layout="swizzled")
    q = mxq.rotate_quantize(x, "mxfp4", "rhad32", **kw)
    want = mxq.quantize(x, "mxfp4", rotation="rhad32", **kw)
    assert_bytes_equal(q.codes.cpu(), want.codes.cpu(), "codes")
    assert_bytes_equal(q.scales.cpu(), want.scales.cpu(), "scales")
    for name in kw:
        base = dict(kw, **{name: {"layout": "linear", "stochastic": False}.get(name, DEFAULT_OF.get(name))})
        if name in ("seed", "offset", "random_bits"):
            base["stochastic"] = True
        other = mxq.rotate_quantize(x, "mxfp4", "rhad32", **base)
        differs(torch.cat([q.codes.reshape(-1), q.scales.reshape(-1)]),
                torch.cat([other.codes.reshape(-1), other.scales.reshape(-1)]), f"rotate_quantize: {name}")
    differs(q.codes, mxq.rotate_quantize(x, "mxfp4", "had32", **kw).codes, "rotation")


# ---- the compat shims -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", BACKENDS, indirect=True)
@pytest.mark.parametrize("fn,fmt,rule", [(vllm_qdq.mxfp4_qdq, "mxfp4", "even"), (vllm_qdq.mxfp8_qdq, "mxfp8_e4m3", "floor")],
                         ids=["mxfp4_qdq", "mxfp8_qdq"])
@pytest.mark.parametrize("group", [16, 64])
def test_vllm_shims_pass_group_size(fn, fmt, rule, group, device):
    x = data(device=device, seed=4, dtype=torch.bfloat16)
    y = fn(x, group_size=group)
    assert_bytes_equal(y.cpu(), oracle.mx_qdq(x.cpu(), fmt, rule, group), f"group_size={group}")
    differs(y, fn(x), "group_size")


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
def test_qutlass_shims_pass_their_arguments(device):
    x = data(device=device, seed=5, dtype=torch.bfloat16)
    h = (torch.ones(1, 1) * torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
    for _ in range(4):
        h = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
    h = (h / 32 ** 0.5).to(torch.bfloat16).to(device)  # 32 x 32
    c0, s0 = qutlass.fusedQuantizeMx(x, None, method="quest")
    c1, s1 = qutlass.fusedQuantizeMx(x, h, method="quest")
    differs(c1, c0, "fusedQuantizeMx: b")
    c2, _ = qutlass.fusedQuantizeMx(x, None, method="abs_max")
    differs(c2, c0, "fusedQuantizeMx: method")
    assert len(qutlass.fusedQuantizeMx(x, None, method="quest", return_mask=True)) == 3
    n1, t1 = qutlass.fusedQuantizeNv(x, None, torch.tensor([50.0]))
    n2, t2 = qutlass.fusedQuantizeNv(x, None, 500.0)
    differs(t2, t1, "fusedQuantizeNv: global_scale")
    want = mxq.quantize(x, "nvfp4", tensor_scale=500.0, layout="padded")
    assert_bytes_equal(n2.cpu(), want.codes.cpu(), "fusedQuantizeNv codes")
    assert_bytes_equal(t2.view(torch.uint8).cpu(), want.scales.cpu(), "fusedQuantizeNv scales")
    nq, _ = qutlass.fusedQuantizeNv(x, None, 500.0, method="quest")
    differs(nq, n2, "fusedQuantizeNv: method")
    nh, _ = qutlass.fusedQuantizeNv(x, h, 500.0)
    differs(nh, n2, "fusedQuantizeNv: b")


# ---- NaN, Inf and huge blocks through every op ------------------------------------------------------------------
NAN_SCALE = {"mxfp4": 0xFF, "mxfp8_e4m3": 0xFF, "mxint8": 0xFF, "nvfp4": 0x7F}


def specials(dtype, device):
    """[4, 64]: row 0 block 0 holds a NaN, row 1 block 1 +Inf, row 2 block 0 -Inf, row 3 block 1 the dtype's
    largest finite value (and its negation); every other block ordinary data."""
    x = data(4, 64, torch.float32, seed=6)
    big = torch.finfo(dtype).max
    x[0, 5], x[1, 40], x[2, 0] = float("nan"), float("inf"), float("-inf")
    x[3, 33], x[3, 60] = big, -big
    return x.to(dtype).to(device)


NONFINITE = [(0, 0), (1, 1), (2, 0)]  # (row, block of 32)


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxint8", "nvfp4"])
def test_nan_inf_and_huge_blocks_through_every_op(fmt, dtype, device):
    x = specials(dtype, device)
    kw = dict(tensor_scale=1.0) if fmt == "nvfp4" else {}
    g = 16 if fmt == "nvfp4" else 32
    q = mxq.quantize(x, fmt, **kw)
    codes, scales = q.codes.cpu(), q.scales.cpu()
    cpb = g // 2 if fmt in ("mxfp4", "nvfp4") else g  # code bytes per block
    clean = x.clone()
    for r, b in NONFINITE:
        clean[r, b * 32:(b + 1) * 32] = 0
    qc = mxq.quantize(clean, fmt, **kw)
    bad = torch.zeros(4, 64, dtype=torch.bool)
    for r, b in NONFINITE:
        bad[r, b * 32:(b + 1) * 32] = True
        for sb in range(b * 32 // g, (b + 1) * 32 // g):
            if fmt == "nvfp4" and not torch.isfinite(x[r, sb * g:(sb + 1) * g]).all():
                assert scales[r, sb].item() == NAN_SCALE[fmt], (r, sb)
                assert (codes[r, sb * cpb:(sb + 1) * cpb] == 0).all(), (r, sb)
            if fmt != "nvfp4":
                assert scales[r, sb].item() == NAN_SCALE[fmt], (r, sb)
                assert (codes[r, sb * cpb:(sb + 1) * cpb] == 0).all(), (r, sb)
    # the other blocks as if the non-finite ones were zero; the huge block finite
    keep_s = torch.ones_like(scales, dtype=torch.bool)
    for r, b in NONFINITE:
        keep_s[r, b * 32 // g:(b + 1) * 32 // g] = False
    assert torch.equal(scales[keep_s], qc.scales.cpu()[keep_s]), "scales of the finite blocks"
    y = q.dequantize().cpu()
    yc = qc.dequantize().cpu()
    assert_bytes_equal(y, yc, "finite blocks of dequantize", mask=~bad)
    assert torch.isfinite(y[3]).all(), "the huge block stays finite"
    assert y[3].abs().max() > 0
    nan_elems = torch.zeros_like(bad)
    for r, b in NONFINITE:
        for sb in range(b * 32 // g, (b + 1) * 32 // g):
            if fmt != "nvfp4" or not torch.isfinite(x[r, sb * g:(sb + 1) * g].cpu()).all():
                nan_elems[r, sb * g:(sb + 1) * g] = True
    assert torch.isnan(y[nan_elems]).all(), "a non-finite block dequantizes to NaN"
    # qdq, qdq_ and the raw dequantize: the same bytes
    assert_bytes_equal(mxq.qdq(x, fmt, **kw).cpu(), y, "qdq")
    z = x.clone()
    mxq.qdq_(z, fmt, **kw)
    assert_bytes_equal(z.cpu(), y, "qdq_")
    raw = mxq.dequantize(q.codes, q.scales, format=fmt, cols=64, tensor_scale=kw.get("tensor_scale"), dtype=dtype)
    assert_bytes_equal(raw.cpu(), y, "dequantize(codes, scales)")
    # rotate_quantize: a NaN or Inf spreads over its rotation group, whose blocks get the NaN scale
    rq = mxq.rotate_quantize(x, fmt, "had32", **kw)
    rs = rq.scales.cpu()
    for r, b in NONFINITE:
        assert (rs[r, b * 32 // g:(b + 1) * 32 // g] == NAN_SCALE[fmt]).all(), (r, b)
    assert torch.isnan(rq.dequantize().cpu()[bad]).all()
