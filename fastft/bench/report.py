"""``fastft bench``'s reading of its runs: medians and ratios per system, the issue's targets, table, plot, README."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from fastft.bench.systems import BASELINE, BASELINE_GC

# First-step losses must agree this closely (relative) with transformers + peft's, or the row is flagged.
LOSS_TOLERANCE = {"float32": 1e-3, "other": 2e-2}
MB = 1e6

# (system, metric, comparison, factor, reference system): system's metric must be <= / >= factor x the reference's.
CPU_TARGETS = (
    ("fastft", "step_s", "<=", 0.9, BASELINE),
    ("fastft+offload", "step_s", "<=", 0.9, BASELINE_GC),
    ("fastft+offload", "step_s", "<=", 0.9, "unsloth"),
    ("fastft+offload", "saved_bytes", "<=", 0.25, BASELINE_GC),
    ("fastft+offload", "saved_bytes", "<=", 0.25, "unsloth"),
)
GPU_TARGETS = (
    ("fastft", "tokens_per_s", ">=", 2.0, BASELINE),
    ("fastft+offload", "tokens_per_s", ">=", 1.1, "unsloth"),
    ("fastft+offload", "peak_vram_bytes", "<=", 1.0, "unsloth"),
)


def _ok(run: dict[str, Any]) -> bool:
    return "error" not in run and not run.get("oom")


def describe_run(run: dict[str, Any]) -> str:
    """One progress line for a finished run."""
    head = f"{run['workload']} {run['system']} round {run['round'] + 1}:"
    if run.get("oom"):
        return f"{head} out of memory"
    if "error" in run:
        return f"{head} FAILED: {run['error']}"
    times = ", ".join(f"{value:.2f}" for value in run["step_times_s"])
    saved = run["saved_bytes"] / MB
    return f"{head} loss {run['loss']:.6f}, steps {times} s, saved {saved:.1f} MB ({run['wall_s']:.0f} s)"


def summarise(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload and system: medians over every timed step of every round, ratios to transformers +
    peft (step time, tokens/s, bytes saved for backward), loss agreement and the fraction of the matmul floor."""
    rows = []
    for workload in record["settings"]["workloads"]:
        name, tokens = workload["name"], workload["batch"] * workload["seq"]
        tolerance = LOSS_TOLERANCE["float32" if workload["dtype"] == "float32" else "other"]
        by_system = {}
        for system in record["settings"]["systems"]:
            runs = [run for run in record["runs"] if run["workload"] == name and run["system"] == system["name"]]
            good = [run for run in runs if _ok(run)]
            row: dict[str, Any] = {"workload": name, "system": system["name"], "runs": len(good)}
            row["failed"] = [run.get("error", "out of memory") for run in runs if not _ok(run)]
            if good:
                times = [value for run in good for value in run["step_times_s"]]
                row.update(
                    step_s=statistics.median(times),
                    step_s_range=[min(times), max(times)],
                    tokens_per_s=tokens / statistics.median(times),
                    loss=good[0]["loss"],
                    saved_bytes=good[0]["saved_bytes"],
                    saved_bytes_raw=good[0]["saved_bytes_raw"],
                    peak_rss_bytes=statistics.median(run["peak_rss_bytes"] for run in good),
                    lora_checksum=good[0]["lora_checksum"],
                    input_checksum=good[0]["input_checksum"],
                    adapters=good[0]["adapters"],
                    versions=good[0]["versions"],
                )
                if all("peak_vram_bytes" in run for run in good):
                    row["peak_vram_bytes"] = statistics.median(run["peak_vram_bytes"] for run in good)
                flops = [run["flops"] for run in good if "flops" in run]
                if flops:
                    row["flops"] = flops[0]
            by_system[system["name"]] = row
            rows.append(row)
        base = by_system.get(BASELINE, {})
        rate = record["matmul_flops_per_s"].get(workload["dtype"])
        for row in by_system.values():
            if "step_s" not in row or "step_s" not in base:
                continue
            row["step_ratio"] = row["step_s"] / base["step_s"]
            row["saved_ratio"] = row["saved_bytes"] / base["saved_bytes"]
            row["loss_rel_diff"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
            row["loss_agrees"] = row["loss_rel_diff"] <= tolerance
            row["same_inputs"] = (row["input_checksum"], row["adapters"]) == (base["input_checksum"], base["adapters"])
            row["same_lora"] = abs(row["lora_checksum"] - base["lora_checksum"]) <= 1e-9 * abs(base["lora_checksum"])
            if "flops" in base and rate:
                # The floor is the baseline step's FLOPs (no recompute) at this device's matmul rate, the same
                # for every system: recomputation is work the floor does not pay.
                row["floor_fraction"] = base["flops"] / rate / row["step_s"]
    return rows


def _targets_for(record: dict[str, Any]) -> list[tuple[dict[str, Any], tuple]]:
    gpu = not record["device"].startswith("cpu")
    chosen = []
    if record["settings"]["quick"]:
        # The tiny model checks the harness; the targets are about real models.
        return chosen
    for workload in record["settings"]["workloads"]:
        if gpu:
            chosen += [(workload, target) for target in GPU_TARGETS]
        elif workload["dtype"] == "float32":
            chosen += [(workload, target) for target in CPU_TARGETS]
    return chosen


def evaluate_targets(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against this run: each with the measured ratio, the bound and met (None: a system or
    figure is missing, with the reason)."""
    rows = {(row["workload"], row["system"]): row for row in record["summary"]}
    results = []
    for workload, (system, metric, comparison, factor, reference) in _targets_for(record):
        ours, theirs = rows.get((workload["name"], system), {}), rows.get((workload["name"], reference), {})
        entry = {
            "workload": workload["name"],
            "target": f"{system} {metric} {comparison} {factor} x {reference}",
            "bound": factor,
        }
        if metric not in ours or metric not in theirs:
            missing = system if metric not in ours else reference
            entry.update(measured=None, met=None, reason=f"no {metric} for {missing} in this run")
        else:
            ratio = ours[metric] / theirs[metric]
            met = ratio <= factor if comparison == "<=" else ratio >= factor
            entry.update(measured=ratio, met=met, ours=ours[metric], theirs=theirs[metric])
        results.append(entry)
    longest = {(row["model"], row["quant"], row["system"]): row["longest_seq"] for row in record.get("longest", [])}
    for (model, quant, system), seq in longest.items():
        if system != "fastft+offload" or (model, quant, "unsloth") not in longest:
            continue
        theirs = longest[(model, quant, "unsloth")]
        results.append(
            {
                "workload": f"{model} {quant} longest sequence, batch 1",
                "target": "fastft+offload longest >= unsloth longest",
                "bound": 1.0,
                "ours": seq,
                "theirs": theirs,
                "measured": None if not seq or not theirs else seq / theirs,
                "met": None if seq is None or theirs is None else seq >= theirs,
            }
        )
    return results


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value / scale, spec)


def markdown(record: dict[str, Any], plot_name: str | None = None) -> str:
    """The run as Markdown: settings, one table per workload, the targets (the README section and stdout)."""
    gpu = not record["device"].startswith("cpu")
    versions, load = record["harness_versions"], record["load_average"]
    lines = [
        f"{record['device']}; {record['started'][:10]}; torch {versions['torch']}, transformers "
        f"{versions['transformers']}, peft {versions['peft']} (competitors' own versions are in the JSON); "
        f"{record['settings']['rounds']} alternated rounds x {record['settings']['timed_steps_per_run']} timed steps "
        f"per system, one process each, medians; load average {_fmt(load['before'], '.2f')} "
        f"before, {_fmt(load['after'], '.2f')} after; {record['duration_s'] / 60:.1f} minutes in all.",
        "",
    ]
    memory = "peak VRAM GiB" if gpu else "peak RSS MB"
    for workload in record["settings"]["workloads"]:
        rows = [row for row in record["summary"] if row["workload"] == workload["name"]]
        lines += [
            f"**{workload['name']}** ({workload['batch']} x {workload['seq']} tokens, {workload['dtype']}"
            + (", NF4 base" if workload["quant"] == "nf4" else "")
            + ")",
            "",
            f"| system | step s | tokens/s | step vs peft | saved MB | saved vs peft | {memory} | loss "
            "| loss rel. diff | matmul floor |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for row in rows:
            if "step_s" not in row:
                lines.append(f"| {row['system']} | failed: {'; '.join(row['failed'])[:80]} | | | | | | | | |")
                continue
            peak = _fmt(row.get("peak_vram_bytes"), ".2f", 2**30) if gpu else _fmt(row["peak_rss_bytes"], ".0f", MB)
            flag = "" if row.get("loss_agrees", True) else " **FLAGGED**"
            lines.append(
                f"| {row['system']} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | "
                f"{_fmt(row.get('step_ratio'), '.3f')}x | {row['saved_bytes'] / MB:.1f} | "
                f"{_fmt(row.get('saved_ratio'), '.3f')}x | {peak} | {row['loss']:.6f} | "
                f"{_fmt(row.get('loss_rel_diff'), '.1e')}{flag} | {_fmt(row.get('floor_fraction'), '.1%')} |"
            )
        lines.append("")
    if record["targets"]:
        lines += ["| target | workload | measured | met |", "|---|---|--:|---|"]
        for target in record["targets"]:
            met = {True: "met", False: "**not met**", None: f"n/a ({target.get('reason', 'missing')})"}[target["met"]]
            lines.append(f"| {target['target']} | {target['workload']} | {_fmt(target['measured'], '.3f')} | {met} |")
        lines.append("")
    if plot_name:
        lines.append(f"![tokens/s and memory per system](results/{plot_name})")
    return "\n".join(lines).rstrip() + "\n"


def plot(record: dict[str, Any], path: Path) -> Path:
    """Tokens/s and memory (peak VRAM on a GPU; bytes saved for backward and peak RSS on a CPU) per system, one
    row of panels per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = not record["device"].startswith("cpu")
    workloads = record["settings"]["workloads"]
    panels = (
        [("tokens_per_s", "tokens/s", 1.0), ("peak_vram_bytes", "peak VRAM (GiB)", 2**30)]
        if gpu
        else [
            ("tokens_per_s", "tokens/s", 1.0),
            ("saved_bytes", "saved for backward (MB)", MB),
            ("peak_rss_bytes", "peak RSS (MB)", MB),
        ]
    )
    figure, axes = plt.subplots(
        len(workloads), len(panels), figsize=(4.2 * len(panels), 2.8 * len(workloads)), squeeze=False
    )
    for row_index, workload in enumerate(workloads):
        rows = [row for row in record["summary"] if row["workload"] == workload["name"]]
        names = [row["system"] for row in rows]
        for column, (metric, label, scale) in enumerate(panels):
            axis = axes[row_index][column]
            values = [row.get(metric, 0) / scale for row in rows]
            colours = ["tab:orange" if name.startswith("fastft") else "tab:gray" for name in names]
            axis.barh(names, values, color=colours)
            axis.invert_yaxis()
            axis.set_xlabel(label)
            axis.set_title(workload["name"] if column == 0 else "", fontsize=9, loc="left")
            axis.tick_params(labelsize=8)
    figure.suptitle(f"fastft bench: {record['device']} ({record['started'][:10]})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def update_readme(readme: Path, record: dict[str, Any], paths: dict[str, Path]) -> None:
    """Replace the README's section for this device (between ``<!-- fastft-bench:<slug> -->`` markers, added at the
    end when missing) with :func:`markdown` of the run."""
    slug = record["device_slug"]
    start, end = f"<!-- fastft-bench:{slug}:start -->", f"<!-- fastft-bench:{slug}:end -->"
    body = markdown(record, plot_name=paths["plot"].name if "plot" in paths else None)
    source = f"results/{paths['json'].name}"
    body += f"\nFrom `{source}` (redraw: `fastft bench --readme-from bench/{source}`).\n"
    text = readme.read_text() if readme.exists() else ""
    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + f"\n\n### {record['device']}\n\n{block}\n"
    readme.write_text(text)
