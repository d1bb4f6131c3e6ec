"""mxq.linear (the W4A16 GEMM) from Python: prepack / unpack round trips, the op against an oracle built
from mxq.dequantize, fake implementation (opcheck, torch.compile), errors, load_quantized on a tiny
Llama checkpoint that `mxq quantize` wrote; on a GPU: CUDA == CPU bytes on exact sums, the error on
LLM-like data against float64 no larger than 1.05x torch.matmul's on the same dequantized weights,
determinism, CUDA-graph capture, generate() on packed weights."""
from __future__ import annotations

import pytest
import torch

import mxq
from conftest import CUDA, assert_bytes_equal, llm_like

FORMATS = ["mxfp4", "nvfp4"]
BLOCK = {"mxfp4": 32, "nvfp4": 16}


def exact_weight(fmt: str, N: int, K: int, seed: int = 0):
    """Codes random, scales from a small set: with x in {-2..2} every fp32 sum is exact in any order."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    if fmt == "mxfp4":
        scales = torch.randint(126, 129, (N, K // 32), dtype=torch.uint8, generator=g)
    else:
        choice = torch.tensor([0x30, 0x38, 0x3C, 0x40, 0x44], dtype=torch.uint8)
        scales = choice[torch.randint(0, 5, (N, K // 16), generator=g)]
    return codes, scales


def exact_x(M: int, K: int, dtype=torch.bfloat16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (M, K), generator=g).to(dtype)


def oracle(x, codes, scales, fmt, S, bias=None):
    """mxq.dequantize to fp32 with S = 1 (e2m1 * scale exactly), float64 sums, / S, + bias, rounded once."""
    K = x.shape[-1]
    q = mxq.QuantizedTensor(codes, scales, torch.tensor([1.0]) if fmt == "nvfp4" else None, fmt,
                            "nvfp4" if fmt == "nvfp4" else "floor", "linear", BLOCK[fmt], torch.Size((codes.shape[0], K)),
                            torch.float32, tensor_scale_value=1.0 if fmt == "nvfp4" else None)
    w = q.dequantize(torch.float32)
    y = (x.double() @ w.double().T).float()
    if fmt == "nvfp4":
        y = y / torch.tensor(S, dtype=torch.float32)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_prepack_unpack_round_trip(fmt, layout):
    w = llm_like(100, 2880, torch.bfloat16, 3)
    q = mxq.quantize(w, fmt, layout=layout)
    pw = mxq.prepack(q)
    codes, scales = pw.unpack()
    ql = mxq.quantize(w, fmt)
    assert_bytes_equal(codes, ql.codes, "codes")
    assert_bytes_equal(scales, ql.scales, "scales")
    assert (pw.N, pw.K) == (100, 2880)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_equals_oracle_on_exact_sums(fmt, dtype):
    N, K = 40, 2880
    codes, scales = exact_weight(fmt, N, K)
    S = 2688.0 / 3.7
    pw = mxq.prepack(codes=codes, scales=scales, format=fmt, tensor_scale=S if fmt == "nvfp4" else None)
    x = exact_x(7, K, dtype)
    bias = torch.arange(N, dtype=dtype) % 5 - 2
    assert_bytes_equal(mxq.linear(x, pw), oracle(x, codes, scales, fmt, S), "no bias")
    assert_bytes_equal(mxq.linear(x, pw, bias), oracle(x, codes, scales, fmt, S, bias), "bias")
    # leading dimensions and a row stride
    x3 = exact_x(6, K + 16, dtype)[:, :K].reshape(2, 3, K)
    assert_bytes_equal(mxq.linear(x3, pw).reshape(6, N), oracle(x3.reshape(6, K), codes, scales, fmt, S), "3-D strided")


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_and_compile(fmt):
    w = llm_like(64, 256, torch.bfloat16, 5)
    pw = mxq.prepack(mxq.quantize(w, fmt))
    x = llm_like(3, 256, torch.bfloat16, 6)
    torch.library.opcheck(torch.ops.mxq.linear, (x, pw.codes, pw.scales, None, pw.format, pw.N, pw.K, pw.exp_shift,
                                                  pw.f16_exact, pw.tensor_scale))
    f = torch.compile(lambda a: mxq.linear(a, pw), fullgraph=True)
    assert_bytes_equal(f(x), mxq.linear(x, pw), "compiled")


def test_errors():
    w = llm_like(64, 256, torch.bfloat16, 5)
    pw = mxq.prepack(mxq.quantize(w, "mxfp4"))
    with pytest.raises(ValueError, match="K = 256"):
        mxq.linear(torch.zeros(2, 128, dtype=torch.bfloat16), pw)
    with pytest.raises(ValueError, match="dtype"):
        mxq.linear(torch.zeros(2, 256), pw)
    with pytest.raises(NotImplementedError, match="mxfp4 or nvfp4"):
        mxq.prepack(mxq.quantize(w, "mxfp8_e4m3"))
    with pytest.raises(NotImplementedError, match="group size"):
        mxq.prepack(mxq.quantize(w, "mxfp4", group_size=16))
    with pytest.raises(ValueError, match="tensor_scale"):
        q = mxq.quantize(w, "nvfp4")
        mxq.prepack(codes=q.codes, scales=q.scales, format="nvfp4")
    with pytest.raises(ValueError, match="bias"):
        mxq.linear(torch.zeros(2, 256, dtype=torch.bfloat16), pw, torch.zeros(63, dtype=torch.bfloat16))


def test_load_quantized_tiny_llama(tmp_path):
    """`mxq quantize` -> load_quantized -> the QuantLinear layers give the logits of the dequantized weights
    within bf16 rounding; generate() runs."""
    transformers = pytest.importorskip("transformers")
    from test_checkpoint_consumers import mxq as tool, tiny_llama

    src, out = tmp_path / "bf16", tmp_path / "mxfp4"
    tiny_llama(src, torch.bfloat16)
    tool("quantize", str(src), "-o", str(out), "--format", "mxfp4", "--device", "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    n = mxq.load_quantized(model, str(out))
    assert n == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert isinstance(model.model.layers[0].self_attn.q_proj, mxq.QuantLinear)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(logits).all()
    assert gen.shape == (1, 8)


# ---- CUDA -------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and mxq built with CUDA")


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M", [1, 7, 16, 17, 64, 129, 1000])
def test_cuda_equals_cpu_on_exact_sums(fmt, dtype, M):
    N, K = (360, 2880) if M < 1000 else (72, 320)
    codes, scales = exact_weight(fmt, N, K, M)
    pw = mxq.prepack(codes=codes, scales=scales, format=fmt, tensor_scale=300.0 if fmt == "nvfp4" else None)
    x = exact_x(M, K, dtype, M)
    bias = (torch.arange(N, dtype=dtype) % 5 - 2)
    want = mxq.linear(x, pw, bias)
    got = mxq.linear(x.cuda(), pw.to("cuda"), bias.cuda())
    assert_bytes_equal(got.cpu(), want, f"{fmt} M={M}")


def weight_values(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """e2m1 * block scale, exactly, in float64 (written here from the formats' definitions)."""
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    e = torch.stack([lut[(codes & 15).long()], lut[(codes >> 4).long()]], dim=-1).reshape(codes.shape[0], -1)
    if fmt == "mxfp4":
        s = torch.exp2(scales.double() - 127)
        s[scales == 255] = float("nan")
    else:
        s = scales.view(torch.float8_e4m3fn).double()
    return e * s.repeat_interleave(BLOCK[fmt], dim=1)


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 16, 64, 256])
def test_cuda_error_against_float64_within_torch_matmul(fmt, M):
    """Mean |y - exact| of mxq.linear no larger than 1.05x that of torch.matmul (cuBLAS, bf16) on the same
    dequantized weights (NVFP4: the sum then divided by S in fp32, as mxq does)."""
    N, K = 1024, 4096
    w = llm_like(N, K, torch.bfloat16, 11)
    q = mxq.quantize(w, fmt)
    pw = mxq.prepack(q)
    S = pw.tensor_scale
    wv = weight_values(q.codes, q.scales, fmt)  # exact, and exactly a bf16 value
    x = llm_like(M, K, torch.bfloat16, 12).cuda()
    exact = (x.double() @ wv.cuda().T) / S
    y = mxq.linear(x, pw.to("cuda"))
    peer = torch.matmul(x, wv.to(torch.bfloat16).cuda().T)
    if fmt == "nvfp4":
        peer = (peer.float() / S).to(torch.bfloat16)
    e_mxq = (y.double() - exact).abs().mean().item()
    e_torch = (peer.double() - exact).abs().mean().item()
    assert e_mxq <= 1.05 * e_torch, (e_mxq, e_torch)


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [16, 300])
def test_cuda_deterministic_graph_and_compile(fmt, M):
    w = llm_like(1024, 4096, torch.bfloat16, 21)
    pw = mxq.prepack(mxq.quantize(w, fmt)).to("cuda")
    x = llm_like(M, 4096, torch.bfloat16, 22).cuda()
    a, b = mxq.linear(x, pw), mxq.linear(x, pw)
    assert_bytes_equal(a, b, "two runs")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mxq.linear(x, pw)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mxq.linear(x, pw)
    g.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(y, a, "graph replay")
    f = torch.compile(lambda t: mxq.linear(t, pw), fullgraph=True)
    assert_bytes_equal(f(x), a, "compiled")


@cuda
def test_cuda_generate_on_packed_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_checkpoint_consumers import mxq as tool, tiny_llama

    src, out = tmp_path / "bf16", tmp_path / "nvfp4"
    tiny_llama(src, torch.bfloat16)
    tool("quantize", str(src), "-o", str(out), "--format", "nvfp4", "--device", "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    mxq.load_quantized(model, str(out))
    model.cuda()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        logits = model(ids.cuda()).logits
        gen = model.generate(ids.cuda(), max_new_tokens=4, do_sample=False)
    assert torch.isfinite(logits).all()
    assert gen.shape == (1, 8)
