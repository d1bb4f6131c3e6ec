"""mxq.compat against independent transcriptions of the originals' references (anchors.py): equal
bytes everywhere except the documented differences (docs/python.md, "Compatibility shims"), which
are asserted to occur in the test data and to differ exactly the documented way."""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

import mxq
from mxq.compat import qutlass as Q
from mxq.compat import vllm_qdq as V

import anchors
import oracle
from conftest import assert_bytes_equal, needs_cuda


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _plugin_data(dtype):
    """Every finite bit pattern of the dtype, shuffled into blocks, plus LLM-like rows, plus zeros."""
    g = torch.Generator().manual_seed(0)
    allp = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    allp = allp[torch.isfinite(allp)]
    allp = allp[torch.randperm(len(allp), generator=g)]
    n = len(allp) // 96 * 96
    x = torch.randn(256, 96, generator=g) * torch.exp(torch.randn(256, 1, generator=g) * 3)
    x[:3] = 0
    x[3, 5:9] = -0.0
    return torch.cat([allp[:n].reshape(-1, 96), x.clamp(-6e4, 6e4).to(dtype)])


# ---- vllm-qdq-plugin ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_vllm_mxfp4_qdq(dtype):
    x = _plugin_data(dtype)
    got, ref = V.mxfp4_qdq(x), anchors.plugin_mxfp4_qdq(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    # Documented: (a) blocks whose amax rounds (at E2M1's mantissa) past the dtype's largest finite
    # value; (b) fp16 blocks whose reference scale underflows fp16 (amax < 2^-22, all-zero included).
    amax = x.float().reshape(x.shape[0], -1, 32).abs().amax(-1)
    overflow = amax >= 1.75 * 2.0 ** (127 if dtype == torch.bfloat16 else 15)
    underflow = anchors.plugin_mxfp4_scale(x) == 0
    documented = (overflow | underflow).repeat_interleave(32, dim=1)
    assert_bytes_equal(got, ref, "mxfp4_qdq vs the plugin's reference", mask=~documented)
    assert int(overflow.sum()) > 0 and (dtype == torch.bfloat16 or int(underflow.sum()) > 0)
    # There mxq computes the exact definition (even rule, saturating) and the reference does not.
    assert_bytes_equal(got, oracle.mx_qdq(x, "mxfp4", "even"), "mxfp4_qdq = exact QDQ", mask=documented)
    differ = (_bits(got) != _bits(ref)) & documented
    assert int(differ.sum()) > 0
    assert bool(torch.isfinite(got).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_vllm_mxfp8_qdq(dtype):
    x = _plugin_data(dtype)
    got, ref = V.mxfp8_qdq(x), anchors.plugin_mxfp8_qdq(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2((torch.floor(torch.log2(amax)) - 8).clamp(-127, 127))
    v = (xb / scale).reshape(x.shape)
    # Documented: (c) |v| in [7.5, 8) * 2^-9 rounds to 2^-6 (true RNE; the reference: 7 * 2^-9);
    # (d) where v is a zero of negative sign (x = -0.0, or a negative x whose x/scale underflows
    # fp32) the reference returns +0 (it multiplies by sign(v) = 0), mxq -0.
    c = (v.abs() >= 7.5 * 2.0**-9) & (v.abs() < 2.0**-6)
    d = (v == 0) & torch.signbit(v)
    assert_bytes_equal(got, ref, "mxfp8_qdq vs the plugin's reference", mask=~(c | d))
    assert int(c.sum()) > 0 and int(d.sum()) > 0
    sc = scale.repeat_interleave(32, dim=-1).reshape(x.shape)
    assert_bytes_equal(got[c], (torch.sign(v[c]) * 2.0**-6 * sc[c]).to(dtype), "(c): 2^-6 * scale")
    assert_bytes_equal(ref[c], (torch.sign(v[c]) * 7 * 2.0**-9 * sc[c]).to(dtype), "(c): the reference")
    assert bool(torch.signbit(got[d]).all()) and not bool(torch.signbit(ref[d]).any()), "(d): signs"


def test_vllm_signature_and_checks(monkeypatch):
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    for f in (V.mxfp4_qdq, V.mxfp8_qdq):
        with pytest.raises(AssertionError, match="only supports 2D tensors"):
            f(x.reshape(2, 4, 64))
        with pytest.raises(AssertionError, match="only supports fp16/bf16"):
            f(x.float())
        out = f(x, 32, trace_op_name="marlin_gemm")
        monkeypatch.setenv("VLLM_QDQ_CUTE", "1")
        assert V.cute_requested()
        assert_bytes_equal(f(x), out, "VLLM_QDQ_CUTE=1 gives the same bytes")
        assert_bytes_equal(f(x[:, :40]), f(x[:, :40].contiguous()), "non-contiguous, K % 32 != 0")
        monkeypatch.setenv("VLLM_QDQ_CUTE", "no")
        assert not V.cute_requested()
    assert_bytes_equal(V.mxfp4_qdq(x, 16), mxq.qdq(x, "mxfp4", rule="even", group_size=16), "group_size")


# ---- QuTLASS --------------------------------------------------------------------------------------
def _qutlass_data():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 512, generator=g) * 25.0)
    x[:2] = 0.0                    # all-zero blocks
    x[2:6, :40] = 0.0              # +0.0 elements inside non-zero blocks
    x[6:8, 3:9] = -0.0
    x[8:12] *= 1e-7                # tiny blocks
    allp = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    allp = allp[torch.isfinite(allp) & (allp.abs() < 1e30) & (allp.abs() > 1e-30)]
    allp = allp[torch.randperm(len(allp), generator=g)][: len(allp) // 512 * 512].reshape(-1, 512)
    return torch.cat([x.bfloat16(), allp])


def _every_pattern_alone(dtype, g):
    """Every bit pattern of a 16-bit dtype alone in a block (the rest +0), one block per row."""
    x = torch.zeros(65536, g, dtype=dtype)
    x[:, 0] = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return x


def _every_pattern_beside_maxima(dtype, g):
    """Every bit pattern beside block maxima from 2^-20 to 1.7 * 2^20 (65504 in fp16), 63 of them spaced in log2."""
    top = 65504.0 if dtype == torch.float16 else 1.7 * 2.0 ** 20
    amax = torch.exp2(torch.linspace(-20.0, math.log2(top), 63, dtype=torch.float64))
    pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    rows = []
    for j in range(8):  # 8 blocks per pattern, maxima cycling
        blk = (torch.arange(g, dtype=torch.float64) * 0.37 % 1.0 - 0.5).repeat(65536, 1)
        a = amax[(torch.arange(65536) * 8 + j) % 63].unsqueeze(1)
        blk = blk * a
        blk[:, (j + 5) % g] = a.squeeze(1)
        b = blk.to(dtype)
        b[:, j % g] = pats
        rows.append(b)
    return torch.cat(rows, dim=1)


def _same_or_both_nan(got, want):
    both_nan = torch.isnan(got) & torch.isnan(want)
    same = (_bits(got) == _bits(want)) | both_nan
    return int((~same).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("g", [16, 32])
def test_vllm_nvfp4_e5m3_qdq_equals_the_reference_on_every_pattern(dtype, g):
    for x in (_every_pattern_alone(dtype, g), _every_pattern_beside_maxima(dtype, g)):
        want = anchors.plugin_nvfp4_e5m3_qdq(x, g)
        for f in (V.nvfp4_e5m3_qdq, V._nvfp4_e5m3_qdq_reference, V.nvfp4_e5m3_qdq_cute):
            got = f(x, g)
            assert got.dtype == dtype and got.shape == x.shape
            assert _same_or_both_nan(got, want) == 0, f.__name__
        # NaN comes back as NaN, never as a finite value; fp16 overflows to Inf as the reference's cast does
        y = V.nvfp4_e5m3_qdq(x, g)
        assert torch.equal(torch.isnan(y), torch.isnan(x))
    if dtype == torch.float16:
        assert torch.isinf(V.nvfp4_e5m3_qdq(torch.tensor([[65504.0] + [0.0] * 15], dtype=dtype))).any()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("g", [16, 32])
def test_vllm_nvfp4_e5m3_qdq_cuda_equals_cpu(dtype, g):
    x = _every_pattern_beside_maxima(dtype, g)
    assert_bytes_equal(V.nvfp4_e5m3_qdq(x.cuda(), g).cpu(), V.nvfp4_e5m3_qdq(x, g), "nvfp4_e5m3 cuda vs cpu")


def test_vllm_nvfp4_e5m3_tails_and_strides():
    g = torch.Generator().manual_seed(3)
    for k in (1, 15, 17, 100):
        x = (torch.randn(5, k, generator=g) * 3).to(torch.bfloat16)
        assert torch.equal(V.nvfp4_e5m3_qdq(x), anchors.plugin_nvfp4_e5m3_qdq(x, 16))
    x = (torch.randn(64, 96, generator=g)).to(torch.float16)[:, ::2]  # non-contiguous
    assert torch.equal(V.nvfp4_e5m3_qdq(x, 32), anchors.plugin_nvfp4_e5m3_qdq(x, 32))


def test_vllm_nvfp4_e5m3_weight_dequant_and_decode():
    for g in (16, 32):
        x = (torch.randn(7, 4 * g) * 5).to(torch.bfloat16)
        q = mxq.quantize(x, "nvfp4_e5m3", group_size=g)
        w = V.nvfp4_e5m3_weight_dequant_cute(q.codes, q.scales, g)
        assert w.dtype == torch.bfloat16 and w.shape == x.shape
        assert torch.equal(w, V.nvfp4_e5m3_qdq(x, g))  # no NaN in x: dequantize(quantize) is the QDQ
        # by hand: code * decode_ue5m3(scale), element 2i in the low nibble
        lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
        codes = torch.stack([q.codes & 0xF, q.codes >> 4], dim=-1).reshape(7, -1).long()
        manual = lut[codes] * V.decode_ue5m3(q.scales).repeat_interleave(g, dim=1)
        assert torch.equal(w, manual.to(torch.bfloat16))
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    d = V.decode_ue5m3(every)
    assert d.dtype == torch.float32
    assert d[0] == 0 and d[1] == 2.0 ** -17 and d[8] == 2.0 ** -14 and d[0x78] == 1.0 and d[0xFE] == 114688 and d[0xFF] == 122880
    assert bool((d[1:] > d[:-1]).all())
    with pytest.raises(TypeError):
        V.decode_ue5m3(every.to(torch.int32))
    ok = torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16 or 32"):
        V.nvfp4_e5m3_weight_dequant_cute(*ok, 8)
    with pytest.raises(ValueError, match="incompatible"):
        V.nvfp4_e5m3_weight_dequant_cute(ok[0], torch.zeros(2, 2, dtype=torch.uint8), 16)
    with pytest.raises(TypeError):
        V.nvfp4_e5m3_weight_dequant_cute(ok[0].float(), ok[1], 16)


@needs_cuda
def test_vllm_nvfp4_e5m3_weight_dequant_cuda_equals_cpu():
    for g in (16, 32):
        x = (torch.randn(7, 4 * g) * 5).to(torch.bfloat16)
        q = mxq.quantize(x, "nvfp4_e5m3", group_size=g)
        w = V.nvfp4_e5m3_weight_dequant_cute(q.codes, q.scales, g)
        assert torch.equal(V.nvfp4_e5m3_weight_dequant_cute(q.codes.cuda(), q.scales.cuda(), g).cpu(), w)


def test_vllm_nvfp4_e5m3_checks():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2D"):
        V.nvfp4_e5m3_qdq(x.reshape(1, 2, 32))
    with pytest.raises(TypeError, match="BF16/FP16"):
        V.nvfp4_e5m3_qdq(x.float())
    with pytest.raises(ValueError, match="group_size 16 or 32"):
        V.nvfp4_e5m3_qdq(x, 64)
    # the library's own refusals through the generic ops, and the fakes agree
    with pytest.raises(ValueError, match="option 'group_size'"):
        mxq.qdq(x, "nvfp4_e5m3", group_size=8)
    with pytest.raises(ValueError, match="option 'rounding'"):
        mxq.qdq(x, "nvfp4_e5m3", stochastic=True)
    with pytest.raises(ValueError, match="rule 'floor' is not defined for format 'nvfp4_e5m3'"):
        mxq.qdq(x, "nvfp4_e5m3", rule="floor")
    assert mxq.rules_for("nvfp4_e5m3") == ("nvfp4_e5m3",)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        xf = torch.empty(2, 32, dtype=torch.bfloat16)
        assert mxq.qdq(xf, "nvfp4_e5m3").shape == (2, 32)
        with pytest.raises(ValueError, match="option 'group_size'"):
            mxq.qdq(xf, "nvfp4_e5m3", group_size=8)
        with pytest.raises(ValueError, match="option 'rounding'"):
            mxq.qdq(xf, "nvfp4_e5m3", stochastic=True)


@pytest.mark.parametrize("method", ["quest", "abs_max"])
def test_qutlass_fusedQuantizeMx(method):
    x = _qutlass_data()
    rows, K = x.shape
    out = Q.fusedQuantizeMx(x, None, method=method, return_mask=method == "quest")
    codes, scales = out[0], out[1]
    assert codes.dtype == torch.uint8 and codes.shape == (rows, K // 2)
    assert scales.dtype == torch.float8_e8m0fnu
    assert scales.shape == ((rows + 127) // 128 * 128, (K // 32 + 3) // 4 * 4)
    s = scales.view(torch.uint8)
    assert int(s[rows:].count_nonzero()) == 0, "padding rows are zero"
    s = s[:rows, : K // 32]
    ref_codes, ref_scales, ref_mask = anchors.qutlass_mx_ref(x, method == "quest")
    xb = x.double().reshape(rows, -1, 32)
    zero_block = (xb == 0).all(-1)
    # Documented scale differences: all-zero blocks get byte 0x00 (QuTLASS: 2^-27, byte 100); quest
    # blocks whose fp32 sum of squared deviations overflows get mxq's largest scale 2^127 (byte 254).
    dev2 = ((xb - xb.mean(-1, keepdim=True)) ** 2).sum(-1)
    overflow = (dev2 >= torch.finfo(torch.float32).max) if method == "quest" else torch.zeros_like(zero_block)
    assert_bytes_equal(s, ref_scales, "scales", mask=~(zero_block | overflow))
    assert bool((s[zero_block] == 0).all()) and bool((ref_scales[zero_block] == 100).all())
    if method == "quest":
        assert int(overflow.sum()) > 0 and bool((s[overflow] == 254).all())
    # Codes, from mxq's scales through the reference's element arithmetic: equal except +0.0 elements,
    # which the reference gives the negative-zero code 0x8 (mxq keeps the sign: 0x0).
    codes_ref_s, _, mask_ref_s = anchors.qutlass_mx_ref(x, method == "quest", scale_bytes=s)
    pos_zero = ((x == 0) & ~torch.signbit(x.float())).reshape(rows, -1, 2)
    nib = torch.stack([codes & 0xF, codes >> 4], -1).reshape(rows, -1, 2)
    nib_ref = torch.stack([codes_ref_s & 0xF, codes_ref_s >> 4], -1).reshape(rows, -1, 2)
    assert_bytes_equal(nib, nib_ref, "codes (with mxq's scales)", mask=~pos_zero)
    assert bool((nib[pos_zero] == 0).all()) and bool((nib_ref[pos_zero] == 8).all()) and int(pos_zero.sum()) > 0
    assert_bytes_equal(codes, ref_codes, "codes (reference scales)",
                       mask=~(zero_block | overflow).repeat_interleave(16, 1) & ~pos_zero.any(-1))
    if method == "quest":
        assert_bytes_equal(out[2], anchors.pack_bits(mask_ref_s), "clip mask")


def test_qutlass_fusedQuantizeNv():
    x = _qutlass_data()
    rows, K = x.shape
    codes, scales = Q.fusedQuantizeNv(x, None, torch.tensor([6.0]))
    assert codes.shape == (rows, K // 2) and scales.dtype == torch.float8_e4m3fn
    assert scales.shape == ((rows + 127) // 128 * 128, (K // 16 + 3) // 4 * 4)
    s = scales.view(torch.uint8)[:rows, : K // 16]
    ref_codes, ref_scales = anchors.qutlass_nv_ref(x)
    # Scales: identical (the reference's + 1e-8 vanishes in its float32 conversion at these magnitudes
    # and both round to nearest even).
    assert_bytes_equal(s, ref_scales, "NV scales")
    # Codes: mxq multiplies by m = RN32(S / s) (TransformerEngine's order) where the reference divides
    # exactly: a code may differ only where x * 6 / s lies within 2^-21 (relative) of an E2M1 midpoint;
    # blocks whose E4M3 scale is 0 (all-zero or tiny amax): the reference divides by it (0/0, x/0)
    # and writes codes of magnitude 6 (0x7, 0xF), mxq writes zeros (0x0, 0x8: the sign kept);
    # +0.0 elements elsewhere: the reference 0x8, mxq 0x0.
    sv = s.view(torch.float8_e4m3fn).double().repeat_interleave(16, 1)
    v = (x.double() / sv * 6.0).abs()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    near = ((v[..., None] - mids).abs() <= mids * 2.0**-21).any(-1) & (sv > 0)
    zero_block = sv == 0
    pos_zero = (x == 0) & ~torch.signbit(x.float()) & ~zero_block
    nib = torch.stack([codes & 0xF, codes >> 4], -1).reshape(rows, K)
    nib_ref = torch.stack([ref_codes & 0xF, ref_codes >> 4], -1).reshape(rows, K)
    assert_bytes_equal(nib, nib_ref, "NV codes", mask=~(near | zero_block | pos_zero))
    assert int(zero_block.sum()) > 0
    assert bool(((nib[zero_block] & 7) == 0).all()) and bool(((nib_ref[zero_block] & 7) == 7).all())
    assert bool((nib[pos_zero] == 0).all()) and bool((nib_ref[pos_zero] == 8).all())
    # Another global scale: the codes are mxq's NVFP4 with that tensor scale.
    gs = 448.0 * 6.0 / float(x.float().abs().max())
    c2, s2 = Q.fusedQuantizeNv(x, None, gs)
    q = mxq.quantize(x, "nvfp4", tensor_scale=gs, layout="padded")
    assert_bytes_equal(c2, q.codes, "NV codes, global scale 448*6/amax")
    assert_bytes_equal(s2.view(torch.uint8), q.scales, "NV scales, global scale 448*6/amax")


def test_qutlass_to_blocked_and_rotation():
    lin = torch.randint(0, 255, (256, 8), dtype=torch.uint8)
    blk = Q.to_blocked(lin.view(torch.float8_e8m0fnu))
    assert blk.dtype == torch.float8_e8m0fnu and blk.shape == (256 * 8,)
    # QuTLASS's torch path: view (nRB, 128, nCB, 4) -> permute(0, 2, 1, 3) -> (-1, 4, 32, 4) -> transpose(1, 2).
    expect = lin.view(2, 128, 2, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)
    assert_bytes_equal(blk.view(torch.uint8), expect, "to_blocked")
    with pytest.raises(AssertionError, match="padded"):
        Q.to_blocked(lin[:100])
    assert Q.to_blocked(lin[:100], use_triton_kernel=True).shape == (128 * 8,)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    base = Q.fusedQuantizeMx(x, None)
    eye = torch.eye(32, dtype=torch.bfloat16)
    for a, b in zip(Q.fusedQuantizeMx(x, eye), base):
        assert_bytes_equal(a, b, "identity rotation == None")
    with pytest.raises(ValueError, match="square RS x RS"):
        Q.fusedQuantizeMx(x, torch.eye(24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rotation size 64"):
        Q.fusedQuantizeMx(x[:, :32], torch.eye(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="floating-point"):
        Q.fusedQuantizeMx(x, torch.eye(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        Q.fusedQuantizeMx(x.double(), torch.eye(32, dtype=torch.bfloat16))
    xg = x.float().requires_grad_()
    for a_, b_ in zip(Q.fusedQuantizeMx(xg, torch.eye(32)), base):  # a tensor that requires grad: no error
        assert_bytes_equal(a_, b_, "requires_grad input")
    with pytest.raises(ValueError, match="invalid method"):
        Q.fusedQuantizeMx(x, None, method="rtn")
    with pytest.raises(ValueError, match="return_mask"):
        Q.fusedQuantizeMx(x, None, method="abs_max", return_mask=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.fusedQuantizeMx(x[:, :48], None)
    with pytest.raises(ValueError, match="invalid method"):
        Q.fusedQuantizeNv(x, None, torch.tensor([6.0]), method="rtn")


def _f32(v: float) -> float:
    """v rounded to fp32 (RN), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _fma32(a: float, b: float, c: float) -> float:
    """fp32 fma: a*b + c exactly (fractions), rounded once to fp32 (ties to even)."""
    v = Fraction(a) * Fraction(b) + Fraction(c)
    r = _f32(float(v))  # within an ulp; settle RN among it and its fp32 neighbours
    bits = struct.unpack("<I", struct.pack("<f", r))[0]
    cands = [r] + [struct.unpack("<f", struct.pack("<I", n))[0] for n in (bits - 1, bits + 1) if 0 <= n < 2**32]
    cands = [t for t in cands if math.isfinite(t)]
    return min(cands, key=lambda t: (abs(Fraction(t) - v), struct.unpack("<I", struct.pack("<f", t))[0] & 1))


def _qutlass_nv_quest_kernel_scales(y: torch.Tensor) -> list:
    """QuTLASS's fusedQuantizeNv(method="quest") scale bytes as its kernel computes them (IEEE: without
    its flush-to-zero, approximate sqrt and reciprocal): per 16, s1 = running fp32 sum in index order,
    s2 = fp32 fma chain of y_i^2, mean = s1 * 0.0625, var = fma(s2, 0.0625, -RN(mean^2)) (no guard:
    var < 0 gives NaN, byte 0x7F), scale = fp32(sqrt(var) * (2.92247856/6) + 1e-8) in float64 (the
    kernel fuses that into one f64 fma), E4M3 RN satfinite. Returns ints (-1 where the scale is NaN)."""
    out = []
    for blk in y.float().reshape(-1, 16).tolist():
        s1, s2 = 0.0, 0.0
        for v in blk:
            s1 = _f32(s1 + v)
            s2 = _fma32(v, v, s2)
        mean = _f32(s1 * 0.0625)
        var = _fma32(s2, 0.0625, -_f32(mean * mean))
        if var < 0:
            out.append(-1)
            continue
        scale = min(_f32(_f32(math.sqrt(var)) * (2.92247856 / 6.0) + 1e-8), 448.0)  # satfinite (torch: NaN past 464)
        out.append(int(torch.tensor([scale]).to(torch.float8_e4m3fn).view(torch.uint8)))
    return out


def test_fused_quantize_nv_quest_against_qutlass_kernel_arithmetic() -> None:
    """fusedQuantizeNv(method="quest") == mxq's nvfp4 rule quest, and against a transcription of QuTLASS's
    kernel arithmetic: scale bytes equal except where QuTLASS's one-pass variance goes negative (its NaN
    scale) or the two statistics fall on either side of an E4M3 rounding boundary (counted, and each
    checked to be within 1e-5 relative of one); elements under equal scales equal E2M1(y * RN(1/s))."""
    torch.manual_seed(5)
    x = (torch.randn(48, 256) * torch.where(torch.rand(48, 256) < 0.02, 30.0, 1.0)).to(torch.bfloat16)
    x[3, 16:32] = 0.0  # a zero block: scale byte 0, codes 0
    codes, scales = Q.fusedQuantizeNv(x, None, torch.tensor([123.0]), method="quest")  # global scale ignored
    q = mxq.quantize(x, "nvfp4", rule="quest", layout="padded")
    assert_bytes_equal(codes, q.codes, "codes == mxq nvfp4 quest")
    assert_bytes_equal(scales.view(torch.uint8), q.scales, "scales == mxq nvfp4 quest")
    assert float(q.tensor_scale) == 1.0
    got = scales.view(torch.uint8)[:48, :16].reshape(-1).tolist()
    want = _qutlass_nv_quest_kernel_scales(x)
    nan_blocks = sum(w == -1 for w in want)
    differ = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if w != -1 and g != w]
    xb = x.double().reshape(-1, 16)
    for i, g, w in differ:  # each difference: t within 1e-5 of the E4M3 midpoint between g and w
        t = xb[i].std(correction=0).item() * 2.92247856 / 6 + 1e-8
        lo, hi = sorted(torch.tensor([g, w], dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist())
        assert abs(t - (lo + hi) / 2) <= 1e-5 * t, (i, g, w, t)
    print(f"nvfp4 quest vs QuTLASS kernel arithmetic: {len(differ)} of {len(got)} scale bytes differ "
          f"(E4M3 boundary cases), {nan_blocks} QuTLASS NaN blocks")
    assert len(differ) <= len(got) // 100
    assert got[3 * 16 + 1] == 0 and not codes[3, 8:16].any()
    # dequantize: code * s, the tensor scale 1
    y = mxq.dequantize(q, dtype=torch.float32)
    assert torch.isfinite(y).all()
    # the CUDA kernels: the same bytes (a rotation too)
    if torch.cuda.is_available():
        for a, b_ in zip(Q.fusedQuantizeNv(x.cuda(), None, torch.tensor([1.0]), method="quest"), (codes, scales)):
            assert_bytes_equal(a.cpu().view(torch.uint8), b_.view(torch.uint8), "nvfp4 quest CUDA == CPU")
        h = torch.eye(32, dtype=torch.bfloat16)[torch.randperm(32)]
        for a, b_ in zip(Q.fusedQuantizeNv(x.cuda(), h.cuda(), 1.0, method="quest"), Q.fusedQuantizeNv(x, h, 1.0, method="quest")):
            assert_bytes_equal(a.cpu().view(torch.uint8), b_.view(torch.uint8), "nvfp4 quest CUDA == CPU, rotated")
        q_cuda = mxq.quantize(x.cuda(), "nvfp4", rule="quest", rotation="had32")
        q_cpu = mxq.quantize(x, "nvfp4", rule="quest", rotation="had32")
        assert_bytes_equal(q_cuda.codes.cpu(), q_cpu.codes, "nvfp4 quest had32 codes")
        assert_bytes_equal(q_cuda.scales.cpu(), q_cpu.scales, "nvfp4 quest had32 scales")
        assert torch.equal(mxq.qdq(x.cuda(), "nvfp4", rule="quest").cpu(), mxq.qdq(x, "nvfp4", rule="quest"))


_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


def _nv_documented(x: torch.Tensor, s_bytes: torch.Tensor, gs: float):
    """Element masks [rows, K] of the documented differences between mxq and QuTLASS's kernel arithmetic
    at global scale gs, given the scale bytes s both use: (zero_block) E4M3 scale 0: QuTLASS divides
    by it (codes of magnitude 6), mxq writes zeros; (near) |x| * gs / s within 2^-21 (relative) of an
    E2M1 midpoint: mxq's m = RN32(S / s) and QuTLASS's RN32(1 / RN32(s / gs)) may round either way."""
    sv = s_bytes.view(torch.float8_e4m3fn).double().repeat_interleave(16, 1)
    v = (x.double() * gs / sv).abs()
    near = ((v[..., None] - _E2M1_MIDS).abs() <= _E2M1_MIDS * 2.0**-21).any(-1) & (sv > 0)
    return sv == 0, near


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    return torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)


@pytest.mark.parametrize("gs", anchors.NV_GLOBAL_SCALES, ids=lambda g: f"gs={g:g}")
def test_qutlass_fusedQuantizeNv_global_scales(gs):
    """QuTLASS's convention for global_scale (the NVFP4 encode scale: block scale E4M3(gs * amax / 6),
    dequantized as code * s / gs) at awkward values, against a transcription of its kernel arithmetic
    (anchors.qutlass_nv_ref_gs): equal bytes except the documented differences."""
    x = _qutlass_data()
    rows, K = x.shape
    codes, scales = Q.fusedQuantizeNv(x, None, gs)
    codes_t, scales_t = Q.fusedQuantizeNv(x, None, torch.tensor([gs]))
    assert_bytes_equal(codes_t, codes, "global_scale as a tensor: codes")
    assert_bytes_equal(scales_t, scales, "global_scale as a tensor: scales")
    # The convention: global_scale is mxq's NVFP4 tensor (encode) scale.
    q = mxq.quantize(x, "nvfp4", tensor_scale=gs, layout="padded")
    assert_bytes_equal(codes, q.codes, "codes = mxq nvfp4 with tensor_scale=gs")
    assert_bytes_equal(scales.view(torch.uint8), q.scales, "scales = mxq nvfp4 with tensor_scale=gs")
    s = scales.view(torch.uint8)[:rows, : K // 16]
    assert int(scales.view(torch.uint8)[rows:].count_nonzero()) == 0, "padding rows are zero"

    ref_codes, ref_s = anchors.qutlass_nv_ref_gs(x, gs)
    gs32 = float(torch.tensor(gs, dtype=torch.float32))  # the global scale both sides compute with
    # Scale bytes: equal except where gs * amax / 6 lies within 2^-21 of an E4M3 rounding boundary
    # (mxq computes RN32(RN32(amax * gs) / 6), QuTLASS RN32(gs * RN32(amax * RN32(1/6))): fp32
    # roundings in another order).
    amax = x.double().reshape(rows, -1, 16).abs().amax(-1)
    near_s = anchors.near_e4m3_midpoint(amax * gs32 / 6.0, 2.0**-21)
    assert_bytes_equal(s, ref_s, f"scale bytes at gs={gs:g}", mask=~near_s)
    assert int((s != ref_s).sum()) <= int(near_s.sum())
    # Codes, computed by the transcription from mxq's scale bytes (so a scale that rounded the other
    # way does not hide or fake code differences): equal except the documented elements.
    sv = s.view(torch.float8_e4m3fn).float()
    m = 1.0 / (sv / torch.tensor(gs, dtype=torch.float32))
    v = x.float().reshape(rows, -1, 16) * m[..., None]
    ref_from_s = anchors.e2m1_codes_rne(v.double()).reshape(rows, K).to(torch.uint8)
    nib = _nibbles(codes)
    zero_block, near = _nv_documented(x, s, gs32)
    assert_bytes_equal(nib, ref_from_s, f"codes at gs={gs:g}", mask=~(zero_block | near))
    assert bool(((nib[zero_block] & 7) == 0).all()), "zero-scale blocks: zero codes (sign kept)"
    assert bool(((ref_from_s[zero_block] & 7) == 7).all()), "zero-scale blocks: QuTLASS's codes of magnitude 6"
    assert int(zero_block.sum()) > 0
    # And with QuTLASS's own scale bytes, where they are the same: the codes of its whole arithmetic.
    same_s = (s == ref_s).repeat_interleave(16, 1)
    assert_bytes_equal(nib, _nibbles(ref_codes), f"codes (QuTLASS's scales) at gs={gs:g}",
                       mask=same_s & ~(zero_block | near))
    # Dequantization: mxq's (fp32, one rounding) equals QuTLASS's code * s / gs (float64) rounded to fp32.
    deq = mxq.dequantize(codes, scales, format="nvfp4", cols=K, layout="padded", tensor_scale=gs,
                         dtype=torch.float32)
    assert_bytes_equal(deq, anchors.qutlass_nv_dequant(codes, s, gs32).float(), f"dequantize at gs={gs:g}")
    assert_bytes_equal(mxq.qdq(x.float(), "nvfp4", tensor_scale=gs), deq, "qdq = dequantize(quantize)")
    # What makes the value awkward, seen in the data: saturated block scales (448, byte 0x7E) and
    # non-zero blocks whose scale underflows to 0.
    nonzero = amax > 0
    sat, under = int((s == 0x7E).sum()), int(((s == 0) & nonzero).sum())
    _GS_SEEN[gs] = (sat, under, int(near_s.sum()), int(near.sum()))


_GS_SEEN: dict = {}


def test_qutlass_global_scales_cover_saturation_and_underflow():
    """The global scales above put the test data's block scales at both ends of E4M3 (run after them)."""
    for gs in anchors.NV_GLOBAL_SCALES:
        if gs not in _GS_SEEN:
            test_qutlass_fusedQuantizeNv_global_scales(gs)
    assert sum(sat > 0 for sat, _, _, _ in _GS_SEEN.values()) >= 6, _GS_SEEN
    assert sum(under > 0 for _, under, _, _ in _GS_SEEN.values()) >= 6, _GS_SEEN
    assert _GS_SEEN[2.0**40][0] > 0 and _GS_SEEN[1e-30][1] > 0, _GS_SEEN


# ---- QuTLASS with its Hadamard rotation -------------------------------------------------------------
def _hadamard_bf16(rs: int) -> torch.Tensor:
    """QuTLASS's test matrix: scipy's Sylvester Hadamard times rs^-0.5, in bf16."""
    i = torch.arange(rs)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for k in range(8):
        parity ^= (bits >> k) & 1
    return ((1 - 2 * parity).double() * rs**-0.5).to(torch.bfloat16)


def _near_pow2(t: torch.Tensor, rel: float) -> torch.Tensor:
    e = torch.round(torch.log2(t.clamp(min=1e-300)))
    return (t - torch.exp2(e)).abs() <= t * rel


@pytest.mark.parametrize("rs", [16, 32, 64, 128])
@pytest.mark.parametrize("method", ["quest", "abs_max"])
def test_qutlass_fusedQuantizeMx_hadamard_against_its_reference(method, rs):
    """fusedQuantizeMx(a, h) against a transcription of QuTLASS's test reference (_forward_quantize_ref:
    the rotation in float64, then its quantization) on its test data (randn * 25, bf16). Every scale
    byte that differs must come from a block whose reference scale argument lies within 2^-20
    (relative) of a power of two, every differing code (equal scales) from a value within 2^-20 of an
    E2M1 midpoint; the rates are printed (docs/python.md reports them)."""
    g = torch.Generator().manual_seed(rs)
    x = (torch.randn(512, 2048, generator=g) * 25.0).bfloat16()
    h = _hadamard_bf16(rs)
    quest = method == "quest"
    codes, scales = Q.fusedQuantizeMx(x, h, method=method)
    rows, K = x.shape
    s = scales.view(torch.uint8)[:rows, : K // 32]
    y64 = (x.double().unflatten(-1, (-1, rs)) @ h.double()).flatten(-2)
    ref_codes, ref_s, _ = anchors.qutlass_mx_ref(y64, quest)
    yb = y64.reshape(rows, -1, 32)
    arg = yb.std(-1, correction=0) * (2.92247856 / 6.0) + 1e-8 if quest else yb.abs().amax(-1) + 1e-8
    bad_s = s != ref_s
    assert bool(_near_pow2(arg[bad_s], 2.0**-20).all()), f"unexplained scale differences: {arg[bad_s][:8]}"
    # codes where the scales agree
    same = ~bad_s.repeat_interleave(32, 1)
    nib = torch.stack([codes & 0xF, codes >> 4], -1).reshape(rows, K)
    nib_ref = torch.stack([ref_codes & 0xF, ref_codes >> 4], -1).reshape(rows, K)
    v = (y64 / torch.exp2(s.double() - 127).repeat_interleave(32, 1)).abs() * (1.0 if quest else 3.0)
    # a rotated value exactly +0.0: the reference's grid search gives it the code 0x8, mxq 0x0 (as above)
    pos_zero = (y64 == 0) & ~torch.signbit(y64)
    assert bool((nib[pos_zero & same] == 0).all()) and bool((nib_ref[pos_zero & same] == 8).all())
    bad_c = (nib != nib_ref) & same & ~pos_zero
    near = ((v[..., None] - _E2M1_MIDS).abs() <= _E2M1_MIDS * 2.0**-20).any(-1)
    assert bool(near[bad_c].all()), f"unexplained code differences at {bad_c.nonzero()[:8].tolist()}"
    print(f"\nQuTLASS fusedQuantizeMx {method} RS {rs}: scale bytes differing {int(bad_s.sum())} / {bad_s.numel()}, "
          f"codes differing {int(bad_c.sum())} / {bad_c.numel()} (+ {int((pos_zero & same).sum())} exact zeros, 0x0 vs 0x8)")
    assert float(bad_s.float().mean()) <= 1e-3 and float(bad_c.float().mean()) <= 1e-4


@pytest.mark.parametrize("rs", [16, 128])
def test_qutlass_fusedQuantizeNv_hadamard(rs):
    """fusedQuantizeNv(a, h, gs): mxq's NVFP4 of the exactly rotated tensor (rounded once to fp32)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(256, 1024, generator=g) * 25.0).bfloat16()
    h = _hadamard_bf16(rs)
    y = (x.double().unflatten(-1, (-1, rs)) @ h.double()).flatten(-2).float()
    gs = 448.0 * 6.0 / float(y.abs().max())
    codes, scales = Q.fusedQuantizeNv(x, h, gs)
    q = mxq.quantize(y, "nvfp4", tensor_scale=gs, layout="padded")
    assert_bytes_equal(codes, q.codes, "NV codes of the rotated tensor")
    assert_bytes_equal(scales.view(torch.uint8), q.scales, "NV scales of the rotated tensor")


@pytest.mark.parametrize("rs", [16, 32, 64, 128])
def test_qutlass_fusedQuantizeNv_hadamard_against_its_kernel_arithmetic(rs):
    """fusedQuantizeNv(a, h, gs) against the transcription of QuTLASS's NVFP4 kernel arithmetic
    (anchors.qutlass_nv_ref_gs) applied to the rotated tensor: scale bytes differ only within 2^-21 of
    an E4M3 rounding boundary, codes (from the same scale bytes) only at the documented elements;
    the counts are printed (docs/python.md reports them)."""
    g = torch.Generator().manual_seed(100 + rs)
    x = (torch.randn(512, 2048, generator=g) * 25.0).bfloat16()
    h = _hadamard_bf16(rs)
    y = (x.double().unflatten(-1, (-1, rs)) @ h.double()).flatten(-2).float()
    gs = 448.0 * 6.0 / float(y.abs().max())
    codes, scales = Q.fusedQuantizeNv(x, h, gs)
    rows, K = x.shape
    s = scales.view(torch.uint8)[:rows, : K // 16]
    ref_codes, ref_s = anchors.qutlass_nv_ref_gs(y, gs)
    gs32 = float(torch.tensor(gs, dtype=torch.float32))
    amax = y.double().reshape(rows, -1, 16).abs().amax(-1)
    bad_s = s != ref_s
    assert bool(anchors.near_e4m3_midpoint(amax * gs32 / 6.0, 2.0**-21)[bad_s].all()), "unexplained scale bytes"
    zero_block, near = _nv_documented(y, s, gs32)
    same_s = (~bad_s).repeat_interleave(16, 1)
    nib, nib_ref = _nibbles(codes), _nibbles(ref_codes)
    bad_c = (nib != nib_ref) & same_s
    assert bool((zero_block | near)[bad_c].all()), "unexplained codes"
    print(f"\nQuTLASS fusedQuantizeNv RS {rs}: scale bytes differing {int(bad_s.sum())} / {bad_s.numel()}, "
          f"codes differing {int(bad_c.sum())} / {bad_c.numel()} (zero-scale blocks {int(zero_block.sum())} elements)")


def test_qutlass_rotation_compiles_without_graph_breaks():
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    h = _hadamard_bf16(64)
    f = torch.compile(lambda a, b: Q.fusedQuantizeMx(a, b, method="quest"), fullgraph=True, backend="aot_eager")
    for got, want in zip(f(x, h), Q.fusedQuantizeMx(x, h, method="quest")):
        assert_bytes_equal(got, want, "compiled")


# ---- QuTLASS's Hadamard rotation: the float64 butterfly (torch.ops.mxq.hadamard_rotate_f64) ----------
def _had_ref(x: torch.Tensor, rs: int, c: float) -> torch.Tensor:
    """The old path's value: the float64 matmul by c * H, rounded once to fp32."""
    h = ((~Q._sylvester_negative(rs)).double() * 2 - 1).to(x.device)
    return (x.unflatten(-1, (-1, rs)).double() @ (h * c)).flatten(-2).float()


def _assert_same_or_both_nan(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bytes equal wherever the matmul is not NaN; NaN exactly where it is NaN (NaN sign and payload
    are not compared: the matmul's depend on the BLAS and the device)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    assert_bytes_equal(got, want, what, mask=~nan)


def _hadamard_cases(rs: int, dtype, n: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + rs)
    x = torch.randn(n, 4 * rs, generator=g) * 25.0
    if dtype == torch.float32:  # keep the fp32 groups' span within the exact bound (docs/numerics.md)
        x = torch.where(x.abs() < 2.0**-6, torch.full_like(x, 2.0**-6), x)
    return x.to(dtype)


@pytest.mark.parametrize("rs", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qutlass_hadamard_rotate_f64_equals_the_matmul(rs, dtype):
    """The butterfly against the float64 matmul, QuTLASS's c = bf16(rs^-0.5) and a power of two, on
    random data (leading dimensions kept, a strided input copied)."""
    x = _hadamard_cases(rs, dtype)
    for c in (float(_hadamard_bf16(rs)[0, 0]), 0.25):
        if dtype == torch.float32 and c != 0.25 and rs not in (16, 64, 256):
            c = 0.25  # fp32 data times an 8-bit c: the matmul's products may round; the butterfly's do not
        got = torch.ops.mxq.hadamard_rotate_f64(x, rs, c)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert_bytes_equal(got, _had_ref(x, rs, c), f"rs {rs} {dtype} c {c}")
    x3 = x.reshape(4, 16, -1)
    assert_bytes_equal(torch.ops.mxq.hadamard_rotate_f64(x3, rs, 0.5), _had_ref(x3, rs, 0.5), "3-D")
    xs = x.t().contiguous().t()  # not contiguous
    assert_bytes_equal(torch.ops.mxq.hadamard_rotate_f64(xs, rs, 0.5), _had_ref(xs, rs, 0.5), "strided")


def _within_exact_bound(x: torch.Tensor, rs: int) -> torch.Tensor:
    """bool per group of rs: every butterfly sum (and, for a power-of-two c, every matmul sum) is exact:
    rs * max|x| <= 2^53 * u, u the smallest unit in the last place among the group's nonzero elements
    (docs/numerics.md); groups with Inf or NaN count as within (their results are Inf / NaN either way)."""
    p = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[x.dtype]
    tiny = {torch.bfloat16: 2.0**-126, torch.float16: 2.0**-14, torch.float32: 2.0**-126}[x.dtype]
    v = x.double().unflatten(-1, (-1, rs))
    a = v.abs()
    finite = torch.isfinite(v).all(-1)
    _, e = torch.frexp(a.clamp(min=tiny))  # a = m * 2^e, m in [0.5, 1): ulp 2^(e - p)
    ulp = torch.where(a > 0, torch.ldexp(torch.ones_like(a), e - p), torch.full_like(a, float("inf")))
    u = ulp.amin(-1)
    return ~finite | (rs * a.amax(-1) <= 2.0**53 * u)


@pytest.mark.parametrize("rs", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qutlass_hadamard_rotate_f64_every_pattern(rs, dtype):
    """Each of the 65536 16-bit patterns (zeros, subnormals, the extremes, Inf, NaN) placed in a group
    of otherwise small values (+-[2^-4, 2^-3)), at every position in turn: the matmul's values (NaN
    exactly where it has NaN) in every group within the exactness bound (every fp16 group is; bf16
    groups with a pattern below about 2^-(46 - 4 - log2 rs) relative to the rest are not: there both
    sums round, in different orders, and a few results differ: counted, printed, documented)."""
    g = torch.Generator().manual_seed(5)
    n = 1 << 16
    small = (torch.rand(n, rs, generator=g) + 1.0) * 2.0**-4 * (torch.randint(0, 2, (n, rs), generator=g) * 2 - 1)
    x = small.to(dtype)
    pat = torch.arange(n, dtype=torch.int32).to(torch.int16).view(dtype)
    x[torch.arange(n), torch.arange(n) % rs] = pat
    c = float(_hadamard_bf16(rs)[0, 0])
    got, want = torch.ops.mxq.hadamard_rotate_f64(x, rs, c), _had_ref(x, rs, c)
    ok = _within_exact_bound(x, rs)[:, 0]
    if dtype == torch.float16:
        assert bool(ok.all())
    _assert_same_or_both_nan(got[ok], want[ok], f"{dtype} patterns rs {rs}")
    out = ~ok
    differ = ((got[out] != want[out]) & ~(torch.isnan(got[out]) & torch.isnan(want[out]))).any(-1)
    print(f"\n{dtype} rs {rs}: {int(out.sum())} groups beyond the exact bound, {int(differ.sum())} of them differ")


def _special_groups(rs: int, dtype) -> torch.Tensor:
    inf, nan = float("inf"), float("nan")
    rows = [torch.full((rs,), -0.0), torch.zeros(rs), torch.zeros(rs), torch.zeros(rs), torch.zeros(rs),
            torch.ones(rs), torch.zeros(rs), torch.full((rs,), 3.0)]
    rows[2][1::2] = -0.0  # +-0 mixed
    rows[3][5] = inf
    rows[4][3], rows[4][rs - 1] = inf, -inf
    rows[5][2], rows[5][7] = inf, inf
    rows[6][0], rows[6][9] = nan, -inf
    rows[7][1] = -3.0  # exact cancellations: +0 results
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("rs", [16, 32, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qutlass_hadamard_rotate_f64_specials(rs, dtype):
    """Signed zeros (the matmul's sums start from +0: every zero result is +0; so are the butterfly's,
    which adds +0 last), one or two infinities (NaN where their signs in H differ, as Inf - Inf in the
    matmul's sum), NaN: the matmul's values."""
    x = _special_groups(rs, dtype)
    for c in (float(_hadamard_bf16(rs)[0, 0]), -0.5):
        got = torch.ops.mxq.hadamard_rotate_f64(x, rs, c)
        _assert_same_or_both_nan(got, _had_ref(x, rs, c), f"specials rs {rs} {dtype} c {c}")
        assert not bool(torch.signbit(got[(got == 0)]).any()), "a -0 result"


def test_qutlass_hadamard_rotate_f64_refusals_and_compile():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for bad in (8, 48, 512):
        with pytest.raises(ValueError, match="argument 'rs'"):
            torch.ops.mxq.hadamard_rotate_f64(x, bad, 1.0)
    with pytest.raises(ValueError, match="multiple of rs"):
        torch.ops.mxq.hadamard_rotate_f64(x[:, :48], 32, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.mxq.hadamard_rotate_f64(x.double(), 32, 1.0)
    with pytest.raises(NotImplementedError, match="requires grad"):
        torch.ops.mxq.hadamard_rotate_f64(x.float().requires_grad_(), 32, 1.0)
    assert torch.ops.mxq.hadamard_rotate_f64(x[:0], 32, 1.0).shape == (0, 64)
    torch.library.opcheck(torch.ops.mxq.hadamard_rotate_f64.default, (x, 32, 0.125))
    f = torch.compile(lambda a: torch.ops.mxq.hadamard_rotate_f64(a, 64, 0.125), fullgraph=True, backend="aot_eager")
    assert_bytes_equal(f(x), torch.ops.mxq.hadamard_rotate_f64(x, 64, 0.125), "compiled")


def test_qutlass_hadamard_detection():
    """_hadamard_scale: c for QuTLASS's matrix (bf16, as its tests build it) and for an fp32 one; None
    for a random orthogonal matrix, one flipped sign, a mix of two power-of-two scales, zero; the
    verdict follows an in-place change (version counter)."""
    for rs in (16, 32, 64, 128, 256):
        h = _hadamard_bf16(rs)
        assert Q._hadamard_scale(h) == float(h[0, 0]) == float(torch.tensor(rs**-0.5).bfloat16())
        h32 = (~Q._sylvester_negative(rs)).float() * 2 - 1
        assert Q._hadamard_scale(h32 * 0.5) == 0.5
        q, _ = torch.linalg.qr(torch.randn(rs, rs, generator=torch.Generator().manual_seed(rs), dtype=torch.float64))
        assert Q._hadamard_scale(q.bfloat16()) is None and Q._hadamard_scale(q.float()) is None
        flipped = h.clone()
        flipped[3, 5] = -flipped[3, 5]
        assert Q._hadamard_scale(flipped) is None
        mixed = h.clone()
        mixed[1, :] *= 2  # +-2c in one row: still +-1 signs, a different scale
        assert Q._hadamard_scale(mixed) is None
        assert Q._hadamard_scale(torch.zeros(rs, rs, dtype=torch.bfloat16)) is None
        assert Q._hadamard_scale(h.t().contiguous()) == float(h[0, 0])  # symmetric
        m = h.clone()
        assert Q._hadamard_scale(m) is not None
        m[0, 1] = -m[0, 1]
        assert Q._hadamard_scale(m) is None, "stale verdict after an in-place change"
    for _ in range(3):  # a freed matrix's address reused by another (version 0 again): no stale verdict
        assert Q._hadamard_scale(_hadamard_bf16(64).float() * 2.0) is not None
        assert Q._hadamard_scale(torch.randn(64, 64)) is None


def _shim_both_paths(monkeypatch, x, h):
    """Every shim variant on (x, h): the fast path's outputs, then the old matmul path's."""
    def run():
        gs = 448.0 * 6.0 / 25.0 / 8.0
        return [*Q.fusedQuantizeMx(x, h, method="quest", return_mask=True), *Q.fusedQuantizeMx(x, h, method="abs_max"),
                *Q.fusedQuantizeNv(x, h, gs), *Q.fusedQuantizeNv(x, h, 1.0, method="quest")]
    assert Q._hadamard_scale(h) is not None
    fast = run()
    with monkeypatch.context() as mp:
        mp.setattr(Q, "_hadamard_scale", lambda b: None)
        old = run()
    return fast, old


@pytest.mark.parametrize("rs", [16, 32, 64, 128, 256])
def test_qutlass_hadamard_fast_path_bytes_equal_the_matmul_path(monkeypatch, rs):
    """The shims' output bytes through the butterfly equal the old float64-matmul path's, on the QuTLASS
    test data (randn * 25, bf16) with a few rows of zeros, signed zeros, tiny and huge values, Inf and
    NaN."""
    g = torch.Generator().manual_seed(300 + rs)
    x = (torch.randn(256, 1024, generator=g) * 25.0).bfloat16()
    x[0] = 0.0
    x[1] = -0.0
    x[2, ::3] = 2.0**-130
    x[3, 7] = 3.0e38
    x[4, 11] = float("inf")
    x[5, 2], x[5, 40] = float("inf"), float("-inf")
    x[6, 17] = float("nan")
    x[7] = (torch.randn(1024, generator=g) * 2.0**-120).bfloat16()
    fast, old = _shim_both_paths(monkeypatch, x, _hadamard_bf16(rs))
    for i, (f, o) in enumerate(zip(fast, old)):
        assert_bytes_equal(f.view(torch.uint8), o.view(torch.uint8), f"output {i}")


def test_qutlass_hadamard_other_matrices_keep_the_matmul():
    x = (torch.randn(8, 256, generator=torch.Generator().manual_seed(1)) * 25.0).bfloat16()
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    q = q.bfloat16()
    want = torch.ops.mxq.quantize(Q._rotate_matmul(x, q), "mxfp4", "quest", 32, False, 0, 0, "padded", None, False)
    got = Q.fusedQuantizeMx(x, q, method="quest")
    assert_bytes_equal(got[0], want[0], "codes")
    assert_bytes_equal(got[1].view(torch.uint8), want[1], "scales")


@needs_cuda
@pytest.mark.parametrize("rs", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qutlass_hadamard_rotate_f64_cuda(rs, dtype):
    """The CUDA kernel: the CPU loop's bits on random data, specials (NaN positions) and, for bf16 / fp16,
    every 16-bit pattern; the matmul's values (on the GPU too); an odd number of groups (rs 16: half a
    warp idle), an input not 16-byte aligned, and a tensor large enough for the grid-stride loop."""
    c = float(_hadamard_bf16(rs)[0, 0]) if dtype != torch.float32 else 0.25
    x = _hadamard_cases(rs, dtype, n=333)
    got = torch.ops.mxq.hadamard_rotate_f64(x.cuda(), rs, c).cpu()
    assert_bytes_equal(got, torch.ops.mxq.hadamard_rotate_f64(x, rs, c), "CUDA == CPU")
    assert_bytes_equal(got, _had_ref(x.cuda(), rs, c).cpu(), "CUDA == the GPU's float64 matmul")
    xo = x.reshape(-1)[1 : 1 + 37 * rs].reshape(37, rs)
    assert_bytes_equal(torch.ops.mxq.hadamard_rotate_f64(xo.cuda(), rs, c).cpu(), _had_ref(xo, rs, c), "unaligned")
    s = _special_groups(rs, dtype)
    _assert_same_or_both_nan(torch.ops.mxq.hadamard_rotate_f64(s.cuda(), rs, c).cpu(), _had_ref(s, rs, c), "specials")
    if dtype != torch.float32:
        n = 1 << 16
        xp = (torch.rand(n, rs, generator=torch.Generator().manual_seed(5)) * 2.0**-4 + 2.0**-4).to(dtype)
        xp[torch.arange(n), torch.arange(n) % rs] = torch.arange(n, dtype=torch.int32).to(torch.int16).view(dtype)
        _assert_same_or_both_nan(torch.ops.mxq.hadamard_rotate_f64(xp.cuda(), rs, c).cpu(),
                                 torch.ops.mxq.hadamard_rotate_f64(xp, rs, c), "patterns CUDA vs CPU")
    big = torch.randn(1 << 24, dtype=torch.float32).to(dtype) if dtype != torch.float32 else None
    if big is not None:
        assert_bytes_equal(torch.ops.mxq.hadamard_rotate_f64(big.cuda(), rs, c).cpu(),
                           torch.ops.mxq.hadamard_rotate_f64(big, rs, c), "grid-stride")


@needs_cuda
@pytest.mark.parametrize("rs", [16, 128])
def test_qutlass_hadamard_cuda_shim_and_graph(monkeypatch, rs):
    """On the GPU: the shims' bytes through the butterfly equal the old matmul path's and the CPU's;
    inside a captured CUDA graph (the verdict cached by a first call) the replay gives the same bytes;
    a matrix first seen during capture keeps the matmul (no host read), which captures too."""
    g = torch.Generator().manual_seed(400 + rs)
    x = (torch.randn(256, 1024, generator=g) * 25.0).bfloat16().cuda()
    h = _hadamard_bf16(rs).cuda()
    fast, old = _shim_both_paths(monkeypatch, x, h)
    cpu, _ = _shim_both_paths(monkeypatch, x.cpu(), h.cpu())
    for i, (f, o, c) in enumerate(zip(fast, old, cpu)):
        assert_bytes_equal(f.view(torch.uint8).cpu(), o.view(torch.uint8).cpu(), f"output {i} fast vs matmul")
        assert_bytes_equal(f.view(torch.uint8).cpu(), c.view(torch.uint8), f"output {i} CUDA vs CPU")
    want = Q.fusedQuantizeMx(x, h, method="quest")
    h_new = _hadamard_bf16(rs).cuda()  # another matrix, never seen: the matmul inside the graph
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        Q.fusedQuantizeMx(x, h, method="quest")  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = Q.fusedQuantizeMx(x, h, method="quest")
            out_new = Q.fusedQuantizeMx(x, h_new, method="quest")
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    for got in (out, out_new):
        assert_bytes_equal(got[0], want[0], "graph codes")
        assert_bytes_equal(got[1].view(torch.uint8), want[1].view(torch.uint8), "graph scales")
