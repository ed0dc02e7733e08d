"""What ``bench/lora.py`` makes of its samples: ratios, noise, the targets of the GEMM-selection issue judged, and the
text table it prints. Loaded by ``bench/lora.py`` from this file, as ``lora_workload.py`` is.
"""

from __future__ import annotations

import statistics
from typing import Any

FASTFT_SYSTEMS = ("cublas", "triton", "auto")
# grouped_mm: the moe group's stock experts on transformers' grouped_mm (peft: their eager loop).
SYSTEMS = (*FASTFT_SYSTEMS, "peft", "grouped_mm", "floor")
# What fastft must reach on a GPU: the tuner's choice no slower than cuBLAS (within the measured noise, and never
# less tolerance than NOISE_MIN), LoRA-QKV at most 15 % over the bare base GEMMs and at least 1.5x faster than peft.
NOISE_MIN = 0.01
TARGET_QKV_OVER_FLOOR = 1.15
TARGET_PEFT_OVER_QKV = 1.5
# Issue 32: fastft's experts at least 1.5x faster than stock transformers + peft on grouped_mm.
TARGET_GROUPED_MM_OVER_MOE = 1.5


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def row_ratios(medians: dict[str, float]) -> dict[str, float]:
    """Every ratio the targets and the README read, for the systems that ran."""
    ratios = {}
    for system in (*FASTFT_SYSTEMS, "peft", "grouped_mm"):
        if system in medians and "floor" in medians:
            ratios[f"{system}_over_floor"] = medians[system] / medians["floor"]
    for system in ("triton", "auto"):
        if system in medians and "cublas" in medians:
            ratios[f"{system}_over_cublas"] = medians[system] / medians["cublas"]
    for system in FASTFT_SYSTEMS:
        if system in medians and "peft" in medians:
            ratios[f"peft_over_{system}"] = medians["peft"] / medians[system]
    if "grouped_mm" in medians and "auto" in medians:
        ratios["grouped_mm_over_auto"] = medians["grouped_mm"] / medians["auto"]
    return ratios


def ratio_noise(samples: dict[str, list[float]]) -> float | None:
    """Tolerance of ``auto / cublas``: the interquartile range of the per-round ratios ``auto_i / cublas_i`` (both
    timed in the same round, so slow drift cancels), at least ``NOISE_MIN``. When auto picked cuBLAS the two run the
    same code, and this range is what comparing a path with itself reads."""
    if "auto" not in samples or "cublas" not in samples:
        return None
    paired = [a / c for a, c in zip(samples["auto"], samples["cublas"], strict=True)]
    low, high = _quartiles(paired)
    return max(NOISE_MIN, high - low)


def evaluate_targets(row: dict[str, Any], judged: bool) -> list[dict[str, Any]]:
    """The issue's targets for one row, each with the measured value, the limit and ``met`` (None when not judged:
    the targets are about the GPU's Triton dispatch, not a CPU or the interpreter)."""
    ratios, targets = row["ratios"], []

    def add(name: str, measured: float | None, limit: float, at_most: bool) -> None:
        if measured is None:
            return
        met = (measured <= limit if at_most else measured >= limit) if judged else None
        targets.append({"target": name, "measured": measured, "limit": limit, "met": met})

    noise = row["auto_over_cublas_noise"]
    if noise is not None:
        add("auto <= cublas x (1 + noise)", ratios.get("auto_over_cublas"), 1 + noise, True)
    if row["group"] == "qkv":
        add("auto <= floor x 1.15", ratios.get("auto_over_floor"), TARGET_QKV_OVER_FLOOR, True)
        add("peft >= auto x 1.5", ratios.get("peft_over_auto"), TARGET_PEFT_OVER_QKV, False)
    if row["group"] == "moe":
        add("grouped_mm >= auto x 1.5", ratios.get("grouped_mm_over_auto"), TARGET_GROUPED_MM_OVER_MOE, False)
    return targets


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _ms(row: dict[str, Any], system: str) -> str:
    value = row["ms"].get(system)
    return "-" if value is None else f"{value:.3f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def auto_path(row: dict[str, Any]) -> str:
    choices = row["gemm_choices"].get("auto", {}).get("choices", [])
    return ",".join(f"{c['group']}:{c['path']}" for c in choices) or "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of the medians, the targeted ratios, memory, the auto path and the error vs peft."""
    header = (
        f"{'shape':13s} {'group':5s} {'weights':7s} "
        + " ".join(f"{system + ' ms':>10s}" for system in SYSTEMS)
        + f" {'auto/cublas':>11s} {'noise':>6s} {'auto/floor':>10s} {'peft/auto':>9s} {'peak MiB auto':>13s} "
        f"{'err vs peft':>11s}  auto path"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ratios = row["ratios"]
        memory = row["memory"].get("auto")
        errors = [value["max"] for key, value in row["correctness"].items() if key.endswith("_vs_peft")]
        lines.append(
            f"{row['shape']:13s} {row['group']:5s} {row['weights']:7s} "
            + " ".join(f"{_ms(row, system):>10s}" for system in SYSTEMS)
            + f" {_fmt(ratios.get('auto_over_cublas'), '.3f'):>11s} {_fmt(row['auto_over_cublas_noise'], '.3f'):>6s}"
            f" {_fmt(ratios.get('auto_over_floor'), '.3f'):>10s} {_fmt(ratios.get('peft_over_auto'), '.2f'):>9s}"
            f" {_mib(memory['peak_above_start_bytes'] if memory else None):>13s}"
            f" {_fmt(max(errors) if errors else None, '.1e'):>11s}  {auto_path(row)}"
        )
        decode = row.get("nf4_decode")
        if decode:
            lines.append(
                f"{'':13s} {'':5s} {'':7s} NF4 decoded in the GEMM: {decode['in_kernel_ms']:.3f} ms against "
                f"{decode['buffer_ms']:.3f} ms through the buffer ({decode['buffer_system']}; {decode['faster']} "
                f"faster; outputs differ by {decode['in_kernel_vs_buffer_relative_error']:.1e})"
            )
    return "\n".join(lines)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per row and target: what the README's target table is drawn from."""
    return [
        {"shape": row["shape"], "group": row["group"], "weights": row["weights"], **target}
        for row in rows
        for target in row["targets"]
    ]


def format_targets(summary: list[dict[str, Any]]) -> str:
    lines = []
    for entry in summary:
        verdict = {True: "met", False: "NOT MET", None: "not judged (no GPU Triton dispatch)"}[entry["met"]]
        lines.append(
            f"{entry['shape']} {entry['group']} {entry['weights']}: {entry['target']}: {entry['measured']:.3f} "
            f"(limit {entry['limit']:.3f}) {verdict}"
        )
    return "\n".join(lines)
