"""A checkpointed layer call's shortcut back into the kernel that ran it: the recompute and the ``"sqrt"`` replay
call it instead of the layer's forward.

The checkpointer runs the layer's forward once without a graph, then again in backward (and ``"sqrt"`` once more
for the inputs of a segment). Each later run through the layer's forward repeats work whose answer the recompute
must not change anyway, since it replays what the forward ran: binding the arguments, checking hooks and cache
arguments, and stamping seven projections to find the layer's kept plan (about a quarter of a fused layer's host
time). So while the checkpointer runs the forward it listens (:func:`listen`), and a fused layer forward that runs
its node offers (:func:`offer`) a callable that runs the same node, with the same plan and the same arguments, on a
new input. The checkpointer keeps it only when the offer came for the call's own input, once; otherwise it calls the
forward as before.

Whoever offers answers for the rerun computing what its forward would compute in the recompute (with autograd on):
the fused layer offers only when no frozen weight needs a gradient and nothing hooks the layer, which are the
conditions under which its forward would take the same path again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

Rerun = Callable[[torch.Tensor], torch.Tensor]


class RerunSlot:
    """What one checkpointed call heard while its forward ran: the input an offer was made for and the offer."""

    __slots__ = ("offers", "rerun", "source")

    def __init__(self) -> None:
        self.source: torch.Tensor | None = None
        self.rerun: Rerun | None = None
        self.offers = 0

    def taken_for(self, tensor: torch.Tensor) -> Rerun | None:
        """The offer, when exactly one came and it was for ``tensor`` itself."""
        return self.rerun if self.offers == 1 and self.source is tensor else None


class _Listeners(threading.local):
    # Per thread: torch's DataParallel runs replicas' layers in threads at once.
    def __init__(self) -> None:
        self.slots: list[RerunSlot] = []


_LISTENERS = _Listeners()


def listen() -> RerunSlot:
    """Open a slot for the offer of the layer forward about to run; close it with :func:`stop`."""
    slot = RerunSlot()
    _LISTENERS.slots.append(slot)
    return slot


def stop(slot: RerunSlot) -> None:
    """Close ``slot`` (the innermost open one: the checkpointer closes it in a ``finally``)."""
    _LISTENERS.slots.remove(slot)


def listening() -> bool:
    """Whether a checkpointer waits for an offer (so an offer is worth building)."""
    return bool(_LISTENERS.slots)


def offer(source: torch.Tensor, rerun: Rerun) -> None:
    """Offer ``rerun`` (``rerun(x)`` computes what the current call computes from ``source``, for ``x`` in its
    place) to the innermost listening checkpointer. A second offer in the same call withdraws both: the call did more
    than one node's work, and only its forward knows how to repeat it."""
    slots = _LISTENERS.slots
    if slots:
        slot = slots[-1]
        slot.offers += 1
        # Kept only while it is the one offer; a second one drops the first's references at once.
        slot.source, slot.rerun = (source, rerun) if slot.offers == 1 else (None, None)


__all__ = ["Rerun", "RerunSlot", "listen", "listening", "offer", "stop"]
