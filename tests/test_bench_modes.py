"""fastft bench --modes: every system in each checkpointing mode it has, compared mode with mode; the GPU busy fraction
and kernel launches of a profiled step; a FLOP count or profile that fails costs its column, never the row."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fastft.bench import gpu_time, report, worker
from fastft.bench.measure import lora_step_flops
from fastft.bench.systems import aliases, select_systems
from fastft.bench.workloads import MODEL_SHAPES, write_random_model

CPU_MODES = [
    ("transformers+peft", False),
    ("unsloth-nogc", False),
    ("fastft", False),
    ("transformers+peft+gc", True),
    ("unsloth-gc", True),
    ("fastft+recompute", True),
    ("unsloth", "unsloth"),
    ("fastft+offload", "offload"),
    ("fastft+sqrt", "sqrt"),
]


def test_modes_run_every_family_in_each_of_its_modes_class_by_class():
    assert [(system.name, system.mode) for system in select_systems("cpu", None, modes=True)] == CPU_MODES
    on_gpu = [system.name for system in select_systems("cuda", None, modes=True)]
    assert on_gpu.index("liger-nogc") < on_gpu.index("fastft") < on_gpu.index("liger") < on_gpu.index("unsloth")
    assert len(on_gpu) == len(CPU_MODES) + 2
    # --systems names families with --modes (any system of a family stands for it).
    chosen = select_systems("cpu", ["fastft+offload", "unsloth"], modes=True)
    assert {system.family for system in chosen} == {"fastft", "unsloth"} and len(chosen) == 7
    # The names before modes keep their meaning; family:mode reaches any mode.
    assert [system.name for system in select_systems("cuda", None)] == [
        "transformers+peft",
        "transformers+peft+gc",
        "liger",
        "unsloth",
        "fastft",
        "fastft+offload",
    ]
    assert (aliases()["liger"].mode, aliases()["unsloth"].mode, aliases()["fastft+offload"].mode) == (
        True,
        "unsloth",
        "offload",
    )
    assert select_systems("cpu", ["fastft:True", "UNSLOTH:false", "unsloth:unsloth"]) == [
        aliases()["fastft+recompute"],
        aliases()["unsloth-nogc"],
        aliases()["unsloth"],
    ]
    with pytest.raises(ValueError, match=r"unknown system 'fastft:nope'.*family:mode"):
        select_systems("cpu", ["fastft:nope"])


def test_compiled_fastft_rows_run_only_when_named(tmp_path):
    """Regional compilation beside each mode (issue 28, point 3: measured on a GPU before it may become a default)."""
    named = select_systems("cpu", ["fastft+compile", "fastft+recompute+compile", "fastft+offload+compile"])
    assert [(system.mode, system.compile) for system in named] == [(False, True), (True, True), ("offload", True)]
    # family:mode keeps naming the eager rows, and --modes leaves the compiled ones out.
    assert not aliases()["fastft:false"].compile and not aliases()["fastft:offload"].compile
    assert not any(system.compile for system in select_systems("cuda", None, modes=True))
    # The worker builds it compiled: every decoder layer on the compiled forward, the loss the eager row's.
    command = [sys.executable, "-m", "fastft.cli", "bench", "--quick", "--device", "cpu", "--rounds", "1", "--steps"]
    command += ["1", "--systems", "fastft", "fastft+compile", "--output-dir", str(tmp_path), "--no-plot"]
    command += ["--readme", str(tmp_path / "README.md")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = {run["system"]: run for run in json.loads((tmp_path / "bench-cpu-quick.json").read_text())["runs"]}
    layers = MODEL_SHAPES["tiny"]["num_hidden_layers"]
    assert (runs["fastft"]["fastft_compiled_layers"], runs["fastft+compile"]["fastft_compiled_layers"]) == (0, layers)
    assert runs["fastft+compile"]["loss"] == pytest.approx(runs["fastft"]["loss"], rel=1e-5)
    assert runs["fastft+compile"]["first_step_s"] > 0
    # Each fused group's GEMM choice is in the eager row's record, so a GPU step can be read against it.
    choices = runs["fastft"]["fastft_gemm_choices"]
    assert {c["group"] for c in choices} == {"qkv", "o", "gate_up", "down"}
    assert all(c["path"] and c["reason"] for c in choices), choices
    # Every fused layer of the eager row ran its straight-line program in the timed steps.
    assert runs["fastft"]["fastft_layer_programs"] == {"fused_layers": layers, "programs": layers}


@pytest.fixture(scope="module")
def modes_run(tmp_path_factory):
    """``fastft bench --quick --modes`` for the two families with a CPU path in this environment."""
    folder = tmp_path_factory.mktemp("modes")
    command = [sys.executable, "-m", "fastft.cli", "bench", "--quick", "--device", "cpu", "--modes", "--rounds", "1"]
    command += ["--steps", "1", "--systems", "transformers+peft", "fastft", "--output-dir", str(folder), "--no-plot"]
    command += ["--venv-root", str(folder / "venvs"), "--readme", str(folder / "README.md")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=folder)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result, json.loads((folder / "bench-cpu-modes-quick.json").read_text())


def test_quick_modes_run_builds_each_mode_and_agrees_on_the_loss(modes_run):
    _, _, record = modes_run
    runs = {run["system"]: run for run in record["runs"]}
    expected = [(name, mode) for name, mode in CPU_MODES if not name.startswith("unsloth")]
    assert [run["system"] for run in record["runs"]] == [name for name, _ in expected]
    assert [system["mode"] for system in record["settings"]["systems"]] == [mode for _, mode in expected]
    # The mode each fastft model ended up in is the one asked for.
    assert runs["fastft"]["fastft_checkpointing"] is None
    assert runs["fastft+recompute"]["fastft_checkpointing"] == "recompute"
    assert runs["fastft+offload"]["fastft_checkpointing"] == "offload"
    assert runs["fastft+sqrt"]["fastft_checkpointing"] == "sqrt"
    losses = [run["loss"] for run in record["runs"]]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    # Checkpointing keeps layer inputs, not activations: every checkpointed mode saves less than its family's False.
    for checkpointed, plain in (("transformers+peft+gc", "transformers+peft"), ("fastft+recompute", "fastft")):
        assert runs[checkpointed]["saved_bytes"] < 0.5 * runs[plain]["saved_bytes"]
    # The baseline's FLOPs were counted once (the tiny model is GQA: 4 heads over 2) and equal the config's count.
    assert runs["transformers+peft"]["flops"] == runs["transformers+peft"]["flops_analytic"] > 0
    assert all("flops" not in run for name, run in runs.items() if name != "transformers+peft")


def test_quick_modes_table_groups_rows_by_mode(modes_run):
    folder, result, record = modes_run
    table = result.stdout
    order = [table.index(f"| {name} |") for name, _ in CPU_MODES if not name.startswith("unsloth")]
    assert order == sorted(order)
    assert '| fastft+offload | "offload" |' in table and "| fastft+recompute | True |" in table
    assert "vs Unsloth, same mode" in table and "GPU busy" not in table  # CPU: no profiled step
    assert "<!-- fastft-bench:cpu-modes:start -->" in (folder / "README.md").read_text()


def _run(system, steps, tokens_per_s=None, **extra):
    run = {"workload": "w", "system": system, "round": 0, "step_times_s": steps, "loss": 2.0, "saved_bytes": 100}
    run.update(saved_bytes_raw=100, peak_rss_bytes=1000, lora_checksum=5.0, input_checksum=7, adapters=14)
    return run | {"versions": {}, "wall_s": 1.0, **extra}


def _gpu_record(runs, systems):
    return {
        "device": "NVIDIA H100 80GB HBM3",
        "started": "2026-11-25T00:00:00",
        "duration_s": 60.0,
        "load_average": {"before": 0.1, "after": 0.2},
        "harness_versions": {"torch": "2.11", "transformers": "5.17", "peft": "0.21"},
        "settings": {
            "rounds": 1,
            "timed_steps_per_run": 1,
            "quick": False,
            "modes": True,
            "workloads": [{"name": "w", "batch": 4, "seq": 2048, "dtype": "bfloat16", "quant": "none"}],
            "systems": [system.to_dict() for system in select_systems("cuda", systems, modes=False)],
        },
        "matmul_flops_per_s": {"bfloat16": 7e14},
        "runs": runs,
        "longest": [],
    }


def test_targets_compare_mode_with_mode_and_the_table_shows_busy_and_launches():
    gib = 2**30
    runs = [
        _run("transformers+peft", [0.257], peak_vram_bytes=33 * gib, flops=1.4e13),
        _run("unsloth-nogc", [0.12], peak_vram_bytes=10.85 * gib, gpu_busy=0.91, kernel_launches=3000),
        _run(
            "fastft",
            [0.1, 0.2, 0.3],
            peak_vram_bytes=10.6 * gib,
            gpu_busy=0.76,
            kernel_launches=4100,
            gpu_kernel_s=0.152,
        ),
        _run("unsloth-gc", [0.1569], peak_vram_bytes=4.0 * gib),
        _run("fastft+recompute", [0.1400], peak_vram_bytes=3.71 * gib, gpu_kernel_s=0.13),
        _run("unsloth", [0.1828], peak_vram_bytes=3.63 * gib),
        _run("fastft+offload", [0.1600], peak_vram_bytes=3.70 * gib),
    ]
    names = [run["system"] for run in runs]
    record = _gpu_record(runs, names)
    record["summary"] = report.summarise(record)
    rows = {row["system"]: row for row in record["summary"]}
    assert rows["fastft"]["same_mode_competitor"] == "unsloth-nogc"
    assert rows["fastft"]["same_mode_speed"] == pytest.approx(0.12 / 0.2)
    assert rows["fastft+offload"]["same_mode_competitor"] == "unsloth"
    assert rows["fastft+offload"]["same_mode_vram"] == pytest.approx(3.70 / 3.63)
    assert rows["transformers+peft"]["same_mode_competitor"] == "unsloth-nogc"
    assert "same_mode_competitor" not in rows["unsloth-nogc"]  # not compared with itself
    assert rows["fastft"]["gpu_busy"] == 0.76 and rows["fastft"]["kernel_launches"] == 4100
    targets = {target["target"]: target for target in report.evaluate_targets(record)}
    assert targets["fastft tokens_per_s >= 1.1 x unsloth-nogc"]["met"] is False
    assert targets["fastft+recompute tokens_per_s >= 1.1 x unsloth-gc"]["measured"] == pytest.approx(0.1569 / 0.14)
    assert targets["fastft+recompute tokens_per_s >= 1.1 x unsloth-gc"]["met"] is True
    assert targets["fastft+recompute peak_vram_bytes <= 1.0 x unsloth-gc"]["met"] is True
    assert targets["fastft+offload peak_vram_bytes <= 1.0 x unsloth"]["met"] is False
    # What each speed bound asks of the GPU: the step that meets it, and the busy share our kernel time needs there.
    unsloth = targets["fastft tokens_per_s >= 1.1 x unsloth-nogc"]
    assert unsloth["step_needed_s"] == pytest.approx(0.12 / 1.1)
    assert unsloth["busy_needed"] == pytest.approx(0.152 / (0.12 / 1.1))  # above 1: kernels alone are too slow
    recompute = targets["fastft+recompute tokens_per_s >= 1.1 x unsloth-gc"]
    assert recompute["busy_needed"] == pytest.approx(0.13 / (0.1569 / 1.1))
    assert "busy_needed" not in targets["fastft+offload tokens_per_s >= 1.1 x unsloth"]  # no profiled kernel time
    assert "busy_needed" not in targets["fastft+offload peak_vram_bytes <= 1.0 x unsloth"]
    record["targets"] = list(targets.values())
    table = report.markdown(record)
    assert "| met | GPU busy needed |" in table
    assert "| fastft tokens_per_s >= 1.1 x unsloth-nogc | w | 0.600 | **not met** | 139.3% |" in table
    assert "| fastft+offload peak_vram_bytes <= 1.0 x unsloth | w | 1.019 | **not met** | – |" in table
    assert "| GPU busy | launches/step |" in table
    assert "| fastft | False | 0.200 |" in table and "| 76% | 4100 |" in table
    assert "| 0.600x |" in table
    # Without the Unsloth modes in the run, their targets are left out rather than reported missing.
    record = _gpu_record(runs[:3], names[:3])
    record["summary"] = report.summarise(record)
    assert [target["target"] for target in report.evaluate_targets(record)] == [
        "fastft tokens_per_s >= 2.0 x transformers+peft",
        "fastft tokens_per_s >= 1.1 x unsloth-nogc",
    ]


def test_longest_targets_pair_each_fastft_mode_with_unsloths_and_respect_lower_bounds():
    record = _gpu_record([], ["transformers+peft"])
    record["summary"] = []
    record["longest"] = [
        {
            "model": "m",
            "quant": "none",
            "system": "unsloth",
            "longest_seq": 98304,
            "stopped_by": "oom",
            "first_oom_seq": 102400,
        },
        {"model": "m", "quant": "none", "system": "fastft+offload", "longest_seq": 196608, "stopped_by": "time"},
        {"model": "m", "quant": "none", "system": "unsloth-nogc", "longest_seq": 65536, "stopped_by": "time"},
        {"model": "m", "quant": "none", "system": "fastft", "longest_seq": 49152, "stopped_by": "time"},
    ]
    targets = {target["target"]: target for target in report.evaluate_targets(record)}
    assert targets["fastft+offload longest >= unsloth longest"]["met"] is True
    assert targets["fastft+offload longest >= unsloth longest"]["measured"] == 2.0
    undecided = targets["fastft longest >= unsloth-nogc longest"]
    assert undecided["met"] is None and "lower bound" in undecided["reason"]
    record["targets"] = list(targets.values())
    table = report.markdown(record)
    assert '| m | fastft+offload | "offload" | ≥ 196,608, stopped by time |' in table
    assert '| m | unsloth | "unsloth" | 98,304 (out of memory at 102,400) |' in table
    assert "n/a (ours stopped by time at 49,152, below the reference: a lower bound only)" in table


def test_a_failed_flop_count_drops_only_the_floor():
    runs = [
        _run("transformers+peft", [1.0], flops_error="AssertionError: sdpa_flop_count: ...", flops_analytic=5e8),
        _run("fastft", [0.5], flops_analytic=5e8),
    ]
    record = _gpu_record(runs, ["transformers+peft", "fastft"])
    record["device"], record["matmul_flops_per_s"] = "cpu: test", {"bfloat16": 1e9}
    rows = {row["system"]: row for row in report.summarise(record)}
    assert rows["fastft"]["floor_fraction"] == pytest.approx(5e8 / 1e9 / 0.5)
    assert rows["fastft"]["floor_source"].startswith("from the config (the count failed: transformers+peft: Assert")
    for run in runs:
        run.pop("flops_analytic")
    record["matmul_flops_per_s"] = {"bfloat16": None}
    rows = {row["system"]: row for row in report.summarise(record)}
    assert rows["fastft"]["step_s"] == 0.5 and rows["fastft"]["floor_fraction"] is None
    assert "no floor" in rows["fastft"]["floor_source"]
    value, reason = report.floor_fraction(1e9, 0.0, 1.0)
    assert value is None and "ZeroDivisionError" in reason
    # A random-weight shape's floor comes from the shape itself (records from before workers counted it too).
    record["settings"]["workloads"][0]["model"] = "tiny"
    record["matmul_flops_per_s"] = {"bfloat16": 1e9}
    rows = {row["system"]: row for row in report.summarise(record)}
    flops = lora_step_flops(MODEL_SHAPES["tiny"], 4, 2048, 16)
    assert rows["fastft"]["floor_fraction"] == pytest.approx(flops / 1e9 / 0.5)
    assert rows["fastft"]["floor_source"].startswith("from the tiny shape (the count failed: transformers+peft:")


def test_the_worker_keeps_its_row_when_the_flop_count_asserts(tmp_path, monkeypatch):
    folder = write_random_model("tiny", tmp_path / "tiny", "float32", "cpu")
    real_load = worker._load

    def load(name):
        module = real_load(name)
        if name == "measure":

            def asserting(work):
                raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

            module.count_flops = asserting
        return module

    monkeypatch.setattr(worker, "_load", load)
    spec = {
        "system": "transformers+peft",
        "family": "transformers+peft",
        "mode": False,
        "folder": str(folder),
        "dtype": "float32",
        "quant": "none",
        "batch": 2,
        "seq": 16,
        "device": "cpu",
        "max_seq_length": 16,
        "rank": 16,
        "alpha": 16,
        "steps": 2,
        "count_flops": True,
    }
    record = worker.measure(spec)
    assert len(record["step_times_s"]) == 2 and record["loss"] > 0
    assert record["flops_error"] == "AssertionError: sdpa_flop_count: query/key/value shapes are incompatible"
    assert record["flops_analytic"] > 0 and "flops" not in record


def test_gpu_busy_is_kernel_time_over_the_step_and_copies_are_apart():
    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")
    events = [
        SimpleNamespace(key="nvjet_gemm", device_type=cuda, count=10, self_device_time_total=50_000.0),
        SimpleNamespace(key="triton_rms_norm", device_type=cuda, count=5, self_device_time_total=10_000.0),
        SimpleNamespace(key="Memcpy DtoH (Device -> Pinned)", device_type=cuda, count=3, self_device_time_total=9e3),
        SimpleNamespace(key="Memset (Device)", device_type=cuda, count=1, self_device_time_total=1e3),
        SimpleNamespace(key="aten::mm", device_type=cpu, count=10, self_device_time_total=0.0),
    ]
    summary = gpu_time.summarise(events, step_s=0.1)
    assert summary["kernel_launches"] == 15 and summary["copies"] == 4
    assert summary["gpu_kernel_s"] == pytest.approx(0.06) and summary["copy_s"] == pytest.approx(0.01)
    assert summary["gpu_busy"] == pytest.approx(0.6)
    assert "gpu_busy" not in gpu_time.summarise(events)
    # The kernels by device time, copies left out: where a step's GPU time goes.
    assert summary["top_kernels"] == [
        {"kernel": "nvjet_gemm", "count": 10, "ms": 50.0},
        {"kernel": "triton_rms_norm", "count": 5, "ms": 10.0},
    ]


def test_profiling_a_step_needs_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        gpu_time.profile_step(lambda: None)


def test_the_worker_writes_each_systems_timeline_where_fastft_bench_trace_dir_says(tmp_path, monkeypatch):
    calls = []

    def profile_step(step, step_s, trace_path=None):
        calls.append(trace_path)
        return {"gpu_kernel_s": 0.1}

    real_load = worker._load
    monkeypatch.setattr(
        worker,
        "_load",
        lambda name: SimpleNamespace(profile_step=profile_step) if name == "gpu_time" else real_load(name),
    )
    model = SimpleNamespace(zero_grad=lambda set_to_none: None, config=SimpleNamespace())
    spec = {"system": "fastft+recompute", "device": "cuda", "batch": 1, "seq": 8, "rank": 16}
    folder = tmp_path / "trace" / "timelines"
    monkeypatch.setenv("FASTFT_BENCH_TRACE_DIR", str(folder))
    assert worker._extras(spec, model, lambda: None, 0.1, None)["gpu_kernel_s"] == 0.1
    assert calls == [str(folder / "fastft+recompute.json.gz")] and folder.is_dir()
    monkeypatch.delenv("FASTFT_BENCH_TRACE_DIR")
    worker._extras(spec, model, lambda: None, 0.1, None)
    assert calls[-1] is None
