"""What bench/linear_peers.py and bench/moe_peers.py share: the formats' constants, the timer (L2 flushed
before each run, CUDA events, the median), the error measure and the compressed-tensors weight config
that Humming's layer reads. Imported by those scripts (bench/ is on their path when run as scripts)."""
from __future__ import annotations

import statistics
from typing import Any, Callable, Optional

import torch

GROUP: dict[str, int] = {"mxfp4": 32, "nvfp4": 16}
BYTES_PER_ELEM: dict[str, float] = {"mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}  # 0.53125, 0.5625
E2M1: list[float] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
SLEEP_CYCLES: int = 200_000  # ~100 us of GPU spin before each flush: keeps the GPU ahead of the host
CHECK_TOL: float = 2e-2


def short(e: BaseException, n: int = 90) -> str:
    """An exception as one table-safe line of at most n characters."""
    s = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return s if len(s) <= n else s[: n - 3] + "..."


class Timer:
    """Median microseconds of a callable on the current CUDA device, the L2 flushed before each run."""

    def __init__(self, reps: int, warmup: int):
        self.reps = reps
        self.warmup = warmup
        l2 = int(torch.cuda.get_device_properties(0).L2_cache_size)
        self.flush = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device="cuda")
        self.sleep_ok = hasattr(torch.cuda, "_sleep")

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Median microseconds of fn over reps, L2 flushed before each."""
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            if self.sleep_ok:
                torch.cuda._sleep(SLEEP_CYCLES)
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| (y in any float dtype, ref fp32)."""
    return (y.float() - ref).norm().item() / max(ref.norm().item(), 1e-30)


def fmt_us(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}"


def humming_weight_config(fmt: str) -> dict[str, Any]:
    """A compressed-tensors weight config as vLLM reads it from a checkpoint's quantization_config."""
    if fmt == "mxfp4":
        return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "type": "float", "num_bits": 4,
                "strategy": "group", "group_size": 32, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "type": "float", "num_bits": 4,
            "strategy": "tensor_group", "group_size": 16, "symmetric": True}
