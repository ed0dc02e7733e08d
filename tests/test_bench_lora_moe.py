"""bench/lora.py's moe group: a Qwen3-MoE layer's experts with LoRA on every expert, fastft's fused experts against
stock transformers + peft (eager loop and grouped_mm) and the bare grouped GEMMs, on CPU at the tiny shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LORA_GRADS = {f"grad_{p}.lora_{m}" for p in ("gate_up_proj", "down_proj") for m in ("A", "B")}


def test_moe_group_times_fastft_against_peft_and_grouped_mm_and_agrees_with_float64(tmp_path):
    output = tmp_path / "lora.json"
    env = dict(os.environ, TRITON_INTERPRET="0", FASTFT_CACHE_DIR=str(tmp_path / "cache"))
    command = [sys.executable, str(ROOT / "bench" / "lora.py"), "--device", "cpu", "--shapes", "tiny"]
    command += ["--groups", "moe", "--dtypes", "fp32", "nf4", "--tokens", "64", "--repeats", "2", "--warmup", "1"]
    command += ["--systems", "cublas", "auto", "peft", "grouped_mm", "floor", "--out", str(output)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(output.read_text())
    # No NF4 experts: the moe group runs for the dense format only.
    [run] = record["runs"]
    assert (run["shape"], run["group"], run["weights"]) == ("tiny", "moe", "fp32")
    assert run["projections"] == ["gate_up_proj", "down_proj"]
    assert run["peft_layer"] == "peft.tuners.lora.layer.ParamWrapper"
    # The experts' grouped GEMMs have no cuBLAS-or-Triton choice: cublas is not a separate system for them.
    systems = {"auto", "peft", "grouped_mm", "floor"}
    assert set(run["ms"]) == set(run["samples_ms"]) == systems
    assert all(len(run["samples_ms"][system]) == 2 and run["ms"][system] > 0 for system in systems)
    dims, rows = run["dims"], 64 * 2
    assert (dims["experts"], dims["top_k"], dims["moe_intermediate"], dims["tokens"]) == (8, 2, 64, 64)
    hidden, inner = dims["hidden"], dims["moe_intermediate"]
    assert run["base_flops"] == 2 * 2 * rows * (2 * inner * hidden + hidden * inner)
    notes = run["notes"]
    assert notes["experts_implementation"] == {"peft": "eager", "grouped_mm": "grouped_mm"}
    assert notes["routed_rows"] == rows and 1 <= notes["experts_with_tokens"] <= 8
    ratios = run["ratios"]
    assert ratios["grouped_mm_over_auto"] == run["ms"]["grouped_mm"] / run["ms"]["auto"]
    assert ratios["peft_over_auto"] == run["ms"]["peft"] / run["ms"]["auto"]
    targets = {target["target"]: target for target in run["targets"]}
    assert set(targets) == {"grouped_mm >= auto x 1.5"} and targets["grouped_mm >= auto x 1.5"]["met"] is None
    # Every system against peft's eager experts and a float64 expert-by-expert computation: outputs, dX, A and B.
    assert set(run["correctness"]) == {"auto_vs_peft", "auto_vs_float64", "peft_vs_float64", "grouped_mm_vs_float64"}
    for pair, errors in run["correctness"].items():
        assert set(errors["per_tensor"]) == {"output", "grad_x", *LORA_GRADS}
        assert errors["max"] < 1e-4, (pair, errors)
    saved = run["saved_for_backward_bytes"]
    assert saved["floor"] == 0 and 0 < saved["auto"] < saved["peft"]
    assert run["memory"] == {system: None for system in systems}
    row = [line for line in result.stdout.splitlines() if line.split()[:3] == ["tiny", "moe", "fp32"]]
    assert len(row) == 1 and f"{run['ms']['grouped_mm']:.3f}" in row[0]
