"""Which GGML type each tensor of a GGUF gets, for the file types users ask for by name.

The float types (``f32`` / ``f16`` / ``bf16``) store every weight matrix in that type. The quantised ones are
llama.cpp's *mixtures*: ``q4_k_m`` is not "everything Q4_K" but llama.cpp's Q4_K_M recipe, which keeps the tensors
quantisation hurts most at more bits. This module reproduces the choice ``llama-quantize`` makes
(``llama_tensor_get_type`` in llama.cpp's src/llama-quant.cpp, without an importance matrix or overrides) for the
architectures fastft exports: Llama (``llama``), Mixtral (``llama`` with experts) and Qwen3-MoE (``qwen3moe``).

The rules, each as llama.cpp applies it (``default`` is the file type's base: Q4_K, Q5_K, Q6_K or Q8_0):

1. **Not quantised**: tensors of fewer than two dimensions (norms, ``rope_freqs``), any ``*_norm.weight`` and the MoE
   router ``ffn_gate_inp`` keep the converter's float32 (``tensor_allows_quantization``).
2. **Output head**: ``output.weight``, and ``token_embd.weight`` when the embeddings are tied (no ``output.weight``,
   so the embedding is the head), get Q6_K; Q8_0 when its rows are not a multiple of the default type's block, or
   when the default is Q8_0 already.
3. **Token embeddings** (untied): the default type.
4. **attn_v**: Q6_K in the "more bits" layers for Q4_K_M and Q5_K_M; in a Llama-architecture model of 80 layers
   with GQA (llama.cpp's ``LLM_TYPE_70B``) a Q4_K one becomes Q5_K; with exactly 8 experts, Q8_0 for every type.
5. **attn_k**: Q8_0 with exactly 8 experts (Mixtral 8x7B's recipe).
6. **ffn_down** (and ``ffn_down_exps``): Q6_K in the "more bits" layers for Q4_K_M and Q5_K_M.
7. **attn_output**: Q5_K with exactly 8 experts for Q4_K_M.
8. **Fallback**: a tensor whose rows are not a multiple of its type's block (256 for K-quants) takes llama.cpp's
   32-block stand-in, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (``tensor_type_fallback``), and F16 when the rows
   are not a multiple of 32 either; one warning (:func:`fallback_warning`) names every such tensor.

"More bits" layers (``use_more_bits``): the first and last eighth of the layers, and every third layer between.
llama.cpp counts attn_v and ffn_down tensors in file order, or reads the layer from the name in a model with
experts; every architecture here has exactly one of each per layer, so both are the layer index.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

# The name it had as fastft/gguf_export.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.gguf_export")

# File type name -> (its type for most weight matrices, the gguf.LlamaFileType member written to general.file_type).
FILE_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M"),
    "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M"),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K"),
}
# Values per block of each type a mixture can pick.
BLOCK_SIZES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q4_0": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32}
# llama.cpp's tensor_type_fallback for the K-quants.
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class MixtureModel:
    """What llama.cpp's type choice reads of a model besides the tensor itself.

    Attributes:
        n_layers: Decoder layers (``block_count``).
        n_experts: Experts per MoE layer; 0 for a dense model (llama.cpp's ``n_expert``).
        tied: Whether the file has no ``output.weight`` (the embedding is the head).
        is_70b: llama.cpp's ``LLM_TYPE_70B``: a ``llama`` architecture model of 80 layers with fewer kv heads than
            heads (and not 8 experts, which llama.cpp types as 8x7B / 8x22B).
    """

    n_layers: int
    n_experts: int = 0
    tied: bool = False
    is_70b: bool = False


@dataclass(frozen=True)
class TypeChoice:
    """The GGML type of one tensor, and, when the mixture's type did not fit its rows, the type it replaced."""

    type_name: str
    replaced: str | None = None


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _layer(name: str, model: MixtureModel) -> int:
    match = _LAYER.match(name)
    if match is None or int(match.group(1)) >= model.n_layers:
        raise ValueError(
            f"fastft.save_gguf: cannot read a layer index below {model.n_layers} from the tensor name {name!r} "
            "(expected 'blk.<layer>.<tensor>.weight'); the export's tensor map is inconsistent."
        )
    return int(match.group(1))


def _category(name: str) -> str:
    """llama.cpp's ``tensor_get_category``: by name, first match wins."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for part in ("attn_v.weight", "attn_k.weight", "attn_q.weight", "attn_output.weight"):
        if part in name:
            return part.removesuffix(".weight")
    for part in ("ffn_up", "ffn_gate", "ffn_down"):
        if part in name:
            return part
    return "other"


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's ``tensor_allows_quantization`` for these architectures: a weight matrix (2-D, or 3-D stacked
    experts) that is neither a norm nor the MoE router (rounding the router would change which experts a token
    picks)."""
    return len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name and "ffn_gate_inp." not in name


def _mixture_type(name: str, row: int, default: str, quantization: str, model: MixtureModel) -> str:
    category = _category(name)
    more_bits_file = quantization in ("q4_k_m", "q5_k_m")
    if category == "output" or (category == "token_embd" and model.tied):
        if row % BLOCK_SIZES[default] or default == "Q8_0":
            return "Q8_0"
        return "Q6_K"
    chosen = default
    if category == "attn_v":
        if more_bits_file and use_more_bits(_layer(name, model), model.n_layers):
            chosen = "Q6_K"
        if model.is_70b and chosen == "Q4_K":
            # 8 query heads share each attn_v there: it is 8x smaller than attn_q, so more bits cost little.
            chosen = "Q5_K"
        if model.n_experts == 8:
            chosen = "Q8_0"
    elif category == "attn_k":
        if model.n_experts == 8:
            chosen = "Q8_0"
    elif category == "ffn_down":
        if more_bits_file and use_more_bits(_layer(name, model), model.n_layers):
            chosen = "Q6_K"
    elif category == "attn_output" and model.n_experts == 8 and quantization == "q4_k_m":
        chosen = "Q5_K"
    return chosen


def tensor_type(name: str, shape: tuple[int, ...], quantization: str, model: MixtureModel) -> TypeChoice:
    """The GGML type name (``gguf.GGMLQuantizationType`` member) of one tensor of the file.

    Args:
        name: GGUF tensor name (``blk.3.attn_v.weight``).
        shape: Its shape, rows last (``[E, rows, row length]`` for stacked experts).
        quantization: A key of :data:`FILE_TYPES`.
        model: The model facts llama.cpp's choice reads.

    Returns:
        The type, and the mixture's type it replaced when the rows did not fit that type's blocks (for
        :func:`fallback_warning`).
    """
    default = FILE_TYPES[quantization][0]
    if not quantizable(name, shape):
        return TypeChoice("F32")
    if default in ("F32", "F16", "BF16"):
        return TypeChoice(default)
    chosen = _mixture_type(name, shape[-1], default, quantization, model)
    row = shape[-1]
    if row % BLOCK_SIZES[chosen] == 0:
        return TypeChoice(chosen)
    fallback = FALLBACK.get(chosen, chosen)
    if row % BLOCK_SIZES[fallback]:
        fallback = "F16"
    return TypeChoice(fallback, replaced=chosen)


def fallback_warning(fallbacks: list[tuple[str, tuple[int, ...], TypeChoice]]) -> None:
    """Log one warning naming every tensor that took a fallback type: ``(name, shape, choice)`` each.

    llama.cpp prints a line per tensor; a model whose hidden size is not a multiple of 256 (SmolLM2's 576) has one
    for most of its matrices, so they are grouped by what replaced what, each group listing its tensors.
    """
    if not fallbacks:
        return
    groups: dict[tuple[int, str, str], list[str]] = {}
    for name, shape, choice in fallbacks:
        groups.setdefault((shape[-1], str(choice.replaced), choice.type_name), []).append(name)
    lines = [
        f"rows of {row} (not a multiple of {replaced}'s block of {BLOCK_SIZES[replaced]}): stored as {stored} instead "
        f"of {replaced}: {', '.join(names)}"
        for (row, replaced, stored), names in groups.items()
    ]
    logger.warning(
        "fastft.save_gguf: %d tensors take llama.cpp's fallback type, as its quantiser does for them; %s.",
        len(fallbacks),
        "; ".join(lines),
    )


__all__ = [
    "FILE_TYPES",
    "MixtureModel",
    "TypeChoice",
    "fallback_warning",
    "quantizable",
    "tensor_type",
    "use_more_bits",
]
