"""Gradient checkpointing for fastft models: the modes, and how fastft's checkpointer is put in place.

``use_gradient_checkpointing`` takes:

- ``False`` (off): every activation is kept.
- ``True`` (``"recompute"``): each decoder layer runs its forward without keeping its activations and keeps only its
  input, on the device; the backward recomputes the layer from it on the same fused path, under the RNG and autocast
  state of its forward (so dropout draws the same masks), and passes the gradients on.
- ``"offload"`` (alias ``"unsloth"``): the same, with each layer's input parked in pinned host memory
  (:mod:`fastft.checkpointing.offload`), except the last layer's, which the backward needs first. The backward brings
  the input back (the input of the layer before is already on its way while this one recomputes). Each parked input
  crosses once each way per step, on a side stream. On CPU the input stays where it is: the same as ``True``.
- ``"sqrt"``: the first layer of every ``ceil(sqrt(L))`` keeps its input on the device and the others are replayed
  from it in backward (:mod:`fastft.checkpointing.replay`): about ``2 sqrt(L)`` layer inputs instead of ``L``, for
  one more forward of the decoder.
- ``"sqrt-offload"``: ``"sqrt"`` with the kept inputs parked in pinned host memory as under ``"offload"`` (the last
  segment's stays on the device, its backward comes first); the replayed ones stay replayed. The device then holds
  one segment's inputs at a time and the host ``L / ceil(sqrt(L))``, for ``2 L / ceil(sqrt(L))`` copies per step
  instead of ``2 (L - 1)``. On CPU: the same as ``"sqrt"``.

All but ``False`` run on fastft's checkpointer (:mod:`fastft.checkpointing.layer`), which plugs into transformers' own
entry point: every ``GradientCheckpointingLayer`` calls ``self._gradient_checkpointing_func(layer_call, *args)`` when
checkpointing is on, and that attribute is set per module instance, so nothing outside the model changes. The
registry record ``checkpoint.offload`` holds the transformers versions this was tested on; where it does not apply,
every mode runs transformers' own recompute checkpointing (``torch.utils.checkpoint``), and the modes other than
``True`` say so in one warning.
"""

from __future__ import annotations

import logging

import torch

from fastft.checkpointing.layer import LayerCheckpoint
from fastft.checkpointing.offload import OffloadEngine
from fastft.checkpointing.replay import segment_length
from fastft.registry import PatchRecord, patch_report, register

# The logger keeps the name users filter on from before the move.
logger = logging.getLogger("fastft.checkpoint")

_MODE_ATTR = "_fastft_checkpointing"
_ORIGINAL_ATTR = "_fastft_checkpointing_original"
_ENGINE_ATTR = "_fastft_offload_engine"
_WARNED_ATTR = "_fastft_offload_warned"
_ALIASES = {
    False: None,
    None: None,
    True: "recompute",
    "recompute": "recompute",
    "offload": "offload",
    "unsloth": "offload",
    "sqrt": "sqrt",
    "sqrt-offload": "sqrt-offload",
}
MODES = ("recompute", "offload", "sqrt", "sqrt-offload")
PATCH_NAME = "checkpoint.offload"


def resolve_mode(value: bool | str | None) -> str | None:
    """Normalise a ``use_gradient_checkpointing`` value.

    Args:
        value: ``False``/``None`` (off), ``True`` or ``"recompute"``, ``"offload"`` or its alias ``"unsloth"``,
            ``"sqrt"``, or ``"sqrt-offload"`` (any case).

    Returns:
        ``None`` or one of :data:`MODES`: ``"recompute"``, ``"offload"``, ``"sqrt"``, ``"sqrt-offload"``.

    Raises:
        ValueError: Any other value.
    """
    key = value.lower() if isinstance(value, str) else value
    if isinstance(key, (bool, str, type(None))) and key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(
        f"fastft.get_peft_model: use_gradient_checkpointing={value!r} is not a mode; "
        "use False, True (or 'recompute'), 'offload' or 'unsloth' (an alias of 'offload'), 'sqrt', or 'sqrt-offload'."
    )


def _enable_method_name(model: torch.nn.Module) -> str:
    # transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    return (
        "activation_checkpointing_enable"
        if hasattr(model, "activation_checkpointing_enable")
        else "gradient_checkpointing_enable"
    )


def _disable(model: torch.nn.Module) -> None:
    name = (
        "activation_checkpointing_disable"
        if hasattr(model, "activation_checkpointing_disable")
        else "gradient_checkpointing_disable"
    )
    getattr(model, name)()


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether checkpointing is on in ``model`` (any transformers version)."""
    # transformers 5.23 deprecates is_gradient_checkpointing in favour of is_activation_checkpointing.
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def set_mode(model: torch.nn.Module, mode: str | None) -> None:
    """Turn checkpointing on or off on a transformers model and keep that choice under a Trainer.

    ``transformers.Trainer`` (and so trl's ``SFTTrainer``, whose config defaults to checkpointing on) calls the
    model's checkpointing entry point at start-up. That call is routed here so the mode chosen in
    ``get_peft_model`` stays in force; a request to turn on what the user turned off is logged as a warning.

    Args:
        model: The ``PreTrainedModel`` (not the peft wrapper).
        mode: A value from :func:`resolve_mode`.
    """
    name = _enable_method_name(model)
    if not hasattr(model, _ORIGINAL_ATTR):
        setattr(model, _ORIGINAL_ATTR, getattr(model, name))

        told: set[str | None] = set()

        def _guarded_enable(*args, **kwargs) -> None:
            chosen = getattr(model, _MODE_ATTR)
            # trl's preference trainers re-enable checkpointing around every reference forward: say it once per mode.
            if chosen not in told:
                told.add(chosen)
                log = logger.warning if chosen is None else logger.info
                log(
                    "fastft keeps gradient checkpointing mode %r chosen in "
                    "get_peft_model(use_gradient_checkpointing=...) over this request to enable it (%s %s).",
                    chosen,
                    args,
                    kwargs,
                )
            _apply(model, chosen)

        setattr(model, name, _guarded_enable)
    setattr(model, _MODE_ATTR, mode)
    _apply(model, mode)


def _apply(model: torch.nn.Module, mode: str | None) -> None:
    if mode is None:
        suspend(model)
        return
    hooked = _input_grad_hooks(model)
    # Non-reentrant checkpointing needs no requires_grad on the (frozen) embedding output.
    getattr(model, _ORIGINAL_ATTR)({"use_reentrant": False})
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is not None and hooked is not None and _input_grad_hooks(model) - hooked:
        # transformers' enable call made the embedding output require grad (reentrant checkpointing needs that).
        # fastft's checkpointer ties the layer's trainable parameters into its node instead, so that would only make
        # the first layer compute an input gradient nobody reads; undo what that call added, not a hook set before.
        model.disable_input_require_grads()
    if engine is None:
        # True asked for transformers' recompute checkpointing, which is what runs: nothing to warn about.
        if mode != "recompute" and not getattr(model, _WARNED_ATTR, False):
            setattr(model, _WARNED_ATTR, True)
            logger.warning(
                "fastft: use_gradient_checkpointing=%r runs transformers' recompute checkpointing on this "
                "model, which keeps every layer input on the device, because %s.",
                mode,
                _why_not_hooked(model),
            )
        return
    install(model, engine, mode)


def _input_grad_hooks(model: torch.nn.Module) -> set[int] | None:
    """The ids of the forward hooks on the model's input embeddings (``None``: it has none to look at)."""
    if not (hasattr(model, "get_input_embeddings") and hasattr(model, "disable_input_require_grads")):
        return None
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:
        # transformers' documented answer of a model without input embeddings: nothing there to undo.
        return None
    return set(embeddings._forward_hooks) if isinstance(embeddings, torch.nn.Module) else None


def _why_not_hooked(model: torch.nn.Module) -> str:
    try:
        row = next(row for row in patch_report(model) if row["name"] == PATCH_NAME)
    except ValueError:
        return "the model was not loaded through FastModel.from_pretrained"
    return f"patch {PATCH_NAME} is {row['status']} ({row['reason']}; fastft.patch_report(model) lists every patch)"


def get_mode(model: torch.nn.Module) -> str | None:
    """The checkpointing mode fastft set on ``model`` (``None`` when off or never set)."""
    return getattr(model, _MODE_ATTR, None)


def suspend(model: torch.nn.Module) -> None:
    """Turn checkpointing off for inference, keeping the chosen mode for :func:`resume`; free the host buffers."""
    if is_enabled(model):
        _disable(model)
    release_buffers(model)


def release_buffers(model: torch.nn.Module) -> None:
    """Free the pinned host buffers the offloaded checkpointer keeps between steps (they return on the next step)."""
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is not None:
        engine.release()


def resume(model: torch.nn.Module) -> None:
    """Turn the mode chosen in ``get_peft_model`` back on after :func:`suspend`."""
    if hasattr(model, _ORIGINAL_ATTR):
        _apply(model, get_mode(model))


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def install(model: torch.nn.Module, engine: OffloadEngine, mode: str = "offload") -> int:
    """Give every checkpointed decoder layer of ``model`` its :class:`LayerCheckpoint`; returns how many.

    Called after transformers' own enable call, which set the stock function on each layer (and left out the layers
    its ``every_n_layers`` skips).

    Args:
        model: The transformers model.
        engine: Its offload engine.
        mode: One of :data:`MODES`.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(
            f"fastft.checkpointing.modes.install: mode={mode!r}; expected one of {MODES} (see resolve_mode)."
        )
    layers = [layer for layer in _checkpointed_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    count = len(layers)
    segment = segment_length(count) if mode in ("sqrt", "sqrt-offload") else 0
    if mode == "offload":
        # The last layer's backward comes first: a copy of its input would have nothing to overlap.
        parked = range(count - 1)
    elif mode == "sqrt-offload":
        # Likewise the last segment's kept input, which its backward replays from at once.
        parked = range(((count - 1) // segment) * segment if count else 0)
    else:
        parked = range(0)
    engine.chain.clear()
    for slot, layer in enumerate(layers):
        layer._gradient_checkpointing_func = LayerCheckpoint(
            layer, slot, engine, keep_on_device=slot not in parked, segment=segment
        )
    return count


def engine_of(model: torch.nn.Module) -> OffloadEngine | None:
    """The model's offload engine (``None`` when the ``checkpoint.offload`` patch did not apply)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, _ENGINE_ATTR, None)


def _has_checkpointed_layers(model: torch.nn.Module) -> str | None:
    if not _checkpointed_layers(model):
        return f"{type(model).__name__} has no GradientCheckpointingLayer (transformers' checkpointed decoder layer)"
    return None


def _attach_engine(model: torch.nn.Module) -> int:
    setattr(model, _ENGINE_ATTR, OffloadEngine())
    return len(_checkpointed_layers(model))


# transformers gives each checkpointed layer its function through _set_gradient_checkpointing; the layer calls it as
# func(layer_call, *args) in every tested range (from __call__ up to 5.22, from a wrapped forward from 5.23).
_TARGET = "transformers.modeling_utils.PreTrainedModel._set_gradient_checkpointing"
_FINGERPRINT = "(self, enable=True, gradient_checkpointing_func=torch.utils.checkpoint.checkpoint)"
for _versions, _fingerprint in (
    (">=4.53.3,<4.58", _FINGERPRINT),
    (">=5.5.4,<5.16", _FINGERPRINT),
    (">=5.16,<5.25", _FINGERPRINT[:-1] + ", every_n_layers=1)"),
):
    register(
        PatchRecord(
            name=PATCH_NAME,
            target=_TARGET,
            versions={"transformers": _versions},
            fingerprint=_fingerprint,
            applies_to=_has_checkpointed_layers,
            apply=_attach_engine,
            replacement=LayerCheckpoint,
        )
    )
