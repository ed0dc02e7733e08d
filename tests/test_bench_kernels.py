"""bench/kernels.py runs end to end (tiny shapes, CPU) and writes the record its README table is built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_bench_quick_run_writes_json(tmp_path):
    output = tmp_path / "kernels.json"
    # The reference path: timing the interpreter would measure numpy, and the harness is what is under test here.
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--device", "cpu", "--quick", "--output", str(output)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(output.read_text())
    assert record["device_type"] == "cpu" and record["fastft_path"] == "reference"
    assert record["ceilings"]["copy_gb_per_s"] > 0 and record["ceilings"]["matmul_tflop_per_s"] > 0
    rows = {row["kernel"]: row for row in record["rows"]}
    assert set(rows) == {
        "rms_norm",
        "rope",
        "swiglu",
        "fused_linear_cross_entropy",
        "fused_linear_cross_entropy_trained_head",
        # The quick shapes' 64 tokens fit one default chunk: only the half-height variant is shorter than the tokens.
        "fused_linear_cross_entropy_chunk32",
        "nf4_linear",
    }
    assert "GEMM height against logits memory" in rows["fused_linear_cross_entropy_chunk32"]["notes"]
    for name, row in rows.items():
        assert row["fastft_ms"] > 0 and row["eager_ms"] > 0, name
        assert row["relative_error_vs_eager"] < 1e-4, (name, row["relative_error_vs_eager"])
        assert name in result.stdout
    for name in ("fused_linear_cross_entropy", "fused_linear_cross_entropy_trained_head"):
        assert rows[name]["fastft_saved_bytes"] < rows[name]["eager_saved_bytes"], rows[name]
    assert rows["nf4_linear"]["dequant"]["bit_identical"]
