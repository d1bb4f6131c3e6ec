"""mxq.compat against the outputs of the upstream code itself: tests/known_answers/upstream/upstream.npz
holds what the vllm-qdq-plugin's torch references and QuTLASS's test reference returned, run from their
repositories at pinned commits (README.md beside it: the commits and the command). Each output is
checked twice: the transcription in anchors.py (which test_compat.py compares the shims with) must
equal it bit for bit, and the shim must equal it except for the documented differences (docs/python.md),
so a misreading of upstream cannot pass both the shim and its transcription."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import anchors
from conftest import assert_bytes_equal
from mxq.compat import qutlass as Q
from mxq.compat import vllm_qdq as V

UP = np.load(Path(__file__).resolve().parents[1] / "known_answers" / "upstream" / "upstream.npz")
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def t16(key, dtype):
    return torch.from_numpy(UP[key].view(np.int16).copy()).view(dtype)


def t8(key):
    return torch.from_numpy(UP[key].copy())


def same_or_both_nan(a, b, what, mask=None):
    """Bit equality, except that NaN matches NaN whatever its payload."""
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    m = ~nan if mask is None else (mask & ~nan)
    assert_bytes_equal(a, b, what, mask=m)


# ---- vllm-qdq-plugin -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_plugin_mxfp4_qdq(name):
    dt = DT[name]
    x, up = t16(f"plugin_x_{name}", dt), t16(f"plugin_mxfp4_{name}", dt)
    same_or_both_nan(anchors.plugin_mxfp4_qdq(x), up, "anchors.plugin_mxfp4_qdq vs upstream")
    # the shim: documented differences where the block amax rounds past the dtype's largest value and
    # (fp16) where the reference's scale underflows
    amax = x.float().reshape(x.shape[0], -1, 32).abs().amax(-1)
    overflow = amax >= 1.75 * 2.0 ** (127 if dt == torch.bfloat16 else 15)
    underflow = anchors.plugin_mxfp4_scale(x) == 0
    documented = (overflow | underflow).repeat_interleave(32, dim=1)
    assert_bytes_equal(V.mxfp4_qdq(x), up, "mxfp4_qdq vs upstream", mask=~documented)
    assert int((~documented).sum()) > 0.75 * documented.numel()  # most of the input is compared


def _mxfp8_documented(x, g):
    xb = x.float().reshape(x.shape[0], -1, g)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    v = (xb / torch.exp2((torch.floor(torch.log2(amax)) - 8).clamp(-127, 127))).reshape(x.shape)
    return ((v.abs() >= 7.5 * 2.0**-9) & (v.abs() < 2.0**-6)) | ((v == 0) & torch.signbit(v))


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_plugin_mxfp8_qdq(name):
    dt = DT[name]
    x, up = t16(f"plugin_x_{name}", dt), t16(f"plugin_mxfp8_{name}", dt)
    same_or_both_nan(anchors.plugin_mxfp8_qdq(x), up, "anchors.plugin_mxfp8_qdq vs upstream")
    assert_bytes_equal(V.mxfp8_qdq(x), up, "mxfp8_qdq vs upstream", mask=~_mxfp8_documented(x, 32))


@pytest.mark.parametrize("name", ["bf16", "fp16"])
@pytest.mark.parametrize("gs", [16, 64])
def test_plugin_group_sizes(name, gs):
    dt = DT[name]
    x = t16(f"plugin_x_{name}", dt)[-256:]  # the LLM-like rows, K = 96 (padded for 64)
    up4, up8 = t16(f"plugin_mxfp4_{name}_g{gs}", dt), t16(f"plugin_mxfp8_{name}_g{gs}", dt)
    xp = torch.nn.functional.pad(x, (0, -x.shape[1] % gs))
    same_or_both_nan(anchors.plugin_mxfp4_qdq(x, gs), up4, f"anchors mxfp4 g{gs}")
    same_or_both_nan(anchors.plugin_mxfp8_qdq(x, gs), up8, f"anchors mxfp8 g{gs}")
    under = (anchors.plugin_mxfp4_scale(xp, gs) == 0).repeat_interleave(gs, dim=1)[:, :x.shape[1]]
    assert_bytes_equal(V.mxfp4_qdq(x, group_size=gs), up4, f"mxfp4_qdq g{gs}", mask=~under)
    doc8 = _mxfp8_documented(xp, gs)[:, :x.shape[1]]
    assert_bytes_equal(V.mxfp8_qdq(x, group_size=gs), up8, f"mxfp8_qdq g{gs}", mask=~doc8)


# ---- QuTLASS ---------------------------------------------------------------------------------------------------
def _nibbles(c):
    return torch.stack([c & 0xF, c >> 4], -1).reshape(c.shape[0], -1)


@pytest.mark.parametrize("method", ["quest", "abs_max"])
def test_qutlass_mx_reference(method):
    x = t16("qutlass_x", torch.bfloat16)
    rows, K = x.shape
    up_c, up_s = t8(f"qutlass_mx_{method}_id_codes"), t8(f"qutlass_mx_{method}_id_scales")
    up_m = t8(f"qutlass_mx_{method}_id_mask")
    codes, scales, mask = anchors.qutlass_mx_ref(x, method == "quest")
    assert_bytes_equal(codes, up_c, "anchors codes")
    assert_bytes_equal(scales, up_s, "anchors scales")
    assert_bytes_equal(anchors.pack_bits(mask), up_m, "anchors clip mask")
    # the Hadamard-rotated reference: anchors on the float64 rotation, as test_compat.py uses it
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 32:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    y64 = (x.double().unflatten(-1, (-1, 32)) @ (h * 32 ** -0.5).bfloat16().double()).flatten(-2)
    hc, hs, _ = anchors.qutlass_mx_ref(y64, method == "quest")
    assert_bytes_equal(hc, t8(f"qutlass_mx_{method}_had32_codes"), "anchors codes, had32")
    assert_bytes_equal(hs, t8(f"qutlass_mx_{method}_had32_scales"), "anchors scales, had32")
    # the shim: documented scale differences (all-zero blocks: 0 vs 100; quest blocks whose fp32 sum of
    # squared deviations overflows: 254); +0.0 elements: code 0x0 vs 0x8
    out = Q.fusedQuantizeMx(x, None, method=method)
    s = out[1].view(torch.uint8)[:rows, :K // 32]
    xb = x.double().reshape(rows, -1, 32)
    zero_block = (xb == 0).all(-1)
    dev2 = ((xb - xb.mean(-1, keepdim=True)) ** 2).sum(-1)
    overflow = (dev2 >= torch.finfo(torch.float32).max) if method == "quest" else torch.zeros_like(zero_block)
    assert_bytes_equal(s, up_s, "fusedQuantizeMx scales vs upstream", mask=~(zero_block | overflow))
    pos_zero = (x == 0) & ~torch.signbit(x.float())
    skip = (zero_block | overflow).repeat_interleave(32, 1) | pos_zero
    assert_bytes_equal(_nibbles(out[0]), _nibbles(up_c), "fusedQuantizeMx codes vs upstream", mask=~skip)


def test_qutlass_nv_reference():
    x = t16("qutlass_x", torch.bfloat16)
    rows, K = x.shape
    up_c, up_s = t8("qutlass_nv_id_codes"), t8("qutlass_nv_id_scales")
    codes, scales = anchors.qutlass_nv_ref(x)
    assert_bytes_equal(codes, up_c, "anchors NV codes")
    assert_bytes_equal(scales, up_s, "anchors NV scales")
    # the shim at global scale 6: the same scales; codes except near an E2M1 midpoint (mxq multiplies by
    # RN(S / s), the reference divides), zero-scale blocks and +0.0 elements
    c, s = Q.fusedQuantizeNv(x, None, 6.0)
    s = s.view(torch.uint8)[:rows, :K // 16]
    assert_bytes_equal(s, up_s, "fusedQuantizeNv scales vs upstream")
    sv = s.view(torch.float8_e4m3fn).double().repeat_interleave(16, 1)
    v = (x.double() / sv * 6.0).abs()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    near = ((v[..., None] - mids).abs() <= mids * 2.0**-21).any(-1) & (sv > 0)
    skip = near | (sv == 0) | ((x == 0) & ~torch.signbit(x.float()))
    assert_bytes_equal(_nibbles(c), _nibbles(up_c), "fusedQuantizeNv codes vs upstream", mask=~skip)
