"""bench/host.py's record: the issue's targets with their verdicts, the per-row summaries and ratios, the text table.

Kept apart from the measuring code so each file holds one responsibility; ``bench/host.py`` loads it by path and
re-exports what it defines.
"""

from __future__ import annotations

import statistics
from typing import Any

BATCH, SEQ = 1, 16  # bench/host.py's step: 1 x 16 tokens
BASELINE, BASELINE_GC = "transformers+peft", "transformers+peft+gc"
COMPILED = "fastft+compile"
# Stock's own regional compilation (``nn.Module.compile()`` on each decoder layer): the like-for-like row of COMPILED.
BASELINE_COMPILED = "transformers+peft+compile"
COMPILED_SYSTEMS = (COMPILED, BASELINE_COMPILED)
LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # relative to the baseline's loss


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def targets(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets for the systems that were asked for, each with its measured ratio and verdict."""
    wanted = [("fastft", "median_host_s", 0.5, BASELINE)]
    wanted += [
        (name, "median_host_s", 0.6, BASELINE_GC)
        for name, row in rows.items()
        if row["kind"] == "fastft" and row["use_gradient_checkpointing"] is not False and name != COMPILED
    ]
    wanted.append(("fastft", "ops_per_step", 0.6, BASELINE))
    # compile=True is fastft without checkpointing too: the same bound, and beside it stock compiled the same way.
    wanted += [(COMPILED, "median_host_s", 0.5, BASELINE), (COMPILED, "median_host_s", 1.0, BASELINE_COMPILED)]
    found = []
    for system, metric, limit, baseline in wanted:
        if system not in rows or baseline not in rows:
            continue
        ours, theirs = rows[system], rows[baseline]
        both_ran = ours["status"] == theirs["status"] == "ok"  # a failed row may hold a partial median
        measured = _ratio(ours.get(metric), theirs.get(metric)) if both_ran else None
        entry = dict(target=f"{system} {metric} <= {limit} x {baseline}", system=system, metric=metric)
        paired = paired_ratio(ours, theirs) if both_ran and metric == "median_host_s" else None
        if paired is not None:
            # The verdict reads the paired ratio; the ratio of the two medians stays beside it.
            entry["ratio_of_medians"], measured = measured, paired
        met = None if measured is None else measured <= limit
        entry.update(baseline=baseline, limit=limit, measured=measured, met=met)
        if measured is None:
            entry["note"] = f"not measured: {system} {ours['status']}, {baseline} {theirs['status']}"
        found.append(entry)
    return found


def paired_ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> float | None:
    """The median over rounds of ours' round median over theirs' in the same round (None without rounds).

    This VM's speed flips between two states for seconds at a time (steps of one system cluster at two values far
    apart), and the systems of one round run seconds apart: a ratio of two rows' overall medians can pair one
    system's fast state with the other's slow one, where the rounds' own ratios compare like with like."""
    pairs = list(zip(ours.get("round_medians_s") or [], theirs.get("round_medians_s") or [], strict=False))
    return statistics.median(a / b for a, b in pairs) if pairs and all(b > 0 for _, b in pairs) else None


def summarise(rows: dict[str, dict[str, Any]], dtype: str) -> dict[str, Any]:
    """Medians, tokens/s and ratios into each row; the loss agreement of the rows that ran."""
    for row in rows.values():
        row["median_host_s"] = statistics.median(row["host_s"]) if row.get("host_s") else None
        row["min_host_s"] = min(row["host_s"]) if row.get("host_s") else None
        if row.get("host_issue_s"):
            row["median_host_issue_s"] = statistics.median(row["host_issue_s"])
        row["tokens_per_s"] = _ratio(BATCH * SEQ, row["median_host_s"])
        if row.get("gpu_kernel_s") is not None:
            row["gpu_busy"] = _ratio(row["gpu_kernel_s"], row["median_host_s"])
    for row in rows.values():
        row["ratios"] = {
            f"{metric}_vs_{baseline}": _ratio(row.get(field), rows[baseline].get(field))
            for baseline in (BASELINE, BASELINE_GC, BASELINE_COMPILED)
            if baseline in rows
            for metric, field in (("host", "median_host_s"), ("ops", "ops_per_step"), ("floor", "op_floor_s"))
        }
        row["paired_host_ratios"] = {
            f"host_vs_{baseline}": paired_ratio(row, rows[baseline])
            for baseline in (BASELINE, BASELINE_GC, BASELINE_COMPILED)
            if baseline in rows and row["status"] == rows[baseline]["status"] == "ok"
        }
        if row.get("op_floor_s") is not None and row.get("median_host_s"):
            # What of the step is the framework's Python rather than its operators (see Runner.count).
            row["python_share"] = 1.0 - row["op_floor_s"] / row["median_host_s"]
    ran = {name: row for name, row in rows.items() if row["status"] == "ok"}
    reference = rows.get(BASELINE, {}).get("loss")
    if reference is None:
        return {"reference": BASELINE, "agree": None, "note": f"{BASELINE} did not run", "max_abs_diff": None}
    for row in ran.values():
        row["loss_diff"] = row["loss"] - reference
    worst = max(abs(row["loss_diff"]) for row in ran.values())
    tolerance = LOSS_TOLERANCE[dtype] * abs(reference)
    return {"reference": BASELINE, "max_abs_diff": worst, "tolerance_abs": tolerance, "agree": worst <= tolerance}


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


HEADERS = ["system", "status", "host ms", "min ms", "floor ms", "tok/s", "ops", "vs peft", "vs gc", "ops/peft"]
HEADERS += ["loss", "Δloss"]
WIDTHS = ("<22", "<8", ">8", ">7", ">8", ">6", ">6", ">8", ">6", ">8", ">10", ">9")
RATIO_COLUMNS = (("host", BASELINE), ("host", BASELINE_GC), ("ops", BASELINE))


def table(record: dict[str, Any]) -> str:
    """The rows, the targets and the loss agreement as plain text."""
    settings = record["settings"]
    lines = [
        f"{record['device']}; {settings['layers']} layers, {BATCH} x {SEQ} tokens, {settings['dtype']}; "
        f"{settings['rounds']} rounds x {settings['steps']} steps; load average "
        f"{record['load_average']['before'][0]:.2f} before, {record['load_average']['after'][0]:.2f} after",
        " ".join(format(head, spec) for head, spec in zip(HEADERS, WIDTHS, strict=True)),
    ]
    for name, row in record["systems"].items():
        # Host columns: the paired (per-round) ratios the targets read; ops: exact counts.
        paired = row.get("paired_host_ratios") or {}
        ratios = [
            (paired if metric == "host" else row["ratios"]).get(f"{metric}_vs_{base}") for metric, base in RATIO_COLUMNS
        ]
        timings = (row.get(key) for key in ("median_host_s", "min_host_s", "op_floor_s"))
        cells = [name, row["status"], *(_fmt(value, ".2f", 1e3) for value in timings)]
        cells.append(_fmt(row["tokens_per_s"], ".0f"))
        cells += [str(row.get("ops_per_step", "-")), *(_fmt(ratio, ".3f") for ratio in ratios)]
        cells += [_fmt(row.get("loss"), ".6f"), _fmt(row.get("loss_diff"), ".1e")]
        lines.append(" ".join(format(cell, spec) for cell, spec in zip(cells, WIDTHS, strict=True)))
        if row["status"] != "ok":
            lines.append(f"    {row.get('reason') or row.get('error')}")
    for entry in record["targets"]:
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[entry["met"]]
        lines.append(f"target {entry['target']}: {_fmt(entry['measured'], '.3f')} {verdict}")
    losses = record["losses"]
    lines.append(f"losses agree: {losses['agree']} (max abs diff {_fmt(losses['max_abs_diff'], '.2e')})")
    return "\n".join(lines)
