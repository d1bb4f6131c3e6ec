"""The benchmark scripts stay runnable: bench/generate_bench.py end to end on a tiny model on the CPU
(eager decode; the numbers mean nothing here, the H200 run is what docs/performance.md reports), and
bench/moe_peers.py --dry-run (a tiny MoE on the CPU: its checks and table code, no timing)."""
from __future__ import annotations

import json
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
    for variant in ("| bf16 |", "| reference |", "| reference, torch.compile |", "| mxq |", "| mxq.linear mxfp4 |",
                    "| mxq.linear nvfp4 |"):
        assert variant in table, table
    assert "decode B=1" in table and "prefill 2x16" in table
    # the packed-experts variants (mxq.pack_experts; the MoE op through the reference on the CPU) on the MoE model only
    packed_moe = ("| mxq.linear+moe mxfp4 |", "| mxq.linear+moe nvfp4 |")
    assert all((v in table) == (model == "tiny-moe") for v in packed_moe), table
    assert "skipped" not in table, table
    # the issue targets below the table: 36's for the packed Linears, 38's for the packed experts
    assert "| target | variant | measured | met |" in table, table
    assert "| issue 36: decode B=1 >= 2.2x bf16 | mxq.linear mxfp4 |" in table, table
    if model == "tiny-moe":
        for v in ("mxfp4", "nvfp4"):
            for c, least in (("decode B=1", 1.8), ("prefill 2x16", 0.95)):
                assert f"| issue 38: {c} >= {least}x bf16 | mxq.linear+moe {v} |" in table, table


def test_moe_peers_dry_run_checks_every_cpu_path(tmp_path):
    """bench/moe_peers.py --dry-run: a tiny MoE on the CPU; mxq's reference op and the bf16 grouped block against the
    fp32 torch reference, the Humming routing-metadata builder against its Python-loop layout, the table and JSON."""
    out = tmp_path / "moe.jsonl"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "moe_peers.py"), "--dry-run", "--routing", "uniform,zipf",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout
    for peer in ("mxq", "bf16 grouped"):
        lines = [ln for ln in text.splitlines() if ln.strip().startswith(f"check {peer} ")]
        assert len(lines) == 2 and all(ln.rstrip().endswith(" ok") for ln in lines), text  # mxfp4 and nvfp4
    assert text.count("check humming_align vs Python-loop layout: ok") == 2, text
    assert "| model | routing | T |" in text and "| tiny | zipf | 16 |" in text, text
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2  # formats x routings x T
    assert {r["target"] for r in rows} == {"TB/s >= 3.4"}
    assert all(r["flops"] == 2.0 * r["T"] * 2 * (2 * 32 * 64 + 64 * 32) for r in rows)
