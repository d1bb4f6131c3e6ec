"""mxq.moe (the W4A16 MoE) from Python: the op against a per-expert loop of the dense reference (mxq.linear on
each expert's rows, the activation in float64, the weighted fp32 sum over slots), routing edge cases, id and
weight dtypes, errors, the fake implementation under torch.compile(fullgraph=True), transformers' Qwen3-MoE
and gpt-oss experts on packed weights (logits against the dequantized model, generate), load_quantized_moe on
an `mxq quantize` checkpoint and on gpt-oss's own MXFP4 tensors; on a GPU with the CUDA MoE kernels: CUDA ==
CPU, determinism, CUDA-graph capture."""
from __future__ import annotations

import pytest
import torch

import mxq
from conftest import CUDA, assert_bytes_equal

BLOCK = {"mxfp4": 32, "nvfp4": 16}


needs_cuda_moe = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and mxq built with CUDA")


def exact_experts(fmt: str, E: int, N: int, K: int, seed: int):
    """E experts with random codes and scales from a small set: with x in {-2..2} the first GEMM's fp32 sums are
    exact in any order. NVFP4 tensor scales: powers of two, one per expert."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    if fmt == "mxfp4":
        scales = torch.randint(126, 129, (E, N, K // 32), dtype=torch.uint8, generator=g)
    else:
        choice = torch.tensor([0x30, 0x38, 0x3C, 0x40, 0x44], dtype=torch.uint8)
        scales = choice[torch.randint(0, 5, (E, N, K // 16), generator=g)]
    S = [float(2 ** (e % 3)) for e in range(E)] if fmt == "nvfp4" else None
    return codes, scales, S


def dequantized(codes, scales, fmt, S):
    """Expert weights [E, N, K] in float32 through mxq.dequantize (e2m1 * block scale exactly), / S."""
    out = []
    for e in range(codes.shape[0]):
        q = mxq.QuantizedTensor(codes[e], scales[e], torch.tensor([1.0]) if fmt == "nvfp4" else None, fmt,
                                "nvfp4" if fmt == "nvfp4" else "floor", "linear", BLOCK[fmt],
                                torch.Size((codes.shape[1], 2 * codes.shape[2])), torch.float32,
                                tensor_scale_value=1.0 if fmt == "nvfp4" else None)
        out.append(q.dequantize(torch.float32))
    return torch.stack(out), (torch.tensor(S) if S else torch.ones(codes.shape[0]))


def activation64(h: torch.Tensor, act: str, alpha=1.702, limit=7.0) -> torch.Tensor:
    h = h.double()
    if act == "none":
        return h
    if act == "swiglu":
        I = h.shape[-1] // 2
        g, u = h[..., :I], h[..., I:]
        return g / (1 + torch.exp(-g)) * u
    g, u = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (u + 1) * g * torch.sigmoid(alpha * g)


def oracle(x, w13, w2, ids, tw, act, b13=None, b2=None):
    """A per-expert loop of the dense reference: h = mxq.linear(x rows, expert e) on the tokens routed to e;
    a = the activation in float64 rounded to the dtype; o = (a @ W2[e]^T in float64) / S + b2 times the weight;
    y = the sum over slots in fp32, rounded once. Also returns the bound |y - oracle| may reach from the fp32
    order of the second GEMM's sums and a last-bit activation difference: ulp terms of sum |a_i W_i|."""
    T, k = ids.shape
    P = T * k
    N13 = w13.N
    h = torch.empty(P, N13, dtype=x.dtype)
    flat = ids.reshape(-1).long()
    for e in range(w13.E):
        pairs = (flat == e).nonzero().reshape(-1)
        if pairs.numel() == 0:
            continue
        we = mxq.PackedLinearWeight(w13.codes[e].reshape(-1, 512), w13.scales[e].reshape(-1, 64 if w13.format == "nvfp4" else 32),
                                    w13.format, w13.N, w13.K, int(w13.exp_shift[e]), w13.f16_exact, float(w13.tensor_scale[e]))
        h[pairs] = mxq.linear(x[pairs // k], we, None if b13 is None else b13[e])
    a = activation64(h, act).float().to(x.dtype)
    W2, S2 = w2._dq
    o = torch.empty(P, w2.N, dtype=torch.float64)
    mag = torch.empty(P, w2.N, dtype=torch.float64)
    for p in range(P):
        e = int(flat[p])
        v = (a[p].double() @ W2[e].double().T) / float(S2[e])
        mag[p] = (a[p].double().abs() @ W2[e].double().abs().T) / float(S2[e]) * float(tw.reshape(-1)[p].abs())
        if b2 is not None:
            v = v + b2[e].double()
        o[p] = v.float().double() * float(tw.reshape(-1)[p].float())
    y = o.reshape(T, k, -1).float().sum(1)
    return y.to(x.dtype), mag.reshape(T, k, -1).sum(1)


def make(fmt, act, E, H, I, seed):
    N13 = I if act == "none" else 2 * I
    c13, s13, S13 = exact_experts(fmt, E, N13, H, seed)
    c2, s2, S2 = exact_experts(fmt, E, H, I, seed + 1)
    w13 = mxq.prepack_experts(codes=c13, scales=s13, format=fmt, tensor_scale=S13)
    w2 = mxq.prepack_experts(codes=c2, scales=s2, format=fmt, tensor_scale=S2)
    w2._dq = dequantized(c2, s2, fmt, S2)
    return w13, w2


def routing(kind, T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "uneven":
        a, b = torch.randint(0, E, (T, k), generator=g), torch.randint(0, E, (T, k), generator=g)
        return (a * b // E).to(torch.int64)
    if kind == "one_expert":
        return torch.full((T, k), E // 2, dtype=torch.int64)
    return torch.where((torch.arange(T)[:, None] + torch.arange(k)) % 2 == 1, 1, E - 2).to(torch.int64)  # two experts


def check(y, want, mag, exact, what):
    if exact:
        assert_bytes_equal(y, want, what)
        return
    ulp = 2.0 ** -8 if y.dtype == torch.bfloat16 else 2.0 ** -11
    tol = mag * 2 * ulp + want.double().abs() * ulp
    bad = (y.double() - want.double()).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} outputs outside the bound, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ["none", "swiglu", "swiglu_oai"])
@pytest.mark.parametrize("T,k", [(1, 1), (7, 4), (64, 8), (1, 8)])
@pytest.mark.parametrize("kind", ["uneven", "one_expert", "two_experts"])
def test_moe_matches_per_expert_reference(fmt, dtype, act, T, k, kind):
    E, H, I = 8, (48 if fmt == "nvfp4" else 64), (16 if fmt == "nvfp4" else 32)
    w13, w2 = make(fmt, act, E, H, I, T * 10 + k)
    g = torch.Generator().manual_seed(T)
    x = torch.randint(-2, 3, (T, H), generator=g).to(dtype)
    ids = routing(kind, T, k, E, T + k)
    tw = (torch.randint(1, 9, (T, k), generator=g) / 8).float()
    bias = (T + k) % 2 == 0
    b13 = (torch.arange(E * w13.N).reshape(E, -1) % 9 - 4).to(dtype) if bias else None
    b2 = (torch.arange(E * H).reshape(E, -1) % 7 - 3).to(dtype) if bias else None
    y = mxq.moe(x, w13, w2, ids, tw, b13=b13, b2=b2, activation=act)
    want, mag = oracle(x, w13, w2, ids, tw, act, b13, b2)
    # none: every sum exact, so the bytes equal; the SwiGLUs: the second GEMM's fp32 order and exp's last bit
    check(y, want, mag, act == "none", f"{fmt} {dtype} {act} T={T} k={k} {kind}")


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_moe_id_weight_dtypes_and_leading_dims(id_dtype, w_dtype):
    w13, w2 = make("mxfp4", "swiglu", 6, 64, 32, 3)
    x = torch.randint(-2, 3, (2, 3, 64)).bfloat16()
    ids = routing("uneven", 6, 4, 6, 1).to(id_dtype).reshape(2, 3, 4)
    tw = (torch.randint(1, 9, (2, 3, 4)) / 8).to(w_dtype)
    y = mxq.moe(x, w13, w2, ids, tw)
    assert y.shape == (2, 3, 64)
    y2 = mxq.moe(x.reshape(6, 64), w13, w2, ids.reshape(6, 4).long(), tw.reshape(6, 4).float())
    assert_bytes_equal(y.reshape(6, 64), y2, "leading dims, id and weight dtypes")


def test_moe_big_T_reduced():
    """T = 4096, k = 4 on the CPU reference, reduced widths (H = 32, I = 16): the reference's cost grows with
    T * k * H * I; real widths are the GPU's."""
    w13, w2 = make("nvfp4", "none", 16, 32, 16, 5)
    x = torch.randint(-2, 3, (4096, 32)).bfloat16()
    ids = routing("uneven", 4096, 4, 16, 2)
    tw = (torch.randint(1, 9, (4096, 4)) / 8).float()
    y = mxq.moe(x, w13, w2, ids, tw, activation="none")
    want, mag = oracle(x, w13, w2, ids, tw, "none")
    check(y, want, mag, True, "T=4096")


def test_moe_prepack_forms_agree():
    w = torch.randn(4, 64, 96)
    q = mxq.quantize(w, "nvfp4")
    a = mxq.prepack_experts(q)
    b = mxq.prepack_experts([mxq.quantize(w[e], "nvfp4", tensor_scale=float(q.tensor_scale)) for e in range(4)])
    for f in ("codes", "scales", "exp_shift", "tensor_scale"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.E, a.N, a.K, a.format) == (4, 64, 96, "nvfp4")


def test_moe_errors():
    w13, w2 = make("mxfp4", "swiglu", 4, 64, 32, 1)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    tw = torch.ones(3, 2)
    bad = ids.clone()
    bad[2, 1] = 4
    with pytest.raises(ValueError, match="token 2, slot 1 routes to expert 4"):
        mxq.moe(x, w13, w2, bad, tw)
    with pytest.raises(ValueError, match="activation"):
        mxq.moe(x, w13, w2, ids, tw, activation="gelu")
    with pytest.raises(ValueError, match="w13.codes"):
        mxq.moe(x, w13, w2, ids, tw, activation="none")
    with pytest.raises(ValueError, match="topk_weights"):
        mxq.moe(x, w13, w2, ids, tw[:, :1])
    with pytest.raises(ValueError, match="b2"):
        mxq.moe(x, w13, w2, ids, tw, b2=torch.zeros(4, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        mxq.moe(x.float(), w13, w2, ids, tw)


def test_moe_torch_compile_fullgraph():
    w13, w2 = make("nvfp4", "swiglu_oai", 4, 48, 16, 2)
    x = torch.randint(-2, 3, (5, 48)).bfloat16()
    ids = routing("uneven", 5, 2, 4, 3)
    tw = torch.rand(5, 2)
    b13 = torch.randn(4, 32).bfloat16()
    f = torch.compile(lambda x, ids, tw: mxq.moe(x, w13, w2, ids, tw, b13=b13, activation="swiglu_oai"), fullgraph=True)
    assert_bytes_equal(f(x, ids, tw), mxq.moe(x, w13, w2, ids, tw, b13=b13, activation="swiglu_oai"), "compiled")


# ---- transformers -------------------------------------------------------------------------------------------
def _tiny_qwen3_moe(transformers):
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


def _tiny_gpt_oss(transformers):
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # biases are zero at init; give them values so that the fused bias path counts
        for name, p in model.named_parameters():
            if name.endswith("proj_bias"):
                p.normal_(0, 0.02)
    return model


def _dequantize_experts(model, fmt, **quantize_kwargs):
    """The model's experts replaced by their quantize-dequantize (bf16): the reference the packed model should match."""
    with torch.no_grad():
        for _, mod in model.named_modules():
            if hasattr(mod, "gate_up_proj") and getattr(mod.gate_up_proj, "dim", lambda: 0)() == 3:
                gpt = hasattr(mod, "gate_up_proj_bias")
                for pname in ("gate_up_proj", "down_proj"):
                    w = getattr(mod, pname).detach().float()
                    w = w.transpose(1, 2) if gpt else w
                    d = mxq.quantize(w.contiguous(), fmt, **quantize_kwargs).dequantize(torch.float32)
                    getattr(mod, pname).copy_((d.transpose(1, 2) if gpt else d).to(torch.bfloat16))


def _mean_err(a, b):
    return float((a.float() - b.float()).abs().mean())


@pytest.mark.parametrize("which", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_transformers_experts_on_packed_weights(which, fmt):
    """Packed experts give the logits of the dequantized bf16 model within its own bf16 rounding: the mean
    error against the float32 dequantized model is at most 1.5x (+1e-3) transformers' bf16 error on the
    same weights (transformers rounds every intermediate to bf16; mxq rounds fewer times). generate() runs."""
    transformers = pytest.importorskip("transformers")
    build = _tiny_qwen3_moe if which == "qwen3_moe" else _tiny_gpt_oss
    packed, ref = build(transformers), build(transformers)
    n = mxq.pack_experts(packed, fmt)
    assert n == 2 and isinstance(packed.model.layers[0].mlp.experts, mxq.QuantExperts)
    _dequantize_experts(ref, fmt)
    ref32 = build(transformers)
    _dequantize_experts(ref32, fmt)
    ref32 = ref32.float()
    ids = torch.tensor([[1, 5, 9, 2, 77, 3, 3, 120]])
    with torch.no_grad():
        lp, lr, l32 = packed(ids).logits, ref(ids).logits, ref32(ids).logits
        gen = packed.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(lp).all()
    assert _mean_err(lp, l32) <= 1.5 * _mean_err(lr, l32) + 1e-3, (_mean_err(lp, l32), _mean_err(lr, l32))
    assert gen.shape == (1, 12)


def test_load_quantized_moe_from_mxq_quantize(tmp_path):
    """`mxq quantize` of a Qwen3-MoE checkpoint (per-expert Linear weights on disk) -> load_quantized_moe puts the
    per-expert packed weights into the fused experts modules; the result equals pack_experts' bytes."""
    transformers = pytest.importorskip("transformers")
    from test_checkpoint_consumers import mxq as tool

    src, out = tmp_path / "bf16", tmp_path / "nvfp4"
    _tiny_qwen3_moe(transformers).save_pretrained(src)
    tool("quantize", str(src), "-o", str(out), "--format", "nvfp4", "--device", "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    assert mxq.load_quantized_moe(model, str(out)) == 2
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, mxq.QuantExperts) and experts.format == "nvfp4"
    assert mxq.load_quantized(model, str(out)) > 0  # the attention layers; the experts are done
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_load_quantized_moe_gpt_oss_native_mxfp4(tmp_path):
    """gpt-oss's own MXFP4 experts (X.gate_up_proj_blocks [E, 2I, H/32, 16] / _scales, down_proj likewise)."""
    transformers = pytest.importorskip("transformers")
    import json

    from safetensors.torch import save_file

    model = _tiny_gpt_oss(transformers)
    want = _tiny_gpt_oss(transformers)
    mxq.pack_experts(want, "mxfp4")
    tensors = {}
    for name, mod in model.named_modules():
        if type(mod).__name__ == "GptOssExperts":
            for p in ("gate_up_proj", "down_proj"):
                q = mxq.quantize(getattr(mod, p).detach().float().transpose(1, 2).contiguous(), "mxfp4")
                E, N, half = q.codes.shape
                tensors[f"{name}.{p}_blocks"] = q.codes.reshape(E, N, half // 16, 16).contiguous()
                tensors[f"{name}.{p}_scales"] = q.scales.contiguous()
                tensors[f"{name}.{p}_bias"] = getattr(mod, f"{p}_bias").detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    assert mxq.load_quantized_moe(model, str(tmp_path)) == 2
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert_bytes_equal(model(ids).logits, want(ids).logits, "gpt-oss blocks == pack_experts")


def test_mxq_quantize_gpt_oss_writes_native_mxfp4(tmp_path):
    """`mxq quantize --format mxfp4` of a bf16 gpt-oss checkpoint (transformers' save_pretrained) writes gpt-oss's own
    MXFP4 experts: load_quantized_moe reads them to exactly pack_experts' model, within the bf16 tolerance of the
    model with QDQ'd experts; generate() runs; transformers' own loader (dequantize mode, on the CPU) reads them too."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no GptOss")
    import json

    from test_checkpoint_consumers import mxq as tool

    src, out = tmp_path / "bf16", tmp_path / "mxfp4"
    _tiny_gpt_oss(transformers).save_pretrained(src)
    tool("quantize", str(src), "-o", str(out), "--format", "mxfp4", "--device", "cpu")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4" and "lm_head" in qc["modules_to_not_convert"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    assert mxq.load_quantized_moe(model, str(out)) == 2
    assert isinstance(model.model.layers[1].mlp.experts, mxq.QuantExperts)
    want = _tiny_gpt_oss(transformers)  # the tool's MX scale rule is `even` (compressed-tensors'; docs/cli.md)
    mxq.pack_experts(want, "mxfp4", rule="even")
    ref, ref32 = _tiny_gpt_oss(transformers), _tiny_gpt_oss(transformers)
    _dequantize_experts(ref, "mxfp4", rule="even")
    _dequantize_experts(ref32, "mxfp4", rule="even")
    ref32 = ref32.float()
    ids = torch.tensor([[1, 5, 9, 2, 77, 3, 3, 120]])
    with torch.no_grad():
        lp, lr, l32 = model(ids).logits, ref(ids).logits, ref32(ids).logits
        assert_bytes_equal(lp, want(ids).logits, "mxq quantize's gpt-oss blocks == pack_experts")
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(lp).all()
    assert _mean_err(lp, l32) <= 1.5 * _mean_err(lr, l32) + 1e-3, (_mean_err(lp, l32), _mean_err(lr, l32))
    assert gen.shape == (1, 12)
    # transformers' gpt-oss MXFP4 loader, dequantizing to bf16 on the CPU: the QDQ'd model's logits
    try:
        tm = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    except (ImportError, RuntimeError, ValueError) as e:  # a transformers without a CPU path for it
        pytest.skip(f"transformers does not load gpt-oss MXFP4 on the CPU here: {e}")
    with torch.no_grad():
        lt = tm(ids).logits
    assert_bytes_equal(tm.model.layers[0].mlp.experts.down_proj.detach(), ref.model.layers[0].mlp.experts.down_proj.detach(),
                       "transformers' dequantized down_proj == mxq's QDQ")
    assert_bytes_equal(tm.model.layers[1].mlp.experts.gate_up_proj.detach(),
                       ref.model.layers[1].mlp.experts.gate_up_proj.detach(), "transformers' dequantized gate_up_proj == mxq's QDQ")
    assert _mean_err(lt, l32) <= 1.5 * _mean_err(lr, l32) + 1e-3, (_mean_err(lt, l32), _mean_err(lr, l32))


# ---- CUDA ---------------------------------------------------------------------------------------------------
@needs_cuda_moe
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ["none", "swiglu", "swiglu_oai"])
@pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (7, 4), (64, 8), (4096, 4)])
def test_cuda_matches_cpu(fmt, dtype, act, T, k):
    E, H, I = 16, (48 if fmt == "nvfp4" else 64), (16 if fmt == "nvfp4" else 32)
    w13, w2 = make(fmt, act, E, H, I, T + k)
    x = torch.randint(-2, 3, (T, H)).to(dtype)
    ids = routing("uneven", T, k, E, T)
    tw = (torch.randint(1, 9, (T, k)) / 8).float()
    b13, b2 = torch.randn(E, w13.N).to(dtype), torch.randn(E, H).to(dtype)
    want = mxq.moe(x, w13, w2, ids, tw, b13=b13, b2=b2, activation=act)
    got = mxq.moe(x.cuda(), w13.to("cuda"), w2.to("cuda"), ids.cuda(), tw.cuda(), b13=b13.cuda(), b2=b2.cuda(), activation=act)
    if act == "none":
        assert_bytes_equal(got.cpu(), want, "cuda == cpu")
    else:
        _, mag = oracle(x, w13, w2, ids, tw, act, b13, b2)
        check(got.cpu(), want, mag, False, "cuda ~ cpu")


@needs_cuda_moe
def test_cuda_deterministic_flag_and_graph_capture():
    w13, w2 = make("mxfp4", "swiglu", 8, 64, 32, 9)
    w13, w2 = w13.to("cuda"), w2.to("cuda")
    x = torch.randn(4, 64, device="cuda").bfloat16()
    ids = torch.randint(0, 8, (4, 2), device="cuda", dtype=torch.int32)
    tw = torch.rand(4, 2, device="cuda")
    a, b = mxq.moe(x, w13, w2, ids, tw), mxq.moe(x, w13, w2, ids, tw)
    assert_bytes_equal(a, b, "two runs")
    bad = ids.clone()
    bad[1, 0] = 99
    _, flag = mxq.moe(x, w13, w2, bad, tw, return_error_flag=True)
    assert int(flag.item()) != 0
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        mxq.moe(x, w13, w2, ids, tw)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mxq.moe(x, w13, w2, ids, tw)
    g.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(y, a, "graph replay")
