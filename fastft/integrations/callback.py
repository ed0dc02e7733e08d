"""``FastftCallback``: :func:`fastft.apply` run by a transformers ``Trainer`` (and so by trl's trainers) itself."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from fastft.integrations.apply_model import apply


class FastftCallback(TrainerCallback):
    """Puts the trainer's model on fastft's fused path when the trainer is built.

    ``Trainer(..., callbacks=[FastftCallback()])``, or ``SFTTrainer(..., callbacks=[FastftCallback()])``: the model
    is patched at the end of the trainer's ``__init__`` (``on_init_end``), before ``train()`` builds the optimizer
    and turns checkpointing on, so a ``gradient_checkpointing=True`` in the arguments runs fastft's checkpointer. A
    trainer given a ``peft_config`` has made its ``PeftModel`` by then, and that is what is patched. ``on_train_begin``
    calls :func:`fastft.apply` again, a no-op unless the model was replaced in between. Equivalent to calling
    ``fastft.apply(trainer.model)`` before ``trainer.train()``.

    Args:
        **apply_kwargs: Passed to :func:`fastft.apply` (``use_gradient_checkpointing``, ``max_seq_length``,
            ``patch``).
    """

    def __init__(self, **apply_kwargs: Any) -> None:
        self.apply_kwargs = apply_kwargs

    def _apply(self, model: torch.nn.Module | None) -> None:
        if model is None:
            raise ValueError(
                "fastft.integrations.FastftCallback: the trainer passed no model to its callbacks; call "
                "fastft.apply(trainer.model) before trainer.train() instead."
            )
        apply(model, **self.apply_kwargs)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Patch the model the trainer was built with."""
        self._apply(kwargs.get("model"))

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Patch the model again if it was replaced after the trainer was built (otherwise a no-op)."""
        self._apply(kwargs.get("model"))


__all__ = ["FastftCallback"]
