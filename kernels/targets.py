"""The NVIDIA GPU generations fastft builds for, what each allows, and which one a CUDA tensor is on.

Launch settings depend on the target (shared memory per block differs threefold between an A10 and an H100, and
Triton's ``tl.dot`` has tensor cores only from compute capability 8.0), so launchers ask :func:`capability` instead
of assuming one card. :func:`simulate` makes the launch code believe it runs on another target: the static compile
check (:mod:`fastft.kernels.compile_check`) and the tests use it to take the CUDA branch of every launcher on a
machine without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """One GPU generation.

    Attributes:
        capability: Compute capability as an int, major * 10 + minor (75 for sm_75).
        cards: Common cards of that generation, for reports.
        shared_bytes: The most shared memory one block may use (opt-in maximum).
        tensor_core_dot: Whether Triton lowers a 16-bit ``tl.dot`` to tensor-core instructions there; since Triton 3.2
            it falls back to plain FMA below 8.0.
        bf16: Whether the card computes in bf16 natively (8.0 and newer); older cards only emulate it.
    """

    capability: int
    cards: str
    shared_bytes: int

    @property
    def tensor_core_dot(self) -> bool:
        return self.capability >= 80

    @property
    def bf16(self) -> bool:
        return self.capability >= 80

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"


TARGETS: dict[int, Target] = {
    75: Target(75, "T4, RTX 20xx (Colab / Kaggle free tier)", 64 * 1024),
    80: Target(80, "A100", 163 * 1024),
    86: Target(86, "A10, RTX 30xx", 99 * 1024),
    89: Target(89, "L4, RTX 40xx", 99 * 1024),
    90: Target(90, "H100, H200", 227 * 1024),
}

_state = threading.local()


def target_for(capability: int) -> Target:
    """The :class:`Target` of a compute capability; an unlisted one takes the nearest listed generation below it
    (a newer card is assumed to allow at least what its predecessor does)."""
    known = [cc for cc in TARGETS if cc <= capability]
    if not known:
        raise ValueError(
            f"fastft.kernels: compute capability {capability / 10:.1f} is older than any supported GPU (7.5, the T4, "
            "is the oldest); run on the CPU or a newer GPU."
        )
    return TARGETS[max(known)]


def capability(device: torch.device | str | int | None = None) -> int:
    """Compute capability (major * 10 + minor) of a CUDA device, or of the simulated target inside :func:`simulate`."""
    simulated = getattr(_state, "capability", None)
    if simulated is not None:
        return simulated
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def simulated() -> int | None:
    """The capability :func:`simulate` set on this thread, or None."""
    return getattr(_state, "capability", None)


@contextlib.contextmanager
def simulate(capability: int) -> Iterator[Target]:
    """Inside the block, launchers take the CUDA branch for ``meta`` tensors and plan for this target."""
    target = TARGETS[capability] if capability in TARGETS else target_for(capability)
    previous = getattr(_state, "capability", None)
    _state.capability = capability
    try:
        yield target
    finally:
        _state.capability = previous


__all__ = ["TARGETS", "Target", "capability", "simulate", "simulated", "target_for"]
