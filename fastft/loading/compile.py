"""Regional compilation: every decoder layer runs one ``torch.compile``-d forward, compiled once and shared.

Compiling the whole model traces the decoder loop, the loss and the trainer's hooks, and recompiles whenever one of
them changes; compiling each decoder layer separately costs one compile per layer. Regional compilation compiles the
decoder layer's forward once: the layers share one class and one compiled function, their parameters are inputs of
the graph rather than constants, so every layer reuses the first layer's graph. fastft's kernels are torch custom
ops (:mod:`fastft.kernels.custom_ops`), so the graph holds them as single nodes and the compiler fuses and launches
what lies between them: residual adds, reshapes, the attention call.

Checkpointing stays outside the compiled region, around it: each decoder layer's class is swapped (per instance,
like every fastft patch) for a subclass whose ``forward`` is the compiled upstream ``forward``. In transformers 5.23
and later, ``GradientCheckpointingLayer.__init_subclass__`` wraps that subclass's forward in the checkpointing call,
so the checkpoint calls the compiled function; before 5.23 the checkpoint wraps ``__call__``, which calls ``forward``.
Either way the checkpointer (fastft's or transformers') is never traced.

A compiled layer's call runs its guards first. Of those, some check that each function, class and module the trace
reached through one of fastft's own modules is still the same object: they guard against fastft's code being replaced
at run time, and cost the host benchmark's layer about 70 µs of a 520 µs forward call (CPU, torch 2.13; a cold
check of all its guards went from 552 to 241 µs without them). :func:`skip_fastft_code_guards` leaves them out
(``torch.compile``'s ``guard_filter_fn``); every guard on a value (fastft's switches such as
:func:`~fastft.kernels.traced_reference.opaque_reference`), on the modules, their adapters and hooks, and on the
tensors stays. Patching fastft's functions after a layer compiled therefore needs ``torch._dynamo.reset()``. A
``guard_filter_fn`` of the caller's own replaces this one; with ``mode=`` (which ``torch.compile`` does not take
together with ``options=``) every guard stays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from fastft.patches.fused_layer import upstream_layer_forward

# The name it had as fastft/compile.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.compile")

_ATTRIBUTE = "_fastft_compiled_layers"
_MARK = "_fastft_compiled_from"
_classes: dict[tuple[type, tuple[tuple[str, Any], ...]], type] = {}
_lock = threading.Lock()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' ``GradientCheckpointingLayer`` instances)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


# Dynamo names a module's globals G['__import_<dotted name with "_dot_">']; fastft's own start with these.
_FASTFT_GLOBALS = ("G['__import_fastft_dot_", "G['__import_fastft']")
# The guards on an object's identity: the same function (code and closure), class, module or builtin, and two
# sources being one object. Value, length, containment, type and tensor guards are not among them.
_CODE_GUARDS = frozenset({"CLOSURE_MATCH", "MODULE_MATCH", "CLASS_MATCH", "BUILTIN_MATCH", "DUPLICATE_INPUT"})


def skip_fastft_code_guards(entries: Sequence[Any]) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn`` for fastft's compiled layers: keep every guard except those on the
    identity of an object reached through one of fastft's own modules (see the module docstring).

    Args:
        entries: Dynamo's ``GuardFilterEntry`` objects (``name``: the guarded source, ``guard_type``).

    Returns:
        Whether to keep each entry. An entry without those fields, as a later torch might hand over, is kept.
    """
    keep = []
    for entry in entries:
        name, kind = getattr(entry, "name", None), getattr(entry, "guard_type", None)
        own_code = isinstance(name, str) and name.startswith(_FASTFT_GLOBALS) and kind in _CODE_GUARDS
        keep.append(not own_code)
    return keep


def _compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``torch.compile`` with :func:`skip_fastft_code_guards` added, unless the caller chose a guard
    filter of their own or a ``mode`` (which excludes ``options=``)."""
    if options.get("mode") is not None:
        return dict(options)
    inner = dict(options.get("options") or {})
    inner.setdefault("guard_filter_fn", skip_fastft_code_guards)
    return {**options, "options": inner}


def _frozen(value: Any) -> Any:
    """``value`` as a hashable key: dicts (``options=``) and lists as sorted / plain tuples."""
    if isinstance(value, dict):
        return tuple(sorted((key, _frozen(item)) for key, item in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value


def _compiled_class(cls: type, options: dict[str, Any]) -> type:
    key = (cls, _frozen(options))
    with _lock:
        compiled = _classes.get(key)
        if compiled is None:
            # Beneath transformers' checkpointing wrapper (5.23 and later): compiled, it would have dynamo trace
            # fastft's checkpointer.
            forward = torch.compile(upstream_layer_forward(cls), **_compile_options(options))
            compiled = type(
                cls.__name__,
                (cls,),
                {
                    "forward": forward,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "__doc__": cls.__doc__,
                    _MARK: cls,
                },
            )
            _classes[key] = compiled
    return compiled


def compile_layers(model: torch.nn.Module, **options: Any) -> int:
    """Compile ``model``'s decoder layers regionally (one compiled forward per layer class, shared by its layers).

    Args:
        model: A transformers model or a peft wrapper of one.
        **options: Passed to ``torch.compile`` (``mode``, ``backend``, ``dynamic``, ``fullgraph``, ``options``), with
            :func:`skip_fastft_code_guards` as the guard filter unless ``mode`` or a ``guard_filter_fn`` is given.

    Returns:
        How many layers now run the compiled forward.

    Raises:
        ValueError: The model has no decoder layer fastft knows how to compile.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"fastft.compile_layers: {type(model).__name__} has no transformers GradientCheckpointingLayer (the "
            "decoder layer regional compilation compiles); compile the whole model with torch.compile(model) instead."
        )
    for layer in layers:
        if getattr(type(layer), _MARK, None) is None:
            layer.__class__ = _compiled_class(type(layer), options)
    count = len(layers)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    setattr(base, _ATTRIBUTE, count)
    logger.info("fastft: %d decoder layers compiled regionally (compiled on their first call)", count)
    return count


def uncompile_layers(model: torch.nn.Module) -> int:
    """Put every regionally compiled decoder layer of ``model`` back on its eager class; returns how many."""
    count = 0
    for layer in decoder_layers(model):
        original = getattr(type(layer), _MARK, None)
        if original is not None:
            layer.__class__ = original
            count += 1
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.__dict__.pop(_ATTRIBUTE, None)
    return count


def compiled_layers(model: torch.nn.Module) -> int:
    """How many decoder layers of ``model`` run a regionally compiled forward (0 when not compiled)."""
    return sum(1 for layer in decoder_layers(model) if getattr(type(layer), _MARK, None) is not None)


def compile_seconds() -> float:
    """Seconds this process has spent compiling with ``torch.compile`` so far (dynamo, AOTAutograd and inductor)."""
    from torch._dynamo.utils import compilation_time_metrics

    # The outermost entries: a frame's compile covers its nested phases (summing every entry would count them twice);
    # AOTAutograd compiles the backward graph later, on the first backward, under its own entry.
    return float(
        sum(
            sum(times)
            for name, times in compilation_time_metrics.items()
            if name == "_compile.compile_inner" or name.endswith("bw_compiler")
        )
    )


class CompileTimer:
    """Wall time and compile time of a block, for reports (``fastft train`` prints both)."""

    def __enter__(self) -> CompileTimer:
        self._start, self._compile = time.perf_counter(), compile_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        self.compile = compile_seconds() - self._compile


__all__ = [
    "CompileTimer",
    "compile_layers",
    "compile_seconds",
    "compiled_layers",
    "decoder_layers",
    "skip_fastft_code_guards",
    "uncompile_layers",
]
