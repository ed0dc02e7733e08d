"""What a GGUF file of each architecture fastft exports holds, and how the merged tensors become its tensors.

- **Llama** (``llama``): llama.cpp's ``llama`` architecture; q and k rows are interleaved within each head, since
  llama.cpp rotates adjacent pairs where transformers rotates two halves.
- **Mixtral** (``mixtral``): llama.cpp's ``llama`` architecture with experts, as llama.cpp's own converter writes
  it: the router as ``ffn_gate_inp``, the experts stacked as ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and
  ``ffn_down_exps`` ``[E, H, I]``, ``expert_count`` and ``expert_used_count`` in the metadata.
- **Qwen3-MoE** (``qwen3_moe``): llama.cpp's ``qwen3moe``: per-head q / k norms, rotary halves as transformers
  keeps them (no row interleaving), the experts stacked as for Mixtral, ``expert_feed_forward_length`` for their
  width. llama.cpp's qwen3moe has only sparse layers and always renormalises the top-k weights, so a config that
  says otherwise is refused rather than written as a file that computes something else.

Experts come in either layout transformers has used: transformers 5.x's fused ``gate_up_proj [E, 2I, H]`` (gate's I
rows, then up's) and ``down_proj [E, H, I]``, or 4.x's one module per expert. Either way each stacked tensor is
written one expert at a time, so the export holds one expert's merged matrix, not a layer's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fastft.contracts import ShapeContractError
from fastft.export.merge import MergedTensor

# An inner model's children that a GGUF of these architectures has tensors for.
_CHILDREN = frozenset({"embed_tokens", "layers", "norm", "rotary_emb"})
_DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
_EXPERT_FFN = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")

# transformers 5.x's fused experts, and 4.x's per-expert modules (Qwen3-MoE's gate / up / down_proj, Mixtral's w1 /
# w3 / w2); Mixtral's block is ``block_sparse_moe`` on 4.x and ``mlp`` on 5.x.
_FUSED = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)(_bias)?")
_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(weight|bias)"
)
logger = logging.getLogger("fastft.gguf_export")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class Arch:
    """One exported architecture.

    Attributes:
        model_type: ``config.model_type`` of the models it covers.
        gguf_arch: The ``gguf.MODEL_ARCH`` member name.
        interleave_rotary: Whether q / k rows are interleaved within each head (llama.cpp's ``llama`` rope).
        experts: Whether its layers are sparse MoE blocks.
        head_norms: Whether each layer has per-head q / k norms.
        check: Refuses a config the architecture's llama.cpp graph would compute differently.
    """

    model_type: str
    gguf_arch: str
    interleave_rotary: bool
    experts: bool = False
    head_norms: bool = False
    check: Callable[[Any], None] = field(default=lambda config: None, repr=False, compare=False)

    def layer_tensors(self) -> tuple[str, ...]:
        """The tensors (without ``.weight``) every block of the file must have."""
        ffn = _EXPERT_FFN if self.experts else _DENSE_FFN
        norms = ("attn_q_norm", "attn_k_norm") if self.head_norms else ()
        return (*_ATTENTION, *norms, *ffn)

    def expert_count(self, config: Any) -> int:
        return int(getattr(config, "num_experts", None) or config.num_local_experts)

    def expert_width(self, config: Any) -> int:
        """The experts' intermediate size."""
        return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def _check_qwen3_moe(config: Any) -> None:
    prefix = "fastft.save_gguf: llama.cpp's qwen3moe"
    if list(getattr(config, "mlp_only_layers", None) or []) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{prefix} has a sparse MoE block in every layer; this config has dense layers (mlp_only_layers="
            f"{config.mlp_only_layers}, decoder_sparse_step={config.decoder_sparse_step}). Export with "
            "FastModel.save_merged instead."
        )
    if not getattr(config, "norm_topk_prob", False):
        raise ValueError(
            f"{prefix} renormalises each token's top-k router weights to sum to one; this config has "
            "norm_topk_prob=False, so llama.cpp would weight the experts differently from this model. Export with "
            "FastModel.save_merged instead."
        )
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{prefix} has no sliding-window attention; this config has use_sliding_window=True.")


def _check_mixtral(config: Any) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        # Only sequences longer than the window differ, and Mixtral checkpoints ship without one; a warning, as for
        # rope scaling transformers' loader ignores.
        logger.warning(
            "fastft.save_gguf: this Mixtral attends within a sliding window of %d tokens; llama.cpp's llama graph "
            "attends to the whole context, so sequences longer than %d tokens are computed differently there.",
            window,
            window,
        )


ARCHES = {
    "llama": Arch("llama", "LLAMA", interleave_rotary=True),
    "mixtral": Arch("mixtral", "LLAMA", interleave_rotary=True, experts=True, check=_check_mixtral),
    "qwen3_moe": Arch(
        "qwen3_moe", "QWEN3MOE", interleave_rotary=False, experts=True, head_norms=True, check=_check_qwen3_moe
    ),
}


@dataclass
class PlannedTensor:
    """One tensor of the GGUF file: its name, its shape in transformers' order, and its rows block by block.

    Attributes:
        name: The GGUF tensor name (``blk.0.ffn_gate_exps.weight``).
        shape: Its shape, outermost dimension first (``[E, I, H]``).
        blocks: Yields the merged float32 values as consecutive blocks along dimension 0 (one expert, or a block
            of rows), in the file's order.
    """

    name: str
    shape: tuple[int, ...]
    blocks: Callable[[], Iterator[torch.Tensor]]


def _fused_half(tensor: MergedTensor, half: int, width: int) -> Callable[[], Iterator[torch.Tensor]]:
    # Each expert is merged whole ([2I, H]) and split, so gate's and up's tensors each merge it once.
    def blocks() -> Iterator[torch.Tensor]:
        for expert in range(tensor.shape[0]):
            yield tensor.expert(expert)[half * width : (half + 1) * width].unsqueeze(0)

    return blocks


def _per_expert(experts: list[MergedTensor]) -> Callable[[], Iterator[torch.Tensor]]:
    def blocks() -> Iterator[torch.Tensor]:
        for tensor in experts:
            yield tensor.whole().unsqueeze(0)

    return blocks


def expert_tensors(
    arch: Arch, config: Any, merged: list[MergedTensor]
) -> tuple[list[PlannedTensor], list[MergedTensor]]:
    """Stack the experts of every layer as the file's ``ffn_{gate,up,down}_exps`` tensors.

    Args:
        arch: The exported architecture (``arch.experts``).
        config: The model's config (E, I, H).
        merged: Every tensor of the merge plan.

    Returns:
        The stacked expert tensors, and the merged tensors that are not experts (named through gguf's map).

    Raises:
        ValueError: Expert biases (llama.cpp's Mixtral and Qwen3-MoE graphs have none), or a layer whose experts
            are missing or of the wrong shape.
    """
    experts, width, hidden = arch.expert_count(config), arch.expert_width(config), int(config.hidden_size)
    planned: list[PlannedTensor] = []
    rest: list[MergedTensor] = []
    per_expert: dict[tuple[int, str], dict[int, MergedTensor]] = {}
    for tensor in merged:
        fused = _FUSED.fullmatch(tensor.name)
        single = _PER_EXPERT.fullmatch(tensor.name)
        if (fused and fused.group(3)) or (single and single.group(4) == "bias"):
            raise ValueError(
                f"fastft.save_gguf: {tensor.name} is an expert bias, which llama.cpp's {arch.gguf_arch.lower()} "
                "graph has no place for; export with FastModel.save_merged instead."
            )
        if fused:
            layer, role = int(fused.group(1)), fused.group(2)
            expected = (experts, 2 * width, hidden) if role == "gate_up_proj" else (experts, hidden, width)
            _check_shape(tensor.name, tensor.shape, expected)
            if role == "gate_up_proj":
                for half, kind in enumerate(("gate", "up")):
                    name = f"blk.{layer}.ffn_{kind}_exps.weight"
                    planned.append(PlannedTensor(name, (experts, width, hidden), _fused_half(tensor, half, width)))
            else:
                planned.append(
                    PlannedTensor(f"blk.{layer}.ffn_down_exps.weight", expected, _fused_half(tensor, 0, hidden))
                )
        elif single:
            layer, index, role = int(single.group(1)), int(single.group(2)), _ROLE[single.group(3)]
            expected = (hidden, width) if role == "down" else (width, hidden)
            _check_shape(tensor.name, tensor.shape, expected)
            per_expert.setdefault((layer, role), {})[index] = tensor
        else:
            rest.append(tensor)
    for (layer, role), found in sorted(per_expert.items()):
        if sorted(found) != list(range(experts)):
            raise ShapeContractError(
                f"fastft.save_gguf: layer {layer} has {role} projections for experts {sorted(found)[:8]}, expected "
                f"({experts}, ...): one for each of the config's {experts} experts, which a GGUF stacks; the config "
                "and the weights disagree. Check the model's config.json."
            )
        stacked = [found[index] for index in range(experts)]
        shape = (experts, *stacked[0].shape)
        planned.append(PlannedTensor(f"blk.{layer}.ffn_{role}_exps.weight", shape, _per_expert(stacked)))
    return planned, rest


def _check_shape(name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(expected):
        raise ShapeContractError(
            f"fastft.save_gguf: {name} has shape {tuple(actual)}, expected {tuple(expected)} from the config "
            "(experts, intermediate size, hidden size); the config and the weights disagree, so no GGUF reader "
            "could load the file. Check the model's config.json."
        )


def write_expert_metadata(writer: Any, arch: Arch, config: Any) -> None:
    """The expert counts (and, where the architecture has a separate one, the experts' width)."""
    writer.add_expert_count(arch.expert_count(config))
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    if arch.model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(arch.expert_width(config))


__all__ = ["ARCHES", "Arch", "PlannedTensor", "expert_tensors", "write_expert_metadata"]
