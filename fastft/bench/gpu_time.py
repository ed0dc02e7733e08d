"""How busy one training step keeps the GPU: kernel time and kernel launches of one step under ``torch.profiler``.

A step whose GPU kernels add up to less than its wall time leaves the GPU waiting for the host (Python, dispatch,
launches). :func:`profile_step` runs one step under the profiler and :func:`summarise` reads its events: the sum of
the CUDA kernels' device time, how many kernels ran, and the copies and memsets apart (they run on copy engines, and
an offloading checkpointer's copies overlap the kernels, so they are not counted as busy time). The busy fraction is
that kernel time over the median wall time of the unprofiled steps: the profiler adds host time per launch, so the
profiled step's own wall time (kept as ``profiled_step_s``) would understate a launch-bound system more than others.

The worker loads this file by path in a competitor's venv, so it imports nothing of fastft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

_COPY_PREFIXES = ("memcpy", "memset")
# How many kernels (by device time) a profiled step records, and how much of each name.
TOP_KERNELS, TOP_NAME_CHARS = 25, 120


def summarise(events: Iterable[Any], step_s: float | None = None) -> dict[str, Any]:
    """Kernel time and counts from profiler entries (``prof.key_averages()`` or ``prof.events()``).

    Args:
        events: Entries with ``key`` (or ``name``), ``device_type`` (its ``name`` is ``"CUDA"`` for GPU work),
            ``count`` (1 when absent) and ``self_device_time_total`` (microseconds).
        step_s: The median wall time of an unprofiled step; with it the result has ``gpu_busy``.

    Returns:
        ``gpu_kernel_s``, ``kernel_launches``, ``copies`` (memcpy and memset count), ``copy_s``, ``top_kernels``
        (the ``TOP_KERNELS`` kernel names with the most device time: count and milliseconds), and ``gpu_busy``
        (kernel time over ``step_s``; above 1 only where kernels overlap on several streams).
    """
    kernel_us = copy_us = 0.0
    kernels = copies = 0
    spent_by_kernel: dict[str, list[float]] = {}
    for event in events:
        if getattr(getattr(event, "device_type", None), "name", None) != "CUDA":
            continue
        name = str(getattr(event, "key", None) or getattr(event, "name", "")).lower()
        count = int(getattr(event, "count", 1) or 1)
        spent = float(getattr(event, "self_device_time_total", 0.0) or 0.0)
        if name.startswith(_COPY_PREFIXES):
            copies, copy_us = copies + count, copy_us + spent
        else:
            kernels, kernel_us = kernels + count, kernel_us + spent
            entry = spent_by_kernel.setdefault(name[:TOP_NAME_CHARS], [0, 0.0])
            entry[0] += count
            entry[1] += spent
    # Where the GPU time goes, for the next GPU session to compare systems kernel by kernel.
    top = sorted(spent_by_kernel.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    summary = {
        "gpu_kernel_s": kernel_us / 1e6,
        "kernel_launches": kernels,
        "copies": copies,
        "copy_s": copy_us / 1e6,
        "top_kernels": [{"kernel": name, "count": int(count), "ms": spent / 1e3} for name, (count, spent) in top],
    }
    if step_s:
        summary["gpu_busy"] = summary["gpu_kernel_s"] / step_s
    return summary


def profile_step(step: Callable[[], Any], step_s: float | None = None, trace_path: str | None = None) -> dict[str, Any]:
    """Run ``step`` once under ``torch.profiler`` (CPU and CUDA activity) and :func:`summarise` it.

    Args:
        step: One training step (forward, backward, zero_grad) on a CUDA model.
        step_s: The median wall time of the unprofiled steps (for ``gpu_busy``).
        trace_path: Where to write the step's Chrome trace (gzipped when it ends in ``.gz``), the timeline that
            shows where the GPU waits for the host; None writes none.

    Returns:
        :func:`summarise`'s fields and ``profiled_step_s``.

    Raises:
        RuntimeError: torch sees no CUDA device (the figures mean nothing for a CPU step).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("fastft.bench.gpu_time.profile_step: torch sees no CUDA device; profile GPU steps only")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        profiled = time.perf_counter() - begin
    if trace_path:
        profiler.export_chrome_trace(trace_path)
    return {**summarise(profiler.key_averages(), step_s), "profiled_step_s": profiled}


__all__ = ["profile_step", "summarise"]
