"""W4A16 mixture of experts: MXFP4 / NVFP4 experts, bf16 / fp16 activations (docs/moe.md).

    w13 = mxq.prepack_experts(mxq.quantize(gate_up, "mxfp4"))   # [E, 2I, H], once, on the CPU
    w2 = mxq.prepack_experts(mxq.quantize(down, "mxfp4"))       # [E, H, I]
    y = mxq.moe(x, w13.to("cuda"), w2.to("cuda"), topk_ids, topk_weights)   # torch.ops.mxq.moe
    mxq.load_quantized_moe(model, "qwen3-moe-mxfp4")              # packed experts into a transformers model

y[t] = sum_j topk_weights[t, j] * (W2[e] act(W13[e] x[t] + b13[e]) + b2[e]) with e = topk_ids[t, j]; each expert
GEMM is mxq.linear's arithmetic, the activation fp32 rounded once, the weighted slots summed in fp32 in slot
order and rounded once (docs/numerics.md, "W4A16 MoE").
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _formats as F
from .linear import _read_checkpoint, packed_shapes, prepack

__all__ = ["PackedExperts", "prepack_experts", "moe", "QuantExperts", "pack_experts", "load_quantized_moe", "MOE_ACTIVATIONS"]

MOE_ACTIVATIONS = ("none", "swiglu", "swiglu_oai")


@dataclass
class PackedExperts:
    """E weights [N, K] in the W4A16 kernel's tile layout, one expert per row (include/mxq/moe.hpp).

    codes:        uint8 [E, code bytes per expert] (each expert's packed codes, contiguous).
    scales:       uint8 [E, scale bytes per expert].
    exp_shift:    int32 [E], each expert's power-of-two shift (set by prepack).
    tensor_scale: float32 [E], each expert's NVFP4 encode scale S (1.0 for MXFP4).
    f16_exact:    whether fp16 activations are exact with every expert (else only bf16 is accepted).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    exp_shift: torch.Tensor
    tensor_scale: torch.Tensor
    format: str
    E: int
    N: int
    K: int
    f16_exact: bool

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.E, self.N, self.K))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: Union[str, torch.device]) -> "PackedExperts":
        """A copy on `device` (every tensor moved; the facts unchanged)."""
        return PackedExperts(self.codes.to(device), self.scales.to(device), self.exp_shift.to(device), self.tensor_scale.to(device),
                             self.format, self.E, self.N, self.K, self.f16_exact)


def _scale_list(tensor_scale, E: int) -> List[float]:
    if tensor_scale is None:
        raise ValueError("mxq.prepack_experts: nvfp4 needs 'tensor_scale', the encode scale S (one, or one per expert)")
    t = torch.as_tensor(tensor_scale, dtype=torch.float32).reshape(-1).cpu()
    if t.numel() == 1:
        return [float(t[0])] * E
    if t.numel() != E:
        raise ValueError(f"mxq.prepack_experts: argument 'tensor_scale': {t.numel()} values, expected 1 or E = {E}")
    return [float(v) for v in t]


def prepack_experts(q=None, *, codes: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None,
                    format: Optional[str] = None, K: Optional[int] = None, layout: str = "linear",
                    tensor_scale: Union[None, float, Sequence[float], torch.Tensor] = None) -> PackedExperts:
    """Prepack E quantized expert weights for :func:`moe` (on the CPU; move the result with ``.to(device)``).

    ``q``: a :class:`mxq.QuantizedTensor` of a 3-D weight [E, N, K] (what ``mxq.quantize`` gives for one:
    codes [E, N, K/2], scales [E, N, K/g], one NVFP4 tensor scale), or a sequence of E 2-D QuantizedTensors
    (each with its own NVFP4 tensor scale). Or checkpoint tensors: ``codes`` uint8 [E, N, K/2], ``scales``
    uint8 / float8_e4m3fn [E, N, K/g], ``format``, ``K`` (default 2 * codes.shape[-1]) and for nvfp4
    ``tensor_scale``: one encode scale S or one per expert."""
    if q is not None:
        if codes is not None or scales is not None or format is not None:
            raise ValueError("mxq.prepack_experts: pass either QuantizedTensors or codes/scales/format, not both")
        if isinstance(q, (list, tuple)):
            ws = [prepack(qe) for qe in q]
            if not ws:
                raise ValueError("mxq.prepack_experts: an empty list of experts")
            return _stack(ws)
        if len(q.shape) != 3:
            raise ValueError(f"mxq.prepack_experts: a QuantizedTensor of shape {tuple(q.shape)}, expected [E, N, K]")
        if q.rotation != "none" or q.layout != "linear":
            raise NotImplementedError("mxq.prepack_experts: a 3-D QuantizedTensor quantized with layout 'linear' and no rotation")
        if q.format not in ("mxfp4", "nvfp4") or q.group_size != F.group_of(q.format, None):
            raise NotImplementedError(f"mxq.prepack_experts: {q.format} with group size {q.group_size}; the W4A16 MoE takes "
                                      "mxfp4 with 32, nvfp4 with 16")
        codes, scales, format, K = q.codes, q.scales, q.format, int(q.shape[2])
        if format == "nvfp4":
            tensor_scale = q.tensor_scale_value if q.tensor_scale_value is not None else q.tensor_scale
    if codes is None or scales is None or format is None:
        raise ValueError("mxq.prepack_experts: expected QuantizedTensors, or codes, scales and format")
    if codes.dim() != 3 or scales.dim() != 3 or codes.shape[0] != scales.shape[0]:
        raise ValueError(f"mxq.prepack_experts: codes {tuple(codes.shape)} and scales {tuple(scales.shape)}, expected "
                         "[E, N, K/2] and [E, N, K/g]")
    E = int(codes.shape[0])
    S = _scale_list(tensor_scale, E) if format == "nvfp4" else [1.0] * E
    K = int(K if K is not None else 2 * codes.shape[2])
    return _stack([prepack(codes=codes[e], scales=scales[e], format=format, K=K, layout=layout, tensor_scale=S[e])
                   for e in range(E)])


def _stack(ws) -> PackedExperts:
    w0 = ws[0]
    for w in ws:
        if (w.format, w.N, w.K) != (w0.format, w0.N, w0.K):
            raise ValueError(f"mxq.prepack_experts: experts of different kinds: {w0.format} [{w0.N}, {w0.K}] and "
                             f"{w.format} [{w.N}, {w.K}]")
    return PackedExperts(torch.stack([w.codes.reshape(-1) for w in ws]), torch.stack([w.scales.reshape(-1) for w in ws]),
                         torch.tensor([w.exp_shift for w in ws], dtype=torch.int32),
                         torch.tensor([w.tensor_scale for w in ws], dtype=torch.float32), w0.format, len(ws), w0.N, w0.K,
                         all(w.f16_exact for w in ws))


def moe(x: torch.Tensor, w13: PackedExperts, w2: PackedExperts, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
        b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None, activation: str = "swiglu", alpha: float = 1.702,
        limit: float = 7.0, return_error_flag: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The two expert GEMMs of an MoE block: y [..., H] from x [..., H] (bf16 or fp16) routed by
    ``topk_ids`` (int32 / int64 [..., k]) with ``topk_weights`` ([..., k], float32, bf16 or fp16).

    w13: [E, 2I, H] for the SwiGLUs (``swiglu``: gate rows then up rows, vLLM's w13; ``swiglu_oai``: gate and
    up rows interleaved, gpt-oss, with ``alpha`` and ``limit``), [E, I, H] for ``none``; w2: [E, H, I]; one
    format; optional biases b13 [E, N13] and b2 [E, H] of x's dtype. On the CPU (the reference) an expert id
    outside [0, E) raises ValueError naming the token and slot; on CUDA the pair is dropped and the error flag
    set (``return_error_flag=True`` returns ``(y, flag)``, flag int32 [1], without a host synchronisation).
    CUDA: no allocation besides y and the workspace, no synchronisation (CUDA graphs, torch.compile)."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"mxq.moe: argument 'activation': '{activation}', expected one of: {', '.join(MOE_ACTIVATIONS)}")
    if w13.format != w2.format:
        raise ValueError(f"mxq.moe: w13 is {w13.format} and w2 {w2.format}; expected one format for both")
    y, flag = torch.ops.mxq.moe(x, w13.codes, w13.scales, w13.exp_shift, w13.tensor_scale, b13, w2.codes, w2.scales, w2.exp_shift,
                                w2.tensor_scale, b2, topk_ids, topk_weights, w13.format, w2.K, w13.f16_exact and w2.f16_exact,
                                activation, alpha, limit)
    return (y, flag) if return_error_flag else y


# ---- transformers' experts modules ------------------------------------------------------------------------
def _experts_kind(mod: torch.nn.Module) -> Optional[str]:
    """'qwen3' for fused [E, 2I, H] gate_up_proj / [E, H, I] down_proj experts without bias and a SiLU
    (Qwen3-MoE, Qwen2-MoE, Mixtral in transformers 5), 'gpt_oss' for gpt-oss's transposed, interleaved,
    biased experts with the clamped SwiGLU; None for anything else."""
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
        return None
    if hasattr(mod, "gate_up_proj_bias") and hasattr(mod, "alpha") and hasattr(mod, "limit"):
        return "gpt_oss"
    act = getattr(mod, "act_fn", None)
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU"):
        return "qwen3"
    return None


class QuantExperts(torch.nn.Module):
    """A transformers experts module on packed weights (inference only): forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H], one :func:`moe` call. The packed tensors and biases
    are buffers, so ``module.to(device)`` moves them."""

    def __init__(self, w13: PackedExperts, w2: PackedExperts, activation: str, b13: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.format, self.num_experts, self.hidden_dim, self.intermediate_dim = w13.format, w13.E, w2.N, w2.K
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.f16_exact = w13.f16_exact and w2.f16_exact
        for name, w in (("w13", w13), ("w2", w2)):
            for field in ("codes", "scales", "exp_shift", "tensor_scale"):
                self.register_buffer(f"{name}_{field}", getattr(w, field), persistent=False)
        self.register_buffer("b13", b13, persistent=False)
        self.register_buffer("b2", b2, persistent=False)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        y, _ = torch.ops.mxq.moe(hidden_states, self.w13_codes, self.w13_scales, self.w13_exp_shift, self.w13_tensor_scale, self.b13,
                                 self.w2_codes, self.w2_scales, self.w2_exp_shift, self.w2_tensor_scale, self.b2, top_k_index,
                                 top_k_weights, self.format, self.intermediate_dim, self.f16_exact, self.activation, self.alpha,
                                 self.limit)
        return y

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
                f"format={self.format}, activation={self.activation}")


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _module_quant(mod: torch.nn.Module, kind: str, w13: PackedExperts, w2: PackedExperts, device, b13=None, b2=None) -> QuantExperts:
    dtype = mod.gate_up_proj.dtype
    if kind == "gpt_oss":
        b13 = (b13 if b13 is not None else mod.gate_up_proj_bias.detach()).to(device=device, dtype=dtype)
        b2 = (b2 if b2 is not None else mod.down_proj_bias.detach()).to(device=device, dtype=dtype)
        return QuantExperts(w13.to(device), w2.to(device), "swiglu_oai", b13, b2, float(mod.alpha), float(mod.limit))
    return QuantExperts(w13.to(device), w2.to(device), "swiglu")


def pack_experts(model: torch.nn.Module, format: str = "mxfp4", device: Union[None, str, torch.device] = None, **quantize_kwargs) -> int:
    """Quantize (``mxq.quantize(w, format, **quantize_kwargs)``, per expert along the input dimension) and
    prepack the expert weights a transformers model holds, replacing every Qwen3-MoE-style or gpt-oss experts
    module by a :class:`QuantExperts`. Returns the number of modules replaced."""
    from .ops import quantize

    n = 0
    for name, mod in list(model.named_modules()):
        kind = _experts_kind(mod)
        if kind is None:
            continue
        gu, dn = mod.gate_up_proj.detach(), mod.down_proj.detach()
        if kind == "gpt_oss":  # [E, H, 2I] / [E, I, H]: stored transposed
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        dev = device if device is not None else gu.device
        w13 = prepack_experts(quantize(gu.float().cpu().contiguous(), format, **quantize_kwargs))
        w2 = prepack_experts(quantize(dn.float().cpu().contiguous(), format, **quantize_kwargs))
        _replace(model, name, _module_quant(mod, kind, w13, w2, dev))
        n += 1
    return n


def _per_expert(tensors: Dict[str, torch.Tensor], prefix: str, E: int, proj: str, format: str, K: int):
    """Expert e's compressed-tensors tensors X.{e}.{proj}.weight_packed / weight_scale / weight_global_scale."""
    codes, scales, S = [], [], []
    for e in range(E):
        base = f"{prefix}.{e}.{proj}"
        if f"{base}.weight_packed" not in tensors:
            return None
        codes.append(tensors.pop(f"{base}.weight_packed"))
        sc = tensors.pop(f"{base}.weight_scale")
        scales.append(sc.view(torch.uint8) if sc.dtype != torch.uint8 else sc)
        s = tensors.pop(f"{base}.weight_global_scale", None)
        S.append(None if s is None else float(s.reshape(-1)[0]))
    return codes, scales, S


def load_quantized_moe(model: torch.nn.Module, checkpoint: str, device: Union[None, str, torch.device] = None) -> int:
    """Put the packed experts of `checkpoint` into `model`'s experts modules (replaced by :class:`QuantExperts`).

    Reads (1) what ``mxq quantize`` / compressed-tensors write for per-expert Linear weights (Qwen3-MoE,
    Qwen2-MoE, Mixtral-style checkpoints): ``X.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` ``.weight_packed``,
    ``.weight_scale`` and, for NVFP4, ``.weight_global_scale`` (gate and up of one expert must share it, as
    ``mxq quantize`` writes them); and (2) gpt-oss's own MXFP4 experts (``X.gate_up_proj_blocks`` /
    ``_scales``, ``X.down_proj_blocks`` / ``_scales``, the biases). Other tensors are left to
    :func:`mxq.load_quantized` (call it too for the attention and dense layers). Returns the number of
    experts modules replaced."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    qc = config.get("quantization_config") or {}
    fmt = qc.get("format", "")
    if qc.get("quant_method") == "mxfp4":
        format = "mxfp4"
    elif fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        format = fmt.split("-")[0]
    else:
        raise NotImplementedError(f"mxq.load_quantized_moe: quantization '{qc.get('quant_method')}' / '{fmt}'; expected an "
                                  "mxfp4-pack-quantized or nvfp4-pack-quantized checkpoint, or gpt-oss's mxfp4")
    if qc.get("transform_config"):
        raise NotImplementedError("mxq.load_quantized_moe: a rotated checkpoint (transform_config) is not supported")
    tensors = _read_checkpoint(checkpoint)
    replaced = 0
    for name, mod in list(model.named_modules()):
        kind = _experts_kind(mod)
        if kind is None:
            continue
        dev = device if device is not None else mod.gate_up_proj.device
        E = mod.gate_up_proj.shape[0]
        if kind == "gpt_oss":
            if f"{name}.gate_up_proj_blocks" not in tensors:
                continue
            H, I2 = mod.gate_up_proj.shape[1], mod.gate_up_proj.shape[2]
            blk, sc = tensors.pop(f"{name}.gate_up_proj_blocks"), tensors.pop(f"{name}.gate_up_proj_scales")
            dblk, dsc = tensors.pop(f"{name}.down_proj_blocks"), tensors.pop(f"{name}.down_proj_scales")
            if tuple(blk.shape) != (E, I2, H // 32, 16) or tuple(dblk.shape) != (E, H, I2 // 64, 16):
                raise ValueError(f"mxq.load_quantized_moe: {name}: blocks {tuple(blk.shape)} / {tuple(dblk.shape)} do not fit "
                                 f"experts [E={E}, 2I={I2}, H={H}]")
            w13 = prepack_experts(codes=blk.reshape(E, I2, H // 2), scales=sc, format="mxfp4", K=H)
            w2 = prepack_experts(codes=dblk.reshape(E, H, I2 // 4), scales=dsc, format="mxfp4", K=I2 // 2)
            _replace(model, name, _module_quant(mod, kind, w13, w2, dev, tensors.pop(f"{name}.gate_up_proj_bias", None),
                                                tensors.pop(f"{name}.down_proj_bias", None)))
            replaced += 1
            continue
        I, H = mod.down_proj.shape[2], mod.down_proj.shape[1]
        gate = _per_expert(tensors, name, E, "gate_proj", format, H)
        up = _per_expert(tensors, name, E, "up_proj", format, H)
        down = _per_expert(tensors, name, E, "down_proj", format, I)
        if gate is None or up is None or down is None:
            continue
        if format == "nvfp4":
            for e, (sg, su) in enumerate(zip(gate[2], up[2])):
                if sg != su:
                    raise NotImplementedError(f"mxq.load_quantized_moe: {name}.{e}: gate_proj and up_proj have different NVFP4 "
                                              f"global scales ({sg} and {su}); the fused w13 needs one per expert (mxq quantize "
                                              "writes one)")
        w13 = prepack_experts(codes=torch.stack([torch.cat([g, u]) for g, u in zip(gate[0], up[0])]),
                              scales=torch.stack([torch.cat([g, u]) for g, u in zip(gate[1], up[1])]), format=format, K=H,
                              tensor_scale=gate[2] if format == "nvfp4" else None)
        w2 = prepack_experts(codes=torch.stack(down[0]), scales=torch.stack(down[1]), format=format, K=I,
                             tensor_scale=down[2] if format == "nvfp4" else None)
        _replace(model, name, _module_quant(mod, kind, w13, w2, dev))
        replaced += 1
    return replaced
