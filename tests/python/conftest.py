"""Shared helpers of mxq's pytest suites: exact byte comparison with the first mismatches printed,
LLM-like test data, and the CUDA skip marker."""
from __future__ import annotations

import pytest
import torch

import mxq

CUDA = torch.cuda.is_available() and mxq.cuda_available()

# The places an op can run, for tests parametrised with @pytest.mark.parametrize("device", BACKENDS,
# indirect=True): CPU data on the fast path, CPU data on the reference backend, CUDA data.
BACKENDS = ["cpu", "reference", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]


@pytest.fixture
def device(request, monkeypatch):
    """The device of the test data; "reference" is CPU data on mxq's reference backend."""
    if request.param == "reference":
        monkeypatch.setenv("MXQ_BACKEND", "reference")
        return "cpu"
    monkeypatch.delenv("MXQ_BACKEND", raising=False)
    return request.param
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and mxq built with CUDA")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (contiguous, flattened to uint8)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8).reshape(-1) if t.element_size() == 1 else t.reshape(-1).view(torch.uint8)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "", mask: torch.Tensor = None,
                       show: int = 10) -> None:
    """Asserts identical shapes, dtypes and bytes (element bit patterns: -0 != +0, NaN patterns
    compared). `mask` (bool, the tensors' shape) restricts the comparison to where it is True.
    On failure prints the first `show` mismatches with their coordinates and both values."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    if a.element_size() == 1:
        ai, ei = a.view(torch.uint8).to(torch.int64), e.view(torch.uint8).to(torch.int64)
    else:
        it = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        ai, ei = a.view(it).to(torch.int64), e.view(it).to(torch.int64)
    diff = ai != ei
    if mask is not None:
        diff &= mask.cpu()
    n = int(diff.sum())
    if n:
        idx = diff.nonzero()[:show]
        lines = [f"{what}: {n} of {diff.numel()} elements differ; first {len(idx)}:"]
        for i in idx.tolist():
            i = tuple(i)
            lines.append(f"  at {i}: got {a[i].item()!r} (0x{ai[i].item() & 0xFFFFFFFF:x}), "
                         f"expected {e[i].item()!r} (0x{ei[i].item() & 0xFFFFFFFF:x})")
        pytest.fail("\n".join(lines))


def llm_like(rows: int, k: int, dtype=torch.bfloat16, seed: int = 0, device="cpu") -> torch.Tensor:
    """Activations-like data: Gaussian rows with a few massive channels and a spread of row scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float32)
    x *= torch.exp(torch.randn(rows, 1, generator=g) * 1.5)
    ch = torch.randint(0, k, (max(1, k // 256),), generator=g)
    x[:, ch] *= 40.0
    return x.to(dtype).to(device)
