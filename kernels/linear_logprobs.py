"""Fused linear log-probabilities: per-token ``log p(target)`` (and entropy etc.) of ``hidden @ weightᵀ`` without the
[tokens, vocab] logits.

RL and preference trainers (GRPO, RLOO, DPO, distillation) need each token's log-probability of its target under the
LM head, often its entropy, and for logging a few more per-token statistics. The stock way materialises the logits
(4096 tokens × 128k vocabulary = 2.1 GB in fp32) and autograd saves their softmax. Here the logits are made one tile
at a time, tokens × vocabulary columns (``chunk_size``; by default at most 32768 columns): one GEMM (cuBLAS; torch's
matmul on the CPU) into one reused fp32 buffer, and a row kernel folds the tile into per-token running statistics with
an online log-sum-exp (a running max and sums rescaled whenever it grows). Backward recomputes each tile, turns it in
place into the gradient with respect to the raw logits, and accumulates ``d hidden``, ``d weight`` and ``d bias`` in
fp32. Saved for backward: ``hidden``, the targets and one or two fp32 numbers per token (log Z, and the entropy when
it was asked for); never a tile.

The logit transform, per vocabulary column, in the order trl 1.16's ``add_fused_lm_head`` uses::

    z = (h · W_vᵀ + b_v) · logit_scale
    z = tanh(z / softcap) · softcap            (only with softcap)
    z = z / temperature

then ``p = softmax(z)``, ``log_prob = z_target − logsumexp(z)``, ``entropy = logsumexp(z) − Σ p z``,
``log_sum_sq_probs = log Σ p²``, ``mean_logits = mean(z)``, ``is_top1 = (first argmax of z) == target``. The entropy
is accumulated as ``log s − (Σ e^{z−m} (z − m)) / s`` (``m`` the running max, ``s = Σ e^{z−m}``), which does not
cancel the way ``logsumexp(z) − Σ p z`` does when the logits are large.

Gradients: ``d log_prob / d z_j = onehot_j − p_j``, ``d entropy / d z_j = −p_j (log p_j + entropy)``, chained through
``1 / temperature``, the cap's derivative ``sech²(u / softcap)`` (``u`` the scaled logit) and ``logit_scale``. With
``ctx.set_materialize_grads(False)`` an entropy used only for logging (no gradient flowing into it) adds nothing to
backward.

Positions whose target equals ``ignore_index`` get 0 in every output (False for ``is_top1``) and no gradient; their
target value is never read, so it need not be a valid index. A non-ignored target outside [0, vocab) raises
:class:`ShapeContractError` before any matmul (one reduction and one host sync per call), as in the fused
cross-entropy.

Dispatch as every kernel here (:mod:`fastft.kernels.dispatch`): CUDA tensors run the Triton row kernels, CPU tensors
their torch twins (the reference, chunked the same way), ``TRITON_INTERPRET=1`` runs the Triton kernels on CPU tensors
and ``FASTFT_DISABLE_TRITON=1`` forces the reference. There is no ``tl.dot`` here: the GEMMs are cuBLAS on every GPU
(so the T4 gets its tensor cores: DESIGN.md allows no Triton dot below compute capability 8.0), and on the CPU 16-bit
inputs are multiplied in fp32 (it has no 16-bit GEMM with fp32 output), which also keeps bf16 working through the
interpreter.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import NamedTuple

import torch

from fastft.kernels import dispatch
from fastft.kernels.cross_entropy import LOGITS_CHUNK_BYTES, _check_softcap
from fastft.kernels.custom_ops import math_backward
from fastft.kernels.head_inputs import check_head_inputs
from fastft.kernels.logprob_tiles import Stats, Transform, fold_torch, fold_triton, grad_torch, grad_triton

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Vocabulary columns per tile (trl's own tile width): a 128k vocabulary is four GEMMs per token chunk.
VOCAB_CHUNK = 32768
# Bound on one fp32 logits tile. On a GPU the GEMMs need hundreds of rows to run at full speed: 256 MiB (as the fused
# cross-entropy) gives 2048 tokens × 32768 columns. On the CPU a few MiB keep the tile and its temporaries small.
CUDA_TILE_BYTES = LOGITS_CHUNK_BYTES
CPU_TILE_BYTES = 8 * 1024 * 1024


class LogProbOutputs(NamedTuple):
    """What :func:`fused_linear_logprobs` returns; every field has the targets' shape, and is 0 (False) where the
    target is ``ignore_index``.

    Attributes:
        log_probs: ``log p(target)``, float32, differentiable.
        entropy: Entropy of the next-token distribution, float32, differentiable; None unless asked for.
        log_sum_sq_probs: ``log Σ_v p_v²``, float32, no gradient; None unless asked for.
        mean_logits: Mean over the vocabulary of the transformed logits ``z``, float32, no gradient; None unless
            asked for.
        is_top1: Whether the target is the first argmax of ``z`` (a tie with an earlier column does not count), bool;
            None unless asked for.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None


def default_chunk_size(num_tokens: int, vocab_size: int, device: torch.device | str = "cpu") -> tuple[int, int]:
    """Tile shape ``(tokens, vocabulary columns)``: at most :data:`VOCAB_CHUNK` columns, and the largest power of two
    of tokens whose fp32 tile fits :data:`CUDA_TILE_BYTES` (CUDA) or :data:`CPU_TILE_BYTES` (elsewhere).

    Args:
        num_tokens: Tokens in the call (all leading dimensions of ``hidden`` multiplied).
        vocab_size: Rows of the LM-head weight.
        device: Where the tensors are; ``meta`` (the static compile check) plans like CUDA.

    Returns:
        ``(rows, cols)``, each at least 1, rows at most ``num_tokens`` and cols at most ``vocab_size``.
    """
    kind = torch.device(device).type
    budget = CUDA_TILE_BYTES if kind in ("cuda", "meta") else CPU_TILE_BYTES
    cols = max(1, min(VOCAB_CHUNK, vocab_size))
    rows = max(1, budget // (4 * cols))
    rows = 1 << (rows.bit_length() - 1)
    return max(1, min(rows, num_tokens)), cols


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_options(name: str, temperature, softcap, logit_scale, outputs, chunk_size) -> frozenset[str]:
    if not (_is_number(temperature) and temperature > 0):
        raise ValueError(
            f"{name}: temperature must be a finite number > 0, got {temperature!r}; pass the sampling temperature "
            "the completions were generated with (1.0 for plain log-probabilities)."
        )
    if not _is_number(logit_scale):
        raise ValueError(
            f"{name}: logit_scale must be a finite number, got {logit_scale!r}; pass the model config's logit "
            "multiplier (Cohere's logit_scale, 1 / Granite's logits_scaling), or 1.0 for none."
        )
    _check_softcap(name, softcap)
    if isinstance(outputs, str):
        outputs = (outputs,)
    names = tuple(outputs) if isinstance(outputs, Iterable) else None
    if names is None or not all(isinstance(item, str) for item in names):
        raise ValueError(f"{name}: outputs must be a tuple of output names, got {outputs!r}.")
    names = frozenset(names) - {"log_probs"}  # always computed; accepted for trl's spelling
    unknown = sorted(names - set(OPTIONAL_OUTPUTS))
    if unknown:
        raise ValueError(
            f"{name}: unknown output name(s) {unknown}; outputs must be a subset of {OPTIONAL_OUTPUTS} (log_probs is "
            "always computed)."
        )
    pair = chunk_size if isinstance(chunk_size, tuple) else (chunk_size, 1)
    if chunk_size is not None and not (
        len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair)
    ):
        raise ValueError(
            f"{name}: chunk_size must be a positive int (tokens per tile), a pair of positive ints (tokens, "
            f"vocabulary columns) or None, got {chunk_size!r}."
        )
    return names


class _Gemm:
    """The tile GEMM ``hidden_chunk @ weight[c0:c1]ᵀ`` into an fp32 tile, and the two gradient GEMMs, per device.

    CUDA (and meta, for the static check) multiplies 16-bit inputs with fp32 output (``out_dtype``); the CPU has no
    such GEMM, so 16-bit inputs are multiplied in fp32 on an fp32 copy of the weight that lives for this call only.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        self.half = hidden.dtype != torch.float32 and hidden.device.type in ("cuda", "meta")
        self.upcast = hidden.dtype != torch.float32 and not self.half
        self.weight = weight.float() if self.upcast else weight

    def rows(self, hidden_chunk: torch.Tensor) -> torch.Tensor:
        return hidden_chunk.float() if self.upcast else hidden_chunk

    def logits(self, hidden_chunk: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
        if self.half:
            torch.mm(hidden_chunk, self.weight[start:stop].t(), out_dtype=torch.float32, out=out)
        else:
            torch.mm(hidden_chunk, self.weight[start:stop].t(), out=out)

    def add(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """``acc += a @ b`` with ``acc`` fp32, the product never rounded to 16 bits."""
        if self.half:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            acc.addmm_(a, b)


def _tiles(num_tokens: int, vocab: int, rows: int, cols: int):
    for row_start in range(0, num_tokens, rows):
        row_stop = min(row_start + rows, num_tokens)
        for col_start in range(0, vocab, cols):
            yield row_start, row_stop, col_start, min(col_start + cols, vocab)


def _fold_all(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    options: Transform,
    rows: int,
    cols: int,
    use_triton: bool,
) -> Stats:
    """Run every tile through the fold; the per-token statistics (unwritten or garbage at ignored tokens)."""
    num_tokens = hidden.shape[0]
    vocab = weight.shape[0]
    device = hidden.device

    def buffer(flag: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        return dispatch.empty((num_tokens,), dtype=dtype, device=device) if flag else None

    stats = Stats(
        max=buffer(),
        sum=buffer(),
        target=buffer(),
        entropy=buffer(options.entropy),
        sum_sq=buffer(options.sum_sq),
        logit_sum=buffer(options.mean),
        argmax=buffer(options.top1, torch.int32),
    )
    fold = fold_triton if use_triton else fold_torch
    gemm = _Gemm(hidden, weight)
    scratch = dispatch.empty((min(rows, num_tokens) * min(cols, vocab),), dtype=torch.float32, device=device)
    hidden_mm = None
    for row_start, row_stop, col_start, col_stop in _tiles(num_tokens, vocab, rows, cols):
        if col_start == 0:
            hidden_mm = gemm.rows(hidden[row_start:row_stop])
        tile = scratch[: (row_stop - row_start) * (col_stop - col_start)].view(row_stop - row_start, -1)
        gemm.logits(hidden_mm, col_start, col_stop, tile)
        fold(
            tile,
            None if bias is None else bias[col_start:col_stop],
            targets[row_start:row_stop],
            stats.rows(row_start, row_stop),
            col_start,
            options,
        )
    return stats


def _finish(stats: Stats, targets: torch.Tensor, options: Transform, vocab: int):
    """Per-token outputs from the statistics, 0 / False at ignored tokens; also log Z and the entropy for backward."""
    valid = targets != options.ignore_index
    log_s = torch.log(stats.sum)
    log_z = torch.where(valid, stats.max + log_s, 0.0)
    log_probs = torch.where(valid, stats.target - log_z, 0.0)
    entropy = log_sum_sq = mean = top1 = None
    if options.entropy:
        entropy = torch.where(valid, log_s - stats.entropy / stats.sum, 0.0)
    if options.sum_sq:
        log_sum_sq = torch.where(valid, torch.log(stats.sum_sq) - 2.0 * log_s, 0.0)
    if options.mean:
        mean = torch.where(valid, stats.logit_sum / vocab, 0.0)
    if options.top1:
        top1 = valid & (stats.argmax.to(torch.int64) == targets)
    return (log_probs, entropy, log_sum_sq, mean, top1), log_z


def _backward_all(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    options: Transform,
    rows: int,
    cols: int,
    need: tuple[bool, bool, bool],
    use_triton: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Recompute every tile, turn it into the gradient of the raw logits, fold that into d hidden / weight / bias."""
    need_dh, need_dw, need_db = need
    if not (need_dh or need_dw or need_db):
        return None, None, None
    num_tokens, width = hidden.shape
    vocab = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    gemm = _Gemm(hidden, weight)
    grad_kernel = grad_triton if use_triton else grad_torch

    # fp32 accumulators: d hidden straight into the output when hidden is fp32, else per token chunk.
    grad_hidden = None
    hidden_acc = None
    if need_dh:
        if dtype == torch.float32:
            grad_hidden = torch.zeros((num_tokens, width), dtype=torch.float32, device=device)
        else:
            grad_hidden = dispatch.empty((num_tokens, width), dtype=dtype, device=device)
            hidden_acc = dispatch.empty((min(rows, num_tokens), width), dtype=torch.float32, device=device)
    grad_weight = torch.zeros((vocab, width), dtype=torch.float32, device=device) if need_dw else None
    grad_bias = torch.zeros((vocab,), dtype=torch.float32, device=device) if need_db else None

    tile_size = min(rows, num_tokens) * min(cols, vocab)
    scratch = dispatch.empty((tile_size,), dtype=torch.float32, device=device)
    # The gradient tile feeds 16-bit GEMMs on CUDA: write it in hidden's dtype there, in place over the logits else.
    grad_scratch = dispatch.empty((tile_size,), dtype=dtype, device=device) if gemm.half else None
    hidden_mm = None
    for row_start, row_stop, col_start, col_stop in _tiles(num_tokens, vocab, rows, cols):
        n, c = row_stop - row_start, col_stop - col_start
        if col_start == 0:
            hidden_mm = gemm.rows(hidden[row_start:row_stop])
            if hidden_acc is not None:
                hidden_acc[:n].zero_()
        tile = scratch[: n * c].view(n, c)
        gemm.logits(hidden_mm, col_start, col_stop, tile)
        grad = tile if grad_scratch is None else grad_scratch[: n * c].view(n, c)
        grad_kernel(
            tile,
            grad,
            None if bias is None else bias[col_start:col_stop],
            targets[row_start:row_stop],
            log_z[row_start:row_stop],
            None if entropy is None else entropy[row_start:row_stop],
            None if grad_log_probs is None else grad_log_probs[row_start:row_stop],
            None if grad_entropy is None else grad_entropy[row_start:row_stop],
            col_start,
            options,
        )
        if need_dh:
            acc = grad_hidden[row_start:row_stop] if hidden_acc is None else hidden_acc[:n]
            gemm.add(acc, grad, gemm.weight[col_start:col_stop])
            if hidden_acc is not None and col_stop == vocab:
                grad_hidden[row_start:row_stop].copy_(acc)
        if need_dw:
            gemm.add(grad_weight[col_start:col_stop], grad.t(), hidden_mm)
        if need_db:
            grad_bias[col_start:col_stop] += grad.sum(dim=0, dtype=torch.float32)
    return grad_hidden, grad_weight, grad_bias


class FusedLinearLogProbsFunction(torch.autograd.Function):
    """Autograd Function for :func:`fused_linear_logprobs` (use that; this is its node).

    ``apply(hidden, weight, bias, targets, ignore_index, temperature, softcap, logit_scale, outputs, chunk_size,
    name)`` with the meanings of :func:`fused_linear_logprobs`, all positional (``name`` only labels error messages).
    Returns the five fields of :class:`LogProbOutputs` as a tuple. Saved for backward: hidden [T, H], weight, bias,
    the int64 targets [T], log Z [T] and (with ``"entropy"``) the entropy [T]; never a logits tile.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        ignore_index: int = -100,
        temperature: float = 1.0,
        softcap: float | None = None,
        logit_scale: float = 1.0,
        outputs: Iterable[str] = ("entropy",),
        chunk_size: int | tuple[int, int] | None = None,
        name: str = "FusedLinearLogProbsFunction",
    ):
        # An entropy used only for logging gets no gradient: backward then sees None, not a tensor of zeros.
        ctx.set_materialize_grads(False)
        names = _check_options(name, temperature, softcap, logit_scale, outputs, chunk_size)
        hidden_2d, flat_targets = check_head_inputs(name, hidden, weight, targets, ignore_index, bias=bias)
        options = Transform(
            logit_scale=float(logit_scale),
            softcap=None if softcap is None else float(softcap),
            inv_temperature=1.0 / float(temperature),
            ignore_index=int(ignore_index),
            entropy="entropy" in names,
            sum_sq="log_sum_sq_probs" in names,
            mean="mean_logits" in names,
            top1="is_top1" in names,
        )
        num_tokens, vocab = hidden_2d.shape[0], weight.shape[0]
        rows, cols = default_chunk_size(num_tokens, vocab, hidden.device)
        if isinstance(chunk_size, tuple):
            rows, cols = chunk_size
        elif chunk_size is not None:
            rows = chunk_size

        # Backward takes the path forward took (linear_logprobs_reference forces it for the forward call only).
        use_triton = dispatch.use_triton(hidden_2d)
        stats = _fold_all(hidden_2d, weight, bias, flat_targets, options, rows, cols, use_triton)
        results, log_z = _finish(stats, flat_targets, options, vocab)
        lead = targets.shape
        log_probs, entropy, log_sum_sq, mean, top1 = (None if t is None else t.view(lead) for t in results)

        # save_for_backward, not ctx attributes: saved-tensor hooks (offloading, memory accounting) must see them.
        ctx.save_for_backward(hidden_2d, weight, bias, flat_targets, log_z, results[1])
        ctx.options = options
        ctx.tiles = (rows, cols)
        ctx.use_triton = use_triton
        ctx.hidden_shape = hidden.shape
        ctx.mark_non_differentiable(*(t for t in (log_sum_sq, mean, top1) if t is not None))
        return log_probs, entropy, log_sum_sq, mean, top1

    @staticmethod
    @math_backward
    def backward(ctx, grad_log_probs, grad_entropy, *_unused):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        none = (None,) * 8
        if entropy is None:
            grad_entropy = None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, *none
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])

        def flat(grad):
            return None if grad is None else grad.reshape(-1).to(torch.float32).contiguous()

        grad_hidden, grad_weight, grad_bias = _backward_all(
            hidden,
            weight,
            bias,
            targets,
            log_z,
            entropy,
            flat(grad_log_probs),
            flat(grad_entropy),
            ctx.options,
            *ctx.tiles,
            need,
            ctx.use_triton,
        )
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype).view(ctx.hidden_shape)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, *none


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs: Iterable[str] = ("entropy",),
    chunk_size: int | tuple[int, int] | None = None,
) -> LogProbOutputs:
    """Per-token log-probabilities of ``targets`` under ``hidden @ weight.T (+ bias)``, and optionally the entropy
    and three logging statistics, without materialising the [tokens, vocab] logits.

    The logits are transformed per column as trl 1.16's ``add_fused_lm_head`` does:
    ``z = (hidden · weightᵀ + bias) · logit_scale``, then ``tanh(z / softcap) · softcap`` if ``softcap``, then
    ``z / temperature``; ``p = softmax(z)``. Tokens are processed in tiles of ``chunk_size`` tokens × vocabulary
    columns with an online log-sum-exp; backward recomputes each tile.

    Args:
        hidden: Final hidden states [..., H], float32 / float16 / bfloat16; leading dims are flattened to T tokens.
        weight: LM-head weight [V, H] (a tied head is the embedding matrix), same dtype and device as ``hidden``;
            it gets a gradient only if it requires one.
        targets: Integer token ids with ``hidden``'s leading shape (already shifted: ``targets[..., t]`` is scored
            at position t); positions equal to ``ignore_index`` are not scored and need not hold a valid index.
        bias: Optional LM-head bias [V], added before ``logit_scale``; any float dtype.
        ignore_index: Target value of the positions not scored.
        temperature: Softmax temperature (> 0), applied last.
        softcap: Final-logit soft cap (Gemma 2/3's ``final_logit_softcapping``), or None.
        logit_scale: Multiplier of the raw logits before the cap (Cohere's ``logit_scale``, 1 / Granite's
            ``logits_scaling``).
        outputs: Which of ``"entropy"``, ``"log_sum_sq_probs"``, ``"mean_logits"``, ``"is_top1"`` to compute
            (``"log_probs"`` is accepted and always computed); the others are None.
        chunk_size: Tokens per tile, or a pair (tokens, vocabulary columns); default :func:`default_chunk_size`
            (at most 32768 columns; 256 MiB fp32 tiles on CUDA, 8 MiB on the CPU).

    Returns:
        :class:`LogProbOutputs` with fields of ``targets``' shape: ``log_probs`` and ``entropy`` float32 and
        differentiable (to ``hidden``, and to ``weight`` / ``bias`` where they require grad, in their own dtypes),
        ``log_sum_sq_probs`` and ``mean_logits`` float32 without gradient, ``is_top1`` bool. Every field is 0 /
        False at ignored positions, which get no gradient.

    Raises:
        ShapeContractError: (a ``ValueError``) ``hidden``'s last dim is not ``weight``'s, ``targets`` does not have
            ``hidden``'s leading shape, ``bias`` is not [V], ``weight`` is not 2-D, or a scored target is outside
            [0, V).
        ValueError: An unknown output name, ``temperature`` not > 0, ``softcap`` not None or > 0, a non-finite
            ``logit_scale``, or a bad ``chunk_size``.
        TypeError: Unsupported or mismatched dtypes.
    """
    results = FusedLinearLogProbsFunction.apply(
        hidden,
        weight,
        bias,
        targets,
        ignore_index,
        temperature,
        softcap,
        logit_scale,
        outputs,
        chunk_size,
        "fused_linear_logprobs",
    )
    return LogProbOutputs(*results)


def linear_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs: Iterable[str] = ("entropy",),
    chunk_size: int | tuple[int, int] | None = None,
) -> LogProbOutputs:
    """:func:`fused_linear_logprobs` on its plain-torch path, whatever the device: the CPU path, tile for tile.

    The same tiles, online log-sum-exp and hand-written backward as the Triton path, with the two row kernels
    written as torch ops over a whole tile; memory stays bounded by one tile and a few temporaries of its size.

    Args:
        hidden: [..., H] hidden states.
        weight: [V, H] LM-head weight.
        targets: Integer targets with ``hidden``'s leading shape.
        bias: Optional [V] bias.
        ignore_index: Target value not scored.
        temperature: Softmax temperature (> 0).
        softcap: Final-logit soft cap, or None.
        logit_scale: Multiplier of the raw logits.
        outputs: Optional outputs to compute, as for :func:`fused_linear_logprobs`.
        chunk_size: Tokens per tile, or (tokens, vocabulary columns).

    Returns:
        :class:`LogProbOutputs`, as :func:`fused_linear_logprobs`.
    """
    with dispatch.force_reference():
        results = FusedLinearLogProbsFunction.apply(
            hidden,
            weight,
            bias,
            targets,
            ignore_index,
            temperature,
            softcap,
            logit_scale,
            outputs,
            chunk_size,
            "linear_logprobs_reference",
        )
    return LogProbOutputs(*results)


__all__ = [
    "CPU_TILE_BYTES",
    "CUDA_TILE_BYTES",
    "OPTIONAL_OUTPUTS",
    "VOCAB_CHUNK",
    "FusedLinearLogProbsFunction",
    "LogProbOutputs",
    "default_chunk_size",
    "fused_linear_logprobs",
    "linear_logprobs_reference",
]
