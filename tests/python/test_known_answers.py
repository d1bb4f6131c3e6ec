"""The stored known answers (tests/known_answers/known_answers.json, computed without mxq by
tests/known_answers/gen_known_answers.py) through the Python package: stochastic rounding's bytes for
a fixed seed, offset and random-bit width through quantize, qdq, qdq_ and dequantize; the swizzled
layout through swizzle_scales / unswizzle_scales and quantize(layout="swizzled"); NVFP4's computed
tensor scale. On the fast CPU path, the reference backend (MXQ_BACKEND=reference) and CUDA."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mxq
from conftest import BACKENDS, CUDA, assert_bytes_equal

KA = json.loads((Path(__file__).resolve().parents[1] / "known_answers" / "known_answers.json").read_text())


def f32(bits, shape, device="cpu"):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(shape).to(device)


def u8(vals, shape):
    return torch.tensor(vals, dtype=torch.uint8).reshape(shape)


SR = KA["stochastic_rounding"]


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", SR, ids=lambda c: f"{c['format']}-r{c['random_bits']}")
def test_stochastic_rounding_bytes(case, device):
    rows, k = case["rows"], case["cols"]
    x = f32(case["x"], (rows, k), device)
    kw = dict(stochastic=True, seed=case["seed"], offset=case["offset"], random_bits=case["random_bits"])
    q = mxq.quantize(x, case["format"], **kw)
    assert_bytes_equal(q.codes.cpu(), u8(case["codes"], q.codes.shape), "codes")
    assert_bytes_equal(q.scales.cpu(), u8(case["scales"], (rows, -1)), "scales")
    want = f32(case["qdq"], (rows, k))
    if case["format"] == "nvfp4":
        assert_bytes_equal(q.tensor_scale.cpu(), f32([case["tensor_scale"]], (1,)), "tensor scale")
    assert_bytes_equal(q.dequantize().cpu(), want, "dequantize(quantize)")
    assert_bytes_equal(mxq.qdq(x, case["format"], **kw).cpu(), want, "qdq")
    y = x.clone()
    mxq.qdq_(y, case["format"], **kw)
    assert_bytes_equal(y.cpu(), want, "qdq_")
    # the raw-codes dequantize, NVFP4 with the stored tensor scale as a float
    ts = f32([case["tensor_scale"]], (1,)).item() if case["format"] == "nvfp4" else None
    raw = mxq.dequantize(q.codes, q.scales, format=case["format"], cols=k, tensor_scale=ts)
    assert_bytes_equal(raw.cpu(), want, "dequantize(codes, scales)")


SW = KA["swizzle"]


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
def test_swizzle_layout_bytes(device):
    lin = u8(SW["linear"], (SW["rows"], SW["cols"])).to(device)
    sw = mxq.swizzle_scales(lin)
    assert_bytes_equal(sw.cpu(), u8(SW["swizzled"], (SW["padded_rows"], SW["padded_cols"])), "swizzle")
    assert_bytes_equal(mxq.unswizzle_scales(sw, SW["rows"], SW["cols"]).cpu(), lin.cpu(), "unswizzle")


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
def test_quantize_writes_the_swizzled_layout(fmt, device):
    g = 16 if fmt == "nvfp4" else 32
    x = torch.randn(SW["rows"], SW["cols"] * g, generator=torch.Generator().manual_seed(5)).to(device)
    ts = 1000.0 if fmt == "nvfp4" else None
    lin = mxq.quantize(x, fmt, tensor_scale=ts).scales.cpu().reshape(-1)
    sw = mxq.quantize(x, fmt, tensor_scale=ts, layout="swizzled").scales.cpu()
    off = torch.tensor(SW["offsets"]).reshape(SW["padded_rows"], SW["padded_cols"])[:SW["rows"], :SW["cols"]]
    want = torch.zeros(SW["padded_rows"] * SW["padded_cols"], dtype=torch.uint8)
    want[off.reshape(-1)] = lin
    assert_bytes_equal(sw, want.reshape(sw.shape), "swizzled scales")


TS = KA["tensor_scale"]


@pytest.mark.parametrize("device", BACKENDS, indirect=True)
def test_nvfp4_computed_tensor_scale_sweep(device):
    amax = f32(TS["amax"], (-1,))
    want = f32(TS["scale"], (-1,))
    keep = torch.isfinite(amax) & (amax != 0)
    amax, want = amax[keep][:600], want[keep][:600]
    x = amax.abs()[:, None] * (torch.arange(1, 17, dtype=torch.float32) / 16)[None, :]  # row amax = |amax|
    got = torch.stack([mxq.quantize(x[i:i + 1].to(device), "nvfp4").tensor_scale.cpu()[0] for i in range(len(x))])
    assert_bytes_equal(got, want, "computed tensor scale")


def test_the_stored_files_are_what_the_generator_writes():
    gen = Path(__file__).resolve().parents[1] / "known_answers" / "gen_known_answers.py"
    r = subprocess.run([sys.executable, str(gen), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
