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
"""

from __future__ import annotations

import logging
import threading
import time
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


def _compiled_class(cls: type, options: dict[str, Any]) -> type:
    key = (cls, tuple(sorted(options.items())))
    with _lock:
        compiled = _classes.get(key)
        if compiled is None:
            # Beneath transformers' checkpointing wrapper (5.23 and later): compiled, it would have dynamo trace
            # fastft's checkpointer.
            forward = torch.compile(upstream_layer_forward(cls), **options)
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
        **options: Passed to ``torch.compile`` (``mode``, ``backend``, ``dynamic``, ``fullgraph``).

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


__all__ = ["CompileTimer", "compile_layers", "compile_seconds", "compiled_layers", "decoder_layers", "uncompile_layers"]
