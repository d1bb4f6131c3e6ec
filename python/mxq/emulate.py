"""Emulation of microscaling inference in any PyTorch model: nn.Linear layers (and MoE expert modules
holding 3-D expert weights) are swapped for layers whose weights were fake-quantized (QDQ) once at
swap time and whose inputs are fake-quantized on every call. Reversible: mxq.restore(model) or
handle.restore() puts the original modules back.

    handle = mxq.emulate(model, weights="mxfp4", activations="mxfp4")
    ...
    handle.restore()   # or mxq.restore(model)

A format spec is a format name ("mxfp4", "nvfp4", ...), None (leave unquantized), a dict of
mxq.qdq keyword arguments with a "format" key, e.g. {"format": "mxfp4", "rule": "even"}, or any
callable fn(x) -> x of the same shape and dtype (another QDQ implementation, e.g. a reference to
compare with: bench/generate_bench.py runs a model through both).
"""
from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from . import _formats as F
from . import ops as _ops
from .ops import qdq

__all__ = ["emulate", "restore", "EmulationHandle", "QDQLinear", "QDQExperts", "FusedRMSNormQDQ", "FusedMLPQDQ",
           "DEFAULT_EXCLUDE"]

Spec = Union[None, str, dict, Callable[[torch.Tensor], torch.Tensor]]
Patterns = Union[None, str, Iterable[str]]

# The modules mxq's checkpoint tools leave unquantized too (docs/cli.md): the output head, MoE routers.
DEFAULT_EXCLUDE: tuple[str, ...] = (r"(^|\.)lm_head$", r"\.mlp\.gate$", r"router", r"shared_expert_gate$")

# The keys of a dict spec: mxq.qdq's keyword arguments, less the rotation's, which emulate takes itself
# (a rotation applies to weights and activations together).
_ROTATION_KEYS = {"rotation", "rotation_seed", "matrix_precision"}
_QDQ_KEYS = {"format"} | {p.name for p in inspect.signature(qdq).parameters.values() if p.kind is p.KEYWORD_ONLY} \
    - _ROTATION_KEYS


def _spec(spec: Spec, what: str) -> Optional[dict]:
    if spec is None:
        return None
    if callable(spec) and not isinstance(spec, (str, dict)):
        return {"fn": spec}
    if isinstance(spec, str):
        d = {"format": spec}
    elif isinstance(spec, dict):
        d = dict(spec)
        unknown = set(d) - _QDQ_KEYS
        if "format" not in d or unknown:
            raise ValueError(f"mxq.emulate: argument '{what}': {spec!r}; a dict needs a 'format' key and only "
                             f"mxq.qdq arguments ({', '.join(sorted(_QDQ_KEYS))})"
                             + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else "")
                             + ("; a rotation applies to weights and activations together: pass "
                                "mxq.emulate(..., rotation=...)" if unknown & _ROTATION_KEYS else ""))
    else:
        raise TypeError(f"mxq.emulate: argument '{what}': expected a format name, a dict, a callable or None, "
                        f"got {type(spec).__name__}")
    d["format"] = F.canonical_format(d["format"])
    d["rule"] = F.canonical_rule(d.get("rule"), d["format"])
    why = F.rule_refusal(d["format"], d["rule"])  # here, not at the first forward deep inside the model
    if why:
        raise ValueError(f"mxq.emulate: argument '{what}': {why}")
    if isinstance(d.get("tensor_scale"), torch.Tensor):  # read once here, not on every forward
        d["tensor_scale"] = _ops._scale_value(d["tensor_scale"])
    return d


def _apply(x: torch.Tensor, spec: Optional[dict]) -> torch.Tensor:
    if spec is None:
        return x
    if "fn" in spec:
        return spec["fn"](x)
    kw = dict(spec)
    return qdq(x, kw.pop("format"), **kw)


class _ActivationCache:
    """The last activation fake-quantized by an emulation, shared by its QDQLinear layers: q/k/v (and
    gate/up) projections read one tensor, which a quantized inference engine quantizes once; without
    it each projection would QDQ it again (three graph nodes where one does; the bytes are the same).
    Keyed by the tensor object, its version counter (an in-place write invalidates the entry) and the
    spec. Under torch.compile tracing the cache is bypassed (every call QDQs)."""

    __slots__ = ("x", "version", "spec", "out")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.x: Optional[torch.Tensor] = None
        self.version = -1
        self.spec: Optional[dict] = None
        self.out: Optional[torch.Tensor] = None

    def __call__(self, x: torch.Tensor, spec: Optional[dict]) -> torch.Tensor:
        if spec is None:
            return x
        if torch.compiler.is_compiling():
            return _apply(x, spec)
        if self.x is x and self.spec is spec and self.version == x._version:
            return self.out  # type: ignore[return-value]
        out = _apply(x, spec)
        self.x, self.version, self.spec, self.out = x, x._version, spec, out
        return out


def _describe(spec: Optional[dict]) -> str:
    if spec is None:
        return "none"
    if "fn" in spec:
        return getattr(spec["fn"], "__name__", "callable")
    extra = ", ".join(f"{k}={f'a {v.shape[0]}x{v.shape[1]} matrix' if isinstance(v, torch.Tensor) else v}"
                      for k, v in spec.items() if k not in ("format", "rule"))
    return f"{spec['format']}/{spec['rule']}" + (f" ({extra})" if extra else "")


class _Rotation:
    """emulate(..., rotation=...): the rotation applied to each Linear's weight (once) and input (per
    call) before their QDQ, along the contraction dimension, so that F.linear(qdq(x R), qdq(W R)) is the
    emulated product (= x W^T before quantization, R being orthogonal). Its (weights, activations) specs
    are made once per device: the activation cache shares one QDQ among layers only for the same spec
    object."""

    def __init__(self, rotation: Union[str, torch.Tensor], rotation_seed: int, matrix_precision: str):
        if isinstance(rotation, torch.Tensor):
            m = _ops._matrix(rotation, "rotation")
            md = m.double()
            err = (md @ md.T - torch.eye(m.shape[0], dtype=torch.float64, device=m.device)).abs().max().item()
            if not err <= 0.05:
                raise ValueError(f"mxq.emulate: argument 'rotation': R R^T differs from the identity by {err:.3g} (at "
                                 "most 0.05 expected): the emulated product x R (W R)^T equals x W^T only for an "
                                 "orthogonal R")
            if rotation_seed != 0:
                raise ValueError("mxq.emulate: argument 'rotation_seed' is for 'rhad<RS>' rotations, not a matrix")
            self.size = int(m.shape[0])
            self.kw: dict = {"rotation": m}
        else:
            name = _ops._rotation(rotation)
            found = re.fullmatch(r"r?had(\d+)", name)
            if found is None or int(found.group(1)) not in _ops._ROTATION_SIZES:
                raise ValueError(f"mxq.emulate: argument 'rotation': {rotation!r}, expected 'had<RS>' or 'rhad<RS>' "
                                 f"(RS in {_ops._ROTATION_SIZES}) or an orthogonal [RS, RS] matrix")
            self.size = int(found.group(1))
            self.kw = {"rotation": name}
            if rotation_seed != 0:
                self.kw["rotation_seed"] = rotation_seed
        if matrix_precision != "exact":
            _ops._precision(matrix_precision, rotation, None)
            self.kw["matrix_precision"] = matrix_precision
        self._specs: dict = {}

    def specs(self, w: dict, a: dict, device: torch.device) -> tuple:
        """(w, a) with the rotation, for modules on `device` (a matrix moved there once)."""
        if device not in self._specs:
            kw = dict(self.kw)
            if isinstance(kw["rotation"], torch.Tensor):
                kw["rotation"] = kw["rotation"].to(device)
            self._specs[device] = ({**w, **kw}, {**a, **kw})
        return self._specs[device]


class QDQLinear(nn.Module):
    """nn.Linear with a weight fake-quantized once (at construction) and its input fake-quantized on
    every forward: F.linear(qdq(x), qdq(W), b)."""

    def __init__(self, linear: nn.Linear, weights: Optional[dict], activations: Optional[dict],
                 cache: Optional[_ActivationCache] = None):
        super().__init__()
        self._cache = cache
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            w = _apply(linear.weight.detach(), weights)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = linear.bias
        self.weight_spec = weights
        self.activation_spec = activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self._cache(x, self.activation_spec) if self._cache is not None else _apply(x, self.activation_spec)
        return nn.functional.linear(xq, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights={_describe(self.weight_spec)}, activations={_describe(self.activation_spec)}")


def _is_experts(m: nn.Module) -> bool:
    """A Hugging Face transformers 5.x experts module: 3-D `gate_up_proj` [E, 2I, H] and `down_proj`
    [E, H, I] parameters (not transposed, no bias), an `act_fn`, forward(hidden, top_k_index,
    top_k_weights) (Qwen3-MoE, Qwen2-MoE, Mixtral, ... in transformers 5)."""
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3
            and gu.shape[0] == dn.shape[0] and gu.shape[1] == 2 * dn.shape[2] and gu.shape[2] == dn.shape[1]
            and hasattr(m, "act_fn") and getattr(m, "gate_up_proj_bias", None) is None
            and not getattr(m, "is_transposed", False))


# transformers' experts functions that QDQExperts runs with its own weights and gate (they read the
# module's gate_up_proj / down_proj and call its _apply_gate): no host synchronisation, so a decode
# step with them is captured in a CUDA graph. Other implementations (deepgemm, sonicmoe: their own
# kernels and weight layouts) and "eager" take the experts loop below.
_EXPERTS_FUNCTIONS = ("grouped_mm", "batched_mm")


@functools.lru_cache(maxsize=None)
def _experts_registry() -> Any:
    """transformers' registry of experts functions (imported once, not on every forward), or None."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return ALL_EXPERTS_FUNCTIONS


def _default_gate(experts: nn.Module) -> bool:
    """The experts module computes act_fn(gate) * up from a concatenated [gate; up] projection through
    transformers' default `_apply_gate` hook, with no bias, no post-expert norm and no expert
    parallelism (what QDQExperts reproduces). A class without the hook is refused: its transformers'
    experts functions may compute the gate inline, where QDQExperts could not QDQ its output."""
    gate = getattr(type(experts), "_apply_gate", None)
    return (gate is not None and getattr(gate, "__name__", "") == "_default_apply_gate") \
        and getattr(experts, "has_gate", True) and not getattr(experts, "has_bias", False) \
        and getattr(experts, "is_concatenated", True) and not getattr(experts, "has_post_expert_norm", False) \
        and not getattr(experts, "_is_expert_parallel", False)


class QDQExperts(nn.Module):
    """A transformers 5.x experts module (see _is_experts) with its expert weights fake-quantized once
    (along their input dimension, as nn.functional.linear reads them) and the inputs of both expert
    projections fake-quantized per call: gate, up = linear(qdq(h), W_gu[e]).chunk(2);
    out += w * linear(qdq(act(gate) * up), W_d[e]) for each routed (token, expert).

    It computes that the way the model's config selects (config._experts_implementation, read on every
    call as transformers does): "grouped_mm" / "batched_mm" run transformers' own function with the
    QDQ'd weights and the QDQ inside the gate (no host synchronisation: CUDA-graph capturable);
    anything else runs the eager loop over the experts hit (a host synchronisation per call)."""

    def __init__(self, experts: nn.Module, weights: Optional[dict], activations: Optional[dict]):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        with torch.no_grad():
            gu = _apply(experts.gate_up_proj.detach(), weights)
            dn = _apply(experts.down_proj.detach(), weights)
        self.gate_up_proj = nn.Parameter(gu, requires_grad=False)
        self.down_proj = nn.Parameter(dn, requires_grad=False)
        self.act_fn = experts.act_fn
        self.weight_spec = weights
        self.activation_spec = activations
        # What transformers' experts functions read (the layout _is_experts and _default_gate checked).
        self.config = getattr(experts, "config", None)
        self._transformers_functions = self.config is not None and _default_gate(experts)
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """qdq(act_fn(gate) * up): the down projection's input, from the [gate; up] projection."""
        gate, up = gate_up_out.chunk(2, dim=-1)
        return _apply(self.act_fn(gate) * up, self.activation_spec)

    def _function(self) -> Optional[Callable]:
        impl = getattr(self.config, "_experts_implementation", None)
        functions = _experts_registry() if self._transformers_functions else None
        if functions is None or impl not in _EXPERTS_FUNCTIONS:
            return None
        # NOTE: the experts class has transformers' `_apply_gate` hook (_default_gate): the versions
        # that install it compute the gate through it in these functions (the QDQ lives there);
        # test_emulate checks the QDQ'd result against a per-token loop for each function
        return functions.get(impl)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # NOTE: the tokens are quantized once, before they are gathered per expert, and the gate's output
        # once over every routed (token, expert) pair in the grouped functions. With MX formats and
        # round-to-nearest-even that equals quantizing each expert's gathered rows (blocks lie inside a
        # row); NVFP4 without a given tensor scale takes one amax over all of them (not one per expert),
        # and stochastic rounding draws by the row's index among them.
        h = _apply(hidden_states, self.activation_spec)
        fn = self._function()
        if fn is not None:
            return fn(self, h, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            experts_hit = (hit.sum(dim=(-1, -2)) > 0).nonzero()
        for e in experts_hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, tok = torch.where(hit[e])
            mid = self._apply_gate(nn.functional.linear(h[tok], self.gate_up_proj[e]))
            y = nn.functional.linear(mid, self.down_proj[e]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        impl = getattr(self.config, "_experts_implementation", None) if self._function() is not None else "eager"
        return (f"num_experts={self.num_experts}, weights={_describe(self.weight_spec)}, "
                f"activations={_describe(self.activation_spec)}, experts_implementation={impl}")


def _fusable(spec: Optional[dict]) -> bool:
    """A spec the fused producer ops compute: an mxq format with round to nearest even, NVFP4 only with
    its tensor scale given."""
    return (spec is not None and "fn" not in spec and not spec.get("stochastic", False)
            and (spec["format"] != "nvfp4" or (spec.get("tensor_scale") is not None and spec.get("rule") != "quest")))


def _fused_kwargs(spec: Optional[dict]) -> dict:
    if spec is None:  # fuse=True without activation QDQ: mxq's producers alone (a baseline)
        return {}
    return {k: v for k, v in spec.items() if k in ("format", "rule", "group_size", "tensor_scale")}


def _within_an_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b (one dtype) equal within the fused producers' bound against transformers' modules: one
    ulp of bf16/f16 (2 eps |b| bounds one ulp of b's binade), a few ulp of fp32."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    eps = torch.finfo(b.dtype).eps * (4 if b.dtype == torch.float32 else 1)
    tiny = torch.finfo(b.dtype).tiny
    a, b = a.float(), b.float()
    return bool(torch.all((a - b).abs() <= 2 * eps * b.abs() + tiny).item())


class FusedRMSNormQDQ(nn.Module):
    """An RMSNorm (transformers' LlamaRMSNorm and its copies) whose output is fake-quantized in the same
    kernel: mxq.rms_norm(x, weight, eps, format=...). It replaces the norm in front of projections
    whose QDQLinear layers then skip their own activation QDQ (emulate(..., fuse=True))."""

    def __init__(self, norm: nn.Module, spec: Optional[dict]):
        super().__init__()
        self.weight = norm.weight
        self.eps = float(_norm_eps(norm))
        self.spec = spec
        self._kw = _fused_kwargs(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops.rms_norm(x, self.weight, self.eps, **self._kw)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, activations={_describe(self.spec)}"


class FusedMLPQDQ(nn.Module):
    """A gated MLP (transformers' LlamaMLP and its copies: down(act(gate(x)) * up(x)) with SiLU) whose
    SiLU-and-multiply fake-quantizes its output in the same kernel (mxq.silu_mul(..., format=...)); the
    down projection's own activation QDQ is skipped."""

    def __init__(self, mlp: nn.Module, spec: Optional[dict]):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.spec = spec
        self._kw = _fused_kwargs(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_ops.silu_mul(self.gate_proj(x), self.up_proj(x), **self._kw))

    def extra_repr(self) -> str:
        return f"activations={_describe(self.spec)}"


def _norm_eps(norm: nn.Module) -> Optional[float]:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(norm, attr, None)
        if isinstance(v, (float, int)) and not isinstance(v, bool):
            return float(v)
    return None


def _probe(m: nn.Module, k: int) -> torch.Tensor:
    p = next(m.parameters())
    g = torch.Generator(device="cpu").manual_seed(0)
    return (torch.randn(4, k, generator=g) * 3).to(device=p.device, dtype=p.dtype)


def _rms_norm_like(norm: nn.Module) -> bool:
    """norm computes mxq.rms_norm (within an ulp in bf16/fp16, a few in fp32, checked on a probe): a 1-D weight, an eps, and the
    LlamaRMSNorm arithmetic (Gemma's (1 + weight) or a norm with a bias fails the probe)."""
    w, eps = getattr(norm, "weight", None), _norm_eps(norm)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None or getattr(norm, "bias", None) is not None:
        return False
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    with torch.no_grad():
        try:
            x = _probe(norm, w.shape[0])
            ref = norm(x)
            return ref.dtype == w.dtype and _within_an_ulp(_ops.rms_norm(x, w, eps), ref)
        except Exception:  # noqa: BLE001  (a module this probe cannot run, e.g. meta weights, is not fused)
            return False


def _silu_mlp_like(mlp: nn.Module) -> bool:
    """mlp is down(act(gate(x)) * up(x)) with SiLU and swapped projections, checked on a probe."""
    if not all(isinstance(getattr(mlp, n, None), QDQLinear) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    act = getattr(mlp, "act_fn", None)
    if act is None:
        return False
    with torch.no_grad():
        x = _probe(mlp.gate_proj, mlp.gate_proj.out_features)
        try:
            return _within_an_ulp(act(x) * x, _ops.silu_mul(x, x))
        except Exception:  # noqa: BLE001
            return False


# Decoder layers whose dataflow is Llama's: input_layernorm feeds q/k/v only, post_attention_layernorm
# feeds the MLP only. The probes check the modules' arithmetic, not where tensors flow: OLMo-2, for one,
# has the same attribute names with post_attention_layernorm applied to the attention's output, where
# fusing would quantize the wrong tensor. Only these classes are fused.
FUSABLE_LAYERS: frozenset = frozenset({
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Qwen2MoeDecoderLayer",
    "Qwen3MoeDecoderLayer", "MixtralDecoderLayer"})


def _fuse(model: nn.Module, handle: "EmulationHandle", spec: Optional[dict]) -> int:
    """Fuse the activation QDQs of Llama-style decoder layers (FUSABLE_LAYERS) into the RMSNorm and
    SiLU-and-multiply that produce them. Returns the number of producers fused."""
    fused = 0
    for name, layer in list(model.named_modules()):
        if type(layer).__name__ not in FUSABLE_LAYERS:
            continue
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        # input_layernorm -> q/k/v only
        norm = getattr(layer, "input_layernorm", None)
        qkv = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")] if attn is not None else []
        if (norm is not None and qkv and all(isinstance(m, QDQLinear) and m.activation_spec is spec for m in qkv)
                and _rms_norm_like(norm)):
            new = FusedRMSNormQDQ(norm, spec)
            layer.input_layernorm = new
            handle.swaps.append((f"{name}.input_layernorm", layer, "input_layernorm", norm, new))
            for m in qkv:
                m.activation_spec = None  # the norm's output is already fake-quantized
            fused += 1
        # post_attention_layernorm -> a dense SiLU MLP only (a MoE block's router reads the norm too)
        norm = getattr(layer, "post_attention_layernorm", None)
        if (norm is not None and mlp is not None and _silu_mlp_like(mlp)
                and all(getattr(mlp, n).activation_spec is spec for n in ("gate_proj", "up_proj", "down_proj"))
                and _rms_norm_like(norm)):
            new_norm, new_mlp = FusedRMSNormQDQ(norm, spec), FusedMLPQDQ(mlp, spec)
            layer.post_attention_layernorm = new_norm
            layer.mlp = new_mlp
            handle.swaps.append((f"{name}.post_attention_layernorm", layer, "post_attention_layernorm", norm, new_norm))
            handle.swaps.append((f"{name}.mlp", layer, "mlp", mlp, new_mlp))
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(new_mlp, n).activation_spec = None
            fused += 2
    return fused


@dataclass
class EmulationHandle:
    """What mxq.emulate swapped: (parent module, attribute name, original module, new module)."""

    model: nn.Module
    swaps: list = field(default_factory=list)
    cache: Optional[_ActivationCache] = None
    fused: int = 0  # producers (norms, MLPs) fused with their activation QDQ (emulate(..., fuse=True))
    unrotated: list = field(default_factory=list)  # emulate(..., rotation=): swapped without it (RS does not divide K)

    @property
    def names(self) -> list[str]:
        return [n for n, *_ in self.swaps]

    def restore(self) -> None:
        """Put every original module back (idempotent)."""
        for name, parent, attr, original, new in reversed(self.swaps):
            if getattr(parent, attr) is new:
                setattr(parent, attr, original)
        self.swaps.clear()
        if self.cache is not None:
            self.cache.clear()  # drop the references to the last activation
        if getattr(self.model, "_mxq_emulation", None) is self:
            del self.model._mxq_emulation

    def __len__(self) -> int:
        return len(self.swaps)

    def __repr__(self) -> str:
        return f"EmulationHandle({len(self.swaps)} modules swapped)"


def _compile(p: Patterns, what: str) -> list:
    if p is None:
        return []
    if isinstance(p, str):
        p = [p]
    try:
        return [re.compile(s) for s in p]
    except re.error as e:
        raise ValueError(f"mxq.emulate: argument '{what}': invalid regular expression: {e}") from None


def emulate(
    model: nn.Module,
    weights: Spec = "mxfp4",
    activations: Spec = "mxfp4",
    *,
    include: Patterns = None,
    exclude: Patterns = DEFAULT_EXCLUDE,
    experts: bool = True,
    filter: Optional[Callable[[str, nn.Module], bool]] = None,
    share_activations: bool = True,
    fuse: bool = False,
    rotation: Union[None, str, torch.Tensor] = None,
    rotation_seed: int = 0,
    matrix_precision: str = "exact",
) -> EmulationHandle:
    """Swap the model's nn.Linear layers (and, with experts=True, transformers-5 MoE experts modules
    with 3-D weights) for fake-quantized ones, in place; returns a handle whose restore() undoes it.

    weights, activations: format specs (a name, a dict of mxq.qdq arguments, or None for none).
    include: regexes; when given, only modules whose qualified name matches one (re.search) are swapped.
    exclude: regexes of names never swapped (default: DEFAULT_EXCLUDE, the output head and MoE routers;
             pass () to swap those too).
    filter:  optional callable(name, module) -> bool, a last say on each candidate.
    share_activations: layers that read the same input tensor (q/k/v, gate/up) share one QDQ of it,
             as an inference engine quantizes an activation once: same outputs, fewer kernels (the
             last activation stays referenced until the next call or restore()). False: every layer
             QDQs its own input.
    fuse:    fuse the activation QDQs of Llama-style decoder layers into the ops that produce them:
             input_layernorm -> q/k/v and post_attention_layernorm -> gate/up become mxq.rms_norm(...,
             format=...), act_fn(gate) * up -> down becomes mxq.silu_mul(..., format=...): no separate QDQ
             kernel is left in such a layer. Each norm and MLP is probed first (it must compute what the
             fused op computes, within a few ulp) and left unfused otherwise; only decoder layers of the
             classes in FUSABLE_LAYERS (Llama's dataflow) are fused; a MoE block is not fused.
             The norms' and SiLU's arithmetic is mxq's (docs/numerics.md, "Fused producers"), within an ulp (a few in fp32) of
             transformers': logits are close to, not bit-identical with, fuse=False. Needs an mxq
             activation format with round to nearest even (NVFP4: with its tensor_scale), or None:
             then mxq's producers run without QDQ (the baseline to measure the fused emulation against).
    rotation: None, "had<RS>", "rhad<RS>" (random signs from `rotation_seed`) or an orthogonal [RS, RS]
             matrix (`matrix_precision` as in mxq.quantize): each swapped layer's weight and input are
             rotated in groups of RS along the contraction dimension before their QDQ (QuaRot / QuTLASS
             style): the layer computes F.linear(qdq(x R), qdq(W R)), which is x W^T before quantization.
             Needs mxq formats (not None, not callables) for both weights and activations, and not
             fuse=True. Layers whose contraction dimension RS does not divide are emulated without the
             rotation, and listed in handle.unrotated. Rotated QDQs have no gradient: run the emulated
             model under torch.no_grad() (evaluation).
    Weights are QDQ'd once here, in their own dtype and device; the original modules are kept by the
    handle (for restore), so their memory stays allocated until it is released.
    """
    if getattr(model, "_mxq_emulation", None) is not None:
        raise RuntimeError("mxq.emulate: this model is already emulated; call mxq.restore(model) first")
    w, a = _spec(weights, "weights"), _spec(activations, "activations")
    inc, exc = _compile(include, "include"), _compile(exclude, "exclude")
    if fuse and a is not None and not _fusable(a):
        raise ValueError("mxq.emulate: fuse=True needs an mxq activation format with round to nearest even "
                         f"(NVFP4 with its tensor_scale and rule nvfp4), got activations={_describe(a)}")
    rot = None
    if rotation is not None:
        if w is None or a is None or "fn" in w or "fn" in a:
            raise ValueError("mxq.emulate: argument 'rotation': needs mxq formats for both weights and activations "
                             f"(got weights={_describe(w)}, activations={_describe(a)}): a rotated input meets only "
                             "a rotated weight")
        if fuse:
            raise ValueError("mxq.emulate: argument 'rotation' with fuse=True: the fused norm and SiLU ops do not "
                             "rotate")
        rot = _Rotation(rotation, rotation_seed, matrix_precision)
    elif rotation_seed != 0 or matrix_precision != "exact":
        raise ValueError("mxq.emulate: arguments 'rotation_seed' and 'matrix_precision' are for rotation=")
    handle = EmulationHandle(model, cache=_ActivationCache() if share_activations else None)
    candidates = []
    for name, module in model.named_modules():
        if not name:
            continue
        kind = QDQLinear if type(module) is nn.Linear else QDQExperts if experts and _is_experts(module) else None
        if kind is None:
            continue
        if inc and not any(r.search(name) for r in inc):
            continue
        if any(r.search(name) for r in exc):
            continue
        if filter is not None and not filter(name, module):
            continue
        candidates.append((name, module, kind))
    try:
        _swap(model, handle, candidates, w, a, rot)
        if fuse:
            handle.fused = _fuse(model, handle, a)
    except BaseException:
        handle.restore()  # nothing half-swapped is left behind
        raise
    model._mxq_emulation = handle
    return handle


def _swap(model: nn.Module, handle: EmulationHandle, candidates: list, w: Optional[dict], a: Optional[dict],
          rot: Optional[_Rotation]) -> None:
    """Swap each candidate (name, module, kind) for its QDQ module, recording it in the handle."""
    for name, module, kind in candidates:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        mw, ma = w, a
        if rot is not None:
            dims = ([module.in_features] if kind is QDQLinear
                    else [module.gate_up_proj.shape[2], module.down_proj.shape[2]])
            if all(d % rot.size == 0 for d in dims):
                dev = module.weight.device if kind is QDQLinear else module.gate_up_proj.device
                mw, ma = rot.specs(w, a, dev)
            else:
                handle.unrotated.append(name)
        new = QDQLinear(module, mw, ma, handle.cache) if kind is QDQLinear else kind(module, mw, ma)
        setattr(parent, attr, new)
        handle.swaps.append((name, parent, attr, module, new))


def restore(model: nn.Module) -> None:
    """Undo mxq.emulate on this model (no effect when it is not emulated)."""
    h: Any = getattr(model, "_mxq_emulation", None)
    if h is not None:
        h.restore()
