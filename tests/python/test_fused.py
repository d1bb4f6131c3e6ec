"""mxq.rms_norm and mxq.silu_mul (the fused producer ops) on the CPU: the fused QDQ is bit-identical to
qdq of the producer's output; the producers are within an ulp of transformers' modules; errors;
torch.compile; emulate(..., fuse=True) on a tiny Llama (the GPU's bytes are checked in test_cuda.py)."""
from __future__ import annotations

import pytest
import torch

import mxq
from conftest import assert_bytes_equal, llm_like
from mxq.emulate import FusedMLPQDQ, FusedRMSNormQDQ

FORMATS = [("mxfp4", "even"), ("mxfp4", "quest"), ("mxfp8_e4m3", "floor"), ("mxfp6_e2m3", "rceil"),
           ("mxint8", "floor"), ("nvfp4", None)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = llm_like(*shape, torch.float32, seed).clamp(-6e4, 6e4).to(dtype)
    w = (torch.rand(shape[-1], generator=g) * 1.75 + 0.25).to(dtype)
    up = (torch.randn(shape, generator=g)).to(dtype)
    gate = (torch.randn(shape, generator=g) * 6).to(dtype)
    return x, w, gate, up


def _ts(fmt):
    return 448.0 * 6.0 / 4.0 if fmt == "nvfp4" else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,rule", FORMATS)
def test_fused_equals_qdq_of_the_producer(fmt, rule, dtype):
    x, w, gate, up = _inputs((7, 520), dtype)
    ts = _ts(fmt)
    n = mxq.rms_norm(x, w, 1e-5)
    assert_bytes_equal(mxq.rms_norm(x, w, 1e-5, format=fmt, rule=rule, tensor_scale=ts),
                       mxq.qdq(n, fmt, rule=rule, tensor_scale=ts), f"rms_norm + {fmt}")
    s = mxq.silu_mul(gate, up)
    assert_bytes_equal(mxq.silu_mul(gate, up, format=fmt, rule=rule, tensor_scale=ts),
                       mxq.qdq(s, fmt, rule=rule, tensor_scale=ts), f"silu_mul + {fmt}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_producers_within_an_ulp_of_transformers(dtype):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w, gate, up = _inputs((16, 1024), dtype, seed=3)
    norm = LlamaRMSNorm(1024, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        ref = norm(x)
    got = mxq.rms_norm(x, w, 1e-6)
    # bf16/f16: within one ulp of the dtype (the casts hide the fp32 differences); fp32: a few ulp (the
    # order of the sum of squares, the correctly rounded 1/sqrt against torch's rsqrt)
    tol = (2 if dtype != torch.float32 else 8) * torch.finfo(dtype).eps

    def close(a, b):
        return bool(torch.all((a.float() - b.float()).abs() <= tol * b.float().abs() + torch.finfo(dtype).tiny))

    assert close(got, ref)
    ref_s = torch.nn.functional.silu(gate) * up
    got_s = mxq.silu_mul(gate, up)
    assert close(got_s, ref_s)
    # measured on torch 2.15's CPU kernels: bf16 and f16 identical, fp32 17% (norm) and 0.4% (SiLU) of
    # elements differ; the bound is loose on purpose (another torch may sum differently)
    if dtype != torch.float32:
        assert (got != ref).float().mean() < 0.05 and (got_s != ref_s).float().mean() < 0.05
    del transformers


def test_every_bf16_silu_equals_torch():
    """mxq's SiLU (its own exp) against torch's on every finite bf16 value: identical after the cast
    (measured on torch 2.15's CPU kernel)."""
    allb = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = allb[torch.isfinite(allb)].reshape(1, -1)
    assert_bytes_equal(mxq.silu_mul(g, torch.ones_like(g)), torch.nn.functional.silu(g), "silu of every bf16")


def test_nd_strided_and_concatenated_halves():
    x, w, gate, up = _inputs((24, 96), torch.bfloat16)
    x, gate, up = x.reshape(4, 6, 96), gate.reshape(4, 6, 96), up.reshape(4, 6, 96)
    flat = mxq.rms_norm(x.reshape(24, 96), w, format="mxfp4", rule="even")
    assert_bytes_equal(mxq.rms_norm(x, w, format="mxfp4", rule="even"), flat.reshape(4, 6, 96), "3-D")
    xt = x.reshape(24, 96).t().contiguous().t()  # same values, column-major
    assert_bytes_equal(mxq.rms_norm(xt, w, format="mxfp4", rule="even"), flat, "non-contiguous")
    gu = torch.cat([gate, up], dim=-1)
    g2, u2 = gu.chunk(2, dim=-1)
    assert_bytes_equal(mxq.silu_mul(g2, u2, format="mxfp8_e4m3"), mxq.silu_mul(gate, up, format="mxfp8_e4m3"),
                       "halves of gate_up")


# With torch 2.11+cu130 (on an H200) a failing check whose message streamed an integer once crashed
# the process; the messages format numbers with std::to_string (python/csrc/ops.cpp). Run on every device.
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_errors_name_the_argument(device):
    x, w, gate, up = (t.to(device) for t in _inputs((2, 64), torch.bfloat16))
    with pytest.raises(ValueError, match="'weight'"):
        mxq.rms_norm(x, w[:32])
    with pytest.raises(ValueError, match="'weight'"):
        mxq.rms_norm(x, w.float())
    with pytest.raises(ValueError, match="'eps'"):
        mxq.rms_norm(x, w, -1.0)
    with pytest.raises(NotImplementedError, match="tensor_scale"):
        mxq.rms_norm(x, w, format="nvfp4")
    with pytest.raises(ValueError, match="need a 'format'"):
        mxq.silu_mul(gate, up, rule="even")
    with pytest.raises(ValueError, match="'up'"):
        mxq.silu_mul(gate, up[:, :32])
    with pytest.raises(ValueError, match="format"):
        mxq.silu_mul(gate, up, format="mxfp5")


def test_torch_compile_fullgraph_and_opcheck():
    x, w, gate, up = _inputs((8, 128), torch.bfloat16)

    def f(x, w, gate, up):
        return mxq.rms_norm(x, w, 1e-6, format="mxfp4", rule="even") + mxq.silu_mul(gate, up, format="mxfp4")

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, gate, up)
    assert_bytes_equal(got, f(x, w, gate, up), "compiled")
    torch.library.opcheck(torch.ops.mxq.rms_norm.default, (x, w, 1e-6, "mxfp4", "even", 0, None))
    torch.library.opcheck(torch.ops.mxq.silu_mul.default, (gate, up, None, "", 0, None))


def _tiny_llama(dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_emulate_fuse_llama(dtype):
    model = _tiny_llama(dtype)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
        h = mxq.emulate(model, weights="mxfp4", activations={"format": "mxfp4", "rule": "even"})
        unfused = model(ids).logits
        h.restore()
        h = mxq.emulate(model, weights="mxfp4", activations={"format": "mxfp4", "rule": "even"}, fuse=True)
        assert h.fused == 2 * 3  # per layer: input_layernorm, post_attention_layernorm, mlp
        layer = model.model.layers[0]
        assert isinstance(layer.input_layernorm, FusedRMSNormQDQ) and isinstance(layer.mlp, FusedMLPQDQ)
        assert all(getattr(layer.self_attn, n).activation_spec is None for n in ("q_proj", "k_proj", "v_proj"))
        assert layer.self_attn.o_proj.activation_spec is not None
        fused = model(ids).logits
        # Independent composition: the same layers, the norms' and MLPs' outputs QDQ'd explicitly.
        x = torch.randn(3, 64, dtype=dtype)
        assert_bytes_equal(layer.input_layernorm(x),
                           mxq.qdq(mxq.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps), "mxfp4",
                                   rule="even"), "fused norm module")
        mlp = layer.mlp
        y = mlp(x)
        mid = mxq.qdq(mxq.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)), "mxfp4", rule="even")
        assert_bytes_equal(y, torch.nn.functional.linear(mid, mlp.down_proj.weight), "fused MLP module")
        # close to the unfused emulation (the norms and SiLU differ by at most an ulp), not equal to bf16
        rel = ((fused - unfused).float().norm() / unfused.float().norm()).item()
        assert rel < 0.05, rel
        assert not torch.equal(fused, base)
        h.restore()
        assert_bytes_equal(model(ids).logits, base, "restored")
        assert not isinstance(model.model.layers[0].mlp, FusedMLPQDQ)


def test_emulate_fuse_refuses_what_it_cannot_fuse():
    model = _tiny_llama()
    with pytest.raises(ValueError, match="fuse=True"):
        mxq.emulate(model, weights="mxfp4", activations={"format": "mxfp4", "stochastic": True}, fuse=True)
    with pytest.raises(ValueError, match="fuse=True"):
        mxq.emulate(model, weights="mxfp4", activations="nvfp4", fuse=True)
    assert getattr(model, "_mxq_emulation", None) is None
    assert all(type(m) is not mxq.QDQLinear for m in model.modules()), "a refused emulate swaps nothing"


def test_no_gradient_is_refused_not_silently_cut():
    x, w, gate, up = _inputs((2, 64), torch.float32)
    with pytest.raises(NotImplementedError, match="no gradient"):
        mxq.rms_norm(x.requires_grad_(), w)
    with pytest.raises(NotImplementedError, match="no gradient"):
        mxq.silu_mul(gate, up.requires_grad_())
    with torch.no_grad():
        assert mxq.rms_norm(x, w).shape == x.shape


def test_emulate_fuse_only_layers_with_llamas_dataflow(monkeypatch):
    """The attribute names alone do not say where tensors flow (OLMo-2 applies post_attention_layernorm
    to the attention's output): only the decoder-layer classes in FUSABLE_LAYERS are fused."""
    import sys

    model = _tiny_llama()
    monkeypatch.setattr(sys.modules["mxq.emulate"], "FUSABLE_LAYERS", frozenset())
    with torch.no_grad():
        h = mxq.emulate(model, weights="mxfp4", activations={"format": "mxfp4", "rule": "even"}, fuse=True)
    assert h.fused == 0
    assert all(m.activation_spec is not None for m in model.modules() if isinstance(m, mxq.QDQLinear))
    h.restore()
