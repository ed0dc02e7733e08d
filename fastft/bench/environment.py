"""What a run was measured on: installed library versions and the device, in words (for logs and benchmark JSON)."""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import torch


def package_version(name: str) -> str | None:
    """The installed distribution version of ``name``, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """:func:`package_version` of each name, in order."""
    return {name: package_version(name) for name in names}


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, or what ``platform`` knows elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_device(device: torch.device, threads: int | None = None) -> str:
    """The GPU's name, or ``"cpu: <model> (<threads> threads)"`` (threads: torch's current count by default)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model()} ({threads if threads is not None else torch.get_num_threads()} threads)"


def device_slug(description: str) -> str:
    """A file-name part for a device: ``cpu`` for any :func:`describe_device` text of a CPU, else the name in lower
    case with every run of other characters turned into one dash (``"NVIDIA H100 80GB HBM3"`` ->
    ``"nvidia-h100-80gb-hbm3"``)."""
    if description.startswith("cpu"):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", description.lower()).strip("-")


__all__ = ["cpu_model", "describe_device", "device_slug", "package_version", "package_versions"]
