"""Which linear layers of a vision-language model get LoRA: the language model and / or the vision tower (with its
merger), their attention and / or MLP projections, as one peft ``target_modules`` pattern.

A name list such as Llama's ``("q_proj", ..., "down_proj")`` cannot say this: Qwen2.5-VL's vision blocks have their
own ``gate_proj`` / ``up_proj`` / ``down_proj``, which peft would adapt too. The pattern names full module paths
(layer numbers generalised), so it reads the same in plain peft.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fastft.loading.vision import VISION_MODULES

# A linear layer's parent module name, last part that is not a list index: attention or MLP. Mergers count as MLP:
# Qwen2.5-VL's ``merger.mlp`` Sequential, Qwen3-VL's ``merger`` and ``deepstack_merger_list.<i>`` (linear_fc1 / 2).
# Llama 3.2 Vision's cross-attention (``cross_attn``: q from the text, k / v from the image) is the language model's
# attention too: finetune_attention_modules adapts it with the self-attention.
_ATTENTION_PARENTS = frozenset({"self_attn", "attn", "attention", "cross_attn"})
_MLP_PARENTS = frozenset({"mlp", "feed_forward", "merger", "deepstack_merger_list"})


@dataclass(frozen=True)
class VisionLoRA:
    """The four switches of :func:`fastft.loading.lora.get_peft_model` for vision-language models.

    Attributes:
        language: LoRA on the language model's layers.
        vision: LoRA on the vision tower's blocks and its merger (projector).
        attention: On the attention projections (q / k / v / o, Llama 3.2 Vision's cross-attention included; the
            tower's packed ``qkv`` and ``proj``).
        mlp: On the MLP projections (gate / up / down; the tower's fc1 / fc2; the mergers' linear layers, Qwen3-VL's
            DeepStack ones too, Llama 3.2 Vision's one-layer ``multi_modal_projector``).
    """

    language: bool = True
    vision: bool = False
    attention: bool = True
    mlp: bool = True

    def check(self) -> None:
        """Raise ValueError for switches that are not booleans or that select nothing."""
        for name, value in vars(self).items():
            if not isinstance(value, bool):
                raise ValueError(f"fastft.get_peft_model: finetune_*={value!r} for {name}: expected True or False.")
        if not (self.language or self.vision) or not (self.attention or self.mlp):
            raise ValueError(
                f"fastft.get_peft_model: these switches select no layer (finetune_language_layers={self.language}, "
                f"finetune_vision_layers={self.vision}, finetune_attention_modules={self.attention}, "
                f"finetune_mlp_modules={self.mlp}); turn on at least one of language / vision and one of "
                "attention / MLP. The model was left without adapters."
            )


def vision_towers(model: torch.nn.Module) -> tuple[str, ...]:
    """The module names of ``model``'s vision side (tower and merger), empty for a text model."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    names = {name for name, _ in model.named_modules()}
    return tuple(name for name in VISION_MODULES.get(model_type, ()) if name in names)


def _role(name: str) -> str | None:
    parent = next((part for part in reversed(name.split(".")[:-1]) if not part.isdigit()), "")
    if parent in _ATTENTION_PARENTS:
        return "attention"
    if parent in _MLP_PARENTS:
        return "mlp"
    return None


def target_pattern(model: torch.nn.Module, switches: VisionLoRA) -> tuple[str, list[str]]:
    """``(pattern, names)``: a peft ``target_modules`` regular expression matching the linear layers ``switches``
    select, and those layers' names.

    Raises:
        ValueError: The switches select no linear layer of this model.
    """
    switches.check()
    towers = vision_towers(model)
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        # A projector that is one linear layer (Llama 3.2 Vision's) counts with the MLPs, as Qwen2.5-VL's merger MLP.
        role = "mlp" if name in towers else _role(name)
        in_tower = any(name == tower or name.startswith(f"{tower}.") for tower in towers)
        side = switches.vision if in_tower else switches.language
        kind = {"attention": switches.attention, "mlp": switches.mlp}.get(role, False)
        if side and kind:
            chosen.append(name)
    if not chosen:
        raise ValueError(
            f"fastft.get_peft_model: the finetune_* switches select no linear layer of {type(model).__name__} "
            f"({switches}); pass target_modules=[...] instead. The model was left without adapters."
        )
    # Layer numbers generalised: one alternative per distinct path shape keeps the pattern short.
    shapes = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) for name in chosen})
    return f"^(?:{'|'.join(shapes)})$", chosen


__all__ = ["VisionLoRA", "target_pattern", "vision_towers"]
