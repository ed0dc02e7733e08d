"""What a patched module decides once and reuses: its fused groups, read and checked, kept until something changes.

Deciding how a projection group runs (fused or peft's own forward, and why) and checking its shapes walks peft's
layers and costs tens of microseconds; doing it on every call of every layer is what left the GPU idle. A
:class:`Plan` holds the decision together with the stamp it was made under (:func:`fastft.patches.lora_layers.
projection_stamp` of every projection, plus whatever else the caller adds: grad mode, the attention implementation).
Each call compares stamps, a few microseconds, and decides again only when they differ: an adapter enabled,
disabled, switched or merged, a hook added, a module swapped, train / eval, grad mode.

While ``torch.compile`` traces, no plan is kept: the tracer reads the modules itself and guards on what it read, which
is the same protection, in its own terms.

Plans live in the module's ``__dict__`` and are never copied: a deep copy or an unpickled module starts without one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastft.patches.lora_layers import projection_objects, projection_stamp

# Where a module keeps its plan (in its __dict__).
PLAN_ATTRIBUTE = "_fastft_plan"


class Plan:
    """A module's recent decisions: each value with the stamp it holds for and the objects whose ids that stamp holds
    (kept alive so that no new object can take one of those ids while the plan lives).

    More than one is kept because training alternates states: checkpointing runs a layer without grad, then again
    with grad in backward; trl's preference trainers alternate the policy with its adapters disabled. The last one
    used is compared first, with ``==`` on its stamp; the others by hash.
    """

    __slots__ = ("keep", "older", "stamp", "value")

    KEPT = 4

    def __init__(self, stamp: Any, value: Any, keep: Sequence[Any]) -> None:
        self.stamp, self.value, self.keep = stamp, value, tuple(keep)
        self.older: dict[Any, tuple[Any, tuple[Any, ...]]] = {}

    def find(self, stamp: Any) -> Any:
        """The value decided under ``stamp`` (made the latest), or ``_MISSING``."""
        if self.stamp == stamp:
            return self.value
        found = self.older.pop(stamp, None)
        if found is None:
            return _MISSING
        self.add(stamp, *found)
        return self.value

    def add(self, stamp: Any, value: Any, keep: Sequence[Any]) -> None:
        """Make ``value`` the latest decision; the one it replaces joins the older ones (the oldest of which goes)."""
        self.older[self.stamp] = (self.value, self.keep)
        while len(self.older) >= self.KEPT:
            self.older.pop(next(iter(self.older)))
        self.stamp, self.value, self.keep = stamp, value, tuple(keep)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        # A pickled module starts without a plan: its stamp would name objects of another process.
        return (_no_plan, ())


_MISSING = object()


def _no_plan() -> None:
    return None


def group_stamp(owner: torch.nn.Module, names: Sequence[str]) -> tuple[Any, ...]:
    """The stamp of every projection ``names`` of ``owner`` (q, k, v; gate, up, down; ...)."""
    modules = owner.__dict__["_modules"]
    return tuple([projection_stamp(modules[name]) for name in names])


def group_objects(owner: torch.nn.Module, names: Sequence[str]) -> list[Any]:
    """What a plan over :func:`group_stamp` of ``names`` keeps alive."""
    return [item for name in names for item in projection_objects(getattr(owner, name))]


def planned(module: torch.nn.Module, stamp: Any, build: Callable[[], tuple[Any, Sequence[Any]]]) -> Any:
    """``module``'s plan for ``stamp``: the kept one when its stamp is equal, else the value of ``build()``, which
    returns ``(value, objects to keep alive)``."""
    plan = module.__dict__.get(PLAN_ATTRIBUTE)
    if plan is not None:
        value = plan.find(stamp)
        if value is not _MISSING:
            return value
    value, keep = build()
    if plan is None:
        # Around nn.Module.__setattr__: a plan is neither a parameter, a buffer nor a submodule.
        module.__dict__[PLAN_ATTRIBUTE] = Plan(stamp, value, keep)
    else:
        plan.add(stamp, value, keep)
    return value


__all__ = ["PLAN_ATTRIBUTE", "Plan", "group_objects", "group_stamp", "planned"]
