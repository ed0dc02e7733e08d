"""Where the GPU waits in a profiled training step, from the Chrome trace `fastft bench` writes with
``FASTFT_BENCH_TRACE_DIR`` set (``bash bench/gpu_modes.sh`` does for its ``trace`` group).

    python bench/gpu_gaps.py bench/results/h100-2026-11-27/timelines/fastft.json.gz [more traces] [--top 15]

Every stretch of the step in which no kernel, memset or copy runs on the GPU is a gap. Each gap is charged to the
host operator that launched the GPU work ending it: the outermost operator on the launching thread (an autograd
node in the backward, a module's first aten operator in the forward) and the innermost one. A gap whose launch came
after the GPU had gone idle is the host's: the GPU had nothing queued. The summary says how much of the step's wall
time was such idle, before the first kernel, between kernels and after the last, and which operators' launches
ended the most idle time: what issue 28 needs to find the Python that still keeps the GPU waiting.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Gaps shorter than this are the GPU's own scheduling between back-to-back kernels, not waiting for the host.
MIN_GAP_US = 2.0


def load(path: Path) -> list[dict[str, Any]]:
    """The trace's events (a ``.gz`` file is read through gzip)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def _enclosing(ops: list[dict[str, Any]], starts: list[float], ts: float) -> tuple[str, str]:
    """The outermost and innermost operator on one thread whose span holds ``ts`` (ops sorted by start)."""
    outer = inner = None
    # Every earlier operator is looked at: a parent starts before its children and their preceding siblings.
    for index in range(bisect_right(starts, ts) - 1, -1, -1):
        op = ops[index]
        if op["ts"] + op["dur"] >= ts:
            inner = inner or op
            outer = op
    if outer is None:
        return "(no operator)", "(no operator)"
    return outer["name"], inner["name"]


def gaps(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's GPU idle time and the host operators charged with it (see the module docstring)."""
    work = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not work:
        raise ValueError("gpu_gaps: the trace holds no GPU kernels; profile a CUDA step")
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in LAUNCH_CATEGORIES and "args" in e}
    ops_by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("cat") in ("cpu_op", "user_annotation") and event.get("ph") == "X":
            ops_by_thread[event["tid"]].append(event)
    starts_by_thread = {}
    for thread, ops in ops_by_thread.items():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        starts_by_thread[thread] = [op["ts"] for op in ops]
    cpu_start = min(e["ts"] for e in events if e.get("cat") == "cpu_op")
    cpu_end = max(e["ts"] + e["dur"] for e in events if e.get("cat") == "cpu_op")
    kernel_us = sum(event["dur"] for event in work if event["cat"] == "kernel")
    busy_until = work[0]["ts"] + work[0]["dur"]
    by_outer: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_inner: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    host_idle = queued_idle = 0.0
    for event in work[1:]:
        gap = event["ts"] - busy_until
        if gap >= MIN_GAP_US:
            launch = launches.get(event["args"].get("correlation"))
            if launch is not None and launch["ts"] >= busy_until:
                host_idle += gap
                thread = launch["tid"]
                outer, inner = _enclosing(ops_by_thread[thread], starts_by_thread[thread], launch["ts"])
                for table, key in ((by_outer, outer), (by_inner, inner)):
                    table[key][0] += 1
                    table[key][1] += gap
            else:
                queued_idle += gap
        busy_until = max(busy_until, event["ts"] + event["dur"])

    def top(table: dict[str, list[float]]) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda item: -item[1][1])
        return [{"op": name, "gaps": int(count), "ms": spent / 1e3} for name, (count, spent) in rows]

    return {
        "wall_ms": (max(cpu_end, busy_until) - cpu_start) / 1e3,
        "kernel_ms": kernel_us / 1e3,
        "before_first_ms": (work[0]["ts"] - cpu_start) / 1e3,
        "after_last_ms": max(0.0, cpu_end - busy_until) / 1e3,
        "host_idle_ms": host_idle / 1e3,
        "queued_idle_ms": queued_idle / 1e3,
        "by_outer": top(by_outer),
        "by_inner": top(by_inner),
    }


def _table(rows: list[dict[str, Any]], limit: int) -> list[str]:
    lines = ["| operator | gaps | idle ms |", "|---|--:|--:|"]
    lines += [f"| `{row['op'][:90]}` | {row['gaps']} | {row['ms']:.2f} |" for row in rows[:limit]]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="Chrome traces of profiled steps (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=12, help="operators listed per table")
    options = parser.parse_args(argv)
    for path in options.traces:
        found = gaps(load(path))
        print(f"## {path.name}\n")
        print(
            f"profiled step {found['wall_ms']:.2f} ms: kernels {found['kernel_ms']:.2f} ms; GPU idle waiting for the "
            f"host {found['host_idle_ms']:.2f} ms between kernels, {found['before_first_ms']:.2f} ms before the first "
            f"and {found['after_last_ms']:.2f} ms after the last; idle with work queued (scheduling) "
            f"{found['queued_idle_ms']:.2f} ms\n"
        )
        print("Idle ended by launches inside (outermost operator):\n")
        print("\n".join(_table(found["by_outer"], options.top)) + "\n")
        print("Idle ended by launches from (innermost operator):\n")
        print("\n".join(_table(found["by_inner"], options.top)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
