"""bench/moe_memory.py: the harness runs on a small shape, agrees with transformers + peft and keeps its target."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "moe_memory.py"


def _bench():
    spec = importlib.util.spec_from_file_location("_moe_memory_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_a_record_that_agrees_and_saves_under_half(tmp_path):
    out = tmp_path / "moe.json"
    assert _bench().main(["--quick", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    stock, ours = (record["systems"][name]["saved_bytes"] for name in ("transformers+peft", "fastft"))
    assert 0 < ours < stock and record["saved_bytes_ratio"] == ours / stock
    assert record["agree"] and record["lora_grads_compared"] == 4
    assert record["target"]["met"] == (record["saved_bytes_ratio"] <= 0.5)


def test_committed_record_meets_the_target():
    record = json.loads((BENCH.parent / "results" / "moe-memory-cpu.json").read_text())
    assert record["agree"] and record["target"]["met"] and record["saved_bytes_ratio"] <= 0.5
    assert record["settings"]["shape"]["num_experts"] == 32 and record["settings"]["tokens"] == 512
