"""The prepared GPU run (`python -m benchmarks.gpu`, issue 40) rehearsed at toy size on the CPU (`--smoke`), so the
one command a session with a GPU runs cannot rot between such sessions: every part runs, its correctness checks hold
against the independent reference, and the report renders from what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_smoke_run_measures_every_part_and_reports(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--smoke", "--seconds", "900", "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    by_name = {(r["part"], r["name"]): r for r in records}
    errors = [r for r in records if "error" in r]
    assert not errors, errors
    checks = [r for r in records if r["part"] == "correctness"]
    assert {r["name"] for r in checks} >= {f"{case}/{check}" for case in ("llama", "learnable_plus", "svformer_cla2")
                                           for check in ("float32/T40", "bfloat16/T40", "attention", "cache",
                                                         "cache/compiled", "continuous_batching")}
    assert all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    for mode in ("eager", "compiled"):
        for variant in ("llama", "learnable_plus"):
            assert by_name[("training", f"{mode}/{variant}")]["step_ms"] > 0
    for batch in (1, 2):
        assert by_name[("decode", f"batch{batch}/learnable_plus")]["time_ratio"] > 0
    # 4 layers: SVFormer's values once hold (2L)/(L+1) = 1.6 times the tokens of one Llama-sized budget
    assert by_name[("capacity", "llama")]["sequences"] == 8
    assert by_name[("capacity", "svformer")]["sequences"] == 12

    sys.path.insert(0, str(REPO))
    from benchmarks.gpu.report import write_report

    page = write_report(tmp_path / "gpu.jsonl", out=tmp_path / "gpu.md").read_text()
    for heading in ("## Correctness", "## Training step", "## Serving capacity", "## Decoding"):
        assert heading in page
    assert "| svformer_cla2 |" in page and "| svformer | 12 |" in page
