"""Measurements shared by tests and benchmarks: bytes autograd keeps for backward, peak RSS, FLOPs and matmul rate."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch


class SavedTensorBytes:
    """Count the bytes autograd saves for backward while the context is open.

    Every tensor packed for backward (``torch.autograd.graph.saved_tensors_hooks``) is counted once per storage, so
    two views of one buffer count once; tensors whose storage belongs to one of ``exclude`` (a model's parameters)
    are left out, because they exist whether or not anything is saved.

    Example::

        with SavedTensorBytes(model.parameters()) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        print(saved.bytes, saved.tensors)

    Args:
        exclude: Tensors (usually parameters and buffers) not to count.

    Attributes:
        bytes: Bytes of the distinct storages saved so far.
        raw_bytes: ``nbytes`` of every saved tensor, repeats included.
        tensors: How many tensors were packed (excluded ones not counted).
        excluded: How many packed tensors were left out because their storage is one of ``exclude``.
        storages: Storage address to its size in bytes.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        self.storages: dict[int, int] = {}
        self.raw_bytes = 0
        self.tensors = 0
        self.excluded = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._excluded:
            self.excluded += 1
        else:
            self.tensors += 1
            self.raw_bytes += tensor.nbytes
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedTensorBytes:
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, traceback)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def resident_bytes() -> int | None:
    """The process's resident set size now, in bytes (``None`` without ``/proc``)."""
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset the peak that :func:`peak_rss_bytes` reports to the current resident size, where the kernel allows it.

    Returns:
        Whether the peak now reads as the resident size (checked, since some kernels accept the write and ignore it).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    peak, resident = _status_bytes("VmHWM"), _status_bytes("VmRSS")
    # A little slack: pages touched between the two reads.
    return peak is not None and resident is not None and peak <= resident + (4 << 20)


def _status_bytes(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes.

    ``VmHWM`` from ``/proc/self/status`` where there is one (Linux; :func:`reset_peak_rss` resets it where the kernel
    allows), else ``getrusage``'s ``ru_maxrss``. Either may start at the size the parent had when it started this
    process (``ru_maxrss`` always does), so measure growth from a known point, or in a process started by a small
    one.
    """
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def count_flops(work: Callable[[], Any]) -> int:
    """The floating-point operations ``torch.utils.flop_counter.FlopCounterMode`` attributes to ``work()``.

    Only aten operators are seen (matmuls, convolutions, attention): a Triton kernel launched directly counts nothing,
    so compare systems with the FLOPs of one that runs on aten operators.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        work()
    return counter.get_total_flops()


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """The dense matmul rate this device reaches, in FLOP/s: the median of ``repeats`` timed square matmuls.

    Args:
        device: Where to measure.
        dtype: The operands' dtype.
        size: The side of the square matrices (default 8192 on CUDA, 1024 elsewhere).
        repeats: Timed matmuls after one untimed warm-up.
    """
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = []
    for index in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


__all__ = ["SavedTensorBytes", "count_flops", "matmul_rate", "peak_rss_bytes", "reset_peak_rss", "resident_bytes"]
