"""``fastft bench``'s reading of its runs: medians and ratios per system, mode-for-mode comparisons, the issue's
targets, the longest-sequence results, table, plot, README."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from fastft.bench import longest as longest_search
from fastft.bench.systems import BASELINE, BASELINE_GC, COMPETITOR_FAMILY, MODE_CLASSES, SYSTEMS
from fastft.bench.workloads import MODEL_SHAPES, RANK, is_moe

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
# Mode for mode (issue 28): fastft >= 1.1x Unsloth's tokens/s in each mode, peak VRAM <= Unsloth's where both
# checkpoint. A target whose two systems were not both asked for is left out of the run's list.
GPU_TARGETS = (
    ("fastft", "tokens_per_s", ">=", 2.0, BASELINE),
    ("fastft", "tokens_per_s", ">=", 1.1, "unsloth-nogc"),
    ("fastft+recompute", "tokens_per_s", ">=", 1.1, "unsloth-gc"),
    ("fastft+recompute", "peak_vram_bytes", "<=", 1.0, "unsloth-gc"),
    ("fastft+offload", "tokens_per_s", ">=", 1.1, "unsloth"),
    ("fastft+offload", "peak_vram_bytes", "<=", 1.0, "unsloth"),
)
# Issue 32's targets for a mixture-of-experts workload: fastft >= 1.5x stock transformers + peft (grouped_mm experts)
# and, as for the dense models, >= 1.1x Unsloth with peak VRAM <= Unsloth's in the same mode.
MOE_GPU_TARGETS = (("fastft", "tokens_per_s", ">=", 1.5, BASELINE), *GPU_TARGETS[1:])
MOE_FLOPS_NOTE = "MoE: each token's top-k experts only; stock peft's per-step fold of B·A into every expert not counted"
# The experts forward a stock MoE run was set to (transformers 5's experts_implementation).
EXPERTS_FIELD = "experts_implementation"
# Per-run figures of the profiled CUDA step, reported as medians over a system's runs.
PROFILE_FIELDS = ("gpu_busy", "kernel_launches", "gpu_kernel_s", "copies")


def _ok(run: dict[str, Any]) -> bool:
    return "error" not in run and not run.get("oom")


def system_info(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each system of the run by name: its ``family``, ``mode`` and ``checkpointing`` class. Records written before
    modes existed lack them; their systems are looked up by name (``None`` where the name is no longer known)."""
    current = {system.name: system.to_dict() for system in SYSTEMS}
    info = {}
    for entry in record["settings"]["systems"]:
        known = current.get(entry["name"], {})
        info[entry["name"]] = {
            key: entry[key] if "family" in entry else known.get(key) for key in ("family", "mode", "checkpointing")
        }
    return info


def _mode_label(mode: Any) -> str:
    if mode is None:
        return "?"
    return repr(mode) if isinstance(mode, bool) else f'"{mode}"'


def floor_flops(
    by_system: dict[str, dict[str, Any]], workload: dict[str, Any], rank: int = RANK
) -> tuple[float | None, str]:
    """The FLOPs of the matmul floor for one workload, and where they come from: the baseline step counted by
    ``FlopCounterMode``; else the analytic count from the model's config (``fastft.bench.measure.lora_step_flops``, the
    same for every system), as a worker computed it or, for the random-weight shapes, from ``MODEL_SHAPES`` (so
    records from before workers computed it get a floor too); else none, with the reasons."""
    from fastft.bench.measure import EXPERT_PARAMETERS, LLAMA_PROJECTIONS, lora_step_flops

    base = by_system.get(BASELINE, {})
    if base.get("flops"):
        return base["flops"], "counted"
    reasons = [f"{name}: {row['flops_error']}" for name, row in by_system.items() if "flops_error" in row]
    if not reasons and "step_s" not in base:
        reasons.append(f"{BASELINE} has no measured run to count")
    failed = f" (the count failed: {'; '.join(reasons)})" if reasons else ""
    analytic = [row["flops_analytic"] for row in by_system.values() if row.get("flops_analytic")]
    routed = f" ({MOE_FLOPS_NOTE})" if is_moe(workload.get("model", "")) else ""
    if analytic:
        return analytic[0], "from the config" + routed + failed
    if workload.get("model") in MODEL_SHAPES:
        shape = MODEL_SHAPES[workload["model"]]
        targets = (*LLAMA_PROJECTIONS, *(EXPERT_PARAMETERS if routed else ()))
        flops = lora_step_flops(shape, workload["batch"], workload["seq"], rank, targets)
        return flops, f"from the {workload['model']} shape" + routed + failed
    reasons += [
        f"{name}: {row['flops_analytic_error']}" for name, row in by_system.items() if "flops_analytic_error" in row
    ]
    return None, "; ".join(reasons) or "no FLOP count in this run"


def floor_fraction(flops: float | None, rate: float | None, step_s: float | None) -> tuple[float | None, str | None]:
    """The fraction of a step the matmul floor would take (``flops / rate / step_s``), or None and why not. Never
    raises: a missing or broken figure drops the floor, not the row."""
    if flops is None:
        return None, "no floor: no FLOP count"
    try:
        value = flops / rate / step_s
    except (TypeError, ZeroDivisionError) as error:
        return None, f"no floor: {flops:.4g} FLOPs at a matmul rate of {rate} FLOP/s ({type(error).__name__})"
    return value, None


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


def _row(name: str, runs: list[dict[str, Any]], tokens: int, info: dict[str, Any]) -> dict[str, Any]:
    good = [run for run in runs if _ok(run)]
    row: dict[str, Any] = {"system": name, **info, "runs": len(good)}
    row["failed"] = [run.get("error", "out of memory") for run in runs if not _ok(run)]
    if not good:
        return row
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
    for field in PROFILE_FIELDS:
        values = [run[field] for run in good if field in run]
        if values:
            row[field] = statistics.median(values)
    for field in ("flops", "flops_analytic", "flops_error", "flops_analytic_error", "profile_error", EXPERTS_FIELD):
        found = [run[field] for run in good if field in run]
        if found:
            row[field] = found[0]
    return row


def summarise(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload and system: medians over every timed step of every round, ratios to transformers +
    peft (step time, tokens/s, bytes saved for backward) and to the competitor in the same checkpointing mode
    (tokens/s, peak VRAM), loss agreement, the fraction of the matmul floor, and on CUDA the GPU busy fraction and
    kernel launches per step."""
    rows = []
    info = system_info(record)
    for workload in record["settings"]["workloads"]:
        name, tokens = workload["name"], workload["batch"] * workload["seq"]
        tolerance = LOSS_TOLERANCE["float32" if workload["dtype"] == "float32" else "other"]
        by_system = {}
        for system in record["settings"]["systems"]:
            runs = [run for run in record["runs"] if run["workload"] == name and run["system"] == system["name"]]
            row = {"workload": name, **_row(system["name"], runs, tokens, info[system["name"]])}
            by_system[system["name"]] = row
            rows.append(row)
        base = by_system.get(BASELINE, {})
        rate = record["matmul_flops_per_s"].get(workload["dtype"])
        flops, source = floor_flops(by_system, workload, record["settings"].get("lora", {}).get("r", RANK))
        competitors = {
            row["checkpointing"]: row
            for row in by_system.values()
            if row.get("family") == COMPETITOR_FAMILY and "step_s" in row
        }
        for row in by_system.values():
            if "step_s" not in row:
                continue
            # The floor is one step's FLOPs without recompute at this device's matmul rate, the same for every
            # system: recomputation is work the floor does not pay.
            row["floor_fraction"], missing = floor_fraction(flops, rate, row["step_s"])
            if flops is None:
                row["floor_source"] = f"no floor: {source}"
            else:
                row["floor_source"] = source if missing is None else missing
            rival = competitors.get(row.get("checkpointing"))
            if rival is not None and rival is not row:
                row["same_mode_competitor"] = rival["system"]
                row["same_mode_speed"] = row["tokens_per_s"] / rival["tokens_per_s"]
                if "peak_vram_bytes" in row and rival.get("peak_vram_bytes"):
                    row["same_mode_vram"] = row["peak_vram_bytes"] / rival["peak_vram_bytes"]
            if "step_s" not in base:
                continue
            row["step_ratio"] = row["step_s"] / base["step_s"]
            row["saved_ratio"] = row["saved_bytes"] / base["saved_bytes"]
            row["loss_rel_diff"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
            row["loss_agrees"] = row["loss_rel_diff"] <= tolerance
            row["same_inputs"] = (row["input_checksum"], row["adapters"]) == (base["input_checksum"], base["adapters"])
            row["same_lora"] = abs(row["lora_checksum"] - base["lora_checksum"]) <= 1e-9 * abs(base["lora_checksum"])
    return rows


def _targets_for(record: dict[str, Any]) -> list[tuple[dict[str, Any], tuple]]:
    gpu = not record["device"].startswith("cpu")
    chosen = []
    if record["settings"]["quick"]:
        # The tiny model checks the harness; the targets are about real models.
        return chosen
    asked = {system["name"] for system in record["settings"]["systems"]}
    for workload in record["settings"]["workloads"]:
        if gpu:
            targets = MOE_GPU_TARGETS if is_moe(workload.get("model", "")) else GPU_TARGETS
        elif workload["dtype"] == "float32":
            targets = CPU_TARGETS
        else:
            continue
        chosen += [(workload, target) for target in targets if {target[0], target[4]} <= asked]
    return chosen


def _entry_info(entry: dict[str, Any], key: str) -> Any:
    """``family``, ``mode`` or ``checkpointing`` of a longest-sequence result; results written before modes existed
    lack them, and their system is looked up by name."""
    if key in entry:
        return entry[key]
    known = next((system for system in SYSTEMS if system.name == entry["system"]), None)
    return None if known is None else known.to_dict()[key]


def _longest_pairs(record: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """fastft's longest-sequence results each with the competitor's in the same checkpointing class and model."""
    info = _entry_info
    entries = record.get("longest", [])
    pairs = []
    for ours in entries:
        if info(ours, "family") != "fastft":
            continue
        for theirs in entries:
            same = (theirs["model"], theirs["quant"], info(theirs, "checkpointing")) == (
                ours["model"],
                ours["quant"],
                info(ours, "checkpointing"),
            )
            if same and info(theirs, "family") == COMPETITOR_FAMILY:
                pairs.append((ours, theirs))
    return pairs


def _what_the_bound_needs(ours: dict[str, Any], ratio: float, factor: float) -> dict[str, float]:
    """For a speed bound on a profiled GPU run: the step time that meets it (``step_needed_s``, the same tokens per
    step) and the GPU busy fraction our measured kernel time would need at that step (``busy_needed``). Above 1.0,
    removing host overhead cannot meet the bound: the kernels alone take longer than the step allows."""
    if "step_s" not in ours or not ours.get("gpu_kernel_s"):
        return {}
    needed = ours["step_s"] * ratio / factor
    return {"step_needed_s": needed, "busy_needed": ours["gpu_kernel_s"] / needed}


def evaluate_targets(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against this run: each with the measured ratio, the bound and met (None: a system or
    figure is missing, or a longest sequence is a lower bound only, with the reason)."""
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
            if metric == "tokens_per_s" and comparison == ">=":
                entry.update(_what_the_bound_needs(ours, ratio, factor))
        results.append(entry)
    for ours, theirs in _longest_pairs(record):
        mine, other = ours.get("longest_seq"), theirs.get("longest_seq")
        met, reason = longest_search.compare(ours, theirs)
        entry = {
            "workload": f"{ours['model']} {ours['quant']} longest sequence, batch 1",
            "target": f"{ours['system']} longest >= {theirs['system']} longest",
            "bound": 1.0,
            "ours": mine,
            "theirs": other,
            "measured": mine / other if mine and other else None,
            "met": met,
        }
        if reason:
            entry["reason"] = reason
        results.append(entry)
    return results


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value / scale, spec)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}x"


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows grouped by checkpointing class (none, recompute, offload, sqrt), in run order within a class."""
    rank = {name: index for index, name in enumerate(MODE_CLASSES)}
    return sorted(rows, key=lambda row: rank.get(row.get("checkpointing"), len(rank)))


def _workload_table(record: dict[str, Any], workload: dict[str, Any], gpu: bool) -> list[str]:
    info = system_info(record)
    # Rows of records written before modes existed carry no mode: take it from the system's name.
    rows = [info.get(row["system"], {}) | row for row in record["summary"] if row["workload"] == workload["name"]]
    rows = _ordered(rows)
    memory = "peak VRAM GiB" if gpu else "peak RSS MB"
    extra = " GPU busy | launches/step |" if gpu else ""
    lines = [
        f"**{workload['name']}** ({workload['batch']} x {workload['seq']} tokens, {workload['dtype']}"
        + (", NF4 base" if workload["quant"] == "nf4" else "")
        + ")",
        "",
        f"| system | mode | step s | tokens/s | step vs peft | vs Unsloth, same mode | saved MB | saved vs peft | "
        f"{memory} | loss | loss rel. diff | matmul floor |{extra}",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|--:|" if gpu else ""),
    ]
    notes = []
    for row in rows:
        mode = _mode_label(row.get("mode"))
        if "step_s" not in row:
            failed = "; ".join(row["failed"])[:80] or "not run"
            lines.append(f"| {row['system']} | {mode} | failed: {failed} |" + " |" * (10 + 2 * gpu))
            continue
        peak = _fmt(row.get("peak_vram_bytes"), ".2f", 2**30) if gpu else _fmt(row["peak_rss_bytes"], ".0f", MB)
        flag = "" if row.get("loss_agrees", True) else " **FLAGGED**"
        line = (
            f"| {row['system']} | {mode} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | "
            f"{_ratio(row.get('step_ratio'))} | {_ratio(row.get('same_mode_speed'))} | {row['saved_bytes'] / MB:.1f} | "
            f"{_ratio(row.get('saved_ratio'))} | {peak} | {row['loss']:.6f} | "
            f"{_fmt(row.get('loss_rel_diff'), '.1e')}{flag} | {_fmt(row.get('floor_fraction'), '.1%')} |"
        )
        if gpu:
            line += f" {_fmt(row.get('gpu_busy'), '.0%')} | {_fmt(row.get('kernel_launches'), '.0f')} |"
        lines.append(line)
        if "profile_error" in row:
            notes.append(f"{row['system']}: no profiled step ({row['profile_error']})")
        if row.get("family") != "fastft" and "experts_implementation" in row:
            notes.append(f"{row['system']}: experts_implementation={row['experts_implementation']!r}")
    sources = {row["floor_source"] for row in rows if "floor_source" in row}
    notes += [f"matmul floor: {source}" for source in sorted(sources) if source != "counted"]
    return lines + [""] + [f"- {note}" for note in notes] + ([""] if notes else [])


def _longest_table(record: dict[str, Any]) -> list[str]:
    entries = record.get("longest", [])
    if not entries:
        return []
    budgets = sorted({entry.get("budget_s") for entry in entries if entry.get("budget_s") is not None})
    budget = ", ".join(f"{value:.0f}" for value in budgets) or "?"
    lines = [
        f"**Longest sequence at batch 1** (one process per system, lengths doubling from the first, then bisected "
        f"after the first out-of-memory error; {budget} s per system, model load included)",
        "",
        "| model | system | mode | longest tokens | step s there | peak VRAM GiB there | probes | s |",
        "|---|---|---|---|--:|--:|--:|--:|",
    ]
    for entry in entries:
        model = entry["model"] + (" NF4" if entry.get("quant") == "nf4" else "")
        step_s, peak = entry.get("step_s_at_longest"), entry.get("peak_vram_bytes_at_longest")
        lines.append(
            f"| {model} | {entry['system']} | {_mode_label(_entry_info(entry, 'mode'))} | "
            f"{longest_search.describe(entry)} | "
            f"{_fmt(step_s, '.2f')} | {_fmt(peak, '.2f', 2**30)} | {len(entry.get('probes', []))} | "
            f"{_fmt(entry.get('wall_s'), '.0f')} |"
        )
    return lines + [""]


def markdown(record: dict[str, Any], plot_name: str | None = None) -> str:
    """The run as Markdown: settings, one table per workload (rows grouped by checkpointing mode), the longest
    sequences, the targets (the README section and stdout)."""
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
    if record["runs"]:
        for workload in record["settings"]["workloads"]:
            lines += _workload_table(record, workload, gpu)
    lines += _longest_table(record)
    if record["targets"]:
        # On a GPU, what a speed bound asks of the GPU: the busy fraction our kernel time would need to meet it.
        needs = gpu and any("busy_needed" in target for target in record["targets"])
        lines += ["| target | workload | measured | met |" + (" GPU busy needed |" if needs else "")]
        lines.append("|---|---|--:|---|" + ("--:|" if needs else ""))
        for target in record["targets"]:
            met = {True: "met", False: "**not met**", None: f"n/a ({target.get('reason', 'missing')})"}[target["met"]]
            line = f"| {target['target']} | {target['workload']} | {_fmt(target['measured'], '.3f')} | {met} |"
            if needs:
                line += f" {_fmt(target.get('busy_needed'), '.1%')} |"
            lines.append(line)
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


def record_key(record: dict[str, Any]) -> str:
    """The device's file-name part with what the run added: ``nvidia-h100-80gb-hbm3-modes-longest``, ``cpu``."""
    settings = record["settings"]
    return (
        record["device_slug"]
        + ("-modes" if settings.get("modes") else "")
        + ("-longest" if settings.get("longest") else "")
    )


def update_readme(readme: Path, record: dict[str, Any], paths: dict[str, Path]) -> None:
    """Replace the README's section for this device and kind of run (between ``<!-- fastft-bench:<key> -->``
    markers, :func:`record_key`; added at the end when missing) with :func:`markdown` of the run."""
    slug = record_key(record)
    start, end = f"<!-- fastft-bench:{slug}:start -->", f"<!-- fastft-bench:{slug}:end -->"
    body = markdown(record, plot_name=paths["plot"].name if "plot" in paths else None)
    source = f"results/{paths['json'].name}"
    body += f"\nFrom `{source}` (redraw: `fastft bench --readme-from bench/{source}`).\n"
    text = readme.read_text() if readme.exists() else ""
    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        flags = [flag for flag in ("modes", "longest") if record["settings"].get(flag)]
        title = record["device"] + (f" (`fastft bench {' '.join('--' + flag for flag in flags)}`)" if flags else "")
        text = text.rstrip("\n") + f"\n\n### {title}\n\n{block}\n"
    readme.write_text(text)
