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

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from . import _formats as F
from . import ops as _ops
from .ops import qdq

__all__ = ["emulate", "restore", "EmulationHandle", "QDQLinear", "QDQExperts", "DEFAULT_EXCLUDE"]

Spec = Union[None, str, dict, Callable[[torch.Tensor], torch.Tensor]]
Patterns = Union[None, str, Iterable[str]]

# The modules mxq's checkpoint tools leave unquantized too (docs/cli.md): the output head, MoE routers.
DEFAULT_EXCLUDE: tuple[str, ...] = (r"(^|\.)lm_head$", r"\.mlp\.gate$", r"router", r"shared_expert_gate$")

_QDQ_KEYS = {"format", "rule", "group_size", "stochastic", "seed", "offset", "tensor_scale"}


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
                             + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
    else:
        raise TypeError(f"mxq.emulate: argument '{what}': expected a format name, a dict, a callable or None, "
                        f"got {type(spec).__name__}")
    d["format"] = F.canonical_format(d["format"])
    d["rule"] = F.canonical_rule(d.get("rule"), d["format"])
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
    extra = ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("format", "rule"))
    return f"{spec['format']}/{spec['rule']}" + (f" ({extra})" if extra else "")


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


class QDQExperts(nn.Module):
    """A transformers 5.x experts module (see _is_experts) with its expert weights fake-quantized once
    (along their input dimension, as nn.functional.linear reads them) and the inputs of both expert
    projections fake-quantized per call. Computes the eager experts loop: for each routed token,
    gate, up = linear(qdq(h), W_gu[e]).chunk(2); out += w * linear(qdq(act(gate) * up), W_d[e])."""

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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        # NOTE: the tokens are quantized once, before they are gathered per expert. With MX formats and
        # round-to-nearest-even that equals quantizing each expert's gathered rows (blocks lie inside a
        # row); NVFP4 without a given tensor scale takes one amax over all tokens here (not one per
        # expert), and stochastic rounding draws by the row's index in all tokens.
        h = _apply(hidden_states, self.activation_spec)
        with torch.no_grad():
            hit = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            experts_hit = (hit.sum(dim=(-1, -2)) > 0).nonzero()
        for e in experts_hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, tok = torch.where(hit[e])
            gate, up = nn.functional.linear(h[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            mid = _apply(self.act_fn(gate) * up, self.activation_spec)
            y = nn.functional.linear(mid, self.down_proj[e]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, weights={_describe(self.weight_spec)}, "
                f"activations={_describe(self.activation_spec)}")


@dataclass
class EmulationHandle:
    """What mxq.emulate swapped: (parent module, attribute name, original module, new module)."""

    model: nn.Module
    swaps: list = field(default_factory=list)
    cache: Optional[_ActivationCache] = None

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
    Weights are QDQ'd once here, in their own dtype and device; the original modules are kept by the
    handle (for restore), so their memory stays allocated until it is released.
    """
    if getattr(model, "_mxq_emulation", None) is not None:
        raise RuntimeError("mxq.emulate: this model is already emulated; call mxq.restore(model) first")
    w, a = _spec(weights, "weights"), _spec(activations, "activations")
    inc, exc = _compile(include, "include"), _compile(exclude, "exclude")
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
    for name, module, kind in candidates:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = QDQLinear(module, w, a, handle.cache) if kind is QDQLinear else kind(module, w, a)
        setattr(parent, attr, new)
        handle.swaps.append((name, parent, attr, module, new))
    model._mxq_emulation = handle
    return handle


def restore(model: nn.Module) -> None:
    """Undo mxq.emulate on this model (no effect when it is not emulated)."""
    h: Any = getattr(model, "_mxq_emulation", None)
    if h is not None:
        h.restore()
