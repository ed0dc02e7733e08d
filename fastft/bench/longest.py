"""The longest sequence one system trains at batch 1, searched in one process: grow, then bisect, within a budget.

:func:`search` runs one training step per probe through a callable, starting at ``start`` tokens and doubling until
the first out-of-memory error or the end of the ladder (the model's longest position); after an out-of-memory error it
frees what it can and bisects between the last length that fitted and the first that did not, until they are within
the resolution. A time budget bounds the whole search: a probe that the last step's time predicts would overrun it is
not started, and the result says so. Each result ends one of four ways (``STOPS``):

- ``"oom"``: the longest length is known to the resolution (the first length that ran out of memory is above it);
- ``"time"``: the budget ran out; the longest length is a lower bound ("≥ N");
- ``"ladder-end"``: the ladder's last length fitted; also a lower bound;
- ``"error"``: a probe failed for another reason (its message is kept).

The harness's worker runs this in a competitor's venv, where fastft is not installed, so this file imports only the
standard library.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

STOPS = ("oom", "time", "ladder-end", "error")
# A long step's time grows faster than its length (attention is quadratic); predicting with the square errs towards
# stopping early rather than overrunning the budget.
TIME_EXPONENT = 2.0


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator running out of memory (torch's ``OutOfMemoryError`` on any device, or a
    message saying so), the failure that ends the growth."""
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def search(
    step: Callable[[int], dict[str, Any]],
    *,
    start: int,
    limit: int,
    deadline: float,
    clock: Callable[[], float],
    free: Callable[[], None] = lambda: None,
    granularity: int = 1,
    resolution: float = 1 / 16,
    growth: float = 2.0,
    on_probe: Callable[[dict[str, Any]], None] = lambda probe: None,
) -> dict[str, Any]:
    """Search the longest length ``step`` runs at without running out of memory.

    Args:
        step: Runs one training step at the given length; returns what it measured (step time, peak memory); raises
            torch's ``OutOfMemoryError`` (or any error :func:`is_out_of_memory` accepts) when the length does not fit.
        start: The first length tried.
        limit: The ladder's end: no length above it is tried.
        deadline: ``clock()`` value after which no probe starts.
        clock: Seconds, monotonic (``time.monotonic``; tests pass a fake).
        free: Called after an out-of-memory error, once the failed step's tensors are unreachable, to give memory
            back (garbage collection, the CUDA cache).
        granularity: Every length tried is a multiple of this.
        resolution: Bisection stops once the gap between the longest fit and the first out-of-memory length is at
            most this fraction of the fit (or ``granularity``).
        growth: The factor between lengths before the first out-of-memory error.
        on_probe: Called with each probe's record as soon as it is made (the worker prints it, so a search the
            harness kills still leaves its probes).

    Returns:
        ``longest_seq`` (None: not even the first length fitted), ``first_oom_seq`` (the shortest length that ran out
        of memory, None if none did), ``stopped_by`` (one of ``STOPS``), ``probes`` (each with ``seq``, ``fits``,
        ``s`` and what ``step`` returned or the error), ``search_s``, and where it applies ``next_seq`` and
        ``predicted_s`` (the probe the budget did not allow) or ``error``.

    Raises:
        ValueError: ``start``, ``limit``, ``granularity`` or ``growth`` make no ladder.
    """
    if not (1 <= granularity <= start <= limit) or growth <= 1:
        raise ValueError(
            f"fastft.bench.longest.search: need 1 <= granularity ({granularity}) <= start ({start}) <= limit "
            f"({limit}) and growth ({growth}) > 1"
        )
    begun = clock()
    fit: int | None = None
    oom: int | None = None
    fit_time: float | None = None
    probes: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    seq: int | None = _round(start, granularity)
    while seq is not None:
        now = clock()
        predicted = None if fit_time is None else fit_time * (seq / fit) ** TIME_EXPONENT
        if now >= deadline or (predicted is not None and now + predicted > deadline):
            result.update(stopped_by="time", next_seq=seq, predicted_s=predicted, left_s=max(deadline - now, 0.0))
            break
        failure = None
        try:
            measured = step(seq)
        except Exception as error:  # noqa: BLE001  (sorted below: out of memory is a result, the rest ends the search)
            failure = _first_line(error)
            if not is_out_of_memory(error):
                # The search stops and says why; the traceback goes to stderr, where the harness keeps its tail.
                traceback.print_exc()
                result.update(stopped_by="error", error=failure)
        taken = clock() - now
        # Outside the except block: the error and its traceback (which hold the failed step's tensors) are gone.
        if failure is None:
            probe = {"seq": seq, "fits": True, "s": taken, **measured}
            fit, fit_time = seq, taken
        else:
            probe = {"seq": seq, "fits": False, "s": taken, "error": failure}
            free()
        probes.append(probe)
        on_probe(probe)
        if result.get("stopped_by") == "error":
            break
        if failure is not None:
            oom = seq if oom is None else min(oom, seq)
        seq, stop = _next(fit, oom, limit, granularity, resolution, growth)
        if stop:
            result["stopped_by"] = stop
    result.update(longest_seq=fit, first_oom_seq=oom, probes=probes, search_s=clock() - begun)
    return result


def _round(seq: float, granularity: int) -> int:
    return max(granularity, int(seq) // granularity * granularity)


def _next(
    fit: int | None, oom: int | None, limit: int, granularity: int, resolution: float, growth: float
) -> tuple[int | None, str | None]:
    """The next length to try, or None and why the search ends."""
    if oom is None:
        if fit >= limit:
            return None, "ladder-end"
        return min(limit, max(_round(fit * growth, granularity), fit + granularity)), None
    low = fit or 0
    if oom - low <= max(granularity, math.ceil(low * resolution)):
        return None, "oom"
    middle = _round((low + oom) / 2, granularity)
    if middle <= low or middle >= oom:
        return None, "oom"
    return middle, None


def from_probes(probes: list[dict[str, Any]], stopped_by: str, note: str) -> dict[str, Any]:
    """A search's result rebuilt from the probes its worker printed, when the worker did not finish (the harness
    killed it at its time limit, or it crashed): the longest fit, the first out-of-memory length, and ``note``."""
    fits = [probe["seq"] for probe in probes if probe.get("fits")]
    ooms = [probe["seq"] for probe in probes if not probe.get("fits")]
    return {
        "longest_seq": max(fits) if fits else None,
        "first_oom_seq": min(ooms) if ooms else None,
        "stopped_by": stopped_by,
        "probes": probes,
        "note": note,
    }


def describe(entry: dict[str, Any]) -> str:
    """The result as the table shows it: ``98,304 (out of memory at 102,400)``, ``≥ 196,608, stopped by time``, ``≥
    262,144, the ladder's end``, or ``failed: ...``."""
    longest, stop = entry.get("longest_seq"), entry.get("stopped_by")
    shown = "none" if longest is None else f"{longest:,}"
    first_oom = entry.get("first_oom_seq")
    if stop == "oom":
        return f"{shown} (out of memory at {first_oom:,})" if first_oom else f"{shown} (out of memory above it)"
    if stop == "time":
        below = f"; out of memory at {first_oom:,}" if first_oom else ""
        return f"≥ {shown}, stopped by time{below}" if longest is not None else f"none in time{below}"
    if stop == "ladder-end":
        return f"≥ {shown}, the ladder's end"
    return f"{'≥ ' + shown + ', ' if longest else ''}failed: {entry.get('error', 'unknown error')}"[:160]


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[bool | None, str | None]:
    """Whether our longest length is at least theirs, from two results that may be lower bounds only.

    Returns:
        ``(met, None)`` where the results decide it, ``(None, reason)`` where they do not: a lower bound below the
        other result (stopped by time or by the ladder's end), or a missing result.
    """
    mine, other = ours.get("longest_seq"), theirs.get("longest_seq")
    if mine is None and other is None:
        return None, "neither trained at any length tried"
    exact_mine, exact_other = ours.get("stopped_by") == "oom", theirs.get("stopped_by") == "oom"
    if other is None:
        # Out of memory at every length tried: any result of ours is at least that.
        return (True, None) if exact_other else (None, f"the reference stopped by {theirs.get('stopped_by')} first")
    if mine is None:
        return (False, None) if exact_mine else (None, "no length fitted before the search stopped")
    if mine >= other:
        # Theirs is below its first out-of-memory length; ours fits at least as long.
        if exact_other or mine >= (theirs.get("first_oom_seq") or math.inf):
            return True, None
        return None, f"the reference stopped by {theirs.get('stopped_by')} at {other:,}: a lower bound only"
    if exact_mine:
        return False, None
    return None, f"ours stopped by {ours.get('stopped_by')} at {mine:,}, below the reference: a lower bound only"


__all__ = ["STOPS", "compare", "describe", "from_probes", "is_out_of_memory", "search"]
