"""The second H100 run of 2026-11-26 (bench/results/h100-2026-11-26b/): every table row of its README rebuilt from the
JSON files `bash bench/gpu_modes.sh` wrote, and every kernel-class table from `bench/kernel_diff.py` over them."""

from __future__ import annotations

import pytest
from gpu_results import ROOT, bench_script, readme_line, record

FOLDER = ROOT / "bench" / "results" / "h100-2026-11-26b"
README = (FOLDER / "README.md").read_text()
RUNS = ("none", "recompute", "offload", "vlm")
PAIRS = (
    ("none", "fastft", "unsloth-nogc"),
    ("recompute", "fastft+recompute", "unsloth-gc"),
    ("offload", "fastft+offload", "unsloth"),
    ("vlm", "fastft", "unsloth-nogc"),
    ("vlm", "fastft", "transformers+peft"),
)


def _baseline_loss(run: str) -> float:
    (row,) = [
        row
        for row in record(FOLDER, "vlm" if run == "vlm" else "none")["summary"]
        if row["system"] == "transformers+peft"
    ]
    return row["loss"]


@pytest.mark.parametrize("run", RUNS)
def test_readme_rows_are_the_json_rows(run: str) -> None:
    data = record(FOLDER, run)
    assert data["device"] == "NVIDIA H100 80GB HBM3"
    for row in data["summary"]:
        assert readme_line(run, row) in README
        assert row["failed"] == []
        # bf16 on random weights: every first-step loss within 5e-5 relative of its workload's stock baseline's.
        assert abs(row["loss"] - _baseline_loss(run)) / _baseline_loss(run) < 5e-5


@pytest.mark.parametrize(("run", "first", "second"), PAIRS)
def test_kernel_class_tables_are_kernel_diff_of_the_json(run: str, first: str, second: str) -> None:
    module = bench_script("kernel_diff")
    text = module.table(record(FOLDER, run), first, second)
    assert f"**{run}**: {first} against {second}\n\n{text}\n" in README
    # Each column sums to the system's kernel time: the classes partition the top 25 and the rest.
    runs = {entry["system"]: entry for entry in record(FOLDER, run)["runs"]}
    for name in (first, second):
        classes = module.breakdown(runs[name])
        assert sum(ms for _, ms in classes.values()) == pytest.approx(runs[name]["gpu_kernel_s"] * 1e3)
        assert sum(count for count, _ in classes.values()) == runs[name]["kernel_launches"]


def test_the_swiglu_row_shows_the_forward_relaunch_this_run_found() -> None:
    """The finding the README reports (and the kernel change after it fixed): fastft's MLP backward relaunched the
    gate's forward kernel, 16 launches a step more than the forward's own 16."""
    runs = {entry["system"]: entry for entry in record(FOLDER, "none")["runs"]}
    launches = {kernel["kernel"]: kernel["count"] for kernel in runs["fastft"]["top_kernels"]}
    assert launches["_gate_forward_kernel"] == 32 and launches["_gate_backward_kernel"] == 16


def test_kernel_diff_refuses_a_run_without_kernels() -> None:
    module = bench_script("kernel_diff")
    with pytest.raises(ValueError, match="no top_kernels"):
        module.breakdown({"system": "fastft", "kernel_launches": 1, "gpu_kernel_s": 0.1})
    with pytest.raises(ValueError, match="no run of"):
        module.table(record(FOLDER, "none"), "fastft", "liger")
