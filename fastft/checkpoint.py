"""Gradient checkpointing modes for fastft models, hooked in per model instance.

``"offload"`` is the mode the offloaded checkpointer will serve; until it lands it is plain recompute
checkpointing, which keeps the same API and the same gradients.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_MODE_ATTR = "_fastft_checkpointing"
_ORIGINAL_ATTR = "_fastft_checkpointing_original"
_ALIASES = {False: None, None: None, True: "recompute", "offload": "offload", "unsloth": "offload"}


def resolve_mode(value: bool | str | None) -> str | None:
    """Normalise a ``use_gradient_checkpointing`` value.

    Args:
        value: ``False``/``None`` (off), ``True`` (recompute), ``"offload"`` or its alias ``"unsloth"``.

    Returns:
        ``None``, ``"recompute"`` or ``"offload"``.

    Raises:
        ValueError: Any other value.
    """
    key = value.lower() if isinstance(value, str) else value
    if isinstance(key, (bool, str, type(None))) and key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(
        f"fastft.get_peft_model: use_gradient_checkpointing={value!r} is not a mode; "
        "use False, True, 'offload' or 'unsloth' (an alias of 'offload')."
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

        def _guarded_enable(*args, **kwargs) -> None:
            chosen = getattr(model, _MODE_ATTR)
            log = logger.warning if chosen is None else logger.info
            log(
                "fastft keeps gradient checkpointing mode %r chosen in get_peft_model(use_gradient_checkpointing=...) "
                "over this request to enable it (%s %s).",
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
    # Non-reentrant checkpointing needs no requires_grad on the (frozen) embedding output.
    getattr(model, _ORIGINAL_ATTR)({"use_reentrant": False})


def get_mode(model: torch.nn.Module) -> str | None:
    """The checkpointing mode fastft set on ``model`` (``None`` when off or never set)."""
    return getattr(model, _MODE_ATTR, None)


def suspend(model: torch.nn.Module) -> None:
    """Turn checkpointing off for inference, keeping the chosen mode for :func:`resume`."""
    if is_enabled(model):
        _disable(model)


def resume(model: torch.nn.Module) -> None:
    """Turn the mode chosen in ``get_peft_model`` back on after :func:`suspend`."""
    if hasattr(model, _ORIGINAL_ATTR):
        _apply(model, get_mode(model))
