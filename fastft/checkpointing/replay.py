"""Where ``use_gradient_checkpointing="sqrt"`` gets a decoder layer's input back in backward: replayed, not kept.

Consecutive checkpointed layers form segments of ``ceil(sqrt(L))`` layers. The first layer of a segment keeps its
input as recompute checkpointing does; each later layer saves a :class:`ReplayedInput` instead of its input. The first
one unpacked (the segment's last layer: backward runs in reverse) runs the segment's layers forward again from the
kept input, without a graph and under each layer's own forward RNG and autocast state, so the values are the ones
the forward computed; the inputs on the way are cached for the layers below, each handed out once. Backward then keeps
about ``L / k`` inputs plus ``k`` of one segment at a time instead of ``L``, for one more forward of the decoder.

A layer joins the segment of the layer before it only when its input is that layer's output tensor itself (the
decoder loop passed it on unchanged) and it takes no other positional tensor; anything else starts a new segment, so
a model whose loop does more between layers keeps more inputs but never replays a wrong one.

Under ``"sqrt-offload"`` a segment's kept input is parked in host memory
(:class:`fastft.checkpointing.offload.ParkedTensor`) instead of staying on the device. The segment then holds the
parked copy, starts bringing it back while the segment above runs its backward (:meth:`Segment.prefetch`), and borrows
it for the replay; the first layer's own backward takes the same device copy, so each kept input crosses to the host
and back once per backward."""

from __future__ import annotations

import math
import weakref
from typing import Any, Protocol

import torch


class Replayable(Protocol):
    """One checkpointed layer call: how to run its forward again from its input."""

    def replay(self, tensor: torch.Tensor) -> torch.Tensor: ...


class Parked(Protocol):
    """A kept input that lives off the device between forward and backward
    (:class:`fastft.checkpointing.offload.ParkedTensor`)."""

    def prefetch(self) -> None: ...

    def borrow(self) -> torch.Tensor: ...


def segment_length(layers: int) -> int:
    """Layers per segment for ``layers`` checkpointed layers: ``ceil(sqrt(layers))`` (1 for one layer)."""
    return max(1, math.ceil(math.sqrt(layers)))


class Segment:
    """The kept input of a segment's first layer, the segment's calls in order, and the inputs replayed so far.

    Args:
        first: The first layer's input: the tensor itself, or its parked copy (``"sqrt-offload"``).
        call: The first layer's call.
    """

    def __init__(self, first: torch.Tensor | Parked, call: Replayable) -> None:
        self.first = first
        self.calls: list[Replayable] = [call]
        self._cache: dict[int, torch.Tensor] = {}
        self.replays = 0

    def prefetch(self) -> None:
        """Start bringing a parked kept input back (the segment's backward is next); nothing for a kept tensor."""
        if not isinstance(self.first, torch.Tensor):
            self.first.prefetch()

    def _first_input(self) -> torch.Tensor:
        return self.first if isinstance(self.first, torch.Tensor) else self.first.borrow()

    def input(self, index: int) -> torch.Tensor:
        """The input of the segment's call ``index`` (> 0), from the cache or by replaying the calls before it."""
        cached = self._cache.pop(index, None)
        if cached is not None:
            return cached
        start = max((position for position in self._cache if position < index), default=0)
        tensor = self._cache[start] if start else self._first_input()
        for position in range(start, index):
            tensor = self.calls[position].replay(tensor)
            self.replays += 1
            if position + 1 < index:
                self._cache[position + 1] = tensor
        return tensor


class ReplayedInput:
    """What autograd keeps in place of a layer input the segment can replay (no tensor of its own)."""

    def __init__(self, segment: Segment, index: int, like: torch.Tensor) -> None:
        self.segment, self.index = segment, index
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device

    def take(self) -> torch.Tensor:
        """Unpack hook: the replayed input, checked against the one the forward saw."""
        tensor = self.segment.input(self.index)
        if (tensor.shape, tensor.dtype, tensor.device) != (self.shape, self.dtype, self.device):
            raise RuntimeError(
                f"fastft sqrt checkpointing: layer {self.index} of its segment was saved with an input of shape "
                f"{tuple(self.shape)} {self.dtype} on {self.device}, but the replay gave {tuple(tensor.shape)} "
                f"{tensor.dtype} on {tensor.device}. Train with use_gradient_checkpointing=True and report this model."
            )
        return tensor


class ReplayChain:
    """Which segment the next layer call joins: weak references to the last call, its input, output and segment.

    Only weak references, so nothing here keeps a tensor alive after its graph is gone.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the last call (the next one starts a segment)."""
        self._output: weakref.ref | None = None
        self._input: weakref.ref | None = None
        self._call: weakref.ref | None = None
        self._segment: weakref.ref | None = None

    def join(self, tensor: torch.Tensor, call: Replayable, length: int) -> tuple[Segment, int] | None:
        """The segment and index of ``call`` whose input is ``tensor``; ``None`` when it starts a segment."""
        previous_output = self._output() if self._output is not None else None
        previous_call = self._call() if self._call is not None else None
        if previous_output is not tensor or previous_call is None:
            return None
        segment = self._segment() if self._segment is not None else None
        if segment is None:
            # The previous call starts the segment: its input (or the parked copy of it) is alive, saved by its node.
            previous_input = self._input() if self._input is not None else None
            if length < 2 or previous_input is None:
                return None
            segment = Segment(previous_input, previous_call)
        elif len(segment.calls) >= length:
            return None
        segment.calls.append(call)
        return segment, len(segment.calls) - 1

    def follow(self, kept: torch.Tensor | Parked, call: Any, output: torch.Tensor, segment: Segment | None) -> None:
        """Record the call just made: its input (or that input's parked copy), its first output and its segment
        (``None``: it starts one)."""
        self._input, self._call, self._output = weakref.ref(kept), weakref.ref(call), weakref.ref(output)
        self._segment = None if segment is None else weakref.ref(segment)


__all__ = ["Parked", "ReplayChain", "ReplayedInput", "Segment", "segment_length"]
