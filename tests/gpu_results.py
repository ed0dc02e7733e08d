"""What the tests of committed GPU results share: a results README's row for a `fastft bench` summary row, and the
bench scripts (`bench/kernel_diff.py`, `bench/gpu_gaps.py`), which live outside the package, loaded by path."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from fastft.bench.report import _mode_label

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def record(folder: Path, run: str) -> dict:
    """The JSON `fastft bench` wrote for one run (group) of an H100 session."""
    return json.loads((folder / f"bench-nvidia-h100-80gb-hbm3-{run}.json").read_text())


def readme_line(run: str, row: dict) -> str:
    """The results README's table row for one summary row: run, system, mode, step, tokens/s, peak VRAM, GPU busy,
    kernel time, launches and the same-mode ratio to Unsloth."""
    speed = row.get("same_mode_speed")
    return (
        f"| {run} | {row['system']} | {_mode_label(row['mode'])} | {row['step_s']:.4f} | {row['tokens_per_s']:,.0f} | "
        f"{row['peak_vram_bytes'] / GIB:.2f} | {row['gpu_busy']:.0%} | {row['gpu_kernel_s']:.4f} | "
        f"{row['kernel_launches']} | {'–' if speed is None else f'{speed:.3f}'} |"
    ).replace("%", " %")


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
