"""bench/lora_step.py runs end to end on a tiny Llama and writes the record its acceptance figures come from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = {"transformers+peft", "fastft"}


def test_lora_step_bench_tiny_run_writes_json(tmp_path, tiny_llama_dir):
    output = tmp_path / "lora-step.json"
    # conftest turns the Triton interpreter on for the kernel tests; the script must drop it itself (else fastft's
    # CPU path would be the interpreter), so it is left on here on purpose.
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, str(ROOT / "bench" / "lora_step.py"), "--model", str(tiny_llama_dir)]
    command += ["--seq", "32", "--batch", "2", "--repeats", "2", "--out", str(output)]
    # cwd elsewhere: the script must find fastft and bitsandbytes whatever directory it is started from.
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(output.read_text())

    assert record["benchmark"] == "lora_step" and record["device_type"] == "cpu"
    assert record["fastft_path"] == "reference" and record["triton_interpret_removed"] is True
    assert record["threads"] >= 1 and record["device"].startswith("cpu")
    for name in ("torch", "transformers", "peft", "fastft"):
        assert record["versions"][name], name
    settings = record["settings"]
    assert (settings["batch"], settings["seq"], settings["tokens"], settings["repeats"]) == (2, 32, 64, 2)
    assert settings["order"] == ["transformers+peft", "fastft"] and settings["dtype"] == "float32"
    layers = record["model"]["layers"]
    assert layers == 2
    # q, k, v, o, gate, up, down: an A and a B each, per layer, copied from fastft's model into peft's
    assert settings["lora_tensors"] == 7 * 2 * layers

    losses = record["losses"]
    assert losses["agree"] and losses["relative_difference"] < 1e-4, losses
    assert losses["lora_grad_relative_error"] < 1e-4, losses
    assert losses["transformers+peft"] > 0

    systems = record["systems"]
    assert set(systems) == SYSTEMS
    for name, row in systems.items():
        assert len(row["step_s"]) == len(row["step_cpu_s"]) == 2 and all(t > 0 for t in row["step_s"]), name
        assert row["saved_bytes"] > 0 and row["saved_bytes_raw"] >= row["saved_storages"] > 0, name
        assert row["rss"]["peak_rss_bytes"] >= row["rss"]["rss_after_load_bytes"] > 0, name
        assert name in result.stdout
    peft, fastft = systems["transformers+peft"], systems["fastft"]
    assert fastft["saved_bytes"] < peft["saved_bytes"], (fastft["saved_bytes"], peft["saved_bytes"])
    # A Llama layer whose parts are all fused is one node (its q / k / v, o and MLP inside).
    assert fastft["fused_nodes"] == {"LoRAQKV": 0, "LoRAO": 0, "LoRAMLP": 0, "LoRADecoderLayer": layers}
    assert peft["fused_nodes"] == {"LoRAQKV": 0, "LoRAO": 0, "LoRAMLP": 0, "LoRADecoderLayer": 0}
    patches = {row["name"]: row for row in fastft["patches"]}
    assert patches["llama.attention"]["status"] == "applied" and not patches["llama.attention"]["fallbacks"]

    ratios = record["ratios"]
    assert abs(ratios["step_time_fastft_over_peft"] - fastft["median_step_s"] / peft["median_step_s"]) < 1e-12
    assert abs(ratios["saved_bytes_fastft_over_peft"] - fastft["saved_bytes"] / peft["saved_bytes"]) < 1e-12
    assert record["acceptance"]["fewer_saved_bytes"] is True
