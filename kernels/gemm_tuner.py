"""Which GEMM runs the base projection of a fused LoRA group: torch's matmul (cuBLAS) or the fused Triton kernel.

cuBLAS is the bar, in two orders:

- ``cublas``: the base GEMM, then the LoRA term added in place (``addmm_`` with K = r), which reads and writes the
  whole output a second time for a product of rank r;
- ``cublas-accumulate``: the LoRA term first (``s·(X Aᵀ) Bᵀ``, a K = r GEMM that only writes), then the base GEMM
  accumulates onto it in place (``beta = 1``), so the output is read once, in the base GEMM's epilogue, instead of
  read and written again. Only for groups with LoRA. Which order is faster depends on the device and the shapes
  (the H100 trace of ``bench/results/h100-2026-11-27b`` spends 15.6 ms of a 99.8 ms step in the separate LoRA adds),
  so it is timed, never assumed.

On a CUDA device, the first call of a group with a new (device, dtype, shape bucket) times both cuBLAS orders and,
at compute capability 8.0 or newer, every Triton configuration of :mod:`fastft.kernels.gemm_configs` that passes
the static check (:func:`fastft.kernels.compiled.usage`) on that device, keeps the fastest, and writes the choice to
a JSON cache (``$FASTFT_CACHE_DIR`` or ``~/.cache/fastft``, file ``gemm-tuning.json``; written atomically; keyed
with the torch, triton and fastft versions). A cache that cannot be read is tuned again and rewritten, never a crash.

``FASTFT_GEMM=cublas|triton|auto`` (default ``auto``) overrides the choice; ``cublas`` pins the first order, untimed.
Below compute capability 8.0 and for fp32 operands there is no Triton candidate (see
:mod:`fastft.kernels.gemm_configs`), so even ``triton`` runs cuBLAS there (the faster order), with one warning. On
the CPU the cuBLAS path is torch's CPU matmul (the reference, first order); under the Triton interpreter
(``TRITON_INTERPRET=1``) ``auto`` runs the Triton kernel, which is how CI checks it.

Every choice made in this process is kept for :func:`choices`, which ``patch_report`` and ``fastft doctor`` show.
A fused group calls :func:`choose` only the first time it meets a new :func:`plan_key` (shape bucket, dtype, device,
dispatch and tuner state) and reuses that choice after: building the bucket, reading the environment and recording
cost tens of microseconds of host time, which a training step pays per group and layer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import statistics
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastft.kernels import dispatch, targets
from fastft.kernels.gemm_configs import INTERPRETER, GemmConfig, candidates

logger = logging.getLogger(__name__)

GEMM_ENV = "FASTFT_GEMM"
CACHE_ENV = "FASTFT_CACHE_DIR"
NF4_DEQUANT_ENV = "FASTFT_NF4_DEQUANT"
MODES = ("auto", "cublas", "triton")
# 2: the cuBLAS accumulate order joined the candidates; a choice made without it is timed again.
CACHE_FORMAT = 2

_state = threading.local()
_lock = threading.Lock()


@dataclass(frozen=True)
class Candidate:
    """One way to run a group's base GEMM: ``cublas``, ``cublas-accumulate`` (the LoRA term first, the base GEMM
    accumulating onto it), ``triton`` (16-bit weights, NF4 ones decoded into the reused buffer first) or
    ``triton-nf4`` (NF4 tiles decoded inside the GEMM), with its Triton configuration."""

    path: str
    config: GemmConfig | None = None

    @property
    def label(self) -> str:
        return self.path if self.config is None else f"{self.path}:{self.config.label}"


CUBLAS = Candidate("cublas")
CUBLAS_ACCUMULATE = Candidate("cublas-accumulate")


@dataclass
class Choice:
    """What a group runs, and why."""

    candidate: Candidate
    reason: str
    timings_ms: dict[str, float] = field(default_factory=dict)


def mode() -> str:
    """The GEMM mode in force: :func:`force`'s, else ``FASTFT_GEMM``'s, else ``auto``."""
    forced = getattr(_state, "mode", None)
    if forced is not None:
        return forced
    value = os.environ.get(GEMM_ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(
            f"fastft.kernels: {GEMM_ENV} must be one of {', '.join(MODES)}, got {value!r}; unset it for 'auto'."
        )
    return value


@contextlib.contextmanager
def force(path: str, candidate: Candidate | None = None) -> Iterator[None]:
    """Run every group inside the block on ``path`` (``auto``, ``cublas`` or ``triton``), like ``FASTFT_GEMM``.

    ``candidate`` pins one Triton candidate (the static compile check walks them one by one with it); a group that
    cannot take it runs cuBLAS.
    """
    if path not in MODES:
        raise ValueError(f"fastft.kernels.gemm_tuner.force: path must be one of {', '.join(MODES)}, got {path!r}.")
    previous = getattr(_state, "mode", None), getattr(_state, "pinned", None)
    _state.mode, _state.pinned = path, candidate
    try:
        yield
    finally:
        _state.mode, _state.pinned = previous


def nf4_decode() -> str | None:
    """``FASTFT_NF4_DEQUANT``: ``"buffer"``, ``"kernel"``, or None (unset: the tuner tries both)."""
    value = os.environ.get(NF4_DEQUANT_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("buffer", "kernel"):
        raise ValueError(
            f"fastft.kernels: {NF4_DEQUANT_ENV} must be 'buffer' or 'kernel', got {value!r}; unset it for the default."
        )
    return value


def cache_dir() -> Path:
    """Where tuning results live: ``$FASTFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastft``, else ``~/.cache/fastft``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastft"


def cache_file() -> Path:
    """The tuning cache file."""
    return cache_dir() / "gemm-tuning.json"


def cache_versions() -> dict[str, str]:
    """The library versions a cached choice is valid for."""
    from fastft._version import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "fastft": __version__}


def read_cache(path: Path) -> dict[str, dict]:
    """The cached choices in ``path`` that are valid for the installed versions; ``{}`` if there are none or the file
    cannot be read (it is tuned again and rewritten)."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.warning("fastft: the GEMM tuning cache %s cannot be read (%s); tuning again.", path, error)
        return {}
    if not isinstance(document, dict) or not isinstance(document.get("choices"), dict):
        logger.warning("fastft: the GEMM tuning cache %s is not a fastft cache; tuning again.", path)
        return {}
    if document.get("format") != CACHE_FORMAT or document.get("versions") != cache_versions():
        return {}
    return document["choices"]


def write_cache(path: Path, key: str, entry: dict) -> None:
    """Add one choice to the cache file, atomically (a temporary file renamed over it), merging with what other
    processes wrote meanwhile."""
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = read_cache(path)
        entries[key] = entry
        document = {"format": CACHE_FORMAT, "versions": cache_versions(), "choices": entries}
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as stream:
                json.dump(document, stream, indent=1, sort_keys=True)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def _entry(choice: Choice) -> dict:
    config = choice.candidate.config
    return {
        "path": choice.candidate.path,
        "config": None if config is None else config.as_dict(),
        "reason": choice.reason,
        "timings_ms": choice.timings_ms,
    }


def _from_entry(entry: dict) -> Choice | None:
    try:
        config = None if entry["config"] is None else GemmConfig(**entry["config"])
        return Choice(Candidate(str(entry["path"]), config), str(entry["reason"]), dict(entry["timings_ms"]))
    except (KeyError, TypeError, ValueError):
        return None


def cuda_timer(run: Callable[[], Any], repeats: int = 10) -> float:
    """Median seconds of ``run()`` on the current CUDA stream, measured with events after one warm-up call."""
    run()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def tune(
    key: str,
    options: Sequence[Candidate],
    run: Callable[[Candidate], Any],
    *,
    check: Callable[[Candidate], list[str]],
    timer: Callable[[Callable[[], Any]], float],
    path: Path,
) -> Choice:
    """The fastest of ``options`` for one bucket, from the cache at ``path`` or measured now and cached.

    Args:
        key: The bucket's cache key.
        options: Plain cuBLAS first (an error there is raised, not excluded), the other cuBLAS order, then the
            Triton candidates.
        run: Runs one candidate once (compiling it on the first call).
        check: The static check of a candidate on this device (run after its first call); problems exclude it.
        timer: Seconds one call takes (``run`` wrapped in a zero-argument callable).
        path: The cache file.
    """
    cached = read_cache(path).get(key)
    if cached is not None:
        choice = _from_entry(cached)
        if choice is not None and choice.candidate in options:
            choice.reason = f"cached: {choice.reason}"
            return choice
    timings, excluded = {}, {}
    for option in options:
        try:
            run(option)
            problems = check(option)
        except Exception as error:  # noqa: BLE001 - a candidate that cannot run here is not a candidate
            if option is options[0]:
                raise
            problems = [f"{type(error).__name__}: {error}"]
        if problems:
            excluded[option.label] = "; ".join(problems)
            continue
        timings[option.label] = timer(lambda option=option: run(option)) * 1e3
    best = min((o for o in options if o.label in timings), key=lambda o: timings[o.label])
    measured = ", ".join(f"{label} {ms:.3f} ms" for label, ms in timings.items())
    reason = f"tuned: {measured}"
    if excluded:
        reason += "; excluded " + "; ".join(f"{label} ({why})" for label, why in excluded.items())
    choice = Choice(best, reason, {label: round(ms, 4) for label, ms in timings.items()})
    try:
        write_cache(path, key, _entry(choice))
    except OSError as error:
        logger.warning(
            "fastft: cannot write the GEMM tuning cache %s (%s); the choice holds for this run.", path, error
        )
    return choice


# Every choice of this process, latest per (group, device, dtype, bucket): what patch_report and doctor show.
_made: dict[tuple[str, str, str, str], Choice] = {}
_memo: dict[str, Choice] = {}
_warned: set[str] = set()
# Bumped by reset(): a group's memoised choice from before a reset is made (and recorded) again.
_generation = 0


def _record(group: str, device: str, dtype: torch.dtype, bucket: str, choice: Choice) -> Choice:
    key = (group, device, str(dtype).removeprefix("torch."), bucket)
    # Re-inserted, so that by_group's "latest per group" is the latest made, not the bucket's first.
    _made.pop(key, None)
    _made[key] = choice
    return choice


def choices() -> list[dict[str, Any]]:
    """Every GEMM choice made in this process (the latest per group, device, dtype and shape bucket)."""
    return [
        {
            "group": group,
            "device": device,
            "dtype": dtype,
            "bucket": bucket,
            "path": choice.candidate.path,
            "config": None if choice.candidate.config is None else choice.candidate.config.label,
            "reason": choice.reason,
            "timings_ms": dict(choice.timings_ms),
        }
        for (group, device, dtype, bucket), choice in _made.items()
    ]


def by_group() -> dict[str, str]:
    """The latest choice per group as one line each (``"qkv": "cublas (reason)"``), for reports."""
    lines = {}
    for (group, device, _, _), choice in _made.items():
        # On the CPU the cuBLAS path is torch's CPU matmul.
        label = "torch matmul" if device == "cpu" and choice.candidate == CUBLAS else choice.candidate.label
        lines[group] = f"{label} ({choice.reason})"
    return lines


def reset() -> None:
    """Forget this process's choices (the disk cache stays); every group chooses again on its next call."""
    global _generation
    _made.clear()
    _memo.clear()
    _generation += 1


def rows_bucket(m: int) -> int:
    """M rounded up to a power of two (at least 1): the rows part of a shape bucket."""
    return 1 << (max(m, 1) - 1).bit_length()


def plan_key(x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple:
    """Everything besides the group's fixed shapes that :func:`choose` reads for an ``[M, K]`` input ``x``: M's
    bucket, dtype, device, whether Triton runs on it, the forced mode and pinned candidate, ``FASTFT_GEMM``,
    ``FASTFT_NF4_DEQUANT``, the simulated target and :func:`reset`'s generation. Two calls with equal keys get the
    same choice, so a group memoises it under this key (invalid settings are not validated here: :func:`choose`
    raises on them before anything is memoised). ``dtype``: the key of x cast to it (x's own dtype by default)."""
    if dtype is None:
        dtype = x.dtype
    if x.is_cpu and not dispatch.INTERPRETED:
        # Only the torch reference runs on CPU tensors then (choose's first answer): no switch can change that.
        return (rows_bucket(x.shape[0]), dtype, "cpu", _generation)
    return (
        rows_bucket(x.shape[0]),
        dtype,
        x.device,
        dispatch.use_triton(x),
        getattr(_state, "mode", None),
        getattr(_state, "pinned", None),
        dispatch.environment(GEMM_ENV),
        dispatch.environment(NF4_DEQUANT_ENV),
        targets.simulated(),
        _generation,
    )


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=4)


def bucket(widths: Sequence[int], k: int, ranks: Sequence[int], m: int, packed: bool) -> str:
    """The shape bucket of a group: exact widths, K and ranks (a model has few), M rounded up to a power of two."""
    rows = rows_bucket(m)
    kind = "nf4" if packed else "dense"
    return f"{kind} K={k} N={'/'.join(map(str, widths))} r={'/'.join(map(str, ranks))} M<={rows}"


def triton_candidates(capability: int, dtype: torch.dtype, packed: bool, every: bool = False) -> list[Candidate]:
    """The Triton candidates of a group on a target: 16-bit weights (NF4 ones decoded into the buffer first), then,
    for NF4 groups, the in-kernel decode, as ``FASTFT_NF4_DEQUANT`` allows; only the one :func:`force` pinned, if
    any. ``every=True`` ignores both (the static check walks them all)."""
    dense = [Candidate("triton", c) for c in candidates(capability, dtype, "dense")]
    in_kernel = [Candidate("triton-nf4", c) for c in candidates(capability, dtype, "nf4")] if packed else []
    if every:
        return dense + in_kernel
    pinned = getattr(_state, "pinned", None)
    if pinned is not None:
        return [pinned] if pinned in dense + in_kernel else []
    decode = nf4_decode() if packed else "buffer"
    return (dense if decode in (None, "buffer") else []) + (in_kernel if decode in (None, "kernel") else [])


def cublas_candidates(ranks: Sequence[int]) -> list[Candidate]:
    """The cuBLAS orders worth timing for a group: the plain one, and the accumulate order where a segment has LoRA
    (without a low-rank term the two are the same GEMM)."""
    return [CUBLAS, CUBLAS_ACCUMULATE] if any(ranks) else [CUBLAS]


def no_triton_reason(capability: int, dtype: torch.dtype) -> str:
    """Why no Triton GEMM may run for this target and dtype, in one line."""
    if capability < 80:
        return f"compute capability {capability / 10:.1f} < 8.0: Triton's tl.dot has no tensor cores there, cuBLAS has"
    return (
        f"{str(dtype).removeprefix('torch.')} operands: the Triton GEMM multiplies fp32 in IEEE precision, cuBLAS too"
    )


def choose(
    group: str,
    x: torch.Tensor,
    widths: Sequence[int],
    ranks: Sequence[int],
    packed: bool,
    run: Callable[[Candidate], Any],
    check: Callable[[Candidate], list[str]],
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> Choice:
    """Pick the GEMM for one call of a group.

    Args:
        group: ``"qkv"``, ``"o"``, ``"gate_up"`` or ``"down"``.
        x: The group's ``[M, K]`` input (device and dtype decide).
        widths: Each segment's output width.
        ranks: Each segment's LoRA rank (0 without).
        packed: Whether the base weights are NF4.
        run: Runs a candidate once and returns its outputs (used only when tuning).
        check: The static check of a candidate that has run once (used only when tuning).
        timer: Seconds per call; default :func:`cuda_timer`.
    """
    device_type = x.device.type
    dtype = x.dtype
    shape = bucket(widths, x.shape[1], ranks, x.shape[0], packed)
    selected = mode()
    if not dispatch.use_triton(x):
        why = "FASTFT_DISABLE_TRITON=1 or triton is missing" if device_type == "cuda" else "CPU tensors"
        return _record(group, device_type, dtype, shape, Choice(CUBLAS, f"the torch reference path: {why}"))
    if selected == "cublas":
        return _record(group, device_type, dtype, shape, Choice(CUBLAS, f"{GEMM_ENV}=cublas"))
    if device_type == "cpu":
        # The interpreter: the point of running it is to check the Triton kernels.
        path = "triton-nf4" if packed and nf4_decode() == "kernel" else "triton"
        return _record(group, "cpu", dtype, shape, Choice(Candidate(path, INTERPRETER), "Triton interpreter"))
    capability = targets.capability(x.device)
    options = triton_candidates(capability, dtype, packed)
    matmuls = cublas_candidates(ranks)
    no_triton = None
    if not options:
        no_triton = no_triton_reason(capability, dtype)
        if selected == "triton":
            _warn_once(
                f"fastft: {GEMM_ENV}=triton ignored for {dtype} on sm_{capability}: {no_triton}; running cuBLAS."
            )
        if len(matmuls) == 1:
            return _record(group, f"sm_{capability}", dtype, shape, Choice(CUBLAS, no_triton))
    elif selected == "triton":
        return _record(group, f"sm_{capability}", dtype, shape, Choice(options[0], f"{GEMM_ENV}=triton"))
    if x.is_meta:
        # A simulated target (the static check) has nothing to time: plain cuBLAS stays, as it does until another
        # candidate wins on a real device.
        reason = "simulated target: nothing to time" + ("" if no_triton is None else f"; {no_triton}")
        return _record(group, f"sm_{capability}", dtype, shape, Choice(CUBLAS, reason))
    name = _device_name(x.device)
    key = f"{name}|sm_{capability}|{str(dtype).removeprefix('torch.')}|{group}|{shape}"
    choice = _memo.get(key)
    if choice is None:
        choice = tune(key, [*matmuls, *options], run, check=check, timer=timer or cuda_timer, path=cache_file())
        if no_triton is not None and no_triton not in choice.reason:
            choice.reason += f"; no Triton candidate: {no_triton}"
        _memo[key] = choice
    return _record(group, name, dtype, shape, choice)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def policy(device: torch.device | str | None = None) -> str:
    """What the groups will run on a device before any has run, in one line (for ``fastft doctor``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    probe = torch.empty(0, device=device)
    if not dispatch.use_triton(probe):
        return "torch matmul (the reference path: no CUDA device, FASTFT_DISABLE_TRITON=1, or no triton)"
    selected = mode()
    if selected == "cublas":
        return f"cuBLAS ({GEMM_ENV}=cublas)"
    if device.type == "cpu":
        return "Triton kernel through the interpreter (TRITON_INTERPRET=1)"
    capability = targets.capability(device)
    if not candidates(capability, torch.float16):
        return (
            f"cuBLAS, its two orders timed on first use and cached in {cache_file()} "
            f"({no_triton_reason(capability, torch.float16)})"
        )
    if selected == "triton":
        return f"Triton ({GEMM_ENV}=triton)"
    return (
        f"auto: cuBLAS (either order) or Triton, whichever is faster, tuned on first use and cached in {cache_file()}"
    )


__all__ = [
    "CACHE_ENV",
    "CUBLAS",
    "CUBLAS_ACCUMULATE",
    "GEMM_ENV",
    "MODES",
    "NF4_DEQUANT_ENV",
    "Candidate",
    "Choice",
    "by_group",
    "cache_dir",
    "cache_file",
    "cache_versions",
    "choices",
    "choose",
    "cublas_candidates",
    "cuda_timer",
    "force",
    "mode",
    "nf4_decode",
    "no_triton_reason",
    "plan_key",
    "policy",
    "read_cache",
    "reset",
    "rows_bucket",
    "triton_candidates",
    "tune",
    "write_cache",
]
