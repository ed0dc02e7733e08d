"""Memory measurements shared by tests and benchmarks: what autograd keeps for backward, and the process's peak RSS."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from types import TracebackType

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


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes (Linux and macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


__all__ = ["SavedTensorBytes", "peak_rss_bytes"]
