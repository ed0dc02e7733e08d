"""The H100 runs of 2026-11-27 (bench/results/h100-2026-11-27/): every table of its README rebuilt from the JSON files
and timelines `bash bench/gpu_modes.sh` wrote, the evidence for its findings, and `bench/gpu_gaps.py` itself on a
hand-built trace."""

from __future__ import annotations

import statistics

import pytest
from gpu_results import ROOT, bench_script, readme_line, record

FOLDER = ROOT / "bench" / "results" / "h100-2026-11-27"
README = (FOLDER / "README.md").read_text()
RUNS = ("none", "recompute", "offload", "compile", "trace")
TIMELINES = ("fastft", "fastft+recompute", "unsloth-nogc")


def _runs(run: str) -> dict[str, dict]:
    return {entry["system"]: entry for entry in record(FOLDER, run)["runs"]}


@pytest.mark.parametrize("run", RUNS)
def test_readme_rows_are_the_json_rows_and_every_loss_agrees(run: str) -> None:
    data = record(FOLDER, run)
    assert data["device"] == "NVIDIA H100 80GB HBM3" and data["harness_versions"]["torch"] == "2.11.0"
    (stock,) = [row for row in record(FOLDER, "none")["summary"] if row["system"] == "transformers+peft"]
    for row in data["summary"]:
        assert readme_line(run, row) in README
        assert row["failed"] == []
        assert abs(row["loss"] - stock["loss"]) / stock["loss"] < 5e-5


def test_the_sync_fix_shortened_every_step_and_the_readme_lists_them() -> None:
    """Run 2 (the label check started before the backbone) against run 1 (checked after it): each of run 2's steps
    is shorter than run 1's median, in both modes."""
    for system, before in (("fastft", "none"), ("fastft+recompute", "recompute")):
        after = _runs("trace")[system]["step_times_s"]
        assert max(after) < statistics.median(_runs(before)[system]["step_times_s"])
        listed = ", ".join(f"{step:.4f}" for step in after)
        assert f"| {system} | {statistics.median(_runs(before)[system]['step_times_s']):.4f} |" in README
        assert f"| {listed} |" in README


def test_kernel_class_table_is_kernel_diff_of_the_trace_run() -> None:
    text = bench_script("kernel_diff").table(record(FOLDER, "trace"), "fastft", "unsloth-nogc")
    assert f"**trace**: fastft against unsloth-nogc\n\n{text}\n" in README


@pytest.mark.parametrize("system", TIMELINES)
def test_gap_table_is_gpu_gaps_of_the_timelines(system: str) -> None:
    gpu_gaps = bench_script("gpu_gaps")
    found = gpu_gaps.gaps(gpu_gaps.load(FOLDER / "timelines" / f"{system}.json.gz"))
    line = (
        f"| {system} | {found['wall_ms']:.2f} | {found['kernel_ms']:.2f} | {found['host_idle_ms']:.2f} | "
        f"{found['before_first_ms']:.2f} | {found['queued_idle_ms']:.2f} |"
    )
    assert line in README
    # The profiled step's kernel time is the one the JSON records for the same step.
    assert found["kernel_ms"] == pytest.approx(_runs("trace")[system]["gpu_kernel_s"] * 1e3, rel=1e-6)


def test_fastfts_remaining_host_idle_is_in_the_forward_only() -> None:
    """The README's reading of fastft's timeline: of its host-caused idle, the decoder layers' share is the 10 gaps
    in their forwards; the backward (autograd's nodes) ends none."""
    gpu_gaps = bench_script("gpu_gaps")
    found = gpu_gaps.gaps(gpu_gaps.load(FOLDER / "timelines" / "fastft.json.gz"))
    by_outer = {row["op"]: row for row in found["by_outer"]}
    layer = by_outer["LoRADecoderLayerFunction"]
    assert layer["gaps"] == 10 and f"{layer['ms']:.2f} ms inside `LoRADecoderLayerFunction`" in README
    assert not [name for name in by_outer if "Backward" in name or "autograd" in name]
    unsloth = gpu_gaps.gaps(gpu_gaps.load(FOLDER / "timelines" / "unsloth-nogc.json.gz"))
    compiled = {row["op"]: row for row in unsloth["by_outer"]}["Torch-Compiled Region: 0/0"]
    assert (
        f"{compiled['ms']:.1f} ms of host-caused idle lie inside its `torch.compile`d region ({compiled['gaps']}"
        in README
    )


def test_compiled_rows_compiled_every_layer_and_ran_slower() -> None:
    compiled = _runs("compile")
    for name, run, eager in (
        ("fastft+compile", "none", "fastft"),
        ("fastft+offload+compile", "offload", "fastft+offload"),
    ):
        assert compiled[name]["fastft_compiled_layers"] == 16
        assert min(compiled[name]["step_times_s"]) > max(_runs(run)[eager]["step_times_s"])


def test_targets_table_is_the_runs_ratios() -> None:
    summary = {(run, row["system"]): row for run in RUNS for row in record(FOLDER, run)["summary"]}
    assert f"| {1 / summary['none', 'fastft']['step_ratio']:.3f} | met |" in README
    assert f"| {summary['trace', 'fastft']['same_mode_speed']:.3f} | met in this run;" in README
    assert f"| {summary['recompute', 'fastft+recompute']['same_mode_speed']:.3f} | not met |" in README
    assert f"| {summary['offload', 'fastft+offload']['same_mode_speed']:.3f} | met |" in README
    vram = [
        summary[key]["same_mode_vram"] for key in (("recompute", "fastft+recompute"), ("offload", "fastft+offload"))
    ]
    assert f"| {vram[0]:.3f} / {vram[1]:.3f} | met |" in README
    busy = [summary["trace", name]["gpu_busy"] for name in ("fastft", "fastft+recompute")]
    assert f"| {busy[0]:.1%} / {busy[1]:.1%} | not met".replace("%", " %") in README
    assert all(value < 0.95 for value in busy)


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1, correlation: int | None = None) -> dict:
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_gpu_gaps_charges_host_gaps_to_the_launching_operator_and_queued_ones_to_scheduling() -> None:
    events = [
        _event("cpu_op", "Outer", 0.0, 100.0),
        _event("cpu_op", "aten::mm", 1.0, 4.0),
        _event("cuda_runtime", "cudaLaunchKernel", 2.0, 1.0, correlation=1),
        # A sibling that ends before the next launch: the outer operator still holds that launch.
        _event("cpu_op", "aten::add", 30.0, 10.0),
        _event("cpu_op", "aten::mul", 50.0, 5.0),
        _event("cuda_runtime", "cudaLaunchKernel", 51.0, 1.0, correlation=2),
        _event("cuda_runtime", "cudaLaunchKernel", 53.0, 1.0, correlation=3),
        _event("kernel", "k1", 10.0, 20.0, tid=7, correlation=1),
        # Launched at 51 after the GPU went idle at 30: 25 us waiting for the host, charged to aten::mul in Outer.
        _event("kernel", "k2", 55.0, 10.0, tid=7, correlation=2),
        # Launched at 53, before k2 ended: a 5 us gap with work queued.
        _event("kernel", "k3", 70.0, 10.0, tid=7, correlation=3),
    ]
    found = bench_script("gpu_gaps").gaps(events)
    assert found["host_idle_ms"] == pytest.approx(0.025) and found["queued_idle_ms"] == pytest.approx(0.005)
    assert found["kernel_ms"] == pytest.approx(0.040) and found["before_first_ms"] == pytest.approx(0.010)
    assert found["by_outer"] == [{"op": "Outer", "gaps": 1, "ms": pytest.approx(0.025)}]
    assert found["by_inner"] == [{"op": "aten::mul", "gaps": 1, "ms": pytest.approx(0.025)}]
    with pytest.raises(ValueError, match="no GPU kernels"):
        bench_script("gpu_gaps").gaps(events[:7])
