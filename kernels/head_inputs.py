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
    started: TargetRangeCheck | None = None,
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
        started: The range check of these targets, started earlier (:class:`TargetRangeCheck`); its verdict is read
            instead of checking here, which on a GPU would wait for every kernel queued before this call.

    Raises:
        ShapeContractError: A shape that does not fit, or a scored target outside [0, V).
        TypeError: Unsupported or mismatched dtypes.
        ValueError: Tensors on different devices, or ``started`` was made for other targets.
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
    if started is not None:
        started.expect(name, vocab, ignore_index, flat.numel())
        failed = started.failed()
    else:
        # Meta tensors (the static compile check) have shapes but no values to check.
        failed = not flat.is_meta and bool(_out_of_range(flat, vocab, ignore_index).any())
    if failed:
        offending = flat[_out_of_range(flat, vocab, ignore_index)]
        raise ShapeContractError(
            f"{name}: {what} must lie in [0, {vocab}) (the rows of weight [{vocab}, {width}]) or equal "
            f"ignore_index={ignore_index}; found {offending.numel()} outside, e.g. {offending[0].item()}. A tokenizer "
            "with added tokens needs model.resize_token_embeddings; padding must be masked with ignore_index."
        )
    return hidden.reshape(-1, width), flat


def _out_of_range(flat: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """Where a scored target lies outside [0, vocab)."""
    return (flat != ignore_index) & ((flat < 0) | (flat >= vocab))


class TargetRangeCheck:
    """The range check of an LM head's targets, started where the targets are known and read where they are used.

    Reading a GPU tensor's value waits for every kernel queued before it. A loss that checks its labels after the
    model's forward therefore drains the queue between forward and backward, and the backward then starts with the
    host no further ahead than the GPU. Started at the top of the forward, the check's few kernels run among the
    step's first; its verdict is copied to pinned host memory behind a CUDA event, which has long completed by the
    time the loss reads it. On the CPU (or meta) the check runs at once and reading it costs nothing extra.

    Args:
        targets: Integer token ids, already shifted, on any device.
        vocab: The head's rows V; a scored target must lie in [0, V).
        ignore_index: The target value of positions not scored.
    """

    def __init__(self, targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
        self.vocab, self.ignore_index, self.numel = vocab, ignore_index, targets.numel()
        self._event: torch.cuda.Event | None = None
        self._flag: torch.Tensor | None = None
        self._failed = False
        if targets.is_meta or not self.numel:
            return
        bad = _out_of_range(targets.reshape(-1), vocab, ignore_index).any()
        if bad.is_cuda:
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(bad, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(bad.device))
        else:
            # Nothing to overlap with off a GPU: the verdict now, so the loss reads no tensor at all.
            self._failed = bool(bad)

    def expect(self, name: str, vocab: int, ignore_index: int, numel: int) -> None:
        """Raise ValueError unless this check was started for targets of this head (V, ignore_index, count)."""
        if (self.vocab, self.ignore_index, self.numel) != (vocab, ignore_index, numel):
            raise ValueError(
                f"{name}: the started target check covers {self.numel} targets against vocab {self.vocab} with "
                f"ignore_index={self.ignore_index}, but the head has {numel} targets, vocab {vocab} and "
                f"ignore_index={ignore_index}; start it on the targets passed here (TargetRangeCheck(targets, "
                "weight.shape[0], ignore_index)) or pass none."
            )

    def failed(self) -> bool:
        """Whether a scored target lies outside [0, V) (waits only for the check's own kernels)."""
        if self._event is not None:
            self._event.synchronize()
            self._failed, self._event = bool(self._flag), None
        return self._failed


__all__ = ["FLOAT_DTYPES", "TargetRangeCheck", "check_head_inputs"]
