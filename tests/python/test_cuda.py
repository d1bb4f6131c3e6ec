"""The mxq ops on a CUDA GPU (skipped without one): bytes equal to the CPU's, the current stream,
torch.compile(fullgraph=True), CUDA-graph capture and replay, the compat shims."""
from __future__ import annotations

import pytest
import torch

import mxq
from mxq.compat import qutlass as Q
from mxq.compat import vllm_qdq as V
from conftest import CUDA, assert_bytes_equal, llm_like

pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and mxq built with CUDA")

CASES = [("mxfp4", "even"), ("mxfp4", "floor"), ("mxfp4", "quest"), ("mxfp4", "qutlass_absmax"),
         ("mxfp6_e2m3", "rceil"), ("mxfp6_e3m2", "ceil"), ("mxfp8_e4m3", "floor"), ("mxfp8_e4m3", "rceil"),
         ("mxfp8_e5m2", "even"), ("mxint8", "floor"), ("nvfp4", None)]
SHAPES = [(1, 32), (16, 4096), (130, 4096 + 16), (257, 100)]


def _x(shape, dtype=torch.bfloat16, seed=0):
    return llm_like(*shape, torch.float32, seed).clamp(-6e4, 6e4).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt,rule", CASES)
def test_cuda_equals_cpu(fmt, rule, dtype, shape):
    x = _x(shape, dtype)
    xc = x.cuda()
    assert_bytes_equal(mxq.qdq(xc, fmt, rule=rule), mxq.qdq(x, fmt, rule=rule), f"qdq {fmt}/{rule}")
    for layout in ("linear", "swizzled", "padded"):
        qg, qc = mxq.quantize(xc, fmt, rule=rule, layout=layout, clip_mask=True), \
            mxq.quantize(x, fmt, rule=rule, layout=layout, clip_mask=True)
        assert_bytes_equal(qg.codes, qc.codes, f"codes {layout}")
        assert_bytes_equal(qg.scales, qc.scales, f"scales {layout}")
        assert_bytes_equal(qg.clip_mask, qc.clip_mask, f"clip mask {layout}")
        if fmt == "nvfp4":
            assert_bytes_equal(qg.tensor_scale, qc.tensor_scale, "tensor scale")
        assert_bytes_equal(qg.dequantize(), qc.dequantize(), f"dequantize {layout}")
    sg = mxq.qdq(xc, fmt, rule=rule, stochastic=True, seed=123, offset=7)
    assert_bytes_equal(sg, mxq.qdq(x, fmt, rule=rule, stochastic=True, seed=123, offset=7), "stochastic")


def test_cuda_strided_inplace_and_nd():
    base = _x((64, 160)).cuda()
    for view in (lambda b: b[3:40, 16:112], lambda b: b[:, :64].t(), lambda b: b.reshape(4, 16, 160)[:, 2:10, :96]):
        b1, b2 = base.clone(), base.cpu().clone()
        mxq.qdq_(view(b1), "nvfp4")
        mxq.qdq_(view(b2), "nvfp4")
        assert_bytes_equal(b1, b2, "in place on a view")
        assert_bytes_equal(mxq.qdq(view(base), "mxfp4", rule="even"), mxq.qdq(view(base.cpu()), "mxfp4", rule="even"),
                           "strided qdq")


def test_cuda_current_stream_and_errors():
    x = _x((256, 4096)).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = mxq.qdq(x, "nvfp4")
        q = mxq.quantize(x, "mxfp8", layout="swizzled")
    s.synchronize()
    assert_bytes_equal(y, mxq.qdq(x.cpu(), "nvfp4"), "side stream qdq")
    assert_bytes_equal(q.scales, mxq.quantize(x.cpu(), "mxfp8", layout="swizzled").scales, "side stream quantize")
    q = mxq.quantize(x, "mxfp4")
    with pytest.raises(ValueError, match="device|cuda|cpu"):
        mxq.dequantize(q.codes, q.scales.cpu(), format="mxfp4", cols=4096)


@pytest.mark.parametrize("backend", ["inductor"])
def test_cuda_torch_compile_fullgraph(backend):
    torch._dynamo.reset()

    def f(x):
        y = mxq.qdq(x * 2, "mxfp4", rule="even")
        q = mxq.quantize(y, "nvfp4", layout="swizzled")
        return y + 1, q.codes, q.scales, V.mxfp8_qdq(x)

    x = _x((128, 1024)).cuda()
    got = torch.compile(f, fullgraph=True, backend=backend)(x)
    for g, e, what in zip(got, f(x), ["qdq", "codes", "scales", "vllm mxfp8"]):
        assert_bytes_equal(g, e, f"compiled {what}")


def test_cuda_graph_capture_and_replay():
    static_x = _x((512, 2048)).cuda()
    target = static_x.clone()

    def work():
        y = mxq.qdq(static_x, "nvfp4")  # computed tensor scale: a 4-byte workspace, no sync
        q = mxq.quantize(static_x, "nvfp4", layout="swizzled")
        z = mxq.qdq(static_x, "mxfp4", rule="even", stochastic=True, seed=5)
        mxq.qdq_(target, "mxfp8")
        c, s = Q.fusedQuantizeMx(static_x, None, method="quest")
        return y, q.codes, q.scales, q.tensor_scale, z, c, s

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        work()  # warm up (allocator, kernels)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = work()
    for seed in (1, 2):
        new = _x((512, 2048), seed=seed).cuda()
        static_x.copy_(new)
        target.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        target_expect = mxq.qdq(new.cpu(), "mxfp8")
        qc = mxq.quantize(new.cpu(), "nvfp4", layout="swizzled")
        cq, sq = Q.fusedQuantizeMx(new.cpu(), None, method="quest")
        expect = (mxq.qdq(new.cpu(), "nvfp4"), qc.codes, qc.scales, qc.tensor_scale,
                  mxq.qdq(new.cpu(), "mxfp4", rule="even", stochastic=True, seed=5), cq, sq)
        for a, e, what in zip(outs, expect, ["qdq", "codes", "scales", "S", "stochastic", "qutlass codes", "scales"]):
            assert_bytes_equal(a, e, f"graph replay {seed}: {what}")
        assert_bytes_equal(target, target_expect, "graph replay: in place")


def test_cuda_compat_equals_cpu():
    x = _x((300, 4096))
    for f in (V.mxfp4_qdq, V.mxfp8_qdq):
        assert_bytes_equal(f(x.cuda()), f(x), f.__name__)
        assert_bytes_equal(f(x.half().cuda()), f(x.half()), f.__name__ + " fp16")
    for method in ("quest", "abs_max"):
        for a, b in zip(Q.fusedQuantizeMx(x.cuda(), None, method=method), Q.fusedQuantizeMx(x, None, method=method)):
            assert_bytes_equal(a, b, f"fusedQuantizeMx {method}")
    gs = torch.tensor([6.0])
    for a, b in zip(Q.fusedQuantizeNv(x.cuda(), None, gs.cuda()), Q.fusedQuantizeNv(x, None, gs)):
        assert_bytes_equal(a, b, "fusedQuantizeNv")
    sc = Q.fusedQuantizeMx(x, None)[1]
    assert_bytes_equal(Q.to_blocked(sc.cuda()), Q.to_blocked(sc), "to_blocked")
    eye = torch.eye(32, dtype=torch.bfloat16, device="cuda")
    assert_bytes_equal(Q.fusedQuantizeMx(x.cuda(), eye)[0], Q.fusedQuantizeMx(x, None)[0], "identity rotation")


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_second_device():
    x = _x((64, 256))
    y = mxq.qdq(x.to("cuda:1"), "nvfp4")
    assert y.device == torch.device("cuda:1")
    assert_bytes_equal(y, mxq.qdq(x, "nvfp4"), "cuda:1")


def test_cuda_emulate_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mxq.emulate(model, weights="nvfp4", activations="mxfp4")
        cpu = model(ids).logits
        model.cuda()
        assert model.model.layers[0].mlp.up_proj.weight.is_cuda
        gpu = model(ids.cuda()).logits
    assert gpu.shape == cpu.shape and bool(torch.isfinite(gpu).all())
