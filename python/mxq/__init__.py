"""mxq: microscaling formats (MXFP4, MXFP6, MXFP8, MXINT8, NVFP4) for PyTorch.

    import mxq
    y = mxq.qdq(x, "mxfp4", rule="even")                  # fake-quantize (QDQ), x's shape and dtype
    q = mxq.quantize(w, "nvfp4", layout="swizzled")       # packed codes + block scales (+ tensor scale)
    w2 = q.dequantize(torch.bfloat16)
    mxq.qdq_(x, "mxfp8", stochastic=True, seed=1)         # in place, stochastic rounding
    handle = mxq.emulate(model, weights="mxfp4", activations="mxfp4")   # swap nn.Linear for QDQ layers
    mxq.restore(model)
    h = mxq.rms_norm(x, w, 1e-6, format="mxfp4")            # RMSNorm + QDQ in one kernel (also silu_mul)
    y = mxq.linear(x, mxq.prepack(mxq.quantize(w, "mxfp4")).to("cuda"))   # the W4A16 GEMM on packed weights
    y = mxq.moe(x, w13, w2, topk_ids, topk_weights)        # the MoE experts on packed weights (mxq.prepack_experts)

Every operation is a torch.library custom op (torch.ops.mxq.*) with CPU and CUDA kernels and a fake
implementation: it works under torch.compile(fullgraph=True) and CUDA-graph capture. The numbers are
bit-exact across backends and defined in docs/numerics.md; docs/python.md documents this package.
Drop-in replacements of other projects' functions live in mxq.compat (vllm_qdq, qutlass).
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # registers torch.ops.mxq.*
from . import _meta  # noqa: F401  (fake implementations)
from ._formats import FORMATS, RULES, FormatInfo, format_info, rules_for
from .ops import QuantizedTensor, dequantize, qdq, qdq_, quantize, rms_norm, rotate_quantize, silu_mul, swizzle_scales, unswizzle_scales
from .linear import PackedLinearWeight, QuantLinear, linear, load_quantized, packed_shapes, prepack
from .moe import PackedExperts, QuantExperts, load_quantized_moe, moe, pack_experts, prepack_experts
from .emulate import EmulationHandle, QDQExperts, QDQLinear, emulate, restore

try:  # the version setup.py took from CMakeLists.txt
    from importlib.metadata import version as _version

    __version__ = _version("mxq")
except Exception:  # noqa: BLE001  (not installed as a distribution: running from the tree)
    __version__ = "unknown"

__all__ = [
    "FORMATS", "RULES", "FormatInfo", "format_info", "rules_for", "QuantizedTensor", "quantize", "rotate_quantize", "dequantize", "qdq", "qdq_",
    "swizzle_scales", "unswizzle_scales", "rms_norm", "silu_mul", "emulate", "restore", "EmulationHandle", "QDQLinear", "QDQExperts", "PackedLinearWeight", "packed_shapes", "prepack", "linear", "QuantLinear", "load_quantized",
    "PackedExperts", "prepack_experts", "moe", "QuantExperts", "pack_experts", "load_quantized_moe", "cuda_compiled",
    "cuda_available",
]


def cuda_compiled() -> bool:
    """Whether this build of mxq has its CUDA kernels."""
    return bool(_C.cuda_compiled())


def cuda_available() -> bool:
    """Whether mxq's CUDA kernels can run here (compiled in, and a usable GPU present)."""
    return bool(_C.cuda_available()[0])
