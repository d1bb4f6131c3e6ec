"""The mxq ops on a CUDA GPU (skipped without one): bytes equal to the CPU's, the current stream,
torch.compile(fullgraph=True), CUDA-graph capture and replay, the compat shims."""
from __future__ import annotations

import pytest
import torch

import mxq
from mxq.compat import qutlass as Q
from mxq.compat import vllm_qdq as V
import anchors
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


# ~0.25-0.5 s of torch.cuda._sleep at the H200's 1.4-2 GHz SM clocks: orders of magnitude longer than
# enqueueing the ops below takes the host.
SLEEP_CYCLES = 500_000_000


def _write_late(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """On `stream`: a long busy-wait kernel, then dst.copy_(src); returns an event recorded after the
    copy. Until that event completes, dst still holds its old contents."""
    stream.wait_stream(torch.cuda.current_stream())  # dst and src are ready before the busy-wait
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        dst.copy_(src)
        written = torch.cuda.Event()
        written.record()
    return written


def test_cuda_ops_run_on_the_current_stream():
    """Each op must enqueue its work on the current stream, after what is already queued there.
    The input is written on a side stream s behind a long busy-wait; the ops are called on s at once,
    while the write is still pending (asserted). On s they wait for it and see the data; an op that
    ran on any other stream (the default stream, a stream of its own) would run at once and see the
    stale zeros. The control at the end shows that this race is real: the same call issued on the
    default stream does see the zeros."""
    src = _x((256, 4096))
    expect = {
        "qdq nvfp4 (computed S: workspace + two kernels)": mxq.qdq(src, "nvfp4"),
        "qdq mxfp4": mxq.qdq(src, "mxfp4", rule="even"),
        "qdq_ mxfp8": mxq.qdq(src, "mxfp8"),
    }
    qc = mxq.quantize(src, "nvfp4", layout="swizzled")
    src_gpu = src.cuda()
    s = torch.cuda.Stream()

    def run_ops(x: torch.Tensor, inplace: torch.Tensor):
        got = {
            "qdq nvfp4 (computed S: workspace + two kernels)": mxq.qdq(x, "nvfp4"),
            "qdq mxfp4": mxq.qdq(x, "mxfp4", rule="even"),
        }
        mxq.qdq_(inplace, "mxfp8")
        got["qdq_ mxfp8"] = inplace
        q = mxq.quantize(x, "nvfp4", layout="swizzled")
        deq = mxq.dequantize(q.codes, q.scales, format="nvfp4", cols=4096, layout="swizzled",
                             tensor_scale=float(qc.tensor_scale), dtype=torch.bfloat16)
        lin = mxq.unswizzle_scales(q.scales, 256, 4096 // 16)
        return got, q, deq, mxq.swizzle_scales(lin)

    # Warm-up on s, before the race: the first launch of a kernel loads its module (CUDA's lazy
    # loading), which may synchronise the context, and s's allocator pool starts empty. Neither
    # happens again on later calls, which are what this test is about.
    with torch.cuda.stream(s):
        run_ops(src_gpu, src_gpu.clone())
    torch.cuda.synchronize()
    x = torch.zeros_like(src_gpu)
    inplace = torch.zeros_like(src_gpu)
    torch.cuda.synchronize()
    written = _write_late(x, src_gpu, s)
    written_inplace = _write_late(inplace, src_gpu, s)
    with torch.cuda.stream(s):
        got, q, deq, sw = run_ops(x, inplace)
    assert not written.query() and not written_inplace.query(), \
        "the busy-wait ended before the ops were enqueued: the test would prove nothing (raise SLEEP_CYCLES)"
    torch.cuda.synchronize()
    for what, e in expect.items():
        assert_bytes_equal(got[what], e, f"on the side stream: {what}")
    assert_bytes_equal(q.codes, qc.codes, "on the side stream: quantize codes")
    assert_bytes_equal(q.scales, qc.scales, "on the side stream: quantize scales")
    assert_bytes_equal(q.tensor_scale, qc.tensor_scale, "on the side stream: quantize tensor scale")
    assert_bytes_equal(deq, qc.dequantize(torch.bfloat16), "on the side stream: dequantize")
    assert_bytes_equal(sw, qc.scales, "on the side stream: unswizzle + swizzle")

    # Control: issued on the default stream, not ordered after s, the same op reads the stale zeros.
    stale = torch.zeros_like(src_gpu)
    torch.cuda.synchronize()
    written = _write_late(stale, src_gpu, s)
    wrong = mxq.qdq(stale, "mxfp4", rule="even")  # the current stream here is the default stream
    assert not written.query()
    torch.cuda.synchronize()
    assert_bytes_equal(wrong, torch.zeros_like(wrong), "control: the default stream saw the stale input")
    assert_bytes_equal(stale, src_gpu, "control: the write did land, later")


def test_cuda_device_mismatch_is_refused():
    x = _x((256, 4096)).cuda()
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

    # (capture mode "global", torch's default: a launch on the legacy default stream during the
    # capture, which runs on a side stream, fails it, so every op below is also checked to use the
    # current stream)
    def work():
        y = mxq.qdq(static_x, "nvfp4")  # computed tensor scale: a 4-byte workspace, no sync
        q = mxq.quantize(static_x, "nvfp4", layout="swizzled")
        z = mxq.qdq(static_x, "mxfp4", rule="even", stochastic=True, seed=5)
        mxq.qdq_(target, "mxfp8")
        c, s = Q.fusedQuantizeMx(static_x, None, method="quest")
        qm = mxq.quantize(static_x, "mxfp4", rule="even", layout="swizzled")
        lin = mxq.unswizzle_scales(qm.scales, 512, 2048 // 32)
        d = mxq.dequantize(qm.codes, mxq.swizzle_scales(lin), format="mxfp4", cols=2048, layout="swizzled",
                           dtype=torch.bfloat16)
        return y, q.codes, q.scales, q.tensor_scale, z, c, s, lin, d

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
                  mxq.qdq(new.cpu(), "mxfp4", rule="even", stochastic=True, seed=5), cq, sq,
                  mxq.quantize(new.cpu(), "mxfp4", rule="even").scales, mxq.qdq(new.cpu(), "mxfp4", rule="even"))
        for a, e, what in zip(outs, expect, ["qdq", "codes", "scales", "S", "stochastic", "qutlass codes", "scales",
                                             "unswizzled", "dequantize"]):
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
    for g in anchors.NV_GLOBAL_SCALES:
        gs = torch.tensor([g])
        for a, b in zip(Q.fusedQuantizeNv(x.cuda(), None, gs.cuda()), Q.fusedQuantizeNv(x, None, gs)):
            assert_bytes_equal(a, b, f"fusedQuantizeNv at global scale {g:g}")
    sc = Q.fusedQuantizeMx(x, None)[1]
    assert_bytes_equal(Q.to_blocked(sc.cuda()), Q.to_blocked(sc), "to_blocked")
    eye = torch.eye(32, dtype=torch.bfloat16, device="cuda")
    assert_bytes_equal(Q.fusedQuantizeMx(x.cuda(), eye)[0], Q.fusedQuantizeMx(x, None)[0], "identity rotation")
    # QuTLASS's Hadamard matrix (bf16, scaled): the exact rotation on the GPU's float64 matmul gives the
    # CPU's bytes (ordinary data: the float64 sums are exact)
    from test_compat import _hadamard_bf16
    for rs in (16, 128):
        h = _hadamard_bf16(rs)
        for method in ("quest", "abs_max"):
            for a, b in zip(Q.fusedQuantizeMx(x.cuda(), h.cuda(), method=method), Q.fusedQuantizeMx(x, h, method=method)):
                assert_bytes_equal(a, b, f"fusedQuantizeMx {method} with a Hadamard {rs}")
        for a, b in zip(Q.fusedQuantizeNv(x.cuda(), h.cuda(), 3.0), Q.fusedQuantizeNv(x, h, 3.0)):
            assert_bytes_equal(a, b, f"fusedQuantizeNv with a Hadamard {rs}")


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


def test_cuda_emulate_moe_grouped_graph():
    """Emulated Qwen3-MoE experts through transformers' grouped_mm function: a forward is captured in a
    CUDA graph (no host synchronisation) and its replay equals the eager forward, byte for byte."""
    transformers = pytest.importorskip("transformers")
    moe = pytest.importorskip("transformers.integrations.moe")
    if not hasattr(transformers, "Qwen3MoeConfig") or "grouped_mm" not in moe.ALL_EXPERTS_FUNCTIONS:
        pytest.skip("transformers without Qwen3-MoE's grouped_mm experts")
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16).cuda()
    model.config._experts_implementation = "grouped_mm"
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        base = model(ids).logits
        h = mxq.emulate(model, weights="mxfp4", activations="mxfp4")
        assert any(isinstance(m, mxq.QDQExperts) for m in model.modules())
        eager = model(ids).logits
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(ids)  # warm-up off the default stream, as torch.cuda.graph wants
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(ids).logits
        g.replay()
        torch.cuda.synchronize()
        assert_bytes_equal(out, eager, "graph replay of the emulated MoE")
        assert not torch.equal(eager, base), "emulation changes the logits"
        h.restore()


@pytest.mark.parametrize("gs", anchors.NV_GLOBAL_SCALES, ids=lambda g: f"gs={g:g}")
def test_cuda_qutlass_global_scales_equal_cpu(gs):
    """fusedQuantizeNv and NVFP4 with a given tensor scale at awkward global scales (saturating and
    underflowing E4M3 block scales): the GPU's bytes are the CPU's (which test_compat.py checks
    against QuTLASS's arithmetic)."""
    from test_compat import _qutlass_data

    x = _qutlass_data()
    for a, b in zip(Q.fusedQuantizeNv(x.cuda(), None, gs), Q.fusedQuantizeNv(x, None, gs)):
        assert_bytes_equal(a, b, f"fusedQuantizeNv gs={gs:g}")
    assert_bytes_equal(mxq.qdq(x.cuda(), "nvfp4", tensor_scale=gs), mxq.qdq(x, "nvfp4", tensor_scale=gs), "qdq")
    qg = mxq.quantize(x.cuda(), "nvfp4", tensor_scale=gs, layout="swizzled")
    qc = mxq.quantize(x, "nvfp4", tensor_scale=gs, layout="swizzled")
    assert_bytes_equal(qg.scales, qc.scales, "swizzled scales")
    assert_bytes_equal(qg.dequantize(torch.float32), qc.dequantize(torch.float32), "dequantize")


def test_cuda_autograd_straight_through_and_compile():
    """The STE on the GPU, eagerly and compiled with inductor (fullgraph, backward)."""
    torch._dynamo.reset()
    x = _x((64, 1024), torch.float32).cuda().requires_grad_()
    g = torch.randn(64, 1024, device="cuda")
    y = mxq.qdq(x, "nvfp4")
    (gx,) = torch.autograd.grad(y, x, g)
    assert_bytes_equal(gx, g, "eager STE on CUDA")

    def f(x):
        return (mxq.qdq(x, "mxfp4", rule="even") * g).sum()

    (gc,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="inductor")(x), x)
    assert_bytes_equal(gc, g, "compiled STE on CUDA")
    with pytest.raises(RuntimeError, match="not differentiable"):
        mxq.quantize(x, "mxfp4")


def test_cuda_torch_compile_dynamic_does_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def f(x):
        q = mxq.quantize(x, "nvfp4", layout="swizzled", tensor_scale=100.0)
        return mxq.qdq(x, "mxfp4", rule="even"), q.dequantize(torch.float32)

    cf = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for rows in (5, 9, 13):
        x = _x((rows, 256), seed=rows).cuda()
        for a, e in zip(cf(x), f(x)):
            assert_bytes_equal(a, e, f"compiled dynamic at {rows} rows")
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (16, 4096), (3, 5504), (5, 100), (2, 40000)], ids=str)
@pytest.mark.parametrize("fmt,rule", [("mxfp4", "even"), ("mxfp4", "quest"), ("mxfp8_e4m3", "floor"),
                                      ("mxint8", "floor"), ("nvfp4", None), (None, None)])
def test_cuda_fused_producers_equal_cpu(fmt, rule, dtype, shape):
    g = torch.Generator().manual_seed(5)
    x = _x(shape, dtype)
    w = (torch.rand(shape[-1], generator=g) * 1.75 + 0.25).to(dtype)
    gate = (torch.randn(shape, generator=g) * 6).to(dtype)
    up = torch.randn(shape, generator=g).to(dtype)
    kw = {} if fmt is None else {"format": fmt, "rule": rule, "tensor_scale": 448.0 * 6 / 5 if fmt == "nvfp4" else None}
    assert_bytes_equal(mxq.rms_norm(x.cuda(), w.cuda(), 1e-6, **kw), mxq.rms_norm(x, w, 1e-6, **kw), f"rms_norm {kw}")
    assert_bytes_equal(mxq.silu_mul(gate.cuda(), up.cuda(), **kw), mxq.silu_mul(gate, up, **kw), f"silu_mul {kw}")


def test_cuda_fused_producers_graph_compile_and_emulate():
    x = _x((16, 2048)).cuda()
    w = torch.rand(2048, device="cuda").to(torch.bfloat16) + 0.5
    gu = _x((16, 2 * 2048), seed=2).cuda()
    gate, up = gu.chunk(2, dim=-1)

    def f(x, gate, up):
        return mxq.rms_norm(x, w, 1e-6, format="mxfp4", rule="even"), mxq.silu_mul(gate, up, format="mxfp4")

    expect = f(x, gate, up)
    got = torch.compile(f, fullgraph=True)(x, gate, up)
    for a, b in zip(got, expect):
        assert_bytes_equal(a, b, "compiled")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        f(x, gate, up)  # warm-up on the side stream
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(x, gate, up)
    x.copy_(_x((16, 2048), seed=9).cuda())
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, f(x, gate, up)):
        assert_bytes_equal(a, b, "graph replay")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = mxq.emulate(model, weights="mxfp4", activations={"format": "mxfp4", "rule": "even"}, fuse=True)
        assert h.fused == 6
        cpu_logits = model(ids).logits
        model.cuda()
        gpu_logits = model(ids.cuda()).logits
    # the same fused ops on both devices; the matmuls differ (CPU vs cuBLAS), so close, not equal
    assert ((gpu_logits.float().cpu() - cpu_logits.float()).norm() / cpu_logits.float().norm()) < 0.05


@pytest.mark.parametrize("rotation", ["had16", "had128", "rhad256", "rhad32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt,rule", [("mxfp4", "even"), ("mxfp4", "quest"), ("mxfp8_e4m3", "floor"), ("nvfp4", None)])
def test_cuda_rotation_equals_cpu(fmt, rule, dtype, rotation):
    x = _x((48, 512), dtype, seed=3)
    xc = x.cuda()
    kw = dict(rule=rule, rotation=rotation, rotation_seed=11)
    assert_bytes_equal(mxq.qdq(xc, fmt, **kw), mxq.qdq(x, fmt, **kw), f"qdq {fmt} {rotation}")
    qg, qc = mxq.quantize(xc, fmt, layout="swizzled", **kw), mxq.quantize(x, fmt, layout="swizzled", **kw)
    assert_bytes_equal(qg.codes, qc.codes, "codes")
    assert_bytes_equal(qg.scales, qc.scales, "scales")
    if fmt == "nvfp4":
        assert_bytes_equal(qg.tensor_scale, qc.tensor_scale, "tensor scale")
    assert_bytes_equal(qg.dequantize(), qc.dequantize(), "dequantize + un-rotate")
    sg = mxq.qdq(xc, fmt, stochastic=True, seed=5, random_bits=16, **kw)
    assert_bytes_equal(sg, mxq.qdq(x, fmt, stochastic=True, seed=5, random_bits=16, **kw), "stochastic")


def test_cuda_rotation_graph_and_compile():
    x = _x((16, 1024)).cuda()
    ref = mxq.qdq(x, "mxfp4", rule="even", rotation="had128")
    f = torch.compile(lambda t: mxq.qdq(t, "mxfp4", rule="even", rotation="had128"), fullgraph=True)
    assert_bytes_equal(f(x), ref, "compiled")
    y = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y.copy_(mxq.qdq(x, "mxfp4", rule="even", rotation="had128"))  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.copy_(mxq.qdq(x, "mxfp4", rule="even", rotation="had128"))
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(y, ref, "graph replay")


def _orthogonal(rs: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(rs, rs, dtype=torch.float64, generator=g))
    return q.to(dtype)


@pytest.mark.parametrize("rs", [16, 128])
@pytest.mark.parametrize("mdtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt,rule", [("mxfp4", "even"), ("mxfp8_e4m3", "floor"), ("nvfp4", None)])
def test_cuda_matrix_rotation_equals_cpu(fmt, rule, mdtype, rs):
    """rotation= a matrix on GPU tensors (mxq's CUDA kernels: float64 sums on the FP64 tensor cores)
    against CPU tensors (mxq's CPU kernels): the same bytes, also on rows whose float64 sums depend on
    their order (the matrix below holds +-2^30 pairs that cancel on constant rows); dequantize rotated
    back; qdq_ in place; a CPU matrix with GPU data is moved to the GPU."""
    x = _x((24, 512), torch.bfloat16, seed=7)
    x[0], x[1] = 1.0, -2.5
    m = _orthogonal(rs, mdtype, 2)
    if mdtype == torch.float32:  # +-2^30 at (j, j) and (j + RS/2, j): cancelled sums on rows 0 and 1
        idx = torch.arange(rs)
        m[idx, idx] = 2.0 ** 30
        m[(idx + rs // 2) % rs, idx] = -(2.0 ** 30)
    xc, mc = x.cuda(), m.cuda()
    assert_bytes_equal(mxq.qdq(xc, fmt, rule=rule, rotation=mc), mxq.qdq(x, fmt, rule=rule, rotation=m), "qdq")
    # R^-1 given: the wide matrix is ill-conditioned (its +-2^30 part is singular), so an inverse is only
    # reproducible when it is the same tensor (mxq computes a missing one on the CPU either way)
    inv = torch.linalg.inv(m.double()).float()
    qg = mxq.quantize(xc, fmt, rule=rule, rotation=mc, rotation_inverse=inv.cuda())
    qc = mxq.quantize(x, fmt, rule=rule, rotation=m, rotation_inverse=inv)
    assert_bytes_equal(qg.codes, qc.codes, "codes")
    assert_bytes_equal(qg.scales, qc.scales, "scales")
    if fmt == "nvfp4":
        assert_bytes_equal(qg.tensor_scale, qc.tensor_scale, "tensor scale")
    assert_bytes_equal(qg.dequantize(), qc.dequantize(), "dequantize + R^-1")
    if mdtype == torch.bfloat16:  # R^-1 computed by mxq (on the CPU for both): the same bytes
        qg2, qc2 = mxq.quantize(xc, fmt, rule=rule, rotation=mc), mxq.quantize(x, fmt, rule=rule, rotation=m)
        assert_bytes_equal(qg2.dequantize(), qc2.dequantize(), "dequantize + computed R^-1")
    u, v = xc.clone(), x.clone()
    mxq.qdq_(u, fmt, rule=rule, rotation=mc)
    mxq.qdq_(v, fmt, rule=rule, rotation=m)
    assert_bytes_equal(u, v, "qdq_")
    assert_bytes_equal(mxq.qdq(xc, fmt, rule=rule, rotation=m), mxq.qdq(x, fmt, rule=rule, rotation=m), "CPU matrix")
    xf = x.float()
    assert_bytes_equal(mxq.qdq(xf.cuda(), fmt, rule=rule, rotation=mc), mxq.qdq(xf, fmt, rule=rule, rotation=m), "fp32 qdq")


def test_cuda_matrix_rotation_graph_and_compile():
    x = _x((16, 1024)).cuda()
    m = _orthogonal(64, torch.bfloat16, 4).cuda()
    ref = mxq.qdq(x, "mxfp4", rule="even", rotation=m)
    torch._dynamo.reset()
    f = torch.compile(lambda t: mxq.qdq(t, "mxfp4", rule="even", rotation=m), fullgraph=True)
    assert_bytes_equal(f(x), ref, "compiled")
    y = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y.copy_(mxq.qdq(x, "mxfp4", rule="even", rotation=m))  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.copy_(mxq.qdq(x, "mxfp4", rule="even", rotation=m))
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(y, ref, "graph replay")


@pytest.mark.parametrize("fmt,rule", [("mxfp4", "even"), ("nvfp4", None)])
def test_cuda_matrix_bf16_precision(fmt, rule):
    """matrix_precision="bf16" on GPU tensors (the bf16 tensor cores' sums, within the stated bound of
    the exact ones; the bound itself is traced code by code in rotation_test): nearly every code and
    scale byte equals the exact mode's (CPU), each differing code is one step away (a value within the
    bound of a rounding boundary), qdq is the codes decoded, qdq_ equals qdq, and it runs in torch.compile
    and a CUDA graph."""
    x = _x((64, 4096), torch.bfloat16, seed=11)
    m = _orthogonal(128, torch.bfloat16, 5)
    xc, mc = x.cuda(), m.cuda()
    qg = mxq.quantize(xc, fmt, rule=rule, rotation=mc, matrix_precision="bf16")
    qc = mxq.quantize(x, fmt, rule=rule, rotation=m)
    same = qg.scales.cpu() == qc.scales
    assert same.float().mean().item() > 0.999, same.float().mean().item()
    gc, cc = qg.codes.cpu(), qc.codes.cpu()
    lo_g, lo_c, hi_g, hi_c = gc & 15, cc & 15, gc >> 4, cc >> 4
    differ = ((lo_g != lo_c) | (hi_g != hi_c)).float().mean().item()
    assert differ < 1e-3, differ
    # In blocks of equal scales, a differing code is one step away: E2M1 magnitudes are ordered by their
    # 3-bit codes, and a sign differs only where both round to zero (a value within the bound of 0).
    in_same = same.repeat_interleave(qg.group_size // 2, dim=1)
    for g, c in ((lo_g, lo_c), (hi_g, hi_c)):
        mg, mc_ = (g & 7).to(torch.int16), (c & 7).to(torch.int16)
        assert int(((mg - mc_).abs() * in_same).max()) <= 1, "a code more than one step from the exact mode's"
        flipped = ((g >> 3) != (c >> 3)) & in_same
        assert bool(((mg == 0) & (mc_ == 0))[flipped].all()), "a sign flipped on a non-zero code"
    y = mxq.qdq(xc, fmt, rule=rule, rotation=mc, matrix_precision="bf16")
    plain = mxq.dequantize(qg.codes, qg.scales, format=fmt, cols=4096, tensor_scale=qg.tensor_scale,
                           dtype=torch.bfloat16)
    assert_bytes_equal(y, plain, "qdq = the bf16-precision codes decoded")
    u = xc.clone()
    mxq.qdq_(u, fmt, rule=rule, rotation=mc, matrix_precision="bf16")
    assert_bytes_equal(u, y, "qdq_")
    torch._dynamo.reset()
    f = torch.compile(lambda t: mxq.qdq(t, fmt, rule=rule, rotation=mc, matrix_precision="bf16"), fullgraph=True)
    assert_bytes_equal(f(xc), y, "compiled")
    out = torch.empty_like(xc)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(mxq.qdq(xc, fmt, rule=rule, rotation=mc, matrix_precision="bf16"))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(mxq.qdq(xc, fmt, rule=rule, rotation=mc, matrix_precision="bf16"))
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(out, y, "graph replay")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_nvfp4_quest_equals_cpu(dtype):
    x = _x((130, 4096 + 16), dtype, seed=9)
    x[0, :16] = torch.tensor([3e38, 3e38, -3e38, -3e38] * 4, dtype=torch.float32).to(dtype)  # a NaN statistic
    xc = x.cuda()
    assert int(mxq.quantize(x, "nvfp4", rule="quest").scales[0, 0]) == 0x7F
    for kw in (dict(), dict(stochastic=True, seed=3), dict(rotation="had64"), dict(group_size=32)):
        # a rotation needs K % 64 == 0; the others keep K = 4112 (a ragged last block at group_size 32)
        xk, xkc = (x[:, :4096].contiguous(), xc[:, :4096].contiguous()) if "rotation" in kw else (x, xc)
        assert_bytes_equal(mxq.qdq(xkc, "nvfp4", rule="quest", **kw), mxq.qdq(xk, "nvfp4", rule="quest", **kw), f"qdq {kw}")
        for layout in ("linear", "swizzled"):
            qg = mxq.quantize(xkc, "nvfp4", rule="quest", layout=layout, clip_mask=True, **kw)
            qc = mxq.quantize(xk, "nvfp4", rule="quest", layout=layout, clip_mask=True, **kw)
            assert_bytes_equal(qg.codes, qc.codes, f"codes {kw} {layout}")
            assert_bytes_equal(qg.scales, qc.scales, f"scales {kw} {layout}")
            assert_bytes_equal(qg.clip_mask, qc.clip_mask, f"clip mask {kw} {layout}")
            assert float(qg.tensor_scale) == 1.0
            assert_bytes_equal(qg.dequantize(), qc.dequantize(), f"dequantize {kw} {layout}")
