"""The benchmark scripts stay runnable: bench/generate_bench.py end to end on a tiny model on the CPU
(eager decode; the numbers mean nothing here, the H200 run is what docs/performance.md reports)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_generate_bench_runs_every_variant_on_a_tiny_model(tmp_path, model):
    transformers = pytest.importorskip("transformers")
    if model == "tiny-moe" and not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("transformers without Qwen3-MoE")
    out = tmp_path / "table.md"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "generate_bench.py"), "--model", model,
                        "--device", "cpu", "--no-graph", "--batch", "1", "--prompt", "8", "--steps", "2",
                        "--prefill", "16", "--prefill-batch", "2", "--rounds", "1", "--markdown", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    table = out.read_text()
    for variant in ("| bf16 |", "| reference |", "| reference, torch.compile |", "| mxq |"):
        assert variant in table, table
    assert "decode B=1" in table and "prefill 2x16" in table
