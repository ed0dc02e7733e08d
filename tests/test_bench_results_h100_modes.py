"""Issue 28's like-for-like H100 run (bench/results/h100-2026-11-26/): every row and target of its README rebuilt from
the JSON files that `bash bench/gpu_modes.sh` wrote, so a number that does not match its file fails."""

from __future__ import annotations

import pytest
from gpu_results import ROOT, readme_line, record

FOLDER = ROOT / "bench" / "results" / "h100-2026-11-26"
README = (FOLDER / "README.md").read_text()
RUNS = ("none", "recompute", "offload", "compile")


def _rows() -> list[tuple[str, dict]]:
    return [(run, row) for run in RUNS for row in record(FOLDER, run)["summary"]]


@pytest.mark.parametrize(
    ("run", "row"), _rows(), ids=lambda value: value if isinstance(value, str) else value["system"]
)
def test_readme_row_is_its_json_row(run: str, row: dict) -> None:
    assert readme_line(run, row) in README


@pytest.mark.parametrize("run", RUNS)
def test_each_run_is_one_device_and_every_loss_agrees(run: str) -> None:
    data = record(FOLDER, run)
    assert data["device"] == "NVIDIA H100 80GB HBM3"
    assert data["harness_versions"]["torch"] == "2.11.0"
    for row in data["summary"]:
        assert row["failed"] == []
        # bf16 on random weights: every first-step loss within 5e-5 relative of the stock baseline's (12.18263).
        assert abs(row["loss"] - 12.18263) / 12.18263 < 5e-5


def test_targets_table_is_the_runs_ratios() -> None:
    by_system = {row["system"]: row for _, row in _rows()}
    speeds = [by_system[name]["same_mode_speed"] for name in ("fastft", "fastft+recompute", "fastft+offload")]
    assert f"| {by_system['fastft']['step_ratio'] ** -1:.3f} | met |" in README
    for speed in speeds:
        assert f"| {speed:.3f} | not met |" in README
    for name in ("fastft+recompute", "fastft+offload"):
        assert f"| {by_system[name]['same_mode_vram']:.3f} | met |" in README
    busy = " / ".join(
        f"{by_system[name]['gpu_busy']:.0%}".replace("%", " %")
        for name in ("fastft", "fastft+recompute", "fastft+offload")
    )
    assert f"| {busy} |" in README


def test_compiled_rows_compiled_every_layer_and_ran_slower() -> None:
    """The evidence that keeps regional compilation off by default on CUDA (issue 28, point 3)."""
    compiled = {row["system"]: row for row in record(FOLDER, "compile")["runs"]}
    eager = {row["system"]: row for run in ("none", "offload") for row in record(FOLDER, run)["runs"]}
    for name, base in (("fastft+compile", "fastft"), ("fastft+offload+compile", "fastft+offload")):
        assert compiled[name]["fastft_compiled_layers"] == 16
        assert eager[base]["fastft_compiled_layers"] == 0
        assert min(compiled[name]["step_times_s"]) > max(eager[base]["step_times_s"])
