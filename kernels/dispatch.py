"""Which implementation a kernel call takes, and the output allocator every kernel shares.

CUDA tensors take the Triton kernels (and ``meta`` tensors inside :func:`fastft.kernels.targets.simulate`, which is
how the static compile check walks the CUDA launch code without a GPU). CPU tensors take the plain-torch reference,
unless the Triton interpreter was on (``TRITON_INTERPRET=1``) when this package was imported: then they take the
Triton kernels too, run by the interpreter, which is how CI checks the kernels on a machine without a GPU.
``FASTFT_DISABLE_TRITON=1`` sends every call to the reference path, a switch for telling a kernel bug from an upstream
one.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from fastft.kernels import targets

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs (macOS, Windows) run the torch references.
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(
                f"fastft.kernels: the Triton kernel {self.fn.__name__} was called but triton is not installed; "
                "install fastft[cuda] (pip install 'fastft[cuda]') or keep the tensors on the CPU."
            )

    def _missing_jit(fn=None, **_options):
        return _MissingKernel(fn) if fn is not None else _MissingKernel

    # Enough of the triton namespace for kernel definitions (decorators, annotations) to import without it.
    triton = SimpleNamespace(jit=_missing_jit, cdiv=lambda a, b: -(-a // b), next_power_of_2=None)
    tl = SimpleNamespace(constexpr=None)

# Kernels are decorated at import, and triton decides there whether they are interpreted: read the same switch once.
INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"

# Process-wide, not per thread: autograd runs a CUDA backward on a device thread of its own, and a block that forces
# the reference path (or poisons outputs) must cover the backward it starts too. Counts, so blocks nest.
_switches = {"reference": 0, "poison": 0}
_switch_lock = threading.Lock()


# Switches are read at call time (tests and users flip them inside a process), on every kernel call: os.environ.get
# re-encodes the key and decodes the value (about 0.5 µs); the mapping os.environ keeps underneath, a plain dict,
# answers the same question in a lookup.
_ENVIRON = getattr(os.environ, "_data", None)
_KEYS: dict[str, object] = {}


def environment(name: str) -> str | None:
    """``os.environ.get(name)``, read now, at the cost of a dict lookup."""
    if _ENVIRON is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.environ.encodekey(name)
    value = _ENVIRON.get(key)
    return None if value is None else os.environ.decodevalue(value)


def _disabled_by_environment() -> bool:
    return environment("FASTFT_DISABLE_TRITON") == "1"


def _forced_reference() -> bool:
    return _switches["reference"] > 0 or _disabled_by_environment()


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel call on ``tensor`` runs the Triton kernel (True) or the torch reference (False)."""
    if tensor.is_cuda:
        return HAS_TRITON and not _forced_reference()
    if tensor.is_meta:
        # The static compile check runs the CUDA launch code on meta tensors for a simulated target.
        return HAS_TRITON and targets.simulated() is not None and not _forced_reference()
    # CPU: only the interpreter runs Triton there (INTERPRETED implies HAS_TRITON); without it nothing else matters.
    return INTERPRETED and tensor.device.type == "cpu" and not _forced_reference()


@contextlib.contextmanager
def _switched(name: str) -> Iterator[None]:
    with _switch_lock:
        _switches[name] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switches[name] -= 1


@contextlib.contextmanager
def force_reference() -> Iterator[None]:
    """Run every kernel call inside the block on its torch reference, whatever the device.

    The switch holds for the whole process while the block is open, autograd's backward threads included.
    """
    with _switched("reference"):
        yield


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Fill every buffer a kernel allocates inside the block with NaN (or -1 for integers).

    Tests run kernels under this so that an output element the kernel forgot to write fails the comparison
    instead of passing on whatever the allocator left there. Process-wide while open, as :func:`force_reference`.
    """
    with _switched("poison"):
        yield


def empty(shape: tuple[int, ...] | torch.Size, *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty`` for kernel outputs: poisoned under :func:`poison_outputs`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _switches["poison"]:
        out.fill_(math.nan if out.is_floating_point() else -1)
    return out


def empty_like(tensor: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous :func:`empty` with ``tensor``'s shape and device."""
    return empty(tensor.shape, dtype=dtype or tensor.dtype, device=tensor.device)


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``: itself when it has that dtype already. A same-dtype ``.to()`` returns its input too,
    but only after a dispatch, which the torch path would pay on every call of every layer."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def mark_overwritten(*tensors: torch.Tensor) -> None:
    """Tell autograd a kernel wrote into these tensors behind its back.

    A backward that reuses its saved inputs as gradient buffers bumps their version counters, so any other node
    that saved the same tensor fails loudly ("modified by an inplace operation") instead of reading gradients.
    """
    for tensor in tensors:
        torch.autograd.graph.increment_version(tensor)


__all__ = [
    "HAS_TRITON",
    "cast",
    "environment",
    "INTERPRETED",
    "empty",
    "empty_like",
    "force_reference",
    "mark_overwritten",
    "poison_outputs",
    "tl",
    "triton",
    "use_triton",
]
