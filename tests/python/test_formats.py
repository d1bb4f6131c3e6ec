"""The Python package's format facts (python/mxq/_formats.py, which the fake implementations use)
against what the C++ kernels do: group sizes and code widths through the shapes quantize writes, the
largest element through saturation, the scale kind through the scale bytes; the rules each format
accepts through the ops' refusals."""
from __future__ import annotations

import math

import pytest
import torch

import mxq
from mxq import _formats as F


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_format_facts_match_the_kernels(fmt):
    info = F.format_info(fmt)
    g, K = info.default_group, 64
    if fmt == "nvfp4_e5m3":  # UE5M3 byte of amax / 6: 1 / 6 -> 1.375 * 2^-3 (0x63); 6 comes back exactly
        q = mxq.quantize(torch.ones(3, K), fmt, layout="linear")
        assert q.codes.shape == (3, K // 2) and q.scales.shape == (3, K // g)
        assert q.scales.unique().tolist() == [0x63]
        x = torch.zeros(1, g)
        x[0, 0] = info.max_elem
        assert mxq.qdq(x, fmt)[0, 0].item() == info.max_elem
        return
    if info.e8m0_scale:
        q = mxq.quantize(torch.ones(3, K), fmt, rule="floor", layout="linear")
    else:
        q = mxq.quantize(torch.ones(3, K), fmt, layout="linear", tensor_scale=448.0)
    assert q.codes.shape == (3, K // 2 if info.bits == 4 else K), "code width"
    assert q.scales.shape == (3, K // g), "default group size"
    # The scale kind: MX, an E8M0 byte: amax 1 under floor is 2^(0 - emax), emax = floor(log2(max));
    # NVFP4, an E4M3 byte: E4M3(1 * 448 / 6 = 74.67) = 72, code 0b1101_001.
    expect = 127 - int(math.floor(math.log2(info.max_elem))) if info.e8m0_scale else 0b1101001
    assert q.scales.view(torch.uint8).unique().tolist() == [expect], "scale byte"
    # The largest element: a block whose amax is max_elem keeps it exactly (MX floor rule: scale 1;
    # NVFP4 with the encode scale that maps amax to 6 * 448).
    x = torch.zeros(1, g)
    x[0, 0] = info.max_elem
    if info.e8m0_scale:
        y = mxq.qdq(x, fmt, rule="floor")
        assert y[0, 0].item() == info.max_elem
        # and twice as much saturates one binade up: the scale doubles, the element stays the largest
        y2 = mxq.qdq(2 * x, fmt, rule="floor")
        assert y2[0, 0].item() == 2 * info.max_elem
    else:
        y = mxq.qdq(x, fmt, tensor_scale=448.0)  # amax 6: block scale 448 * 6 / 6 = 448, element 6
        assert y[0, 0].item() == info.max_elem


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_rules_for_match_the_kernels(fmt):
    """mxq.rules_for(fmt) lists what the kernels accept; the others are refused by the op (eagerly, with
    the library's message: F.rule_refusal's, word for word) and by its fake (tracing) alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(4, 64)
    ts = 448.0 if fmt == "nvfp4" else None
    for rule in F.RULES:
        kw = dict(tensor_scale=None if rule == "quest" else ts)  # nvfp4 under quest: tensor scale 1
        if rule in mxq.rules_for(fmt):
            assert F.rule_refusal(fmt, rule) == ""
            mxq.qdq(x, fmt, rule=rule, **kw)
            mxq.quantize(x, fmt, rule=rule, **kw)
            continue
        why = F.rule_refusal(fmt, rule)
        assert why.startswith(f"rule '{rule}' is not defined for format '{fmt}' (") and why.endswith(
            f"); {fmt} accepts {', '.join(mxq.rules_for(fmt))}"), why
        for op in ("qdq", "quantize"):
            want = f"mxq::{op}: option 'rule': {why}"
            with pytest.raises(ValueError) as eager:
                getattr(mxq, op)(x, fmt, rule=rule, **kw)
            assert str(eager.value) == want
            with FakeTensorMode():
                with pytest.raises(ValueError) as traced:
                    getattr(mxq, op)(torch.randn(4, 64), fmt, rule=rule, **kw)
            assert str(traced.value) == want
    assert mxq.rules_for("mxfp8") == mxq.rules_for("mxfp8_e4m3") == ("floor", "ceil", "even", "rceil", "even_fp4")
