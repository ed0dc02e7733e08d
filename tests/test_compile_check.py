"""The static GPU check (python -m fastft.kernels.compile_check): every Triton kernel compiled for sm_75 / 80 / 86 /
89 / 90 without a GPU. CI fails here when a kernel change makes a selectable configuration spill, overrun shared
memory, lose its tensor-core instructions or its software pipeline, or leaves bench/results/compile.json stale.

The check compiles, so it runs in a subprocess without TRITON_INTERPRET (this test session interprets the kernels),
from outside the checkout (whose kernels/ folder would shadow the PyPI package bitsandbytes imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "bench" / "results" / "compile.json"
TARGETS = {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"}
GEMMS = {"_lora_gemm_kernel", "_lora_gemm_nf4_kernel"}


def _python(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    # Nor with the reference switch the test session sets: the check runs the Triton kernels' compiler.
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "FASTFT_DISABLE_TRITON")}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    folder = tmp_path_factory.mktemp("compile_check")
    output = folder / "compile.json"
    result = _python(["-m", "fastft.kernels.compile_check", "--quiet", "--output", str(output)], folder, 3000)
    assert output.exists(), f"no report written:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result, json.loads(output.read_text())


def test_every_kernel_compiles_for_every_target_without_spill_or_overrun(fresh):
    from fastft.kernels.compile_check import failures

    result, report = fresh
    assert failures(report) == [], result.stdout[-5000:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no compile failure, spill or shared-memory overrun" in result.stdout
    assert {record["target"] for record in report["binaries"]} == TARGETS
    for record in report["binaries"]:
        assert record["spill_bytes"] == 0, record
        assert record["shared_bytes"] <= report["targets"][record["target"]]["shared_bytes"], record


def test_every_selectable_gemm_uses_tensor_cores_and_is_pipelined(fresh):
    _, report = fresh
    gemms = [record for record in report["binaries"] if record["kernel"] in GEMMS]
    assert {record["target"] for record in gemms} == TARGETS - {"sm_75"}, "no Triton GEMM is selectable below 8.0"
    for record in gemms:
        if record["target"] == "sm_90":
            assert record["wgmma"] > 0, record
        else:
            assert record["mma"] > 0, record
        assert record["cp_async"] + record["tma"] > 0, record
    not_selectable = {(row["target"], row["dtype"]) for row in report["not_selectable"]}
    assert {("sm_75", "float16"), ("sm_75", "float32")} <= not_selectable
    assert {("sm_80", "float32"), ("sm_90", "float32")} <= not_selectable


def test_sm_75_runs_every_other_kernel_in_fp16(fresh):
    from fastft.kernels.compile_check import launched_kernels

    _, report = fresh
    binaries = {record["id"]: record for record in report["binaries"]}
    on_t4 = {case["kernel"] for case in report["cases"] if case["target"] == "sm_75" and case["dtype"] == "float16"}
    assert on_t4 == set(launched_kernels()) - GEMMS
    assert all(binaries[case["binary"]]["spill_bytes"] == 0 for case in report["cases"] if case["target"] == "sm_75")
    assert report["uncovered"] == {}


def _case_set(report: dict) -> set[tuple]:
    keys = ("target", "dtype", "model", "call", "rank", "candidate", "kernel")
    return {tuple(case.get(key) for key in keys) for case in report["cases"]}


def test_the_committed_report_is_the_current_one(fresh):
    from fastft.kernels.compile_check import failures

    _, report = fresh
    committed = json.loads(COMMITTED.read_text())
    stale = (
        "bench/results/compile.json is stale: run `python -m fastft.kernels.compile_check` from outside the checkout "
        "root (it writes the checkout's bench/results/compile.json) and commit it"
    )
    assert _case_set(committed) == _case_set(report), stale
    assert len(committed["binaries"]) == len(report["binaries"]), stale
    assert failures(committed) == []


PROBE = textwrap.dedent(
    """
    import json, torch
    from fastft.kernels import compile_check as cc

    def launch(capability, kernel, dtype=torch.bfloat16):
        for item in cc.record(capability, dtype, "SmolLM2-135M", cc.MODELS["SmolLM2-135M"], (16,)):
            if item.kernel == kernel:
                return item

    found = {}
    nf4 = launch(86, "_lora_gemm_nf4_kernel")
    nf4.kwargs["SCALE_PER_COLUMN"] = False  # one absmax per element: a 32 KB fp32 tile per stage
    found["overrun"] = cc.compile_launch(nf4, 86)["problems"]
    wide = launch(90, "_lora_gemm_kernel")
    wide.kwargs["BLOCK_N"] = 256
    found["spill"] = cc.compile_launch(wide, 90)["problems"]
    fp32 = launch(80, "_lora_gemm_kernel")
    fp32.args = tuple(cc.Pointer(torch.float32, a.address) if isinstance(a, cc.Pointer) else a for a in fp32.args)
    fp32.kwargs["PRECISION"] = "ieee"
    found["fp32"] = cc.compile_launch(fp32, 80)["problems"]
    odd = launch(80, "_lora_gemm_kernel")
    odd.args = tuple(576 + 2 if a == 576 else a for a in odd.args)  # K no longer a multiple of 16
    found["unaligned"] = cc.compile_launch(odd, 80)["problems"]
    print(json.dumps(found))
    """
)


def test_the_check_fails_an_overrun_a_spill_a_dot_without_tensor_cores_and_an_unpipelined_gemm(tmp_path):
    result = _python(["-c", PROBE], tmp_path, 600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert any("shared memory, sm_86 allows 101376" in p for p in found["overrun"]), found
    assert any(p.startswith("spills") for p in found["spill"]), found
    assert "tl.dot without tensor-core instructions (no mma / wgmma)" in found["fp32"], found
    assert any("not software-pipelined" in p for p in found["unaligned"]), found
