"""bench/lora.py runs end to end on CPU (tiny shape) and writes the record a README table would be built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = {"fused", "peft", "floor"}
LORA_GRADS = {f"grad_{p}.lora_{m}" for p in ("q_proj", "k_proj", "v_proj") for m in ("A", "B")}


def _run_bench(tmp_path: Path, interpret: bool, tokens: int, repeats: int, *extra: str) -> tuple[dict, str]:
    output = tmp_path / "lora.json"
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    command = [
        sys.executable,
        str(ROOT / "bench" / "lora.py"),
        "--device",
        "cpu",
        "--shapes",
        "tiny",
        "--dtypes",
        "fp32",
        "nf4",
        "--tokens",
        str(tokens),
        "--repeats",
        str(repeats),
        "--out",
        str(output),
        *extra,
    ]
    # cwd is elsewhere on purpose: the script must find fastft and bitsandbytes whatever directory it is started from.
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(output.read_text()), result.stdout


def _check_record(record: dict, stdout: str, path: str, tokens: int, repeats: int) -> None:
    assert record["benchmark"] == "lora_qkv"
    assert record["device_type"] == "cpu" and record["device"].startswith("cpu")
    for name in ("torch", "triton", "peft", "bitsandbytes"):
        assert record["versions"][name], name
    assert record["settings"]["repeats"] == repeats and record["settings"]["order"] == ["fused", "peft", "floor"]
    runs = {run["weights"]: run for run in record["runs"]}
    assert set(runs) == {"fp32", "nf4"}
    table = stdout.splitlines()
    assert any(line.split()[:4] == ["shape", "weights", "fused", "ms"] for line in table), stdout
    for weights, run in runs.items():
        assert run["shape"] == "tiny" and run["dims"]["tokens"] == tokens
        assert run["compute_dtype"] == "float32" and run["fastft_path"] == path
        expected_systems = SYSTEMS | ({"fused_nf4_decoded_in_kernel"} if weights == "nf4" else set())
        assert set(run["ms"]) == expected_systems
        if weights == "nf4":
            decode = run["nf4_decode"]
            assert decode["buffer_ms"] == run["ms"]["fused"] and decode["in_kernel_ms"] > 0
            assert decode["faster"] in ("buffer", "in_kernel")
            assert decode["in_kernel_vs_buffer_relative_error"] < 1e-5
        # peft's own QLoRA layer for a 4-bit base, as under transformers' load_in_4bit; lora.Linear for a dense one.
        expected_layer = "peft.tuners.lora.bnb.Linear4bit" if weights == "nf4" else "peft.tuners.lora.layer.Linear"
        assert run["peft_layer"] == expected_layer
        for system in SYSTEMS:
            assert len(run["samples_ms"][system]) == repeats
            assert all(ms > 0 for ms in run["samples_ms"][system]), (weights, system)
            assert run["ms"][system] > 0 and run["base_tflop_per_s"][system] > 0
        assert run["fused_over_floor"] == run["ms"]["fused"] / run["ms"]["floor"]
        assert run["peft_over_fused"] == run["ms"]["peft"] / run["ms"]["fused"]
        # No GPU: no allocator peak, and no claim about the GPU targets either way.
        assert run["memory"] == {system: None for system in SYSTEMS}
        assert run["meets_targets"] is None
        # fastft keeps only X Aᵀ (tokens × 3 r, fp32) beyond the inputs; the frozen base GEMM keeps nothing extra.
        rank = run["dims"]["rank"]
        assert run["saved_for_backward_bytes"]["fused"] == tokens * 3 * rank * 4
        assert run["saved_for_backward_bytes"]["floor"] == 0
        for pair in ("fused_vs_peft", "fused_vs_float64", "peft_vs_float64"):
            errors = run["correctness"][pair]
            assert set(errors["per_tensor"]) == {"output", "grad_x", *LORA_GRADS}
            assert errors["max"] < 1e-4, (weights, pair, errors)
        row = [line for line in table if line.split()[:2] == ["tiny", weights]]
        assert len(row) == 1, stdout
        assert f"{run['ms']['fused']:.3f}" in row[0] and f"{run['ms']['peft']:.3f}" in row[0]


def test_lora_bench_cpu_reference_writes_json(tmp_path):
    # The torch reference path, what fastft runs on CPU; the harness and its correctness check are under test.
    record, stdout = _run_bench(tmp_path, False, 256, 3)
    _check_record(record, stdout, "reference", 256, 3)


def test_lora_bench_through_triton_interpreter(tmp_path):
    # The same harness with the Triton kernels run by the interpreter: what the GPU run will time, checked for
    # agreement with peft (the times themselves measure the interpreter and mean nothing).
    record, stdout = _run_bench(tmp_path, True, 64, 1, "--warmup", "0")
    _check_record(record, stdout, "triton", 64, 1)
