"""W4A16 linear layers: MXFP4 / NVFP4 weights, bf16 / fp16 activations (docs/linear.md).

    w = mxq.prepack(q)                         # q = mxq.quantize(weight, "mxfp4"): once, on the CPU
    w = w.to("cuda")
    y = mxq.linear(x, w, bias)                 # x [..., K] bf16/fp16 -> y [..., N], torch.ops.mxq.linear
    mxq.load_quantized(model, "llama-mxfp4")   # an `mxq quantize` checkpoint into a transformers model

The op computes every product x_k * (e2m1_k * scale_k) exactly, sums them in fp32 and rounds once
(NVFP4: the sum divided by the tensor encode scale S first); docs/numerics.md states the contract.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional, Union

import torch

from . import _formats as F

__all__ = ["PackedLinearWeight", "packed_shapes", "prepack", "linear", "QuantLinear", "load_quantized"]

_FORMATS = ("mxfp4", "nvfp4")


def packed_shapes(format: str, N: int, K: int):
    """The shapes of a packed weight's codes and scales (docs/linear.md): N padded to 32, K to 64, tiles of
    16 rows x 64 columns, 512 code bytes and 32 (MXFP4) or 64 (NVFP4) scale bytes each."""
    Np, Kp = (N + 31) // 32 * 32, (K + 63) // 64 * 64
    tiles = (Np // 16) * (Kp // 64)
    return (tiles, 512), (tiles, 64 if format == "nvfp4" else 32)


@dataclass
class PackedLinearWeight:
    """A weight [N, K] in the W4A16 kernel's tile layout (docs/linear.md).

    codes, scales: uint8 tensors (the packed layout), on the device the op runs on.
    exp_shift:     the power of two the kernel factors out of the block scales (set by prepack).
    f16_exact:     whether fp16 activations are exact with this weight (else only bf16 is accepted).
    tensor_scale:  NVFP4: the encode scale S (y is divided by it); 1.0 for MXFP4.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    format: str
    N: int
    K: int
    exp_shift: int
    f16_exact: bool
    tensor_scale: float = 1.0

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.N, self.K))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: Union[str, torch.device]) -> "PackedLinearWeight":
        """A copy on `device` (the packed tensors moved; the facts unchanged)."""
        return PackedLinearWeight(self.codes.to(device), self.scales.to(device), self.format, self.N, self.K, self.exp_shift,
                                  self.f16_exact, self.tensor_scale)

    def unpack(self):
        """(codes uint8 [N, K/2], scales uint8 [N, K/g]) as mxq.quantize writes them (linear layout), on the CPU."""
        return torch.ops.mxq.unpack(self.codes.cpu(), self.scales.cpu(), self.N, self.K, self.format, self.exp_shift)


def prepack(q=None, *, codes: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None, format: Optional[str] = None,
            K: Optional[int] = None, layout: str = "linear", tensor_scale: Union[None, float, torch.Tensor] = None) -> PackedLinearWeight:
    """Prepack a quantized weight for :func:`linear` (on the CPU; move the result with ``.to(device)``).

    Either ``q``, a :class:`mxq.QuantizedTensor` of a 2-D weight quantized with format mxfp4 (group 32) or
    nvfp4 (group 16), layout linear or swizzled; or the checkpoint tensors: ``codes`` uint8 [N, K/2],
    ``scales`` uint8 / float8_e4m3fn [N, K/g] (or swizzled), ``format``, ``K`` (default 2 * codes.shape[1]),
    ``layout`` and, for nvfp4, ``tensor_scale`` (the encode scale S, compressed-tensors' weight_global_scale).
    """
    if q is not None:
        if codes is not None or scales is not None or format is not None:
            raise ValueError("mxq.prepack: pass either a QuantizedTensor or codes/scales/format, not both")
        if len(q.shape) != 2:
            raise ValueError(f"mxq.prepack: a QuantizedTensor of shape {tuple(q.shape)}, expected a 2-D weight [N, K]")
        if q.rotation != "none":
            raise NotImplementedError("mxq.prepack: a rotated weight (rotate x with the same rotation and prepack the "
                                      "unrotated quantization instead)")
        if q.layout == "padded":
            raise NotImplementedError("mxq.prepack: layout 'padded'; quantize with layout 'linear' or 'swizzled'")
        codes, scales, format, layout = q.codes, q.scales, q.format, q.layout
        K = int(q.shape[1])
        if format not in _FORMATS:
            raise NotImplementedError(f"mxq.prepack: format '{format}': the W4A16 linear takes mxfp4 or nvfp4")
        if q.group_size != F.group_of(q.format, None):
            raise NotImplementedError(f"mxq.prepack: {q.format} with group size {q.group_size}; the W4A16 linear takes "
                                      "mxfp4 with 32, nvfp4 with 16")
        if format == "nvfp4":
            tensor_scale = q.tensor_scale_value if q.tensor_scale_value is not None else q.tensor_scale
    if codes is None or scales is None or format is None:
        raise ValueError("mxq.prepack: expected a QuantizedTensor, or codes, scales and format")
    if format not in _FORMATS:
        raise NotImplementedError(f"mxq.prepack: format '{format}': the W4A16 linear takes mxfp4 or nvfp4")
    if codes.dim() != 2:
        raise ValueError(f"mxq.prepack: argument 'codes': shape {tuple(codes.shape)}, expected [N, K/2]")
    N = int(codes.shape[0])
    K = int(K if K is not None else 2 * codes.shape[1])
    S = 1.0
    if format == "nvfp4":
        if tensor_scale is None:
            raise ValueError("mxq.prepack: nvfp4 needs 'tensor_scale', the encode scale S (448*6/amax)")
        S = float(tensor_scale.reshape(-1)[0].item()) if isinstance(tensor_scale, torch.Tensor) else float(tensor_scale)
    pc, ps, info = torch.ops.mxq.prepack(codes.cpu(), scales.cpu(), N, K, format, layout)
    return PackedLinearWeight(pc, ps, format, N, K, int(info[0]), bool(info[1]), S)


def linear(x: torch.Tensor, w: PackedLinearWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias): x and bias bf16 or fp16, on w's device (CPU: the reference).

    CUDA: sm80 or newer; no allocation besides y, no synchronisation (CUDA graphs, torch.compile)."""
    return torch.ops.mxq.linear(x, w.codes, w.scales, bias, w.format, w.N, w.K, w.exp_shift, w.f16_exact, w.tensor_scale)


class QuantLinear(torch.nn.Module):
    """An nn.Linear whose weight is a :class:`PackedLinearWeight` (inference only). The packed tensors and
    the bias are buffers, so ``module.to(device)`` moves them."""

    def __init__(self, weight: PackedLinearWeight, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features = weight.K
        self.out_features = weight.N
        self.format = weight.format
        self.exp_shift = weight.exp_shift
        self.f16_exact = weight.f16_exact
        self.tensor_scale = weight.tensor_scale
        self.register_buffer("codes", weight.codes, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def weight_packed(self) -> PackedLinearWeight:
        return PackedLinearWeight(self.codes, self.scales, self.format, self.out_features, self.in_features, self.exp_shift,
                                  self.f16_exact, self.tensor_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mxq.linear(x, self.codes, self.scales, self.bias, self.format, self.out_features, self.in_features,
                                    self.exp_shift, self.f16_exact, self.tensor_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def _read_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    out: Dict[str, torch.Tensor] = {}
    for name in files:
        if os.path.basename(name) != name:
            raise ValueError(f"mxq.load_quantized: shard name '{name}' in {index} is not a plain file name")
        out.update(load_file(os.path.join(path, name)))
    return out


def load_quantized(model: torch.nn.Module, checkpoint: str, device: Union[None, str, torch.device] = None) -> int:
    """Replace every nn.Linear of `model` that `checkpoint` (an `mxq quantize` / compressed-tensors
    directory: ``X.weight_packed``, ``X.weight_scale`` and, for NVFP4, ``X.weight_global_scale``) holds
    packed weights for by a :class:`QuantLinear` on `device` (default: the Linear's). Other tensors of the
    checkpoint (norms, embeddings, unquantized layers) are loaded into the model as they are. Returns the
    number of layers replaced. Rotated checkpoints (a transform_config) are refused."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    qc = config.get("quantization_config") or {}
    fmt = qc.get("format", "")
    if fmt not in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        raise NotImplementedError(f"mxq.load_quantized: quantization format '{fmt}'; expected mxfp4-pack-quantized or "
                                  "nvfp4-pack-quantized")
    if qc.get("transform_config"):
        raise NotImplementedError("mxq.load_quantized: a rotated checkpoint (transform_config); not supported by the linear")
    format = "mxfp4" if fmt.startswith("mxfp4") else "nvfp4"
    tensors = _read_checkpoint(checkpoint)
    replaced = 0
    modules = dict(model.named_modules())
    for name, mod in list(modules.items()):
        if not isinstance(mod, torch.nn.Linear) or f"{name}.weight_packed" not in tensors:
            continue
        codes = tensors.pop(f"{name}.weight_packed")
        scales = tensors.pop(f"{name}.weight_scale")
        S = tensors.pop(f"{name}.weight_global_scale", None)
        if (mod.out_features, mod.in_features) != (codes.shape[0], 2 * codes.shape[1]):
            raise ValueError(f"mxq.load_quantized: {name}: packed weight {tuple(codes.shape)} does not fit nn.Linear "
                             f"[{mod.out_features}, {mod.in_features}]")
        w = prepack(codes=codes, scales=scales, format=format, K=mod.in_features, tensor_scale=S)
        dev = device if device is not None else mod.weight.device
        bias = tensors.pop(f"{name}.bias", None)
        if bias is None and mod.bias is not None:
            bias = mod.bias.detach()
        if bias is not None:
            bias = bias.to(device=dev, dtype=mod.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, child, QuantLinear(w.to(dev), bias))
        replaced += 1
    # the rest (norms, embeddings, lm_head, unquantized layers) as stored
    state = model.state_dict()
    rest = {k: v for k, v in tensors.items() if k in state}
    model.load_state_dict(rest, strict=False)
    return replaced
