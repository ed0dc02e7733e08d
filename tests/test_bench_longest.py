"""fastft bench --longest: the one-process search (grow, bisect, budget) against a fake out-of-memory error and a fake
clock, its reading (table text, target), and the harness's handling of a search it had to stop."""

from __future__ import annotations

import json
import math
import sys
import weakref
from pathlib import Path

import pytest
import torch

from fastft.bench import harness, longest
from fastft.bench.systems import select_systems
from fastft.bench.workloads import select_workloads


class FakeGPU:
    """One training step per call: out of memory above ``threshold`` tokens; each step advances a fake clock by
    ``seconds(seq)``; what a failed step allocated must be unreachable by the time ``free`` runs."""

    def __init__(self, threshold: int, seconds=lambda seq: seq / 10_000) -> None:
        self.threshold, self.seconds, self.now = threshold, seconds, 0.0
        self.lengths: list[int] = []
        self.starts: list[float] = []
        self.freed = 0
        self._allocation = None

    def clock(self) -> float:
        return self.now

    def step(self, seq: int) -> dict:
        self.lengths.append(seq)
        self.starts.append(self.now)
        self.now += self.seconds(seq)
        activations = torch.empty(seq)  # what the failed step holds, referenced from this frame only
        self._allocation = weakref.ref(activations)
        if seq > self.threshold:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {seq} bytes")
        return {"step_s": self.seconds(seq), "peak_vram_bytes": 4 * seq}

    def free(self) -> None:
        assert self._allocation() is None, "the failed step's tensors are still reachable when memory is freed"
        self.freed += 1


def _search(gpu: FakeGPU, budget: float = 1e9, **settings) -> dict:
    settings = {"start": 8192, "limit": 262144, "granularity": 1024} | settings
    probes = []
    result = longest.search(
        gpu.step, deadline=budget, clock=gpu.clock, free=gpu.free, on_probe=probes.append, **settings
    )
    assert probes == result["probes"]  # every probe was reported as it was made
    return result


def test_grows_geometrically_then_bisects_to_the_resolution_freeing_memory_after_each_oom():
    gpu = FakeGPU(threshold=100_000)
    result = _search(gpu)
    # Doubling from 8192 until the first out-of-memory error, then only lengths between the last fit and it.
    assert gpu.lengths[:5] == [8192, 16384, 32768, 65536, 131072]
    fit, oom = result["longest_seq"], result["first_oom_seq"]
    assert result["stopped_by"] == "oom"
    assert fit <= 100_000 < oom and oom - fit <= max(1024, math.ceil(fit / 16))
    assert all(65536 < seq < 131072 and seq % 1024 == 0 for seq in gpu.lengths[5:])
    assert gpu.freed == sum(not probe["fits"] for probe in result["probes"]) >= 2
    assert [probe["seq"] for probe in result["probes"] if probe["fits"]][-1] == fit
    assert result["probes"][-1]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert longest.describe(result) == f"{fit:,} (out of memory at {oom:,})"


def test_the_budget_stops_the_search_before_a_probe_that_would_overrun_it_and_says_so():
    # Quadratic step times: 8192 -> 0.67 s, 65536 -> 43 s, 131072 -> 172 s.
    gpu = FakeGPU(threshold=10**9, seconds=lambda seq: (seq / 10_000) ** 2)
    result = _search(gpu, budget=100.0)
    assert result["stopped_by"] == "time"
    assert result["longest_seq"] == 65536 and result["first_oom_seq"] is None
    assert result["next_seq"] == 131072 and result["predicted_s"] > result["left_s"]
    # No probe started after the deadline, and none ran past it.
    assert max(gpu.starts) < 100.0 and gpu.now <= 100.0
    assert longest.describe(result) == "≥ 65,536, stopped by time"


def test_a_budget_gone_before_the_first_probe_reports_no_length():
    gpu = FakeGPU(threshold=10**9)
    gpu.now = 50.0
    result = _search(gpu, budget=40.0)
    assert result["stopped_by"] == "time" and result["longest_seq"] is None and gpu.lengths == []
    assert longest.describe(result) == "none in time"


def test_the_ladder_end_is_a_lower_bound():
    gpu = FakeGPU(threshold=10**9)
    result = _search(gpu, limit=100_000)
    assert gpu.lengths == [8192, 16384, 32768, 65536, 100_000]  # the last one capped at the ladder's end
    assert result["stopped_by"] == "ladder-end" and result["longest_seq"] == 100_000
    assert longest.describe(result) == "≥ 100,000, the ladder's end"


def test_an_oom_at_the_first_length_bisects_downwards_and_none_fitting_is_said():
    gpu = FakeGPU(threshold=3000)
    result = _search(gpu)
    assert gpu.lengths[0] == 8192 and result["stopped_by"] == "oom"
    assert result["longest_seq"] <= 3000 < result["first_oom_seq"]
    nothing = _search(FakeGPU(threshold=0))
    assert nothing["longest_seq"] is None and nothing["stopped_by"] == "oom" and nothing["first_oom_seq"] == 1024


def test_another_error_ends_the_search_with_its_message_and_keeps_what_fitted():
    gpu = FakeGPU(threshold=10**9)

    def step(seq):
        if seq > 20000:
            raise ValueError("fastft: sequence longer than max_seq_length")
        return gpu.step(seq)

    result = longest.search(step, start=8192, limit=262144, granularity=1024, deadline=1e9, clock=gpu.clock)
    assert result["stopped_by"] == "error" and result["longest_seq"] == 16384
    assert result["error"] == "ValueError: fastft: sequence longer than max_seq_length"
    assert longest.describe(result).startswith("≥ 16,384, failed: ValueError")


def test_a_ladder_that_cannot_be_walked_is_refused():
    with pytest.raises(ValueError, match=r"granularity \(2048\) <= start \(1024\)"):
        longest.search(lambda seq: {}, start=1024, limit=4096, granularity=2048, deadline=1.0, clock=lambda: 0.0)


@pytest.mark.parametrize(
    ("ours", "theirs", "met"),
    [
        ({"longest_seq": 196608, "stopped_by": "time"}, {"longest_seq": 98304, "stopped_by": "oom"}, True),
        ({"longest_seq": 98304, "stopped_by": "oom"}, {"longest_seq": 131072, "stopped_by": "time"}, False),
        ({"longest_seq": 65536, "stopped_by": "time"}, {"longest_seq": 98304, "stopped_by": "oom"}, None),
        ({"longest_seq": 196608, "stopped_by": "time"}, {"longest_seq": 196608, "stopped_by": "time"}, None),
        (
            {"longest_seq": 196608, "stopped_by": "time"},
            {"longest_seq": 131072, "stopped_by": "time", "first_oom_seq": 163840},
            True,
        ),
        ({"longest_seq": 8192, "stopped_by": "time"}, {"longest_seq": None, "stopped_by": "oom"}, True),
        ({"longest_seq": None, "stopped_by": "time"}, {"longest_seq": 8192, "stopped_by": "oom"}, None),
    ],
)
def test_longest_comparison_decides_only_what_lower_bounds_allow(ours, theirs, met):
    decided, reason = longest.compare(ours, theirs)
    assert decided is met
    assert (reason is None) == (met is not None)


def _fake_python(tmp_path: Path, body: str) -> Path:
    """An executable the harness starts in place of a system's Python: prints two probes, then ``body``."""
    probes = [
        {"seq": 64, "fits": True, "s": 0.1, "step_s": 0.1},
        {"seq": 128, "fits": True, "s": 0.2, "step_s": 0.2},
    ]
    lines = "".join(f"print({json.dumps(harness.PROBE_PREFIX + json.dumps(probe))}, flush=True)\n" for probe in probes)
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport sys, time\n{lines}{body}\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    return str(folder)


def test_a_search_the_harness_stops_keeps_its_probes_and_says_stopped_by_time(tmp_path, tiny_folder, monkeypatch):
    monkeypatch.setattr(harness, "LONGEST_GRACE_S", 1.0)
    python = _fake_python(tmp_path, "time.sleep(60)")
    system = select_systems("cpu", ["fastft+offload"])[0]
    workload = select_workloads("cpu", True, None)[0]
    entry = harness.longest_one(system, workload, tiny_folder, python, harness.Options(), tmp_path, budget_s=0.5)
    assert entry["stopped_by"] == "time" and entry["longest_seq"] == 128 and len(entry["probes"]) == 2
    assert "timed out after 2 s" in entry["note"] and entry["wall_s"] < 30
    assert (entry["start"], entry["limit"], entry["granularity"]) == (64, 1024, 8)
    assert entry["step_s_at_longest"] == 0.2 and entry["mode"] == "offload" and entry["checkpointing"] == "offload"
    assert longest.describe(entry) == "≥ 128, stopped by time"


def test_a_search_whose_worker_crashes_is_an_error_with_its_output(tmp_path, tiny_folder):
    python = _fake_python(tmp_path, "print('Traceback: boom', file=sys.stderr); sys.exit(3)")
    system = select_systems("cpu", ["fastft"])[0]
    workload = select_workloads("cpu", True, None)[0]
    entry = harness.longest_one(system, workload, tiny_folder, python, harness.Options(), tmp_path, budget_s=30)
    assert entry["stopped_by"] == "error" and entry["longest_seq"] == 128
    assert entry["error"] == "worker exited with 3" and "Traceback: boom" in entry["output_tail"]


def test_the_default_budget_shares_six_minutes_among_the_searches_and_the_ladder_follows_the_model(tiny_folder):
    assert harness.longest_budget(harness.Options(), 6) == 60.0
    assert harness.longest_budget(harness.Options(), 24) == harness.LONGEST_MIN_BUDGET_S
    assert harness.longest_budget(harness.Options(longest_budget_s=90), 24) == 90.0
    assert harness.longest_ladder(tiny_folder) == {"start": 64, "limit": 1024, "granularity": 8}


@pytest.fixture(scope="module")
def longest_run(tmp_path_factory):
    """``fastft bench --quick --rounds 0 --longest`` for two systems: the search alone, one process each."""
    import subprocess

    folder = tmp_path_factory.mktemp("longest")
    command = [sys.executable, "-m", "fastft.cli", "bench", "--quick", "--device", "cpu", "--rounds", "0"]
    command += ["--longest", "--longest-budget", "120", "--systems", "transformers+peft", "fastft+offload"]
    command += ["--output-dir", str(folder), "--venv-root", str(folder / "venvs"), "--readme", str(folder / "R.md")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=folder)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result, json.loads((folder / "bench-cpu-longest-quick.json").read_text())


def test_the_longest_search_runs_alone_one_process_per_system_to_the_ladder_end(longest_run):
    folder, result, record = longest_run
    assert record["runs"] == [] and all(row["runs"] == 0 and not row["failed"] for row in record["summary"])
    assert [entry["system"] for entry in record["longest"]] == ["transformers+peft", "fastft+offload"]
    for entry in record["longest"]:
        # The tiny model's 1024 positions fit on any CPU: doubling from 64 reaches the ladder's end.
        assert [probe["seq"] for probe in entry["probes"]] == [64, 128, 256, 512, 1024]
        assert entry["stopped_by"] == "ladder-end" and entry["longest_seq"] == 1024 and entry["budget_s"] == 120
        assert all(probe["fits"] and probe["loss"] > 0 for probe in entry["probes"])
        assert entry["load_s"] > 0 and entry["elapsed_s"] < 120
    assert '| tiny | fastft+offload | "offload" | ≥ 1,024, the ladder\'s end |' in result.stdout
    assert "<!-- fastft-bench:cpu-longest:start -->" in (folder / "R.md").read_text()
    assert not (folder / "bench-cpu-longest-quick.png").exists()  # no timed runs, nothing to plot


def test_rounds_zero_needs_longest_and_the_budget_must_be_positive():
    from fastft.cli import main

    assert main(["bench", "--quick", "--device", "cpu", "--rounds", "0"]) == 2
    assert main(["bench", "--quick", "--device", "cpu", "--longest", "--longest-budget", "0"]) == 2
