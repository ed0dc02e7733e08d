"""Counting and replaying the aten operators of one step: ``bench/host.py``'s op count and operator floor.

Loaded by path (``bench/host.py`` keeps its own folder off ``sys.path``, and the Unsloth worker's environment may have
no fastft), so it imports torch and the standard library only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from fastft.bench.operators import OperatorMode


class OpCounter(OperatorMode):
    """Counts every aten operator dispatched while open (autograd's backward included), by name; with ``record``,
    also keeps each call (operator, arguments) in order."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.record = record
        self.calls: list[tuple[Any, tuple, dict]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # False would make torch.compile fall back to eager under this mode, counting ops the compiled step never runs.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counts[str(func)] += 1
        if self.record:
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def operator_floor(calls: list[tuple[Any, tuple, dict]], sync: Callable[[], None], repeats: int) -> dict[str, float]:
    """What a recorded step's operators cost alone: ``op_floor_s`` and ``op_replay_loop_s``.

    The calls are replayed ``repeats`` times with grad mode off and nothing else around them; the floor is the fastest
    replay less the replay loop's own cost (the fastest replay of the same calls into a Python no-op). That is what
    the step would cost if the framework's Python took no time at all, so a host-time target below it needs fewer
    operators, not faster Python. An estimate: a replayed operator skips autograd's recording, and its call goes
    through ``OpOverload.__call__``, a little dearer than a tensor method's binding.

    Args:
        calls: ``(operator, args, kwargs)`` in dispatch order (:class:`OpCounter` with ``record=True``); replaying
            overwrites the outputs of in-place operators, which only the step that recorded them reads.
        sync: Waits for the device (a no-op on CPU).
        repeats: Timed replays of each kind.
    """

    def replay(target: Callable[..., Any] | None) -> float:
        sync()
        started = time.perf_counter()
        with torch.no_grad():
            for func, args, kwargs in calls:
                (target or func)(*args, **kwargs)
        sync()
        return time.perf_counter() - started

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    replay(None)  # the first replay allocates what later ones reuse
    # The least of the repeats: a floor is what the operators cost at best, and load only ever adds to it.
    ops = min(replay(None) for _ in range(repeats))
    loop = min(replay(noop) for _ in range(repeats))
    return {"op_floor_s": max(ops - loop, 0.0), "op_replay_loop_s": loop}
