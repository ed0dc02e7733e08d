"""bench/preference.py runs end to end on a tiny Llama: three systems agree on the loss, fastft's log-prob head
serves the DPO policy and reference forwards, and the record holds what the README's figures are read from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_preference_bench_tiny_run_writes_json(tmp_path, tiny_llama_dir):
    output = tmp_path / "preference.json"
    command = [sys.executable, str(ROOT / "bench" / "preference.py"), "--model", str(tiny_llama_dir)]
    command += ["--seq", "32", "--completion", "8", "--out", str(output)]
    env = dict(os.environ, TRITON_INTERPRET="1")  # the script must drop it for its probes
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(output.read_text())
    assert record["benchmark"] == "bench/preference.py" and record["device"].startswith("cpu")
    assert {(run["method"], run["system"]) for run in record["runs"]} == {
        (method, system) for method in ("dpo", "grpo") for system in ("stock", "stock-no-ckpt", "fastft", "fastft-sqrt")
    }
    for method in ("dpo", "grpo"):
        rows = {run["system"]: run for run in record["runs"] if run["method"] == method}
        assert record["summary"][method]["losses_agree"]
        # Without checkpointing stock keeps every activation; both checkpointed systems keep about the layer inputs.
        assert rows["fastft"]["saved_bytes"] < rows["stock-no-ckpt"]["saved_bytes"] / 2
        assert rows["fastft"]["saved_bytes"] <= rows["stock"]["saved_bytes"] * 1.01
        # The tiny model's 2 layers form one segment: the second layer's input is replayed, not kept.
        assert rows["fastft-sqrt"]["checkpointing"] == "sqrt"
        assert rows["fastft-sqrt"]["saved_bytes"] < rows["fastft"]["saved_bytes"]
        assert rows["stock"]["fused_logprob_calls"] == 0
    # Policy and reference (adapters as trl sets them up) both went through fastft's fused log-prob head.
    for system in ("fastft", "fastft-sqrt"):
        assert record["summary"]["dpo"][system]["fused_logprob_calls"] == 2
        assert record["summary"]["grpo"][system]["fused_logprob_calls"] >= 1
    grpo = [run for run in record["runs"] if run["method"] == "grpo"]
    # Same seed, same generations on every system (else the GRPO comparison would mean nothing).
    assert len({run["completion_ids_checksum"] for run in grpo}) == 1


def test_preference_bench_on_cuda_without_a_gpu_says_so(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "preference.py"), "--device", "cuda", "--out", str(tmp_path / "x")]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "torch sees no CUDA device" in result.stderr
    assert not (tmp_path / "x").exists()
