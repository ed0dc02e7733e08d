"""fastft bench: the harness end to end on a tiny model, and its reading of runs (medians, ratios, targets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastft.bench import harness, report, venvs, worker
from fastft.bench.measure import SavedTensorBytes
from fastft.bench.systems import select_systems
from fastft.bench.workloads import select_workloads


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``fastft bench --quick`` with two systems, two rounds, into a README with a section to replace."""
    folder = tmp_path_factory.mktemp("bench")
    readme = folder / "README.md"
    readme.write_text(
        "# Benchmarks\n\n<!-- fastft-bench:cpu:start -->\nold table\n<!-- fastft-bench:cpu:end -->\ntail\n"
    )
    command = [sys.executable, "-m", "fastft.cli", "bench", "--quick", "--device", "cpu", "--rounds", "2"]
    command += ["--steps", "1", "--systems", "transformers+peft", "fastft+offload", "--output-dir", str(folder)]
    command += ["--readme", str(readme), "--venv-root", str(folder / "venvs")]
    # Its own temporary folder, to show that the run leaves nothing behind there.
    (folder / "tmp").mkdir()
    env = dict(os.environ, TMPDIR=str(folder / "tmp"))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=folder, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result, json.loads((folder / "bench-cpu-quick.json").read_text())


def test_quick_run_alternates_systems_one_process_each_and_agrees_on_the_loss(quick_run):
    _, _, record = quick_run
    order = [(run["round"], run["system"]) for run in record["runs"]]
    assert order == [(0, "transformers+peft"), (0, "fastft+offload"), (1, "transformers+peft"), (1, "fastft+offload")]
    losses = [run["loss"] for run in record["runs"]]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    # Every run set the same LoRA weights on the same number of adapters and read the same tokens.
    assert (
        len({(run["adapters"], run["input_checksum"], round(run["lora_checksum"], 6)) for run in record["runs"]}) == 1
    )
    assert record["runs"][0]["adapters"] == 2 * 7
    assert "flops" in record["runs"][0] and "flops" not in record["runs"][2]
    assert record["runs"][1]["fastft_patches"] and "checkpoint.offload" in record["runs"][1]["fastft_patches"]
    assert record["matmul_flops_per_s"]["float32"] > 1e8


def test_quick_run_leaves_no_temporary_folder_behind(quick_run):
    folder, _, _ = quick_run
    assert not list((folder / "tmp").iterdir())


def test_quick_run_summary_table_plot_and_readme(quick_run):
    folder, result, record = quick_run
    rows = {row["system"]: row for row in record["summary"]}
    base, offload = rows["transformers+peft"], rows["fastft+offload"]
    assert base["step_ratio"] == 1.0 and base["runs"] == 2 and not base["failed"]
    assert offload["loss_agrees"] and offload["same_inputs"] and offload["same_lora"]
    # Checkpointing keeps layer inputs, not activations.
    assert offload["saved_ratio"] < 0.5
    assert 0 < offload["floor_fraction"] < 1
    assert "| transformers+peft |" in result.stdout and "| fastft+offload |" in result.stdout
    assert (folder / "bench-cpu-quick.png").stat().st_size > 10_000
    readme = (folder / "README.md").read_text()
    assert "old table" not in readme and "| fastft+offload |" in readme and readme.endswith("tail\n")
    assert "![tokens/s and memory per system](results/bench-cpu-quick.png)" in readme


def test_readme_from_redraws_plot_and_section_from_the_json(quick_run, tmp_path):
    folder, _, _ = quick_run
    source = tmp_path / "bench-cpu-quick.json"
    source.write_text((folder / "bench-cpu-quick.json").read_text())
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    from fastft.cli import main

    assert main(["bench", "--readme-from", str(source), "--readme", str(readme)]) == 0
    assert (tmp_path / "bench-cpu-quick.png").exists()
    text = readme.read_text()
    assert "<!-- fastft-bench:cpu:start -->" in text and "| transformers+peft |" in text


def _run(system, round_index, steps, loss=2.0, saved=100, flops=None, **extra):
    run = {"workload": "w", "system": system, "round": round_index, "step_times_s": steps, "loss": loss}
    run.update(saved_bytes=saved, saved_bytes_raw=saved, peak_rss_bytes=1000, lora_checksum=5.0)
    run.update(input_checksum=7, adapters=14, versions={}, wall_s=1.0, **extra)
    if flops is not None:
        run["flops"] = flops
    return run


def _record(runs, device="cpu: test (2 threads)", dtype="float32"):
    systems = ["transformers+peft", "transformers+peft+gc", "unsloth", "fastft", "fastft+offload"]
    return {
        "device": device,
        "settings": {
            "rounds": 1,
            "timed_steps_per_run": 2,
            "quick": False,
            "workloads": [{"name": "w", "batch": 2, "seq": 50, "dtype": dtype, "quant": "none"}],
            "systems": [{"name": name} for name in systems],
        },
        "matmul_flops_per_s": {dtype: 1e9},
        "runs": runs,
    }


def test_summary_pools_rounds_flags_a_loss_mismatch_and_reads_the_targets():
    runs = [
        _run("transformers+peft", 0, [1.0, 1.2], flops=4e8),
        _run("transformers+peft", 1, [1.1, 5.0]),
        _run("transformers+peft+gc", 0, [2.0], saved=40),
        _run("unsloth", 0, [1.5], saved=40, loss=2.01),
        _run("fastft", 0, [0.8, 0.9]),
        _run("fastft+offload", 0, [1.2], saved=11),
        {"workload": "w", "system": "fastft+offload", "round": 1, "error": "worker exited with -9", "wall_s": 1.0},
    ]
    record = _record(runs)
    record["summary"] = report.summarise(record)
    rows = {row["system"]: row for row in record["summary"]}
    # Median of every timed step of every round: 1.0, 1.1, 1.2, 5.0 -> 1.15.
    assert rows["transformers+peft"]["step_s"] == pytest.approx(1.15)
    assert rows["transformers+peft"]["tokens_per_s"] == pytest.approx(100 / 1.15)
    assert rows["fastft"]["step_ratio"] == pytest.approx(0.85 / 1.15)
    assert rows["fastft"]["floor_fraction"] == pytest.approx(0.4 / 0.85)
    assert rows["unsloth"]["loss_agrees"] is False and rows["fastft"]["loss_agrees"] is True
    assert rows["fastft+offload"]["runs"] == 1 and rows["fastft+offload"]["failed"] == ["worker exited with -9"]
    targets = {target["target"]: target for target in report.evaluate_targets(record)}
    assert targets["fastft step_s <= 0.9 x transformers+peft"]["met"] is True
    assert targets["fastft+offload step_s <= 0.9 x transformers+peft+gc"]["met"] is True
    assert targets["fastft+offload step_s <= 0.9 x unsloth"]["met"] is True
    assert targets["fastft+offload saved_bytes <= 0.25 x unsloth"]["measured"] == pytest.approx(11 / 40)
    assert targets["fastft+offload saved_bytes <= 0.25 x unsloth"]["met"] is False
    table = report.markdown(
        record
        | {
            "started": "2026-11-21T00:00:00",
            "duration_s": 60.0,
            "load_average": {"before": 0.1, "after": None},
            "harness_versions": {"torch": "t", "transformers": "x", "peft": "p"},
            "targets": report.evaluate_targets(record),
        }
    )
    assert "**FLAGGED**" in table and "**not met**" in table


def test_gpu_targets_and_a_missing_competitor():
    runs = [
        _run("transformers+peft", 0, [2.0], peak_vram_bytes=100),
        _run("fastft", 0, [0.9], peak_vram_bytes=90),
        _run("fastft+offload", 0, [1.0], peak_vram_bytes=50),
    ]
    record = _record(runs, device="NVIDIA H100 80GB HBM3", dtype="bfloat16")
    record["summary"] = report.summarise(record)
    record["longest"] = [
        {"model": "m", "quant": "none", "system": "fastft+offload", "longest_seq": 65536, "stopped_by": "time"},
        {"model": "m", "quant": "none", "system": "unsloth", "longest_seq": 49152, "stopped_by": "oom"},
    ]
    targets = report.evaluate_targets(record)
    by_name = {target["target"]: target for target in targets}
    assert by_name["fastft tokens_per_s >= 2.0 x transformers+peft"]["met"] is True
    assert by_name["fastft+offload peak_vram_bytes <= 1.0 x unsloth"]["met"] is None
    assert "unsloth" in by_name["fastft+offload peak_vram_bytes <= 1.0 x unsloth"]["reason"]
    assert by_name["fastft+offload longest >= unsloth longest"]["met"] is True


def test_unknown_or_unavailable_systems_and_workloads_are_refused_by_name():
    with pytest.raises(ValueError, match="liger has no cpu path"):
        select_systems("cpu", ["liger"])
    with pytest.raises(ValueError, match="unknown system 'peft'"):
        select_systems("cpu", ["peft"])
    with pytest.raises(ValueError, match="unknown workload"):
        select_workloads("cpu", False, ["smollm2-135m-fp16"])
    assert [system.name for system in select_systems("cpu", None)] == [
        "transformers+peft",
        "transformers+peft+gc",
        "unsloth",
        "fastft",
        "fastft+offload",
    ]
    assert "liger" in [system.name for system in select_systems("cuda", None)]
    from fastft.cli import main

    assert main(["bench", "--device", "cpu", "--systems", "liger"]) == 2


def test_saved_bytes_see_the_input_torch_checkpoint_keeps_for_its_recompute():
    # The harness compares checkpointing systems by bytes saved for backward; that is only fair if the layer
    # inputs torch's non-reentrant checkpoint keeps reach the hook (they do, in torch 2.13) while the activations
    # inside the checkpointed function do not.
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    hidden = x * 2

    with SavedTensorBytes(exclude=layer.parameters()) as saved:
        torch.utils.checkpoint.checkpoint(lambda h: layer(h).relu(), hidden, use_reentrant=False).sum()
    assert saved.bytes == hidden.nbytes


def test_a_worker_out_of_memory_is_a_result_not_a_crash(monkeypatch, capsys):
    def out_of_memory(spec):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(worker, "measure", out_of_memory)
    assert worker.main(["--spec", json.dumps({"system": "fastft"})]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    record = json.loads(line.removeprefix(worker.RESULT_PREFIX))
    assert record["oom"] is True and "Tried to allocate" in record["error"]

    def broken(spec):
        raise ValueError("a real bug")

    monkeypatch.setattr(worker, "measure", broken)
    with pytest.raises(ValueError, match="a real bug"):
        worker.main(["--spec", "{}"])


def test_a_competitor_venv_is_reused_when_its_stamp_matches_and_a_failed_build_names_its_log(tmp_path, monkeypatch):
    venv = tmp_path / "unsloth"
    venv.mkdir()
    (venv / venvs.STAMP).write_text(json.dumps(venvs.wanted_stamp("unsloth")))
    assert venvs.ensure("unsloth", tmp_path) == venvs.python_of(venv)  # nothing built: it would take a minute

    monkeypatch.setitem(venvs.VENVS, "broken", {"requirements": [str(tmp_path / "missing.whl")], "no_deps": []})
    with pytest.raises(venvs.VenvError, match=r"installing its pins for the broken venv failed .*broken-build\.log"):
        venvs.ensure("broken", tmp_path)
    assert "missing.whl" in (tmp_path / "broken-build.log").read_text()


def test_workers_never_run_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = harness._worker_env(harness.Options())
    assert "TRITON_INTERPRET" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert Path(harness.WORKER).name == "worker.py"
