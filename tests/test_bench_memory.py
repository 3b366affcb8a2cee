"""bench/memory.py end to end on the tiny shape in bf16: one worker subprocess per method, a JSON report and a plot;
the dense baseline keeps fp32 master weights (bf16-mixed), LoGRA trains the bf16 weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # minutes of end-to-end runs: `pytest -m "not integration"` skips them

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "memory.py"


def test_memory_bench_writes_rows_and_plot(tmp_path):
    out, plot = tmp_path / "tmp.json", tmp_path / "tmp.png"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--shape", "tiny", "--dtype", "bf16", "--steps", "2",
         "--methods", "logra,dense_adamw,logra_lightning",
         "--out", str(out), "--plot", str(plot)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    report = json.loads(out.read_text())
    assert set(report) == {"rows", "settings"}
    assert report["settings"]["shape"] == "tiny"
    rows = {row["method"]: row for row in report["rows"]}
    assert list(rows) == ["logra", "dense_adamw", "logra_lightning"]  # the last: a Trainer + MemoryProfiler
    for row in rows.values():
        assert set(row) == {"method", "weights", "peak_gib", "avg_gib", "step_s"}, row
        assert row["peak_gib"] > 0 and row["avg_gib"] > 0 and row["step_s"] > 0
        assert row["avg_gib"] <= row["peak_gib"]
    assert rows["dense_adamw"]["weights"] == "fp32 master + bf16 autocast"
    assert rows["logra"]["weights"] == rows["logra_lightning"]["weights"] == "bf16"
    assert plot.stat().st_size > 0
