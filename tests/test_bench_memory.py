"""bench/memory.py runs its CPU harness end to end: one process per (sequence length, mode), JSON, plot, verdicts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = ["none", "recompute", "offload"]
SEQS = [64, 128]


def test_memory_bench_cpu_harness_writes_json_and_plot(tmp_path):
    output = tmp_path / "results" / "memory.json"
    # conftest turns the Triton interpreter on for the kernel tests; the script must drop it itself (else fastft's
    # CPU path would be the interpreter), so it is left on here on purpose.
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, str(ROOT / "bench" / "memory.py"), "--device", "cpu", "--shape", "tiny"]
    # One thread: on a machine shared with other work, OpenMP threads waiting for a busy core make tiny steps crawl.
    command += ["--seqs", *map(str, SEQS), "--steps", "2", "--threads", "1", "--out", str(output)]
    # cwd elsewhere: the script must find fastft whatever directory it is started from.
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(output.read_text())

    assert record["benchmark"] == "memory" and record["device_type"] == "cpu"
    assert record["device"].startswith("cpu") and "nothing about" in record["note"]
    assert record["fastft_path"] == "reference" and record["triton_interpret_removed"] is True
    for name in ("torch", "transformers", "peft", "fastft"):
        assert record["versions"][name], name
    assert record["model"]["shape"] == "tiny" and record["model"]["num_hidden_layers"] == 4
    assert record["model"]["max_position_embeddings"] >= max(SEQS)
    settings = record["settings"]
    assert settings["seqs"] == SEQS and settings["modes"] == MODES and settings["dtype"] == "float32"
    assert settings["use_gradient_checkpointing"] == {"none": False, "recompute": True, "offload": "offload"}
    assert settings["timed_steps"] == 2 and settings["one_process_per_run"] is True

    runs = record["runs"]
    assert sorted((row["seq"], row["mode"]) for row in runs) == sorted((s, m) for s in SEQS for m in MODES)
    assert [row["order"] for row in runs] == list(range(len(runs)))
    for index, seq in enumerate(SEQS):
        # the modes of one sequence length run back to back, and the first of them rotates between lengths
        block = runs[index * len(MODES) : (index + 1) * len(MODES)]
        assert {row["seq"] for row in block} == {seq}
        assert block[0]["mode"] == MODES[index % len(MODES)]
    rows = {(row["seq"], row["mode"]): row for row in runs}
    for (seq, mode), row in rows.items():
        assert row["status"] == "ok", row
        assert row["peak_vram_bytes"] is None and row["peak_vram_reserved_bytes"] is None
        assert len(row["step_s"]) == 2 and all(t > 0 for t in row["step_s"]), row
        assert abs(row["tokens_per_s"] - seq / row["median_step_s"]) < 1e-6 * row["tokens_per_s"]
        assert row["peak_rss_bytes"] >= row["rss_after_build_bytes"] > 0, row
        assert row["saved_bytes"] > 0 and row["saved_bytes_raw"] >= row["saved_bytes"] // 2, row
        assert 5.5 < row["first_loss"] < 7.0, row  # random weights: about ln(512) = 6.24
        assert f"{seq:>6} {mode:<10} ok" in result.stdout

    for seq in SEQS:
        full = rows[(seq, "none")]["saved_bytes"]
        # checkpointing keeps (next to) nothing of the layers' insides for backward
        assert rows[(seq, "recompute")]["saved_bytes"] < 0.5 * full
        assert rows[(seq, "offload")]["saved_bytes"] < 0.5 * full
        reference = rows[(seq, "none")]["first_loss"]
        for mode in MODES:
            assert abs(rows[(seq, mode)]["first_loss"] - reference) <= 1e-5 * abs(reference), (seq, mode)
    # twice the tokens, about twice the saved activations
    assert rows[(128, "none")]["saved_bytes"] > 1.5 * rows[(64, "none")]["saved_bytes"]

    assert record["losses_agree"] is True and record["failed_runs"] == []
    summary = {entry["seq"]: entry for entry in record["summary"]}
    assert sorted(summary) == SEQS
    for seq, entry in summary.items():
        assert entry["modes_ok"] == MODES and entry["losses"]["agree"] is True
        assert entry["losses"]["tolerance"] == 1e-5
        verdict = entry["verdict"]
        ratio = rows[(seq, "offload")]["median_step_s"] / rows[(seq, "recompute")]["median_step_s"]
        assert abs(verdict["offload_over_recompute_step_time"] - ratio) < 1e-12
        assert verdict["offload_step_time_within_10pct"] == (ratio <= 1.10)
        assert verdict["offload_peak_vram_lower"] is None and "CPU" in verdict["note"]
    assert "losses agree" in result.stdout and "offload / recompute step time" in result.stdout

    png = output.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _load_bench():
    spec = importlib.util.spec_from_file_location("fastft_bench_memory", ROOT / "bench" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_out_of_memory_becomes_a_row_not_a_crash(monkeypatch):
    bench = _load_bench()
    build = bench.build_model

    def no_room_to_build(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(bench, "build_model", no_room_to_build)
    row = bench.measure("cpu", "tiny", 64, "none", steps=1, threads=1)
    assert (row["status"], row["phase"]) == ("oom", "build") and "Tried to allocate" in row["message"]
    assert row["peak_rss_bytes"] > 0 and "median_step_s" not in row

    def cublas_runs_out(*args, **kwargs):
        model = build(*args, **kwargs)

        def forward(*args, **kwargs):
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

        model.forward = forward
        return model

    monkeypatch.setattr(bench, "build_model", cublas_runs_out)
    row = bench.measure("cpu", "tiny", 64, "offload", steps=1, threads=1)
    assert (row["status"], row["phase"]) == ("oom", "warm-up"), row
    assert row["rss_after_build_bytes"] > 0 and "first_loss" not in row

    def broken(*args, **kwargs):
        raise ValueError("not a memory problem")

    monkeypatch.setattr(bench, "build_model", broken)
    with pytest.raises(ValueError, match="not a memory problem"):
        bench.measure("cpu", "tiny", 64, "none", steps=1, threads=1)


def test_verdicts_need_both_checkpointing_modes_and_compare_them():
    bench = _load_bench()

    def row(seq, mode, status="ok", step=1.0, vram=100, loss=11.0):
        figures = {"median_step_s": step, "peak_vram_bytes": vram, "saved_bytes": vram, "first_loss": loss}
        return {"seq": seq, "mode": mode, "status": status, **(figures if status == "ok" else {})}

    rows = [
        row(2048, "none", vram=300),
        row(2048, "recompute", step=1.0, vram=200),
        row(2048, "offload", step=1.2, vram=150, loss=11.0 * (1 + 2e-2)),
        row(32768, "none", status="oom"),
        row(32768, "recompute", step=2.0, vram=500),
        row(32768, "offload", status="oom"),
    ]
    short, long = bench.summarise(rows, [2048, 32768], "bfloat16", on_cuda=True)
    assert short["verdict"]["offload_over_recompute_step_time"] == pytest.approx(1.2)
    assert short["verdict"]["offload_step_time_within_10pct"] is False
    assert short["verdict"]["offload_peak_vram_lower"] is True
    assert short["verdict"]["offload_over_recompute_peak_vram"] == pytest.approx(0.75)
    # 2e-2 relative is beyond bf16's 1e-2
    assert short["losses"]["agree"] is False and short["losses"]["reference_mode"] == "none"
    assert long["modes_ok"] == ["recompute"] and long["losses"]["agree"] is True
    assert long["verdict"]["offload_step_time_within_10pct"] is None and "offload oom" in long["verdict"]["note"]
