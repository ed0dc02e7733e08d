"""Shape contracts: what each projection expects, checked early, with errors that name the module.

Every check raises :class:`ShapeContractError` (a ``ValueError``) whose message names the module (its qualified name
in the transformers model, e.g. ``model.layers.0.self_attn.q_proj``), the expected and the actual shape, and what to
change. ``FastModel`` runs them at ``from_pretrained``, ``get_peft_model`` and ``load_adapter``; three of them also
stay on the model as forward pre-hooks (a 4-bit weight's quant_state, ``max_seq_length``, and a batch's images against
its placeholder tokens and the vision config), because what they guard can change after loading or comes with each
batch.

Module names are relative to the transformers model (``PeftModel`` wrappers and LoRA ``base_layer`` levels are left
out), so they read the same as in ``model.named_modules()`` of the model ``from_pretrained`` returned.
"""

from __future__ import annotations

import torch

from fastft.contracts._layers import _base_model
from fastft.contracts.attention import AttentionShape, attention_shape, check_config, check_projections
from fastft.contracts.checkpoint import check_checkpoint
from fastft.contracts.lora import check_adapter_tensors, check_lora
from fastft.contracts.moe import check_adapter_layout, check_moe_layout
from fastft.contracts.quantized import check_quant_states, guard_4bit
from fastft.contracts.sequence import guard_max_seq_length
from fastft.contracts.vision import VISION_RULES, guard_vision_inputs

# The class lives in the kernel layer, which sits above this one and raises it too (a packed 4-bit weight
# without its quant_state); defining it there keeps one class for both layers.
from fastft.kernels.errors import ShapeContractError

__all__ = [
    "check_checkpoint",
    "AttentionShape",
    "ShapeContractError",
    "attention_shape",
    "check_adapter_layout",
    "check_adapter_tensors",
    "check_config",
    "check_lora",
    "check_model",
    "check_moe_layout",
    "check_projections",
    "check_quant_states",
    "guard_4bit",
    "guard_max_seq_length",
    "guard_vision_inputs",
    "VISION_RULES",
]


def check_model(model: torch.nn.Module) -> None:
    """Run the static contracts on a loaded model: config, projections, MoE experts, 4-bit quant_states, LoRA pairs.

    Args:
        model: A transformers model or a ``PeftModel``.

    Raises:
        ShapeContractError: The first contract that fails.
    """
    config = getattr(_base_model(model), "config", None)
    if config is not None:
        check_config(config, source=type(_base_model(model)).__name__ + ".config")
    check_projections(model)
    check_moe_layout(model)
    check_quant_states(model)
    check_lora(model)
