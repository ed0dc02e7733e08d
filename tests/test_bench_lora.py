"""bench/lora.py runs end to end on CPU (tiny shape) and writes the record a README table would be built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "mlp": ("gate_proj", "up_proj", "down_proj")}
# The tuner's groups each fused function asks it about.
TUNER_GROUPS = {"qkv": {"qkv"}, "o": {"o"}, "mlp": {"gate_up", "down"}}


def _lora_grads(group: str) -> set[str]:
    return {f"grad_{p}.lora_{m}" for p in PROJECTIONS[group] for m in ("A", "B")}


def _run_bench(tmp_path: Path, interpret: bool, *args: str) -> tuple[dict, str]:
    output = tmp_path / "lora.json"
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0", FASTFT_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("FASTFT_GEMM", None)
    env.pop("FASTFT_NF4_DEQUANT", None)
    command = [sys.executable, str(ROOT / "bench" / "lora.py"), "--device", "cpu", "--shapes", "tiny"]
    command += [*args, "--out", str(output)]
    # cwd is elsewhere on purpose: the script must find fastft and bitsandbytes whatever directory it is started from.
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(output.read_text()), result.stdout


def _check_record(
    record: dict, stdout: str, *, path: str, tokens: int, repeats: int, systems: list[str], formats: tuple[str, ...]
) -> None:
    assert record["benchmark"] == "lora_groups"
    assert record["device_type"] == "cpu" and record["device"].startswith("cpu")
    for name in ("torch", "triton", "peft", "bitsandbytes", "fastft"):
        assert record["versions"][name], name
    assert record["settings"]["repeats"] == repeats and record["settings"]["order"] == systems
    gemm = record["gemm"]
    assert gemm["cache_file"].endswith(".json") and gemm["cache_existed_before"] is False
    table = stdout.splitlines()
    assert any(line.split()[:4] == ["shape", "group", "weights", "cublas"] for line in table), stdout
    fastft_systems = [system for system in systems if system in ("cublas", "triton", "auto")]
    groups = record["settings"]["groups"]
    runs = {(run["group"], run["weights"]): run for run in record["runs"]}
    assert set(runs) == {(group, weights) for group in groups for weights in formats}
    for (group, weights), run in runs.items():
        assert run["shape"] == "tiny" and run["dims"]["tokens"] == tokens
        assert run["projections"] == list(PROJECTIONS[group])
        assert run["compute_dtype"] == "float32" and run["fastft_path"] == path
        decode_base = next(s for s in ("triton", "auto") if s in systems)
        timed = set(systems) | ({"nf4_in_kernel"} if weights == "nf4" else set())
        assert set(run["ms"]) == set(run["samples_ms"]) == timed
        for system in timed:
            assert len(run["samples_ms"][system]) == repeats
            assert all(ms > 0 for ms in run["samples_ms"][system]), (group, weights, system)
            assert run["ms"][system] > 0 and run["base_tflop_per_s"][system] > 0
        if weights == "nf4":
            decode = run["nf4_decode"]
            assert decode["buffer_system"] == decode_base and decode["buffer_ms"] == run["ms"][decode_base]
            assert decode["in_kernel_ms"] == run["ms"]["nf4_in_kernel"] and decode["faster"] in ("buffer", "in_kernel")
            assert decode["in_kernel_vs_buffer_relative_error"] < 1e-5
        else:
            assert "nf4_decode" not in run
        # peft's own QLoRA layer for a 4-bit base, as under transformers' load_in_4bit; lora.Linear for a dense one.
        expected_layer = "peft.tuners.lora.bnb.Linear4bit" if weights == "nf4" else "peft.tuners.lora.layer.Linear"
        assert run["peft_layer"] == expected_layer

        # Every fastft system's GEMM choices, from a clean slate each, for exactly this group's tuner groups.
        assert set(run["gemm_choices"]) == {s for s in timed if s not in ("peft", "floor")}
        for system, made in run["gemm_choices"].items():
            assert made["first_call_s"] > 0
            assert {choice["group"] for choice in made["choices"]} == TUNER_GROUPS[group], (system, made)
            assert run["gemm_paths"][system] == sorted({choice["path"] for choice in made["choices"]})

        ms, ratios = run["ms"], run["ratios"]
        for system in (*fastft_systems, "peft"):
            assert ratios[f"{system}_over_floor"] == ms[system] / ms["floor"]
        for system in fastft_systems:
            assert ratios[f"peft_over_{system}"] == ms["peft"] / ms[system]
        if "cublas" in systems:
            assert ratios["auto_over_cublas"] == ms["auto"] / ms["cublas"]
            assert run["auto_over_cublas_noise"] >= 0.01
        else:
            assert "auto_over_cublas" not in ratios and run["auto_over_cublas_noise"] is None
        # No GPU: no allocator peak, and no claim about the GPU targets either way.
        assert run["memory"] == {system: None for system in timed}
        names = {target["target"] for target in run["targets"]}
        assert ("auto <= cublas x (1 + noise)" in names) == ("cublas" in systems)
        assert ("auto <= floor x 1.15" in names) == (group == "qkv")
        assert all(target["met"] is None for target in run["targets"])

        # fastft keeps X Aᵀ (tokens × Σ r, fp32) beyond the inputs, and for the MLP the gate and up outputs; the
        # frozen base GEMMs keep nothing extra.
        rank, intermediate = run["dims"]["rank"], run["dims"]["intermediate"]
        expected_saved = {"qkv": 3 * rank, "o": rank, "mlp": 3 * rank + 2 * intermediate}[group] * tokens * 4
        for system in fastft_systems:
            assert run["saved_for_backward_bytes"][system] == expected_saved, (group, system)
        assert run["saved_for_backward_bytes"]["floor"] == 0
        pairs = {f"{s}_vs_{ref}" for s in fastft_systems for ref in ("peft", "float64")} | {"peft_vs_float64"}
        assert set(run["correctness"]) == pairs
        for pair, errors in run["correctness"].items():
            assert set(errors["per_tensor"]) == {"output", "grad_x", *_lora_grads(group)}
            assert errors["max"] < 1e-4, (group, weights, pair, errors)
        row = [line for line in table if line.split()[:3] == ["tiny", group, weights]]
        assert len(row) == 1, stdout
        assert f"{ms['auto']:.3f}" in row[0] and f"{ms['peft']:.3f}" in row[0]

    # The record-level list of choices is every row's, labelled with the system that made it.
    assert len(gemm["choices"]) == sum(len(m["choices"]) for run in runs.values() for m in run["gemm_choices"].values())
    assert {choice["system"] for choice in gemm["choices"]} == set(runs[(groups[0], formats[-1])]["gemm_choices"])
    assert len(record["summary"]) == sum(len(run["targets"]) for run in runs.values())


def test_lora_bench_cpu_reference_writes_json(tmp_path):
    # The default CPU run: the torch reference path, what fastft runs on CPU, for the qkv group; the harness and its
    # correctness check are under test.
    record, stdout = _run_bench(tmp_path, False, "--dtypes", "fp32", "nf4", "--tokens", "256", "--repeats", "3")
    assert record["settings"]["groups"] == ["qkv"]
    systems = ["auto", "peft", "floor"]
    _check_record(record, stdout, path="reference", tokens=256, repeats=3, systems=systems, formats=("fp32", "nf4"))
    for run in record["runs"]:
        # On CPU tensors the tuner has nothing to choose: torch's matmul, which it calls the cuBLAS path.
        assert run["gemm_paths"] == {system: ["cublas"] for system in run["gemm_choices"]}


@pytest.mark.interpreted
def test_lora_bench_every_system_and_group_through_triton_interpreter(tmp_path):
    # Every system and group, the Triton kernels run by the interpreter: what the GPU run will time, checked for
    # agreement with peft (the times themselves measure the interpreter and mean nothing). NF4 alone: its "triton"
    # decodes into the buffer and runs the dense kernel, so both kernels run, and the interpreter is slow.
    systems = ["cublas", "triton", "auto", "peft", "floor"]
    args = ["--dtypes", "nf4", "--tokens", "32", "--repeats", "1", "--warmup", "0", "--groups", "qkv", "o", "mlp"]
    record, stdout = _run_bench(tmp_path, True, *args, "--systems", *systems)
    _check_record(record, stdout, path="triton", tokens=32, repeats=1, systems=systems, formats=("nf4",))
    for run in record["runs"]:
        paths = run["gemm_paths"]
        assert paths["cublas"] == ["cublas"] and paths["triton"] == ["triton"] and paths["auto"] == ["triton"]
        assert paths["nf4_in_kernel"] == ["triton-nf4"]


def test_lora_bench_tune_only_records_every_groups_choice(tmp_path):
    output = tmp_path / "tuner.json"
    env = dict(os.environ, TRITON_INTERPRET="0", FASTFT_CACHE_DIR=str(tmp_path / "cache"))
    command = [sys.executable, str(ROOT / "bench" / "lora.py"), "--tune-only", "--device", "cpu", "--shapes", "tiny"]
    command += ["--dtypes", "fp32", "--groups", "qkv", "o", "mlp", "--tokens", "64", "--out", str(output)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(output.read_text())
    assert record["benchmark"] == "gemm_tuning" and record["device_type"] == "cpu"
    assert record["gemm"]["cache_file"].startswith(str(tmp_path / "cache"))
    assert [(run["group"], run["weights"], run["tokens"]) for run in record["runs"]] == [
        ("qkv", "fp32", 64),
        ("o", "fp32", 64),
        ("mlp", "fp32", 64),
    ]
    assert all(run["s"] > 0 for run in record["runs"])
    assert {choice["group"] for choice in record["choices"]} == {"qkv", "o", "gate_up", "down"}
    assert all(choice["path"] == "cublas" and choice["dtype"] == "float32" for choice in record["choices"])
