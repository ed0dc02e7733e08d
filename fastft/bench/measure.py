"""Measurements shared by tests and benchmarks: bytes autograd keeps for backward, peak RSS, FLOPs and matmul rate."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

# The projections of a Llama block, in the order peft and the benchmarks name them.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture-of-experts block's stacked expert parameters, as peft's target_parameters names them.
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")


class SavedTensorBytes:
    """Count the bytes autograd saves for backward while the context is open.

    Every tensor packed for backward (``torch.autograd.graph.saved_tensors_hooks``) is counted once per storage, so
    two views of one buffer count once; tensors whose storage belongs to one of ``exclude`` (a model's parameters)
    are left out, because they exist whether or not anything is saved.

    Example::

        with SavedTensorBytes(model.parameters()) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        print(saved.bytes, saved.tensors)

    Args:
        exclude: Tensors (usually parameters and buffers) not to count.

    Attributes:
        bytes: Bytes of the distinct storages saved so far.
        raw_bytes: ``nbytes`` of every saved tensor, repeats included.
        tensors: How many tensors were packed (excluded ones not counted).
        excluded: How many packed tensors were left out because their storage is one of ``exclude``.
        storages: Storage address to its size in bytes.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        self.storages: dict[int, int] = {}
        self.raw_bytes = 0
        self.tensors = 0
        self.excluded = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._excluded:
            self.excluded += 1
        else:
            self.tensors += 1
            self.raw_bytes += tensor.nbytes
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedTensorBytes:
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, traceback)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def resident_bytes() -> int | None:
    """The process's resident set size now, in bytes (``None`` without ``/proc``)."""
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset the peak that :func:`peak_rss_bytes` reports to the current resident size, where the kernel allows it.

    Returns:
        Whether the peak now reads as the resident size (checked, since some kernels accept the write and ignore it).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    peak, resident = _status_bytes("VmHWM"), _status_bytes("VmRSS")
    # A little slack: pages touched between the two reads.
    return peak is not None and resident is not None and peak <= resident + (4 << 20)


def _status_bytes(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes.

    ``VmHWM`` from ``/proc/self/status`` where there is one (Linux; :func:`reset_peak_rss` resets it where the kernel
    allows), else ``getrusage``'s ``ru_maxrss``. Either may start at the size the parent had when it started this
    process (``ru_maxrss`` always does), so measure growth from a known point, or in a process started by a small
    one.
    """
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def count_flops(work: Callable[[], Any]) -> int:
    """The floating-point operations ``torch.utils.flop_counter.FlopCounterMode`` attributes to ``work()``.

    Only aten operators are seen (matmuls, convolutions, attention): a Triton kernel launched directly counts nothing,
    so compare systems with the FLOPs of one that runs on aten operators. Attention is counted by fastft's own
    formulas (:func:`attention_flops`), which hold for grouped-query attention (fewer key/value heads than query
    heads: torch 2.11's own formula asserts there) and cover the CPU's fused kernel (which torch counts as zero).
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_attention_formulas()) as counter:
        work()
    return counter.get_total_flops()


def attention_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int], backward: bool = False) -> int:
    """FLOPs of one scaled-dot-product attention over ``[batch, heads, seq, head_dim]`` shapes, causal or not.

    Key and value may have fewer heads than the query (grouped-query attention): each query head still multiplies a
    full ``seq_q x seq_k`` score matrix, so the count is the query's heads times the per-head work. The forward pass
    is two matmuls (scores, weighted values); the backward pass of the fused kernels recomputes the scores and runs
    four more (grad of the values, of the scores, of the query and of the key). A causal mask is not discounted, as
    in torch's counter.

    Raises:
        ValueError: Shapes that are not four-dimensional, disagree on batch, sequence or head size, or whose query
            heads are not a multiple of the key/value heads; the message gives all three shapes.
    """
    shapes = (tuple(query), tuple(key), tuple(value))
    if any(len(shape) != 4 for shape in shapes):
        raise ValueError(f"fastft.measure.attention_flops: expected [batch, heads, seq, head_dim] shapes, got {shapes}")
    (batch, heads, seq_q, dim_qk), (batch_k, kv_heads, seq_k, dim_k), (batch_v, heads_v, seq_v, dim_v) = shapes
    if not (batch == batch_k == batch_v and kv_heads == heads_v and seq_k == seq_v and dim_qk == dim_k):
        raise ValueError(f"fastft.measure.attention_flops: query/key/value shapes disagree: {shapes}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"fastft.measure.attention_flops: {heads} query heads are not a multiple of {kv_heads} key/value heads "
            f"(shapes {shapes})"
        )
    scores = 2 * batch * heads * seq_q * seq_k * dim_qk
    weighted = 2 * batch * heads * seq_q * seq_k * dim_v
    if not backward:
        return scores + weighted
    # Recomputed scores, the query's and the key's gradients run over the q.k width; the gradients of the scores
    # and of the values over the value width.
    return 3 * scores + 2 * weighted


def _forward_formula(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return attention_flops(query, key, value)


def _backward_formula(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return attention_flops(query, key, value, backward=True)


def _attention_formulas() -> dict[Any, Callable[..., int]]:
    """The sdpa operators whose first tensors are ``[batch, heads, seq, dim]`` query, key and value (forward) or
    grad_out, query, key and value (backward), mapped to fastft's formulas. Operators this torch lacks are left
    out."""
    formulas = {}
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    ):
        for suffix, formula in (("", _forward_formula), ("_backward", _backward_formula)):
            packet = getattr(torch.ops.aten, name + suffix, None)
            if packet is not None:
                formulas[packet] = formula
    return formulas


def _sparse_layers(read: Callable[..., Any], layers: int) -> set[int]:
    """The layers whose MLP is a sparse MoE block: Qwen3-MoE's every ``decoder_sparse_step``-th outside
    ``mlp_only_layers``, or every layer of a Mixtral; none for a dense config."""
    if not (read("num_experts") or read("num_local_experts")):
        return set()
    step, dense = read("decoder_sparse_step") or 1, set(read("mlp_only_layers") or ())
    return {layer for layer in range(layers) if layer not in dense and (layer + 1) % step == 0}


def lora_step_flops(config: Any, batch: int, seq: int, rank: int, targets: Iterable[str] = LLAMA_PROJECTIONS) -> int:
    """The matmul FLOPs of one LoRA training step (forward with labels, backward) of a Llama-family decoder, or of a
    mixture-of-experts one (Qwen3-MoE, Mixtral), computed from its config: for a dense model what
    :func:`count_flops` counts for stock transformers + peft with sdpa.

    Counted: the frozen base projections forward and their input gradients; each LoRA pair's two matmuls forward
    and their weight and input gradients; attention (:func:`attention_flops`, forward and backward, with the
    query's heads); the LM head forward and its input gradient. The first layer's q, k and v projections get no
    input gradient (their input, the embedding, needs none), nor do their LoRA A matrices. Not counted, as in the
    counter: elementwise work, norms, softmax, the loss, any recomputation by gradient checkpointing.

    A sparse MoE block counts the work its routing asks for: the router, and for each token only its top-k experts'
    gate | up and down (base and, when ``targets`` names ``EXPERT_PARAMETERS``, each expert's LoRA applied to the
    rows routed to it). Stock peft computes more than this: it folds ``B·A`` into the whole expert stack each
    forward (``E·r·in·out`` per projection whatever the tokens), work the routed count leaves out, as the floor
    leaves out recomputation.

    Args:
        config: A transformers config (or a mapping of one): ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``; ``num_key_value_heads`` and
            ``head_dim`` when they differ from the defaults (all heads; hidden // heads); for MoE ``num_experts``
            (or ``num_local_experts``), ``num_experts_per_tok`` and ``moe_intermediate_size`` (default
            ``intermediate_size``).
        batch: Sequences per step.
        seq: Tokens per sequence.
        rank: LoRA rank.
        targets: What carries LoRA: names of :data:`LLAMA_PROJECTIONS` and :data:`EXPERT_PARAMETERS`.

    Raises:
        ValueError: The config lacks one of those fields, or ``targets`` names an unknown projection.
    """
    read = config.get if isinstance(config, Mapping) else lambda name, default=None: getattr(config, name, default)
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [name for name in required if read(name) is None]
    if missing:
        raise ValueError(
            f"fastft.measure.lora_step_flops: the config has no {missing}; it counts Llama-family decoders and "
            "Qwen3-MoE / Mixtral ones only"
        )
    targets = set(targets)
    unknown = targets - set(LLAMA_PROJECTIONS) - set(EXPERT_PARAMETERS)
    if unknown:
        raise ValueError(
            f"fastft.measure.lora_step_flops: unknown projections {sorted(unknown)}; choose from "
            f"{list(LLAMA_PROJECTIONS) + list(EXPERT_PARAMETERS)}"
        )
    hidden, inner, layers = read("hidden_size"), read("intermediate_size"), read("num_hidden_layers")
    heads, vocab = read("num_attention_heads"), read("vocab_size")
    kv_heads = read("num_key_value_heads") or heads
    head_dim = read("head_dim") or hidden // heads
    tokens = batch * seq
    sparse = _sparse_layers(read, layers)
    if sparse and not read("num_experts_per_tok"):
        raise ValueError(
            "fastft.measure.lora_step_flops: a mixture-of-experts config (num_experts set) without "
            "num_experts_per_tok; pass the full config"
        )
    attention = {  # projection: (in, out)
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    dense_mlp = {"gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
    total = 0
    for layer in range(layers):
        shapes = {**attention, **({} if layer in sparse else dense_mlp)}
        for name, (fan_in, fan_out) in shapes.items():
            # The first layer's attention inputs come from the frozen embedding: no gradient flows into them.
            input_grad = layer > 0 or name not in ("q_proj", "k_proj", "v_proj")
            total += _projection_flops(tokens, fan_in, fan_out, rank if name in targets else 0, input_grad)
        if layer in sparse:
            total += _moe_flops(read, tokens, hidden, inner, rank, targets)
        query, key = (batch, heads, seq, head_dim), (batch, kv_heads, seq, head_dim)
        total += attention_flops(query, key, key) + attention_flops(query, key, key, backward=True)
    return total + 2 * (2 * tokens * hidden * vocab)


def _projection_flops(rows: int, fan_in: int, fan_out: int, rank: int, input_grad: bool = True) -> int:
    """A frozen projection over ``rows`` (forward, and its input gradient when wanted) with its LoRA of ``rank``
    (none at 0): A forward, weight gradient and (when its input needs one) input gradient; B all three."""
    base = 2 * rows * fan_in * fan_out
    total = base * (2 if input_grad else 1)
    if rank:
        lora_a, lora_b = 2 * rows * fan_in * rank, 2 * rows * rank * fan_out
        total += lora_a * (3 if input_grad else 2) + 3 * lora_b
    return total


def _moe_flops(read: Callable[..., Any], tokens: int, hidden: int, inner: int, rank: int, targets: set[str]) -> int:
    """One sparse block: the router over every token (its input gradient too), and each expert's gate | up and
    down over the rows routed to it (tokens x top-k in all)."""
    experts = read("num_experts") or read("num_local_experts")
    expert_inner, rows = read("moe_intermediate_size") or inner, tokens * read("num_experts_per_tok")
    total = 2 * (2 * tokens * hidden * experts)
    gate_up, down = EXPERT_PARAMETERS
    total += _projection_flops(rows, hidden, 2 * expert_inner, rank if gate_up in targets else 0)
    return total + _projection_flops(rows, expert_inner, hidden, rank if down in targets else 0)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """The dense matmul rate this device reaches, in FLOP/s: the median of ``repeats`` timed square matmuls.

    Args:
        device: Where to measure.
        dtype: The operands' dtype.
        size: The side of the square matrices (default 8192 on CUDA, 1024 elsewhere).
        repeats: Timed matmuls after one untimed warm-up.
    """
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = []
    for index in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


__all__ = [
    "EXPERT_PARAMETERS",
    "LLAMA_PROJECTIONS",
    "SavedTensorBytes",
    "attention_flops",
    "count_flops",
    "lora_step_flops",
    "matmul_rate",
    "peak_rss_bytes",
    "reset_peak_rss",
    "resident_bytes",
]
