"""bench/host.py: its quick run writes a consistent record, its op count is deterministic, and the committed CPU
record has every system and target. No timing is asserted here: the speed targets live in the committed JSON."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
QUICK_SYSTEMS = ["transformers+peft", "transformers+peft+gc", "unsloth", "fastft", "fastft+sqrt"]
# The systems of the committed record; a fastft mode added later appears when the record is regenerated.
COMMITTED_SYSTEMS = [
    "transformers+peft",
    "transformers+peft+gc",
    "unsloth",
    "unsloth-nogc",
    "fastft",
    "fastft+recompute",
    "fastft+offload",
    "fastft+sqrt",
    "fastft+compile",
    "transformers+peft+compile",
]
ROW_FIELDS = ("median_host_s", "tokens_per_s", "ops_per_step", "top_ops", "loss", "loss_diff", "host_s", "ratios")
# Every row of the committed record but the compiled one's (its generated kernels are not operators to replay).
FLOOR_FIELDS = ("op_floor_s", "op_replay_loop_s", "python_share")
TARGET_FIELDS = ("target", "system", "metric", "baseline", "limit", "measured", "met")


def _load_bench():
    spec = importlib.util.spec_from_file_location("fastft_bench_host", ROOT / "bench" / "host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


def test_quick_run_writes_a_consistent_record(bench, tmp_path, capsys):
    output = tmp_path / "host.json"
    threads = torch.get_num_threads()
    # This interpreter has no Unsloth here: its row must say so instead of failing the run.
    argv = ["--quick", "--out", str(output), "--systems", *QUICK_SYSTEMS, "--unsloth-python", sys.executable]
    assert bench.main(argv) == 0
    assert torch.get_num_threads() == threads  # main gives the caller its thread count back
    record = json.loads(output.read_text())
    # The printed table: a row per system and a line per target (it once printed "None").
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1] == f"wrote {output}"
    for name in QUICK_SYSTEMS:
        assert any(line.split()[:1] == [name] for line in printed.splitlines()), name
    for entry in record["targets"]:
        assert f"target {entry['target']}: " in printed, entry["target"]

    assert record["benchmark"] == "bench/host.py" and record["device"].startswith("cpu")
    assert record["fastft_kernel_path"] == "torch reference" and record["command"].endswith(sys.executable)
    # conftest turns the Triton interpreter on; the benchmark measures fastft's CPU path as users get it instead.
    from fastft.kernels import dispatch

    assert record["triton_interpreter_forced_off"] is dispatch.INTERPRETED
    for name in ("torch", "transformers", "peft", "fastft"):
        assert record["versions"][name], name
    assert Path(record["fastft_source"]["path"], "fastft", "__init__.py").exists()
    settings = record["settings"]
    assert (settings["layers"], settings["rounds"], settings["steps"], settings["threads"]) == (2, 2, 2, 1)
    assert settings["quick"] is True and settings["tokens_per_step"] == 16

    rows = record["systems"]
    assert list(rows) == QUICK_SYSTEMS  # build order, whatever order they were asked in
    unsloth = rows.pop("unsloth")
    assert unsloth["status"] in ("ok", "not run"), unsloth
    if unsloth["status"] == "not run":
        assert sys.executable in unsloth["reason"] and "median_host_s" in unsloth
    base, base_gc = rows["transformers+peft"], rows["transformers+peft+gc"]
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert len(row["host_s"]) == 4 and all(seconds > 0 for seconds in row["host_s"]), name
        assert row["median_host_s"] == statistics.median(row["host_s"])
        assert row["tokens_per_s"] == pytest.approx(16 / row["median_host_s"])
        assert row["ops_per_step"] > 100 and sum(count for _, count in row["top_ops"]) <= row["ops_per_step"]
        ratios = row["ratios"]
        assert ratios["host_vs_transformers+peft"] == pytest.approx(row["median_host_s"] / base["median_host_s"])
        assert ratios["host_vs_transformers+peft+gc"] == pytest.approx(row["median_host_s"] / base_gc["median_host_s"])
        assert ratios["ops_vs_transformers+peft"] == pytest.approx(row["ops_per_step"] / base["ops_per_step"])
        assert ratios["floor_vs_transformers+peft"] == pytest.approx(row["op_floor_s"] / base["op_floor_s"])
        assert row["python_share"] == pytest.approx(1 - row["op_floor_s"] / row["median_host_s"])
        # Same weights, same LoRA values (2 layers x 7 projections), same tokens: the same loss.
        assert (row["adapters"], row["lora_checksum"]) == (14, base["lora_checksum"])
        assert abs(row["loss_diff"]) <= 1e-4 * base["loss"] and 4.5 < row["loss"] < 6.5, name  # about ln(256)
    assert base["ratios"]["host_vs_transformers+peft"] == 1.0
    # Recomputing in backward dispatches more operators than keeping every activation.
    assert base_gc["ops_per_step"] > base["ops_per_step"]
    assert rows["fastft+sqrt"]["ops_per_step"] > rows["fastft"]["ops_per_step"]
    assert rows["fastft+sqrt"]["checkpointing"] == "sqrt" and rows["fastft"]["checkpointing"] is None
    assert record["losses"]["agree"] is True
    assert record["losses"]["max_abs_diff"] == max(abs(row["loss_diff"]) for row in rows.values())

    targets = {entry["target"]: entry for entry in record["targets"]}
    assert set(targets) == {
        "fastft median_host_s <= 0.5 x transformers+peft",
        "fastft+sqrt median_host_s <= 0.6 x transformers+peft+gc",
        "fastft ops_per_step <= 0.6 x transformers+peft",
    }
    for entry in targets.values():
        ours, theirs = rows[entry["system"]], rows[entry["baseline"]]
        of_medians = ours[entry["metric"]] / theirs[entry["metric"]]
        if entry["metric"] == "median_host_s":
            # Host time: the median of the rounds' own ratios, the ratio of the medians beside it.
            per_round = [a / b for a, b in zip(ours["round_medians_s"], theirs["round_medians_s"], strict=True)]
            assert entry["measured"] == pytest.approx(statistics.median(per_round))
            assert entry["ratio_of_medians"] == pytest.approx(of_medians)
            assert ours["paired_host_ratios"][f"host_vs_{entry['baseline']}"] == pytest.approx(entry["measured"])
        else:
            assert entry["measured"] == pytest.approx(of_medians)
        assert entry["met"] == (entry["measured"] <= entry["limit"])


def test_op_count_is_the_same_every_step(bench, tmp_path):
    folder = tmp_path / "model"
    bench.write_model(folder, layers=2)
    for system, mode in (("transformers+peft", False), ("fastft+sqrt", "sqrt")):
        runner = bench.Runner(bench.build(system, folder, "cpu", torch.float32, mode), "cpu")
        runner.warm(1)
        first, second = runner.count(), runner.count()
        counted = ("ops_per_step", "top_ops")
        assert [first[key] for key in counted] == [second[key] for key in counted], system
        assert first["ops_per_step"] > 100, system
        # The floor replays the step's operators: it costs something, and the loop around them is not counted in it.
        assert first["op_floor_s"] > 0 and first["op_replay_loop_s"] > 0, system


def test_fastft_modes_are_found_once_each(bench):
    modes = bench.fastft_modes()
    # "unsloth" is an alias of "offload": one row per mode, under the value a user would pass.
    assert {None: False, "recompute": True, "offload": "offload", "sqrt": "sqrt"}.items() <= modes.items()
    assert "unsloth" not in modes.values()
    systems = bench.available_systems()
    assert list(systems)[:4] == ["transformers+peft", "transformers+peft+gc", "unsloth", "unsloth-nogc"]
    assert {"fastft", "fastft+recompute", "fastft+offload", "fastft+sqrt", "fastft+compile"} <= set(systems)


def test_targets_without_a_baseline_are_not_measured(bench):
    rows = {
        "transformers+peft": {"kind": "stock", "status": "failed", "use_gradient_checkpointing": False},
        "transformers+peft+gc": {"kind": "stock", "status": "ok", "median_host_s": 2.0, "ops_per_step": 10},
        "fastft": {"kind": "fastft", "status": "ok", "use_gradient_checkpointing": False, "median_host_s": 1.0},
        "fastft+offload": {"kind": "fastft", "status": "ok", "use_gradient_checkpointing": "offload"},
    }
    rows["fastft+offload"]["median_host_s"] = 1.0
    targets = {entry["target"]: entry for entry in bench.targets(rows)}
    host = targets["fastft median_host_s <= 0.5 x transformers+peft"]
    assert host["measured"] is None and host["met"] is None and "transformers+peft failed" in host["note"]
    offload = targets["fastft+offload median_host_s <= 0.6 x transformers+peft+gc"]
    assert offload["measured"] == 0.5 and offload["met"] is True


def test_committed_cpu_record_has_every_system_and_target():
    record = json.loads((ROOT / "bench" / "results" / "host-cpu.json").read_text())
    settings = record["settings"]
    assert record["device"].startswith("cpu") and settings["quick"] is False
    assert (settings["layers"], settings["threads"], settings["tokens_per_step"]) == (16, 1, 16)
    for name in ("torch", "transformers", "peft", "trl", "fastft"):
        assert record["versions"][name], name
    rows = record["systems"]
    assert set(COMMITTED_SYSTEMS) <= set(rows)
    for name, row in rows.items():
        if row["status"] == "ok":
            assert all(field in row for field in ROW_FIELDS), name
            if name not in ("fastft+compile", "transformers+peft+compile"):
                assert all(field in row for field in FLOOR_FIELDS), name
                assert 0 < row["op_floor_s"] < 2 * row["median_host_s"], name
            assert row["median_host_s"] > 0 and row["ops_per_step"] > 0, name
        else:
            assert row["status"] in ("not run", "failed") and (row.get("reason") or row.get("error")), name
    for name in ("transformers+peft", "transformers+peft+gc", "fastft"):
        assert rows[name]["status"] == "ok", name
    assert record["losses"]["agree"] is True
    targets = {entry["target"]: entry for entry in record["targets"]}
    wanted = ["fastft median_host_s <= 0.5 x transformers+peft", "fastft ops_per_step <= 0.6 x transformers+peft"]
    wanted += [
        f"fastft+{mode} median_host_s <= 0.6 x transformers+peft+gc" for mode in ("recompute", "offload", "sqrt")
    ]
    # compile=True against eager stock's bound and against stock compiled the same way (regional).
    wanted += [
        "fastft+compile median_host_s <= 0.5 x transformers+peft",
        "fastft+compile median_host_s <= 1.0 x transformers+peft+compile",
    ]
    assert set(wanted) <= set(targets)
    for entry in targets.values():
        assert all(field in entry for field in TARGET_FIELDS), entry
        assert entry["met"] is None or entry["met"] == (entry["measured"] <= entry["limit"])


def test_host_targets_read_the_per_round_ratio(bench):
    """Each round's ratio compares the two systems in the same seconds; the ratio of the overall medians can pair one
    system's fast state with the other's slow one (here 1.0 where every round says 0.5)."""
    rows = {
        "transformers+peft": {"kind": "stock", "status": "ok", "use_gradient_checkpointing": False},
        "fastft": {"kind": "fastft", "status": "ok", "use_gradient_checkpointing": False},
    }
    rows["transformers+peft"].update(median_host_s=2.0, round_medians_s=[4.0, 4.0, 2.0, 2.0, 2.0], ops_per_step=10)
    rows["fastft"].update(median_host_s=2.0, round_medians_s=[2.0, 2.0, 1.0, 1.0, 1.0], ops_per_step=5)
    targets = {entry["target"]: entry for entry in bench.targets(rows)}
    host = targets["fastft median_host_s <= 0.5 x transformers+peft"]
    assert host["measured"] == 0.5 and host["met"] is True and host["ratio_of_medians"] == 1.0
    assert targets["fastft ops_per_step <= 0.6 x transformers+peft"]["measured"] == 0.5
    assert bench.paired_ratio(rows["fastft"], {"round_medians_s": []}) is None
