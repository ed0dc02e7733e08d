"""The first H100 results (bench/results/h100-2026-11-25/), checked against the schema that wrote them and against
the tables of their README (bench/results/h100-2026-11-25/README.md).

They live in a folder of their own, not beside the current results: `fastft bench`, bench/lora.py and
bench/kernels.py of main 36b0bdd wrote them, and issue 29 changes the harness's record (checkpointing modes, GPU
busy fraction and launches per step, a GQA-safe FLOP count), so they are validated here as what they are, the
36b0bdd record, and tests of the current schema need not bend to them. Each table row of that README
is built again here from the JSON, so a row that does not match its file fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "bench" / "results" / "h100-2026-11-25"
README = (FOLDER / "README.md").read_text()
DEVICE = "NVIDIA H100 80GB HBM3"
GIB = 1 << 30
HARNESS = {
    "own-systems": "bench-nvidia-h100-80gb-hbm3-own-systems.json",
    "competitors": "bench-nvidia-h100-80gb-hbm3-competitors.json",
    "nf4": "bench-nvidia-h100-80gb-hbm3-nf4.json",
}
LORA = "lora-nvidia-h100-80gb-hbm3-llama-3.2-1b.json"
KERNELS = "kernels-nvidia-h100-80gb-hbm3-bf16.json"
MEASURED = ("step_s", "tokens_per_s", "loss", "saved_bytes", "peak_vram_bytes", "lora_checksum", "input_checksum")


def _load(name: str) -> dict:
    return json.loads((FOLDER / name).read_text())


def step_row(run: str, row: dict) -> str:
    """A README row of the step table: run, system, step s, tokens/s, peak VRAM GiB, saved for backward GiB, loss."""
    return (
        f"| {run} | {row['system']} | {row['step_s']:.4f} | {row['tokens_per_s']:,.0f} | "
        f"{row['peak_vram_bytes'] / GIB:.2f} | {row['saved_bytes'] / GIB:.2f} | {row['loss']:.5f} |"
    )


def lora_row(run: dict) -> str:
    """A README row of the LoRA groups table (milliseconds per forward + backward of the group)."""
    ms, ratios = run["ms"], run["ratios"]
    in_kernel = f"{ms['nf4_in_kernel']:.2f}" if "nf4_in_kernel" in ms else "-"
    return (
        f"| {run['group']} | {run['weights']} | {ms['cublas']:.2f} | {ms['triton']:.2f} | {ms['auto']:.2f} | "
        f"{ms['peft']:.2f} | {ms['floor']:.2f} | {ratios['auto_over_floor']:.1f} | {in_kernel} |"
    )


def kernel_row(row: dict) -> str:
    """A README row of the kernels table."""
    return (
        f"| {row['kernel']} | {row['fastft_ms']:.3f} | {row['eager_ms']:.3f} | {row['speedup']:.2f} | "
        f"{row['fastft_saved_bytes'] / (1 << 20):.1f} | {row['eager_saved_bytes'] / (1 << 20):.1f} |"
    )


@pytest.mark.parametrize("kind", sorted(HARNESS))
def test_each_harness_record_has_the_36b0bdd_schema_and_explains_every_missing_row(kind):
    record = _load(HARNESS[kind])
    assert record["benchmark"] == "fastft bench" and record["device"] == DEVICE
    assert record["harness_versions"]["torch"] == "2.11.0" and record["harness_versions"]["transformers"] == "5.17.0"
    assert record["matmul_flops_per_s"]["bfloat16"] > 7e14
    workloads = {workload["name"] for workload in record["settings"]["workloads"]}
    for row in record["summary"]:
        assert row["workload"] in workloads
        if row["runs"]:
            assert all(row[key] is not None for key in MEASURED), row
            # Every system of a run trained the same tokens with the same LoRA weights.
            assert row["adapters"] == 112
        else:
            assert row["failed"], row
    checksums = {(row["input_checksum"], row["lora_checksum"]) for row in record["summary"] if row["runs"]}
    assert len(checksums) == 1
    # The baseline's first process of each run died in torch's FLOP count (GQA sdpa), which is why two of the three
    # tables have no transformers+peft row and this one has only round 2's.
    (died,) = [run for run in record["runs"] if "error" in run]
    assert died["system"] == "transformers+peft" and died["round"] == 0
    assert "sdpa_flop_count: query/key/value shapes are incompatible" in died["output_tail"][-1]
    baseline = next(row for row in record["summary"] if row["system"] == "transformers+peft")
    assert baseline["runs"] == (1 if kind == "own-systems" else 0)


@pytest.mark.parametrize("kind", sorted(HARNESS))
def test_the_readme_quotes_each_measured_row_of_the_harness_records(kind):
    for row in _load(HARNESS[kind])["summary"]:
        if row["runs"]:
            assert step_row(kind, row) in README, step_row(kind, row)
        else:
            assert f"| {kind} | {row['system']} |" not in README


def test_the_readme_quotes_the_lora_groups_and_the_kernels():
    lora = _load(LORA)
    assert lora["benchmark"] == "lora_groups" and lora["device"] == DEVICE and lora["settings"]["repeats"] == 15
    assert {(run["group"], run["weights"]) for run in lora["runs"]} == {
        (group, weights) for group in ("qkv", "o", "mlp") for weights in ("bf16", "nf4")
    }
    for run in lora["runs"]:
        assert lora_row(run) in README, lora_row(run)
        if run["weights"] == "nf4":
            # The buffer path beat decoding inside the GEMM on every group (DESIGN.md).
            assert run["nf4_decode"]["faster"] == "buffer"
    kernels = _load(KERNELS)
    assert kernels["device"] == DEVICE and kernels["dtype"] == "bfloat16" and kernels["fastft_path"] == "triton"
    for row in kernels["rows"]:
        assert kernel_row(row) in README, kernel_row(row)


def test_the_readme_no_longer_says_no_gpu_was_measured():
    bench_readme = (ROOT / "bench" / "README.md").read_text()
    for text in (bench_readme, README):
        assert "no session has had a GPU" not in text and "no session so far has had a GPU" not in text.lower()
    assert "main 36b0bdd" in bench_readme and "results/h100-2026-11-25/README.md" in bench_readme
    assert "main 36b0bdd" in README
