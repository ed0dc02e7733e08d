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

An offer may come with a second callable for the backward's recompute alone: it builds the same node with the same
gradients, but its output's values are never read there (only its ``grad_fn`` is), so it need not compute them. The
fused layer's skips its down projection's GEMM and last residual add that way. The ``"sqrt"`` replay, which reads the
output as the next layer's input, keeps the full rerun.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

Rerun = Callable[[torch.Tensor], torch.Tensor]


class RerunSlot:
    """What one checkpointed call heard while its forward ran: the input an offer was made for and the offer."""

    __slots__ = ("for_backward", "offers", "rerun", "source")

    def __init__(self) -> None:
        self.source: torch.Tensor | None = None
        self.rerun: Rerun | None = None
        self.for_backward: Rerun | None = None
        self.offers = 0

    def taken_for(self, tensor: torch.Tensor) -> tuple[Rerun, Rerun] | None:
        """``(rerun, rerun for the backward alone)`` of the offer, when exactly one came and it was for ``tensor``
        itself (both the same callable where the offer had no second one)."""
        if self.offers != 1 or self.source is not tensor or self.rerun is None:
            return None
        return self.rerun, self.for_backward or self.rerun


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


def offer(source: torch.Tensor, rerun: Rerun, for_backward: Rerun | None = None) -> None:
    """Offer ``rerun`` (``rerun(x)`` computes what the current call computes from ``source``, for ``x`` in its
    place) to the innermost listening checkpointer. A second offer in the same call withdraws both: the call did more
    than one node's work, and only its forward knows how to repeat it.

    ``for_backward(x)``, where given, builds the same autograd node over ``x`` with grad mode on, for a recompute
    that only runs the backward through it: its output's ``grad_fn`` must be that node and its shape and dtype the
    output's, but its values may be left uncomputed."""
    slots = _LISTENERS.slots
    if slots:
        slot = slots[-1]
        slot.offers += 1
        # Kept only while it is the one offer; a second one drops the first's references at once.
        first = slot.offers == 1
        slot.source, slot.rerun, slot.for_backward = (source, rerun, for_backward) if first else (None, None, None)


__all__ = ["Rerun", "RerunSlot", "listen", "listening", "offer", "stop"]
