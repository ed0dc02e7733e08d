"""Where two systems' GPU time goes, kernel class by kernel class, from the ``top_kernels`` a `fastft bench` run on
a GPU records for each system (the 25 kernels that took the most device time in its profiled step).

    python bench/kernel_diff.py bench/results/h100-2026-11-26b/bench-nvidia-h100-80gb-hbm3-none.json fastft unsloth-nogc

Kernels are grouped by what they compute, whoever wrote them (cuBLAS, cuDNN, aten, fastft's or Unsloth's Triton,
Inductor), so the two columns compare the same work; the time outside the top 25 is its own row, so each column sums
to the system's ``gpu_kernel_s``. This is what issue 28 needs to pick the next kernel to cut.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# First match wins; the patterns are the kernel names the H100 runs produced (cuBLAS's nvjet / xmma / cutlass, cuDNN's
# attention, aten's elementwise kernels, fastft's and Unsloth's Triton kernels, Inductor's fused kernels).
CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Unsloth's fused cross-entropy kernels are _fl_flash_p_kernel and _fl_partial_kernel: before attention's "flash".
    ("cross-entropy", re.compile(r"cross_entropy|_fl_|softmax", re.I)),
    ("attention (cuDNN SDPA)", re.compile(r"sdpa|cudnn|flash", re.I)),
    ("SwiGLU", re.compile(r"_gate_(forward|backward)_kernel|_fg_kernel|_dwf|sigmoid|silu", re.I)),
    ("RMSNorm", re.compile(r"rms|layernorm|pow_sum", re.I)),
    ("RoPE", re.compile(r"rope", re.I)),
    ("GEMM, bf16 out (cuBLAS)", re.compile(r"nvjet_sm\d+_tst|s16816gemm", re.I)),
    ("GEMM, fp32 out (cuBLAS)", re.compile(r"nvjet_sm\d+_tss|xmma_gemm_f32", re.I)),
    ("copies and casts (aten)", re.compile(r"copy|cat", re.I)),
    ("other elementwise (aten)", re.compile(r"elementwise|triton_poi", re.I)),
)
OTHER = "other kernels in the top 25"
REST = "outside the top 25"


def classify(kernel: str) -> str:
    """The class of a kernel name (:data:`CLASSES`), or :data:`OTHER`."""
    for name, pattern in CLASSES:
        if pattern.search(kernel):
            return name
    return OTHER


def breakdown(run: dict) -> dict[str, tuple[int, float]]:
    """Launches and milliseconds per class for one run of a bench JSON (a ``runs`` entry)."""
    if "top_kernels" not in run:
        raise ValueError(
            f"bench/kernel_diff.py: the run of {run.get('system')!r} has no top_kernels (a CPU run, or one made "
            "before the harness recorded them); rerun it on a GPU."
        )
    classes: dict[str, tuple[int, float]] = {}
    for kernel in run["top_kernels"]:
        count, ms = classes.get(classify(kernel["kernel"]), (0, 0.0))
        classes[classify(kernel["kernel"])] = (count + kernel["count"], ms + kernel["ms"])
    listed = sum(ms for _, ms in classes.values())
    classes[REST] = (
        run["kernel_launches"] - sum(count for count, _ in classes.values()),
        run["gpu_kernel_s"] * 1e3 - listed,
    )
    return classes


def table(record: dict, first: str, second: str) -> str:
    """A Markdown table of ``first``'s and ``second``'s GPU milliseconds per class, and the difference."""
    runs = {run["system"]: run for run in record["runs"]}
    missing = [name for name in (first, second) if name not in runs]
    if missing:
        raise ValueError(f"bench/kernel_diff.py: no run of {missing} in this file; it has {sorted(runs)}.")
    a, b = breakdown(runs[first]), breakdown(runs[second])
    names = [name for name, _ in CLASSES] + [OTHER, REST]
    lines = [
        f"| kernel class | {first} ms | {first} launches | {second} ms | {second} launches | difference ms |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name in names:
        if name not in a and name not in b:
            continue
        (ca, ma), (cb, mb) = a.get(name, (0, 0.0)), b.get(name, (0, 0.0))
        lines.append(f"| {name} | {ma:.2f} | {ca} | {mb:.2f} | {cb} | {ma - mb:+.2f} |")
    total_a, total_b = runs[first]["gpu_kernel_s"] * 1e3, runs[second]["gpu_kernel_s"] * 1e3
    lines.append(
        f"| **all kernels** | {total_a:.2f} | {runs[first]['kernel_launches']} | {total_b:.2f} | "
        f"{runs[second]['kernel_launches']} | {total_a - total_b:+.2f} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="a `fastft bench` JSON from a GPU run")
    parser.add_argument("first", help="system name, e.g. fastft")
    parser.add_argument("second", help="system name, e.g. unsloth-nogc")
    args = parser.parse_args(argv)
    print(table(json.loads(args.json.read_text()), args.first, args.second))
    return 0


if __name__ == "__main__":
    sys.exit(main())
