"""The memory table's rows (memory_table, peer_table, profile): bench.memory's workers, one subprocess per (shape,
method), beside the paper's figures."""

from __future__ import annotations

import time

from bench.gpu_stages.plan import Plan, Progress
from bench.lib.memory_rows import run_method

# The paper's memory table (GiB per GPU: step average, peak), for the rows measured here.
PAPER_GIB = {
    ("1.5b", "logra_adam"): (7.18, 8.66), ("1.5b", "dense_adamw"): (9.18, 9.19),
    ("7b", "logra_adam"): (17.29, 22.26), ("7b", "dense_adamw"): (31.82, 31.85),
}


def measure_rows(plan: Plan, progress: Progress, methods: dict[str, tuple[str, ...]], extra: list[str] = ()
                 ) -> dict:
    """bench.memory's workers, one subprocess per (shape, method); the rows are written as they come, and a row
    not started when the check's time is spent says so."""
    result = dict(settings={shape: " ".join([*plan.memory[shape], *extra]) for shape in methods}, rows=[])
    for shape, names in methods.items():
        argv = ["--shape", shape, *plan.memory[shape], *extra, "--device", plan.device]
        for method in names:
            if time.monotonic() > plan.ends_at:
                row = dict(method=method, error=f"not run: the check's {plan.time_s:.0f} s were spent")
            else:
                row = run_method(method, argv, timeout_s=plan.method_timeout_s)
            paper = PAPER_GIB.get((shape, method))
            if paper is not None:
                row["paper_avg_gib"], row["paper_peak_gib"] = paper
            result["rows"].append({"shape": shape, **row})
            progress(result)
    return result
