"""``fastft.apply``: an already-built transformers model (with or without a peft LoRA adapter) put on fastft's fused
path in place, so a trainer that builds its own model (transformers' ``Trainer``, trl's trainers, Axolotl) can train
it through fastft's kernels.

It does what :meth:`FastModel.from_pretrained` and :meth:`FastModel.get_peft_model` do to a model once it exists: the
shape contracts, the version-pinned patches of :mod:`fastft.registry` (per instance: module classes swapped, never a
parameter replaced, so an optimizer built before or after sees the same parameters), the patch report, and the
fallback to stock modules for a family fastft has no patches for. What it leaves alone is what the caller chose:
the adapter's weights, dtypes and config, which parameters train, and (unless asked) the checkpointing mode.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from peft import PeftModel

from fastft import patches  # noqa: F401  (registers the built-in patches)
from fastft.checkpointing import modes
from fastft.contracts import check_lora, guard_max_seq_length, guard_vision_inputs
from fastft.loading.dtypes import guard_bnb_cpu_repack
from fastft.loading.lora import base_model, check_base
from fastft.patches.causal_lm import FusedLossState
from fastft.registry import _REPORT_ATTR, APPLIED, DISABLED, apply_patches, patch_report

logger = logging.getLogger("fastft.integrations")

# peft adapter types whose layers the fused path reads (DoRA and other LoRA variants are LoRA adapters whose layers
# fall back one by one, as the patch report says).
LORA_TYPES = ("LORA",)
# The mode checkpointing takes when a trainer turns it on over a model applied with use_gradient_checkpointing=None.
FOLLOWED_MODE = "recompute"
_FOLLOW = "follow"


def refuse_other_adapters(model: torch.nn.Module) -> None:
    """Refuse a peft model with an adapter of a type other than LoRA, before anything is changed.

    fastft's fused kernels compute ``W x + s B A x``; an IA3, LoHa, LoKr, prompt-tuning or other adapter changes the
    computation in ways the fused modules would not reproduce, and silently training such a model on a partly stock
    path would hide that. The refusal says what to do instead.

    Raises:
        ValueError: An adapter whose ``peft_type`` is not LoRA, named with its type.
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    for name, config in configs.items():
        peft_type = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
        if str(peft_type).upper() not in LORA_TYPES:
            raise ValueError(
                f"fastft.apply: adapter {name!r} of {type(model).__name__} is a {peft_type} adapter; fastft's fused "
                f"path serves LoRA adapters ({', '.join(LORA_TYPES)}, DoRA included as a per-layer fallback). Train "
                "this model without fastft.apply, or replace the adapter with a peft LoraConfig. The model was "
                "left unchanged."
            )


def _patched(base: torch.nn.Module) -> bool:
    """Whether fastft's patches were already decided on ``base`` (by FastModel or an earlier apply), other than
    ``patch=False``."""
    report = getattr(base, _REPORT_ATTR, None)
    return report is not None and any(row["status"] != DISABLED for row in report)


def _take_trl_head(model: torch.nn.Module) -> None:
    """Route an LM-head forward trl assigned before the model was patched through fastft's wrapper.

    trl >= 1.15 assigns ``model.forward`` when its trainer is built; a fastft causal-LM class catches that assignment
    (:class:`~fastft.patches.causal_lm.FusedLossState`), but on a model patched after the trainer was built, the
    function already sits in the instance's ``__dict__``. Assigning it again lets the wrapper see it; the wrapper
    passes through anything that is not trl's function, so this is harmless when repeated.
    """
    for module in {id(m): m for m in (model, base_model(model))}.values():
        assigned = module.__dict__.get("forward")
        if assigned is not None and isinstance(module, FusedLossState) and module.fastft_forward_wrapper is not None:
            module.forward = assigned


def _follow_trainer_checkpointing(base: torch.nn.Module) -> None:
    """Keep the model's checkpointing as it is, and have a later request to turn it on (a Trainer's
    ``gradient_checkpointing=True``) run fastft's checkpointer in ``"recompute"`` mode.

    The request is routed through :func:`fastft.checkpointing.modes.set_mode`, which from then on keeps that mode (or
    one the caller sets later) over further requests, as for a model from :meth:`FastModel.get_peft_model`.
    """
    if modes.is_enabled(base):
        modes.set_mode(base, FOLLOWED_MODE)
        return
    name = modes._enable_method_name(base)
    # modes.set_mode calls the method it finds here as the original; it must be transformers' own.
    setattr(base, modes._ORIGINAL_ATTR, getattr(base, name))

    def enable(*args: Any, **kwargs: Any) -> None:
        modes.set_mode(base, getattr(base, modes._MODE_ATTR, FOLLOWED_MODE))

    setattr(base, name, enable)


def apply(
    model: torch.nn.Module,
    use_gradient_checkpointing: bool | str | None = None,
    max_seq_length: int | None = None,
    patch: bool = True,
) -> torch.nn.Module:
    """Put an already-built transformers model on fastft's fused path, in place; returns the same object.

    For a model a trainer or another library loaded: a ``PreTrainedModel``, or a ``peft.PeftModel`` with LoRA adapters
    (built by ``peft.get_peft_model``, ``PeftModel.from_pretrained`` or a trainer's ``peft_config``). Either order
    works: ``apply`` then ``peft.get_peft_model``, or the reverse; the fused modules read the LoRA layers at each
    forward. The same checks, registry records, patch report (:func:`fastft.patch_report`) and fallbacks as
    :class:`~fastft.FastModel` apply: a family fastft has no patches for runs stock transformers with one warning,
    and a layer the fused kernels cannot serve (dropout, DoRA, a bias, another quantiser) runs peft's forward, the
    report saying which and why.

    Nothing the caller chose is changed: the adapter's weights, dtypes and config, which parameters train, the
    device. No parameter is replaced (modules change class, not weights), so an optimizer built before or after
    ``apply`` trains the same tensors. A second call is a no-op apart from the checks and any new settings given.
    Over an fp16 base with fp16 adapters, call :func:`fastft.model.keep_trainable_fp32` yourself if a gradient scaler
    needs fp32 gradients; ``apply`` leaves dtypes as they are.

    Typical uses::

        fastft.apply(trainer.model)          # before trainer.train(), any transformers / trl trainer
        Trainer(..., callbacks=[fastft.integrations.FastftCallback()])

    Args:
        model: The model; a ``PeftModel`` is patched through its base model.
        use_gradient_checkpointing: ``None`` (default) keeps the model's checkpointing as it is, on fastft's
            checkpointer in ``"recompute"`` mode when it is on now or a trainer turns it on later
            (``TrainingArguments(gradient_checkpointing=True)``). Any value :meth:`FastModel.get_peft_model` takes
            (``False``, ``True``, ``"offload"``, ``"sqrt"``, ``"sqrt-offload"``) sets that mode and keeps it over a
            trainer's requests.
        max_seq_length: When given, every forward with a longer input raises :class:`fastft.ShapeContractError`
            naming both lengths (as for :meth:`FastModel.from_pretrained`); ``None`` sets no limit.
        patch: ``False`` records every patch as disabled and changes no module (the stock path, checks still run).

    Returns:
        ``model`` itself.

    Raises:
        ValueError: A model without a transformers config, a peft adapter that is not LoRA, an unknown checkpointing
            mode or a bad ``max_seq_length``. Raised before the model is changed.
        ShapeContractError: A projection, 4-bit weight or LoRA weight that does not fit the config.
        PatchSkippedError: ``FASTFT_STRICT=1`` and a patch that fits the model was skipped.
    """
    base = base_model(model)
    if not isinstance(model, torch.nn.Module) or getattr(base, "config", None) is None:
        raise ValueError(
            f"fastft.apply: expected a transformers PreTrainedModel or a peft PeftModel over one, got "
            f"{type(model).__name__} (no .config). Pass the model itself (trainer.model), not a wrapper such as "
            "DistributedDataParallel's (apply before accelerate or the trainer wraps it)."
        )
    try:
        mode = _FOLLOW if use_gradient_checkpointing is None else modes.resolve_mode(use_gradient_checkpointing)
    except ValueError as error:
        raise ValueError(f"fastft.apply: {error} (or None: follow the model and its trainer)") from error
    if max_seq_length is not None and (
        not isinstance(max_seq_length, int) or isinstance(max_seq_length, bool) or max_seq_length < 1
    ):
        raise ValueError(
            f"fastft.apply: max_seq_length must be a positive int or None (no limit), got {max_seq_length!r}; "
            "e.g. max_seq_length=2048."
        )
    refuse_other_adapters(model)
    check_base(model)
    if isinstance(model, PeftModel) or any(hasattr(m, "lora_A") for m in base.modules()):
        check_lora(model)
    # bitsandbytes' CPU repack of 4-bit weights computes in bf16 whatever the model's dtype (fastft.loading.dtypes).
    guard_bnb_cpu_repack(base, getattr(base, "dtype", torch.float32))
    if max_seq_length is not None:
        guard_max_seq_length(model, max_seq_length)
        guard_vision_inputs(model, max_seq_length)
        base.max_seq_length = max_seq_length
    first = not _patched(base)
    if first:
        apply_patches(base, enabled=patch)
    _take_trl_head(model)
    if mode == _FOLLOW:
        if not hasattr(base, modes._ORIGINAL_ATTR):
            _follow_trainer_checkpointing(base)
    else:
        modes.set_mode(base, mode)
    if first:
        applied = sum(row["status"] == APPLIED for row in patch_report(base))
        logger.info("fastft.apply: %s on fastft's path, %d patches applied", type(base).__name__, applied)
    return model


__all__ = ["FOLLOWED_MODE", "LORA_TYPES", "apply", "refuse_other_adapters"]
