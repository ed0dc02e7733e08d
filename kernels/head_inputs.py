"""The input checks every LM-head kernel shares (the fused cross-entropy and the fused log-probs): the head weight,
the hidden states, the targets and an optional bias, checked before any tile is computed, with errors that name the
caller, both shapes and the fix."""

from __future__ import annotations

import torch

from fastft.kernels.errors import ShapeContractError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_head_inputs(
    name: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    *,
    bias: torch.Tensor | None = None,
    what: str = "targets",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check an LM head's inputs; return hidden as [T, H] and the targets as contiguous int64 [T] on its device.

    Args:
        name: The caller, first in every message.
        hidden: [..., H] final hidden states.
        weight: [V, H] LM-head weight (or the tied embedding matrix).
        targets: Integer token ids with ``hidden``'s leading shape, ``ignore_index`` where a position is not scored.
        ignore_index: The target value of positions not scored.
        bias: Optional [V] head bias.
        what: What the caller calls its targets (``"labels"`` for a loss), in the messages.

    Raises:
        ShapeContractError: A shape that does not fit, or a scored target outside [0, V).
        TypeError: Unsupported or mismatched dtypes.
        ValueError: Tensors on different devices.
    """
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ShapeContractError(
            f"{name}: weight must be the LM head [vocab, hidden], got shape {tuple(weight.shape)} (vocab must be at "
            "least 1); pass lm_head.weight (nn.Linear stores [out_features, in_features]) or the tied embedding "
            "matrix."
        )
    vocab, width = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != width:
        raise ShapeContractError(
            f"{name}: hidden must be [..., {width}] to match weight [{vocab}, {width}], got shape "
            f"{tuple(hidden.shape)}; pass the final hidden states (after the last norm), not the logits."
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ShapeContractError(
            f"{name}: {what} must have hidden's leading shape {tuple(hidden.shape[:-1])}, got "
            f"{tuple(targets.shape)}; give one target token id per hidden row, already shifted ({what}[..., t] is "
            "the token after position t), with ignore_index where a position is not scored."
        )
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ShapeContractError(
            f"{name}: bias must be [{vocab}] (one per row of weight [{vocab}, {width}]), got shape "
            f"{tuple(bias.shape)}; pass lm_head.bias, or None for a head without bias."
        )
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(
            f"{name}: hidden and weight must share one dtype among float32, float16, bfloat16; got "
            f"{hidden.dtype} and {weight.dtype}. Cast one of them."
        )
    if bias is not None and not bias.dtype.is_floating_point:
        raise TypeError(f"{name}: bias must be floating point, got dtype {bias.dtype}.")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"{name}: {what} must be integer token ids, got dtype {targets.dtype}.")
    if hidden.device != weight.device or (bias is not None and bias.device != weight.device):
        raise ValueError(
            f"{name}: hidden ({hidden.device}) and weight ({weight.device})"
            + ("" if bias is None else f" and bias ({bias.device})")
            + " must be on one device; move the LM head or the hidden states."
        )
    # Targets may live elsewhere (model parallel, a collator on the CPU); transformers moves them too.
    flat = targets.reshape(-1).to(device=hidden.device, dtype=torch.int64).contiguous()
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    # Meta tensors (the static compile check) have shapes but no values to check.
    if not flat.is_meta and bool(bad.any()):
        offending = flat[bad]
        raise ShapeContractError(
            f"{name}: {what} must lie in [0, {vocab}) (the rows of weight [{vocab}, {width}]) or equal "
            f"ignore_index={ignore_index}; found {offending.numel()} outside, e.g. {offending[0].item()}. A tokenizer "
            "with added tokens needs model.resize_token_embeddings; padding must be masked with ignore_index."
        )
    return hidden.reshape(-1, width), flat


__all__ = ["FLOAT_DTYPES", "check_head_inputs"]
