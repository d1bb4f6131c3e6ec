"""mxq.emulate / mxq.restore on plain modules and on tiny randomly initialised transformers models
(built from configs: no download)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mxq
from conftest import assert_bytes_equal, needs_cuda


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.down = nn.Linear(96, 64, bias=False)
        self.lm_head = nn.Linear(64, 10)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


def test_emulate_plain_module_and_restore():
    torch.manual_seed(0)
    m = Tiny().to(torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    base = m(x)
    originals = {n: p for n, p in m.named_parameters()}
    h = mxq.emulate(m, weights="mxfp4", activations={"format": "mxfp8", "rule": "rceil"})
    assert h.names == ["up", "down"], "lm_head is excluded by default"
    assert isinstance(m.up, mxq.QDQLinear) and "mxfp4/floor" in repr(m.up)
    y = m(x)
    # The same computation written out: QDQ of the inputs per call, of the weights once.
    a = lambda t: mxq.qdq(t, "mxfp8", rule="rceil")
    wu, wd = mxq.qdq(originals["up.weight"], "mxfp4"), mxq.qdq(originals["down.weight"], "mxfp4")
    h1 = torch.relu(nn.functional.linear(a(x), wu, originals["up.bias"]))
    expect = nn.functional.linear(nn.functional.linear(a(h1), wd), originals["lm_head.weight"],
                                  originals["lm_head.bias"])
    assert_bytes_equal(y, expect, "emulated forward")
    with pytest.raises(RuntimeError, match="already emulated"):
        mxq.emulate(m)
    mxq.restore(m)
    assert type(m.up) is nn.Linear and m.up.weight is originals["up.weight"]
    assert_bytes_equal(m(x), base, "restored forward")
    h2 = mxq.emulate(m, weights=None, activations="nvfp4", include=[r"^up$"], exclude=())
    assert h2.names == ["up"]
    h2.restore()
    assert mxq.emulate(m, exclude=(), filter=lambda n, mod: n == "lm_head").names == ["lm_head"]
    mxq.restore(m)
    with pytest.raises(ValueError, match="unknown format"):
        mxq.emulate(m, weights="fp3")
    with pytest.raises(ValueError, match="'format' key"):
        mxq.emulate(m, weights={"rule": "even"})
    with pytest.raises(ValueError, match=r"^mxq\.emulate: argument 'activations': rule 'quest' is not defined for format "
                                         r"'mxint8' \(.*\); mxint8 accepts floor, ceil, even, rceil$"):
        mxq.emulate(m, activations={"format": "mxint8", "rule": "quest"})
    assert not isinstance(m.up, mxq.QDQLinear)  # refused before any module was replaced


def test_a_spec_dict_takes_every_qdq_keyword_but_the_rotation():
    """A dict spec carries any of mxq.qdq's keyword arguments (each reaching the QDQ); the rotation ones
    are refused there (emulate's own rotation= applies to weights and activations together)."""
    torch.manual_seed(0)
    m = Tiny().to(torch.bfloat16)
    w = m.up.weight.detach().clone()
    spec = {"format": "mxfp4", "stochastic": True, "seed": 3, "random_bits": 8}
    h = mxq.emulate(m, weights=spec, activations=None)
    assert_bytes_equal(m.up.weight, mxq.qdq(w, "mxfp4", stochastic=True, seed=3, random_bits=8), "random_bits")
    assert not torch.equal(m.up.weight, mxq.qdq(w, "mxfp4", stochastic=True, seed=3)), "random_bits did not reach"
    h.restore()
    for key in ("rotation", "rotation_seed", "matrix_precision"):
        with pytest.raises(ValueError, match=r"emulate\(\.\.\., rotation=\.\.\.\)"):
            mxq.emulate(m, weights={"format": "mxfp4", key: None})


class Attention(nn.Module):
    """Three projections of one input (q/k/v), then one of their sum (o)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.o = nn.Linear(64, 64)

    def forward(self, x):
        return self.o(self.q(x) + self.k(x) * self.v(x))


def test_emulate_shares_one_activation_qdq_between_layers_reading_it():
    torch.manual_seed(0)
    m = Attention().to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    calls = []

    def counted(t):
        calls.append(t.shape)
        return mxq.qdq(t, "mxfp4")

    h = mxq.emulate(m, weights=None, activations=counted)
    y = m(x)
    assert len(calls) == 2, f"q/k/v share one QDQ of x, o has its own: {len(calls)} calls"
    calls.clear()
    assert_bytes_equal(m(x), y, "a second forward")
    assert len(calls) == 2, "the cache holds one entry, overwritten by o's input"
    x.mul_(2)  # an in-place write bumps the version counter: the entry is stale
    calls.clear()
    y2 = m(x)
    assert len(calls) == 2
    h.restore()
    assert h.cache.x is None and h.cache.out is None, "restore drops the references"
    # Without sharing: one QDQ per layer, the same bytes.
    calls.clear()
    h = mxq.emulate(m, weights=None, activations=counted, share_activations=False)
    assert_bytes_equal(m(x), y2, "shared and unshared emulation give the same output")
    assert len(calls) == 4
    h.restore()
    # The bytes against the computation written out.
    a = lambda t: mxq.qdq(t, "mxfp4")
    xq = a(x)
    expect = m.o(a(m.q(xq) + m.k(xq) * m.v(xq)))
    assert_bytes_equal(y2, expect, "emulated forward")


def test_emulate_with_a_callable_spec():
    """A callable stands in for mxq.qdq (a reference to compare with): applied to the weights once and
    to every input, nothing else."""
    torch.manual_seed(0)
    m = Tiny().to(torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    calls = []

    def halve(t):
        calls.append(tuple(t.shape))
        return t * 0.5

    originals = {n: p.detach().clone() for n, p in m.named_parameters()}
    h = mxq.emulate(m, weights=halve, activations=halve)
    assert calls == [(96, 64), (64, 96)] and "halve" in repr(m.up)
    y = m(x)
    h1 = torch.relu(nn.functional.linear(x * 0.5, originals["up.weight"] * 0.5, originals["up.bias"]))
    expect = nn.functional.linear(nn.functional.linear(h1 * 0.5, originals["down.weight"] * 0.5),
                                  originals["lm_head.weight"], originals["lm_head.bias"])
    assert_bytes_equal(y, expect, "forward with a callable spec")
    h.restore()
    with pytest.raises(TypeError, match="a callable"):
        mxq.emulate(m, weights=3)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_emulate_llama():
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids).logits
        h = mxq.emulate(model, weights="mxfp4", activations="mxfp4")
        names = h.names
        assert len(names) == 2 * 7 and all("layers." in n for n in names)  # q k v o gate up down per layer
        emu = model(ids).logits
        # Independent mechanism: QDQ'd weights copied into the original modules, inputs QDQ'd by hooks.
        h.restore()
        ref = _tiny_llama()
        hooks = []
        for name, mod in ref.named_modules():
            if name in names:
                mod.weight.copy_(mxq.qdq(mod.weight, "mxfp4"))
                hooks.append(mod.register_forward_pre_hook(lambda m, args: (mxq.qdq(args[0], "mxfp4"),)))
        expect = ref(ids).logits
        for hk in hooks:
            hk.remove()
        assert_bytes_equal(emu, expect, "emulated Llama logits")
        assert not torch.equal(emu, base), "emulation changes the logits"
        assert_bytes_equal(model(ids).logits, base, "restored Llama logits")
        out = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False) if hasattr(model, "generate") else None
        assert out is None or out.shape == (1, 7)


@pytest.mark.parametrize("rot", [None, "had32"])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_emulate_qwen3_moe_experts(impl, rot):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("transformers without Qwen3-MoE")
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    experts = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.experts")]
    if not experts or not hasattr(experts[0][1], "gate_up_proj"):
        pytest.skip("this transformers has no 3-D experts module")
    name, ex = experts[0]
    if impl != "eager":
        moe = pytest.importorskip("transformers.integrations.moe")
        if impl not in moe.ALL_EXPERTS_FUNCTIONS:
            pytest.skip(f"this transformers has no {impl} experts function")
    model.config._experts_implementation = impl  # read on every call, by transformers and by QDQExperts
    gu, dn = ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = model(ids).logits
        rk = {"rotation": rot} if rot else {}  # had32: H = 64 and I = 32 along the experts' contractions
        h = mxq.emulate(model, weights="mxfp4", activations="mxfp8", **rk)
        assert name in h.names and isinstance(model.get_submodule(name), mxq.QDQExperts) and h.unrotated == []
        assert not any("mlp.gate" == n.split(".", 3)[-1] for n in h.names)
        new = model.get_submodule(name)
        assert_bytes_equal(new.gate_up_proj, mxq.qdq(gu, "mxfp4", **rk), "3-D expert weights QDQ'd along K")
        # The experts module against the same loop written out with per-expert gathers.
        hs = torch.randn(7, 64)
        idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2], [1, 3], [3, 1]])
        w = torch.rand(7, 2)
        got = new(hs, idx, w)
        expect = torch.zeros_like(hs)
        a = lambda t: mxq.qdq(t, "mxfp8", **rk)
        for t in range(7):
            for j in range(2):
                e = int(idx[t, j])
                g_, u_ = nn.functional.linear(a(hs[t:t + 1]), mxq.qdq(gu[e], "mxfp4", **rk)).chunk(2, -1)
                expect[t] += (nn.functional.linear(a(ex.act_fn(g_) * u_), mxq.qdq(dn[e], "mxfp4", **rk)) * w[t, j])[0]
        # NOTE: a tolerance only for the fp32 GEMM: the module multiplies each expert's gathered tokens at once,
        # this loop one token at a time (another accumulation order); the QDQ'd weights are compared exactly above.
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)
        assert f"experts_implementation={impl}" in repr(new)
        emu = model(ids).logits
        assert emu.shape == base.shape and not torch.equal(emu, base)
        h.restore()
        assert model.get_submodule(name) is ex
        assert_bytes_equal(model(ids).logits, base, "restored MoE logits")


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum())).item()


DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_emulate_rotation_computes_the_rotated_products(device: str):
    """emulate(..., rotation=): each swapped Linear computes F.linear(qdq(x R), qdq(W R), b) (both in the
    rotated domain, so x W^T before quantization); a layer whose K the size does not divide is swapped
    without it and listed. On CUDA the bf16 matrix takes the tensor cores on both sides."""
    torch.manual_seed(0)
    m = Tiny().to(torch.bfloat16).to(device)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16).to(device)
    orig = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        h = mxq.emulate(m, weights="mxfp4", activations={"format": "nvfp4", "tensor_scale": 30.0}, rotation="had64")
        assert h.names == ["up", "down"] and h.unrotated == ["down"], (h.names, h.unrotated)
        assert "rotation=had64" in repr(m.up) and "rotation" not in repr(m.down)
        y = m(x)
        r = {"rotation": "had64"}
        a = lambda t, **kw: mxq.qdq(t, "nvfp4", tensor_scale=30.0, **kw)
        h1 = torch.relu(nn.functional.linear(a(x, **r), mxq.qdq(orig["up.weight"], "mxfp4", **r), orig["up.bias"]))
        h2 = nn.functional.linear(a(h1), mxq.qdq(orig["down.weight"], "mxfp4"))
        expect = nn.functional.linear(h2, orig["lm_head.weight"], orig["lm_head.bias"])
        assert_bytes_equal(y, expect, "emulated forward with a rotation")
        h.restore()
        # randomised signs (their seed), and a matrix (bf16, with the bf16 product: on the CPU the exact sums)
        q, _ = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
        R = q.to(torch.bfloat16)
        for rot, kw in (("rhad32", {"rotation_seed": 9}), (R, {"matrix_precision": "bf16"})):
            h = mxq.emulate(m, weights="mxfp4", activations="mxfp4", rotation=rot, **kw)
            assert h.unrotated == []
            y = m(x)
            rk = {"rotation": rot.to(device) if isinstance(rot, torch.Tensor) else rot, **kw}
            h1 = torch.relu(nn.functional.linear(mxq.qdq(x, "mxfp4", **rk), mxq.qdq(orig["up.weight"], "mxfp4", **rk),
                                                 orig["up.bias"]))
            h2 = nn.functional.linear(mxq.qdq(h1, "mxfp4", **rk), mxq.qdq(orig["down.weight"], "mxfp4", **rk))
            expect = nn.functional.linear(h2, orig["lm_head.weight"], orig["lm_head.bias"])
            assert_bytes_equal(y, expect, f"emulated forward, rotation {'matrix' if kw.get('matrix_precision') else rot}")
            if isinstance(rot, torch.Tensor):
                assert "a 32x32 matrix" in repr(m.up)
            h.restore()
    assert type(m.up) is nn.Linear


@pytest.mark.parametrize("device", DEVICES)
def test_emulate_rotation_spreads_outliers(device: str):
    """On activations with outlier channels, a Hadamard rotation makes QuTLASS's quest rule usable
    (docs/numerics.md: +6 to +14 dB): the emulated layer's output SQNR against the unquantized one."""
    torch.manual_seed(1)
    lin = nn.Linear(512, 256, bias=False).to(device)
    x = (torch.randn(64, 512) * 0.5).to(device)
    x[:, 7::97] *= 40.0  # outlier channels
    ref = lin(x).detach()
    spec = {"format": "mxfp4", "rule": "quest"}
    with torch.no_grad():
        model = nn.Sequential(lin)
        h = mxq.emulate(model, weights=spec, activations=spec)
        plain = _sqnr(ref, model(x))
        h.restore()
        h = mxq.emulate(model, weights=spec, activations=spec, rotation="had128")
        rotated = _sqnr(ref, model(x))
        h.restore()
    assert rotated > plain + 3.0, (plain, rotated)


def test_emulate_rotation_refusals():
    m = Tiny()
    with pytest.raises(ValueError, match="needs mxq formats for both weights and activations"):
        mxq.emulate(m, weights=None, activations="mxfp4", rotation="had32")
    with pytest.raises(ValueError, match="needs mxq formats for both weights and activations"):
        mxq.emulate(m, weights="mxfp4", activations=lambda t: t, rotation="had32")
    with pytest.raises(ValueError, match="fuse=True"):
        mxq.emulate(m, rotation="had32", fuse=True)
    with pytest.raises(ValueError, match="pass mxq.emulate"):
        mxq.emulate(m, weights={"format": "mxfp4", "rotation": "had32"})
    with pytest.raises(ValueError, match="are for rotation="):
        mxq.emulate(m, rotation_seed=3)
    with pytest.raises(ValueError, match="expected 'had<RS>'"):
        mxq.emulate(m, rotation="had48")
    with pytest.raises(ValueError, match="orthogonal"):
        mxq.emulate(m, rotation=torch.ones(32, 32))
    with pytest.raises(ValueError, match="'bf16' is for rotation= a matrix"):
        mxq.emulate(m, rotation="had32", matrix_precision="bf16")
    assert all(type(mod) is not mxq.QDQLinear for mod in m.modules())
    # a refusal while swapping (bf16 products of float32 weights) leaves nothing swapped
    q = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype torch.float32 with matrix_precision 'bf16'"):
        mxq.emulate(m, rotation=q, matrix_precision="bf16")
    assert type(m.up) is nn.Linear and type(m.down) is nn.Linear and getattr(m, "_mxq_emulation", None) is None
