"""Fused linear cross-entropy: the causal-LM loss of ``hidden @ weightᵀ`` without the [tokens, vocab] logits.

The LM head of a 49k-vocabulary model on 4096 tokens produces 4096 × 49152 fp32 logits (805 MB), and the stock
loss saves them (or their log-softmax) for backward. Here the tokens are processed in chunks: each chunk's logits are
computed into one reused buffer, a row kernel turns them into the row losses and, in place, into each row's gradient
softmax − onehot (zero for ignored rows), and two matmuls fold that gradient into ``d hidden`` and ``d weight`` right
away. Backward then only scales the two saved gradients by ``grad_output`` / N (N: the non-ignored count or
``num_items_in_batch``); nothing of size [tokens, vocab] outlives the chunk that made it.

Semantics follow transformers' ``ForCausalLMLoss`` / ``fixed_cross_entropy`` (5.x): logits in fp32; the mean over
non-ignored tokens, or the sum divided by ``num_items_in_batch`` when it is given (what makes gradient accumulation
exact). Labels are taken as already aligned with ``hidden``: the caller shifts them.

``softcap=c`` (Gemma 2/3's ``final_logit_softcapping``) caps the logits at ``tanh(logits / c) * c`` before the loss,
inside the row kernel, so the capped logits are never materialised either. The gradient of a capped logit is the
softmax gradient times ``1 - tanh(logits / c)²``, computed as ``sech²`` (``4e / (1 + e)²`` with ``e = exp(-2|u|)``)
rather than ``1 - t²``, which loses its digits where ``|tanh|`` is close to 1.

Deliberate differences from ``F.cross_entropy``:

- every label ignored (and no ``num_items_in_batch``): the loss is 0.0 with zero gradients, not NaN. A batch of pure
  padding or prompt tokens then leaves the weights alone instead of poisoning them.
- a label outside [0, vocab) that is not ``ignore_index`` raises :class:`ShapeContractError` before any matmul. On
  CUDA torch would trip a device-side assert that kills the CUDA context, and a Triton row kernel would read past the
  row. The check is a reduction over the labels; reading its verdict waits for the GPU, unless the caller started it
  earlier with :class:`~fastft.kernels.head_inputs.TargetRangeCheck` (the patched causal-LM forward does, before the
  backbone), so that the loss does not drain the queue between the forward and the backward.
"""

from __future__ import annotations

import math
import numbers

import torch

from fastft.kernels import dispatch
from fastft.kernels.custom_ops import math_backward
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.head_inputs import TargetRangeCheck, check_head_inputs

# Bound on one chunk's fp32 logits. 256 MiB keeps the GEMMs hundreds of rows tall (1024 rows at a 49k vocabulary,
# 512 at Llama 3's 128k), which is where they reach full speed on a GPU, while staying a small fraction of what the
# unchunked logits cost (805 MB for 4096 tokens × 49152 in fp32, 8.4 GB for 16k tokens × 128k).
LOGITS_CHUNK_BYTES = 256 * 1024 * 1024
# Vocabulary columns one Triton program handles per step of its loop over the row.
_MAX_BLOCK = 4096


@triton.jit
def _tanh_softcap(x, cap):
    """``(tanh(x / cap) * cap, 1 - tanh(x / cap)²)`` in fp32, from ``exp`` alone.

    Neither ``tl`` nor ``tl.math`` has a tanh in triton 3.9, and ``libdevice.tanh`` returns None in the interpreter.
    ``e = exp(-2|u|)`` lies in (0, 1], so nothing overflows for any finite or infinite ``u``; below |u| = 1/8, where
    ``1 - e`` would cancel, tanh is its odd Taylor series (truncation error under 1e-11 relative). The derivative is
    ``sech²(u) = 4e / (1 + e)²``, accurate also where tanh is close to ±1.
    """
    u = x / cap
    magnitude = tl.abs(u)
    e = tl.exp(-2.0 * magnitude)
    one_plus_e = 1.0 + e
    u2 = u * u
    series = magnitude * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (62.0 / 2835.0)))))
    t = tl.where(magnitude < 0.125, series, (1.0 - e) / one_plus_e)
    t = tl.where(u < 0.0, -t, t)
    return t * cap, 4.0 * e / (one_plus_e * one_plus_e)


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    labels_ptr,
    loss_ptr,
    n_cols,
    ignore_index,
    softcap,
    WRITE_GRAD: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: its loss (lse − target logit) and, if asked, softmax − onehot over the row.

    With ``SOFTCAP`` the row's logits are first capped at ``tanh(x / softcap) * softcap`` (recomputed in each pass,
    never stored) and the gradient is multiplied by the cap's derivative; without it ``softcap`` is unused.
    """
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    grad_row = grad_ptr + row * grad_row_stride
    label = tl.load(labels_ptr + row)
    offsets = tl.arange(0, BLOCK)
    if SOFTCAP:
        # A Python float argument is a plain float in the interpreter (no .to()); tl.cast works in both.
        cap = tl.cast(softcap, tl.float32)

    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                cols = start + offsets
                tl.store(
                    grad_row + cols,
                    tl.zeros([BLOCK], dtype=tl.float32).to(grad_ptr.dtype.element_ty),
                    mask=cols < n_cols,
                )
        return

    # Online log-sum-exp: one read of the row instead of a max pass and a sum pass.
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        if SOFTCAP:
            # Masked columns load 0 and are set to -inf after the cap (tanh would turn -inf into -softcap).
            x = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
            x, _ = _tanh_softcap(x, cap)
            x = tl.where(mask, x, float("-inf"))
        else:
            x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        # Every block holds at least one real column, so new_max is finite and exp(-inf - new_max) is a clean 0.
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    # Read before the gradient pass below overwrites the row (the gradient may be written in place).
    target = tl.load(logits_row + label).to(tl.float32)
    if SOFTCAP:
        target, _ = _tanh_softcap(target, cap)
    tl.store(loss_ptr + row, lse - target)

    if WRITE_GRAD:
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                x, slope = _tanh_softcap(x, cap)
            prob = tl.exp(x - lse)
            grad = tl.where(cols == label, prob - 1.0, prob)
            if SOFTCAP:
                grad = grad * slope
            tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _cross_entropy_rows_triton(
    logits: torch.Tensor,
    grad: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    loss_out: torch.Tensor,
    write_grad: bool,
    softcap: float | None = None,
) -> None:
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block = min(_MAX_BLOCK, triton.next_power_of_2(n_cols))
    _cross_entropy_rows_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        labels,
        loss_out,
        n_cols,
        ignore_index,
        1.0 if softcap is None else float(softcap),
        WRITE_GRAD=write_grad,
        SOFTCAP=softcap is not None,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )


def _cross_entropy_rows_torch(
    logits: torch.Tensor,
    grad: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    loss_out: torch.Tensor,
    write_grad: bool,
    softcap: float | None = None,
) -> None:
    """The row kernel in torch ops: same outputs; ``logits`` is scratch (overwritten, in place, like the kernel).

    The log-softmax is taken in place (``out=logits``: every row is read before its first write), so the transient
    memory of the CPU path stays at the one chunk buffer, and in few operators: on a model small enough that the loss
    costs what its operator calls cost, each one counts. The gradient is ``exp`` of it, ``exp(x - lse)``, as the
    Triton kernel forms it. A soft cap that needs gradients costs one more chunk-sized temporary, the cap's
    derivative, which the kernel recomputes instead.
    """
    slope = None
    if softcap is not None:
        # The same ops as tanh(logits / c) * c, in place; sech²(u) = 1 / cosh²(u) is the derivative of tanh(u)
        # (cosh overflowing to inf for |u| > 89 gives the right limit, 0).
        scaled = logits.div_(softcap)
        if write_grad:
            slope = torch.cosh(scaled).square_().reciprocal_()
        logits = scaled.tanh_().mul_(softcap)
    ignored = labels == ignore_index
    safe_labels = labels.masked_fill(ignored, 0).unsqueeze(1)
    log_probs = torch.log_softmax(logits, 1, out=logits)
    torch.neg(log_probs.gather(1, safe_labels).squeeze(1), out=loss_out).masked_fill_(ignored, 0.0)
    if not write_grad:
        return
    probs = log_probs.exp_()
    ignored_rows = ignored.unsqueeze(1)
    # softmax − onehot: −1 at each scored target (0 − 1 = −1 where scored, 1 − 1 = 0 where ignored).
    probs.scatter_add_(1, safe_labels, ignored_rows.to(probs.dtype).sub_(1))
    probs.masked_fill_(ignored_rows, 0.0)
    if slope is not None:
        probs.mul_(slope)
    if grad is not probs:
        grad.copy_(probs)


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
    """Rows per chunk: the largest power of two whose fp32 logits fit :data:`LOGITS_CHUNK_BYTES`, at most the tokens.

    Args:
        num_tokens: Tokens in the call (all leading dimensions of ``hidden`` multiplied).
        vocab_size: Rows of the LM-head weight.

    Returns:
        A chunk size of at least 1.
    """
    rows = max(1, LOGITS_CHUNK_BYTES // (4 * max(1, vocab_size)))
    rows = 1 << (rows.bit_length() - 1)
    return max(1, min(rows, num_tokens))


def _check_softcap(name: str, softcap: float | None) -> None:
    if softcap is None:
        return
    is_number = isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
    if not (is_number and math.isfinite(softcap) and softcap > 0):
        raise ValueError(
            f"{name}: softcap must be a finite number > 0 or None, got {softcap!r}; pass the model config's "
            "final_logit_softcapping (e.g. 30.0 for Gemma 2/3), or None (the default) when the model has no cap."
        )


def _validate(
    name: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_size: int | None,
    softcap: float | None = None,
    labels_check: TargetRangeCheck | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the inputs and return hidden as [T, H] and labels as contiguous int64 [T]."""
    _check_softcap(name, softcap)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{name}: chunk_size must be a positive int or None, got {chunk_size!r}.")
    return check_head_inputs(name, hidden, weight, labels, ignore_index, what="labels", started=labels_check)


def _denominator(labels: torch.Tensor, ignore_index: int, num_items_in_batch: int | torch.Tensor | None):
    """What the summed row losses are divided by, as a 0-dim fp32 tensor on the labels' device."""
    if num_items_in_batch is None:
        # clamp: all-ignored gives 0 / 1 = 0 instead of torch's 0 / 0.
        return (labels != ignore_index).sum().clamp_(min=1).to(torch.float32)
    count = torch.as_tensor(num_items_in_batch)
    if count.numel() != 1:
        raise ValueError(f"num_items_in_batch must be a single number, got a tensor of shape {tuple(count.shape)}.")
    return count.reshape(()).to(device=labels.device, dtype=torch.float32)


def _chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_size: int,
    need_dh: bool,
    need_dw: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Row losses [T] (fp32) and the unscaled gradients d(Σ row losses)/d hidden [T, H], /d weight [V, H] (fp32).

    The gradients are of the plain sum of the row losses: the 1/N of the mean (or 1/num_items_in_batch) is applied
    in backward together with ``grad_output``, so a half-precision gradient is rounded once, at the magnitude the
    caller's loss scale asks for, rather than first stored at loss-scale 1 where fp16 loses small values.
    """
    num_tokens, width = hidden.shape
    vocab = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    # CUDA has fp16/bf16 GEMMs with fp32 output (out_dtype); the CPU has not, so there half inputs run their matmuls
    # in fp32 on an fp32 copy of the weight that lives for this call only.
    half_gemm = dtype != torch.float32 and hidden.is_cuda
    upcast = dtype != torch.float32 and not half_gemm
    weight_mm = weight.float() if upcast else weight
    write_grad = need_dh or need_dw
    row_kernel = _cross_entropy_rows_triton if dispatch.use_triton(hidden) else _cross_entropy_rows_torch

    row_loss = dispatch.empty((num_tokens,), dtype=torch.float32, device=device)
    grad_hidden = dispatch.empty((num_tokens, width), dtype=dtype, device=device) if need_dh else None
    grad_weight = dispatch.empty((vocab, width), dtype=torch.float32, device=device) if need_dw else None
    rows = min(chunk_size, num_tokens)
    logits_buffer = dispatch.empty((rows, vocab), dtype=torch.float32, device=device)
    # The row kernel writes the gradient where the next matmuls can read it: in place over the fp32 logits, or into
    # a half buffer when those matmuls run in half.
    grad_buffer = dispatch.empty((rows, vocab), dtype=dtype, device=device) if half_gemm and write_grad else None

    for start in range(0, num_tokens, chunk_size):
        stop = min(start + chunk_size, num_tokens)
        hidden_chunk = hidden[start:stop]
        hidden_mm = hidden_chunk.float() if upcast else hidden_chunk
        logits = logits_buffer[: stop - start]
        if half_gemm:
            torch.mm(hidden_chunk, weight.t(), out_dtype=torch.float32, out=logits)
        else:
            torch.mm(hidden_mm, weight_mm.t(), out=logits)
        grad = grad_buffer[: stop - start] if grad_buffer is not None else logits
        row_kernel(logits, grad, labels[start:stop], ignore_index, row_loss[start:stop], write_grad, softcap)

        if need_dh:
            if upcast:
                grad_hidden[start:stop].copy_(grad @ weight_mm)
            else:
                torch.mm(grad, weight_mm, out=grad_hidden[start:stop])
        if need_dw:
            if half_gemm:
                if start == 0:
                    torch.mm(grad.t(), hidden_chunk, out_dtype=torch.float32, out=grad_weight)
                else:
                    torch.addmm(grad_weight, grad.t(), hidden_chunk, out_dtype=torch.float32, out=grad_weight)
            elif start == 0:
                torch.mm(grad.t(), hidden_mm, out=grad_weight)
            else:
                grad_weight.addmm_(grad.t(), hidden_mm)

    if grad_weight is not None and num_tokens == 0:
        grad_weight.zero_()
    return row_loss, grad_hidden, grad_weight


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd Function for :func:`fused_linear_cross_entropy`; gradients are computed in forward.

    ``apply(hidden, weight, labels, ignore_index, num_items_in_batch, chunk_size, softcap, labels_check)`` with the
    meanings of :func:`fused_linear_cross_entropy` (all positional; the last five may be left out). Saved for backward:
    d hidden [T, H] in hidden's dtype, d weight [V, H] in fp32 when weight requires grad, and the 0-dim denominator;
    never the logits.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int = -100,
        num_items_in_batch: int | torch.Tensor | None = None,
        chunk_size: int | None = None,
        softcap: float | None = None,
        labels_check: TargetRangeCheck | None = None,
    ) -> torch.Tensor:
        name = "FusedLinearCrossEntropyFunction"
        hidden_2d, flat_labels = _validate(
            name, hidden, weight, labels, ignore_index, chunk_size, softcap, labels_check
        )
        denominator = _denominator(flat_labels, ignore_index, num_items_in_batch)
        chunk = chunk_size or default_chunk_size(hidden_2d.shape[0], weight.shape[0])
        row_loss, grad_hidden, grad_weight = _chunked_forward(
            hidden_2d,
            weight,
            flat_labels,
            ignore_index,
            chunk,
            need_dh=ctx.needs_input_grad[0],
            need_dw=ctx.needs_input_grad[1],
            softcap=softcap,
        )
        # save_for_backward, not ctx attributes: saved-tensor hooks (offloading, memory accounting) must see them.
        ctx.save_for_backward(grad_hidden, grad_weight, denominator)
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype = weight.dtype
        return row_loss.sum() / denominator

    @staticmethod
    @math_backward
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight, denominator = ctx.saved_tensors
        factor = grad_output.to(torch.float32) / denominator
        out_hidden = out_weight = None
        if grad_hidden is not None:
            # A 0-dim fp32 factor keeps a half tensor half; the product is formed in fp32 and rounded once.
            out_hidden = (grad_hidden * factor).view(ctx.hidden_shape)
        if grad_weight is not None:
            out_weight = torch.mul(grad_weight, factor, out=dispatch.empty_like(grad_weight, dtype=ctx.weight_dtype))
        return out_hidden, out_weight, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    labels_check: TargetRangeCheck | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without materialising the [tokens, vocab] logits.

    Matches transformers' causal-LM loss on already shifted labels, with the differences listed in the module
    docstring (all-ignored gives 0, out-of-range labels raise).

    Args:
        hidden: Final hidden states [..., H], float32 / float16 / bfloat16; leading dims are flattened to T tokens.
        weight: LM-head weight [V, H], same dtype and device as ``hidden``.
        labels: Integer targets with ``hidden``'s leading shape, aligned with it (the caller shifts); entries equal
            to ``ignore_index`` do not count.
        ignore_index: Label value to skip.
        num_items_in_batch: If given, the loss is the summed token losses divided by it (transformers' gradient
            accumulation convention); otherwise the mean over non-ignored tokens. Like transformers, 0 here divides
            by zero (inf, or NaN when every label is ignored).
        chunk_size: Tokens per chunk; default :func:`default_chunk_size`. Bounds the transient logits at
            ``chunk_size × V`` fp32 values.
        softcap: Final-logit soft cap ``c``: the loss is taken over ``tanh(logits / c) * c`` (Gemma 2/3's
            ``final_logit_softcapping``), applied chunk by chunk inside the fused computation. None: no cap, the
            plain kernel.
        labels_check: The range check of ``labels``, started before the work that produced ``hidden``
            (:class:`~fastft.kernels.head_inputs.TargetRangeCheck`); None checks here, which on a GPU waits for every
            kernel queued so far.

    Returns:
        The loss, a 0-dim float32 tensor. Gradients flow to ``hidden`` and, if it requires grad, ``weight``, in
        their own dtypes.

    Raises:
        ShapeContractError: ``weight`` is not 2-D, ``hidden``'s last dim is not ``weight``'s, ``labels`` does not
            have ``hidden``'s leading shape, or a label is outside [0, V) and not ``ignore_index``.
        TypeError: Unsupported or mismatched dtypes.
        ValueError: ``softcap`` is not None and not a finite number > 0; ``chunk_size`` is not a positive int;
            ``labels_check`` was started for other labels.
    """
    name = "fused_linear_cross_entropy"
    # Checked here too so that the message names this function, not the autograd Function behind it.
    _check_softcap(name, softcap)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return FusedLinearCrossEntropyFunction.apply(
            hidden, weight, labels, ignore_index, num_items_in_batch, chunk_size, softcap, labels_check
        )
    # No graph will be built: skip the gradient pass of the row kernel and the two gradient matmuls.
    hidden_2d, flat_labels = _validate(name, hidden, weight, labels, ignore_index, chunk_size, softcap, labels_check)
    denominator = _denominator(flat_labels, ignore_index, num_items_in_batch)
    chunk = chunk_size or default_chunk_size(hidden_2d.shape[0], weight.shape[0])
    row_loss, _, _ = _chunked_forward(
        hidden_2d.detach(),
        weight.detach(),
        flat_labels,
        ignore_index,
        chunk,
        need_dh=False,
        need_dw=False,
        softcap=softcap,
    )
    return row_loss.sum() / denominator


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The naive baseline: fp32 logits ``hidden @ weight.T`` in full, then ``F.cross_entropy``; autograd-differentiable.

    Same function as :func:`fused_linear_cross_entropy` (including 0 for all-ignored labels), but it materialises
    and saves the [tokens, vocab] logits; tests and benchmarks compare against it.

    Args:
        hidden: [..., H] hidden states.
        weight: [V, H] LM-head weight.
        labels: Aligned integer labels with ``hidden``'s leading shape.
        ignore_index: Label value to skip.
        num_items_in_batch: Divisor for the summed loss; default the number of non-ignored labels.
        softcap: If given, the loss is over ``tanh(logits / softcap) * softcap`` (Gemma 2/3).

    Returns:
        The 0-dim float32 loss.
    """
    hidden_2d, flat_labels = _validate(
        "linear_cross_entropy_reference", hidden, weight, labels, ignore_index, None, softcap
    )
    logits = hidden_2d.float() @ weight.float().t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    total = torch.nn.functional.cross_entropy(logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    return total / _denominator(flat_labels, ignore_index, num_items_in_batch)


__all__ = [
    "LOGITS_CHUNK_BYTES",
    "FusedLinearCrossEntropyFunction",
    "default_chunk_size",
    "fused_linear_cross_entropy",
    "linear_cross_entropy_reference",
]
