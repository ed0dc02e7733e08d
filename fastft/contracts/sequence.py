"""max_seq_length: a forward pre-hook on the decoder backbone that refuses longer inputs by name."""

from __future__ import annotations

import torch

from fastft.contracts._layers import _base_model
from fastft.kernels.errors import ShapeContractError


def _longest_segment(position_ids: torch.Tensor) -> int:
    """Longest run of consecutive positions in each row: the longest sequence when several are packed in a row."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1] + 1
    longest = 0
    for row in starts:
        edges = torch.cat([row.nonzero().flatten(), row.new_tensor([row.numel()], dtype=torch.long)])
        longest = max(longest, int(edges.diff().max()))
    return longest


class _MaxSeqLengthGuard:
    """Forward pre-hook (with kwargs) of the decoder backbone: refuse inputs longer than ``max_seq_length``."""

    def __init__(self, name: str, max_seq_length: int) -> None:
        self.name = name
        self.max_seq_length = max_seq_length

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(input_ids, torch.Tensor):
            what, tensor, length = "input_ids", input_ids, input_ids.shape[-1]
        elif isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
            what, tensor, length = "inputs_embeds", embeds, embeds.shape[-2]
        else:
            return
        if length <= self.max_seq_length:
            return
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.shape[-1] == length:
            # Padding-free batches put several sequences in one row; each restarts its positions at 0.
            length = _longest_segment(position_ids)
            if length <= self.max_seq_length:
                return
            what += " (longest packed sequence, from position_ids)"
        raise ShapeContractError(
            f"{self.name} ({type(module).__name__}): expected at most max_seq_length={self.max_seq_length} tokens per "
            f"sequence, got {length} in {what} of shape {list(tensor.shape)}. Truncate when tokenizing "
            f"(tokenizer(..., truncation=True) stops at tokenizer.model_max_length; with trl, "
            f"SFTConfig(max_length={self.max_seq_length})), or load with a larger max_seq_length "
            f"(FastModel.from_pretrained(..., max_seq_length={length}))."
        )


def guard_max_seq_length(model: torch.nn.Module, max_seq_length: int) -> torch.nn.Module:
    """Make every forward with a sequence longer than ``max_seq_length`` raise :class:`ShapeContractError`.

    The check is a forward pre-hook on the decoder backbone (the module named by ``base_model_prefix``, e.g.
    ``model`` in ``LlamaForCausalLM``), so it also fires when a trainer calls the backbone directly (trl >= 1.15
    does, for its fused LM head). It looks at the length of this call's input only (``input_ids`` or
    ``inputs_embeds``, sequence dimension): generation with a KV cache feeds one token per step and is not limited.
    A row that packs several sequences (padding-free batches with ``position_ids`` restarting at 0) is judged by
    its longest sequence. Calling it again replaces the limit.

    Args:
        model: A transformers model or a ``PeftModel``.
        max_seq_length: The longest sequence accepted.

    Returns:
        The module the hook is on.
    """
    base = _base_model(model)
    prefix = getattr(base, "base_model_prefix", "")
    backbone = getattr(base, prefix, None) if prefix else None
    if not isinstance(backbone, torch.nn.Module):
        backbone, prefix = base, type(base).__name__
    for hook in backbone._forward_pre_hooks.values():
        if isinstance(hook, _MaxSeqLengthGuard):
            hook.max_seq_length = max_seq_length
            return backbone
    backbone.register_forward_pre_hook(_MaxSeqLengthGuard(prefix, max_seq_length), with_kwargs=True)
    return backbone
