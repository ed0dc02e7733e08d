"""Export to GGUF, llama.cpp's single-file format, written with the ``gguf`` package (no llama.cpp build).

The weights go through fastft's own merge (:func:`fastft.export.merge.merge_plan`: LoRA updates added in float32, a
4-bit base dequantised first), one tensor at a time and in blocks of rows, so the export never holds more than one
block of dense float32 rows, or one q / k projection (its rows are permuted within each head). Each converted tensor
is appended to a scratch file beside the output; the GGUF header needs every tensor's type and shape before the first
byte of data, and this way the weights are neither merged twice nor kept in memory. The file itself is written under
a temporary name and renamed when complete.

What a loader needs, and where it comes from:

- the architecture (:mod:`fastft.export.gguf_arch`): Llama, Mixtral (llama.cpp's ``llama`` with experts) or Qwen3-MoE
  (``qwen3moe``), with its required tensors, its metadata and, for MoE models, the experts stacked per layer;
- tensor names: the ``gguf`` package's own name map for that architecture (``blk.N.attn_q.weight`` ...), the same
  map transformers inverts when it loads a GGUF;
- q and k rows: transformers' Llama rotates the two halves of each head, llama.cpp's ``llama`` rotates adjacent
  pairs, so the rows of each head are interleaved here and transformers' GGUF loader undoes exactly that on load
  (``qwen3moe`` rotates halves, as transformers does: its rows are kept);
- tied embeddings: no ``output.weight`` tensor, which both llama.cpp and transformers read as "tied";
- tensor types: the one llama.cpp's quantiser would pick for each tensor of the named file type
  (:mod:`fastft.export.gguf_mixtures`), K-quants encoded by :mod:`fastft.export.kquants`, the legacy 32-value blocks
  by the ``gguf`` package;
- the tokenizer: byte-level BPE (``tokenizer.ggml.model = "gpt2"``): tokens, token types, merges, the special ids,
  whether BOS / EOS are added, the pre-tokenizer name and the chat template.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch
from peft import PeftModel
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastft.export import kquants
from fastft.export.file_modes import as_if_created
from fastft.export.gguf_arch import ARCHES, Arch, PlannedTensor, expert_tensors, write_expert_metadata
from fastft.export.gguf_mixtures import FILE_TYPES, MixtureModel, fallback_warning, tensor_type
from fastft.export.gguf_vision import refuse_vision_language
from fastft.export.merge import MergedTensor, merge_plan
from fastft.export.shards import BLOCK_ELEMENTS, check_block
from fastft.loading.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT, has_byte_level

if TYPE_CHECKING:
    import gguf as gguf_types

# The name it had as fastft/gguf_export.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.gguf_export")

# The float types, and llama.cpp's mixtures by the names its users know them by (gguf_mixtures).
QUANTIZATIONS = tuple(FILE_TYPES)
# Converting a few million values at a time bounds the temporaries of the q8_0 quantiser (several copies of its input)
# on a large embedding matrix.
_CHUNK_ELEMENTS = 1 << 24
_COPY_BYTES = 16 << 20
# Pre-tokenizer split patterns (as tokenizer.json spells them) and the name llama.cpp knows them by.
_SPLIT_PRE_NAMES = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
_LLAMA_CHILDREN = {"embed_tokens", "layers", "norm", "rotary_emb"}


@dataclass
class _Stored:
    """One converted tensor in the scratch file."""

    name: str
    ggml_type: Any
    byte_shape: tuple[int, ...]
    offset: int
    nbytes: int


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as error:
        raise ImportError(
            "fastft.save_gguf needs the gguf package. Install it with: pip install 'fastft[gguf]' "
            "(or pip install gguf)."
        ) from error
    return gguf


def _progress_bars_enabled() -> bool:
    # Follow transformers' switch, so a user who silenced its loading bars gets none here either.
    from transformers.utils import logging as hf_logging

    return hf_logging.is_progress_bar_enabled()


def _check_model(base: PreTrainedModel) -> Arch:
    """The model's exported architecture, or a refusal naming what does not fit it."""
    model_type = getattr(base.config, "model_type", None)
    arch = ARCHES.get(model_type)
    if arch is None:
        raise ValueError(
            f"fastft.save_gguf: exports Llama-architecture, Mixtral and Qwen3-MoE models (config.model_type "
            f"{', '.join(repr(name) for name in ARCHES)}); this {type(base).__name__} has model_type "
            f"{model_type!r}. Save it with FastModel.save_merged and convert that folder with llama.cpp's "
            "convert_hf_to_gguf.py."
        )
    inner = getattr(base, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(base, "lm_head"):
        raise ValueError(
            f"fastft.save_gguf: expected a causal LM with .model.layers and .lm_head (LlamaForCausalLM), got "
            f"{type(base).__name__}; pass the model from FastModel.from_pretrained or get_peft_model."
        )
    extra = {name for name, _ in inner.named_children()} - _LLAMA_CHILDREN
    if extra:
        raise ValueError(
            f"fastft.save_gguf: {type(inner).__name__} has submodules {sorted(extra)} that a {arch.gguf_arch.lower()} "
            f"GGUF has no tensors for (expected only {sorted(_LLAMA_CHILDREN)}); export with FastModel.save_merged "
            "instead."
        )
    if len(inner.layers) != base.config.num_hidden_layers:
        raise ValueError(
            f"fastft.save_gguf: config.num_hidden_layers is {base.config.num_hidden_layers} but the model has "
            f"{len(inner.layers)} decoder layers; a GGUF reader would take the config's count."
        )
    act = getattr(base.config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"fastft.save_gguf: llama.cpp's {arch.gguf_arch.lower()} uses SiLU; this config has hidden_act={act!r}."
        )
    arch.check(base.config)
    return arch


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _model_stem(base: PreTrainedModel) -> str:
    source = getattr(base.config, "name_or_path", "") or getattr(base, "name_or_path", "") or ""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(source)).name).strip("-.")
    return stem or "model"


def _output_file(path: str | Path, stem: str, quantization: str) -> Path:
    target = Path(path)
    if target.suffix.lower() == ".gguf" and not target.is_dir():
        return target
    return target / f"{stem}-{quantization.upper()}.gguf"


def _rope(base: PreTrainedModel) -> tuple[float, str, dict[str, Any]]:
    config = base.config
    # transformers >= 5 keeps theta inside rope_parameters; 4.x has rope_theta and rope_scaling.
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise NotImplementedError(
            f"fastft.save_gguf: rope_type {rope_type!r} is not supported (supported: default, linear, llama3); "
            "save with FastModel.save_merged and convert with llama.cpp's convert_hf_to_gguf.py."
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("fastft.save_gguf: a partial rotary factor is not supported for GGUF export.")
    return theta, rope_type, params


def _rope_frequency_factors(base: PreTrainedModel, theta: float, head_dim: int) -> torch.Tensor:
    """llama.cpp's ``rope_freqs`` tensor: the divisor of each default rotary frequency.

    Taken from the model's own rotary embedding (transformers already applied the Llama 3 scaling to its
    ``inv_freq``), so it is exactly what the model computes with, not a second implementation of the formula.
    """
    inv_freq = base.model.rotary_emb.inv_freq.detach().float().cpu()
    default = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if inv_freq.shape != default.shape:
        raise ValueError(
            f"fastft.save_gguf: the rotary embedding has {inv_freq.numel()} frequencies, expected head_dim / 2 = "
            f"{default.numel()}."
        )
    return default / inv_freq


def _interleave_rotary_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    # Within each head, transformers keeps the two rotated halves apart (rotate_half) and llama.cpp expects them
    # as adjacent pairs; transformers' GGUF loader applies the inverse of this when it reads attn_q / attn_k.
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gguf_tensors(base: PreTrainedModel, gguf: Any, arch: Arch) -> list[PlannedTensor]:
    """Every tensor of the file, in the merge plan's order (stacked experts where their layer's were), nothing
    merged yet."""
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.gguf_arch), base.config.num_hidden_layers)
    plan = merge_plan(base)
    if plan.untied:
        # An adapter on the head or the embeddings unties them; both are written so neither update is lost.
        logger.info("fastft.save_gguf: an adapter changed the tied head or embeddings; writing both.")
    merged = plan.tensors
    experts: list[PlannedTensor] = []
    if arch.experts:
        experts, merged = expert_tensors(arch, base.config, merged)
    planned = []
    for tensor in merged:
        gguf_name = name_map.get_name(tensor.name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(
                f"fastft.save_gguf: the merged tensor {tensor.name} {tensor.shape} has no "
                f"{arch.gguf_arch.lower()} GGUF name; export this model with FastModel.save_merged instead."
            )
        planned.append(PlannedTensor(gguf_name, tensor.shape, partial(_blocks, tensor, gguf_name, base.config, arch)))
    return planned + experts


def _blocks(tensor: MergedTensor, gguf_name: str, config: Any, arch: Arch) -> Iterator[torch.Tensor]:
    """The merged tensor as blocks of rows, in llama.cpp's row order."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if arch.interleave_rotary and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        # Rows are permuted within each head, so the projection is merged whole (one projection, not the model).
        yield _interleave_rotary_rows(tensor.whole(), heads if ".attn_q." in gguf_name else kv_heads)
        return
    yield from tensor.chunks(BLOCK_ELEMENTS)


def _tensor_type(gguf: Any, shape: tuple[int, ...], quantization: str, name: str, model: MixtureModel) -> Any:
    # The per-tensor choice llama.cpp's quantiser makes for this file type (gguf_mixtures), as a gguf type member.
    return getattr(gguf.GGMLQuantizationType, tensor_type(name, shape, quantization, model).type_name)


def _fallbacks(tensors: list[PlannedTensor], quantization: str, model: MixtureModel) -> None:
    # Before any tensor is merged: one warning naming each tensor whose rows do not fit its mixture type.
    choices = [
        (tensor.name, tensor.shape, tensor_type(tensor.name, tensor.shape, quantization, model)) for tensor in tensors
    ]
    fallback_warning([entry for entry in choices if entry[2].replaced is not None])


def _mixture_model(base: PreTrainedModel, arch: Arch, names: set[str]) -> MixtureModel:
    config = base.config
    n_layers = int(config.num_hidden_layers)
    n_experts = arch.expert_count(config) if arch.experts else 0
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    is_70b = arch.gguf_arch == "LLAMA" and n_experts != 8 and n_layers == 80 and kv_heads != heads
    return MixtureModel(n_layers, n_experts, tied="output.weight" not in names, is_70b=is_70b)


def _encode(gguf: Any, rows: torch.Tensor, ggml_type: Any) -> np.ndarray:
    """``rows`` [n, k] float32 as the bytes of ``ggml_type``, shape [n, bytes per row]."""
    types = gguf.GGMLQuantizationType
    if ggml_type == types.F32:
        return rows.contiguous().numpy().view(np.uint8)
    if ggml_type == types.F16:
        return rows.to(torch.float16).numpy().view(np.uint8)
    if ggml_type == types.BF16:
        # torch rounds to nearest even, as ggml's own float32 -> bf16 conversion does.
        return rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    # Quantised from the float16 rounding of the weights, as llama.cpp's pipeline quantises its converter's f16 file:
    # the bytes are then those llama-quantize writes from this model's f16 GGUF (its quantisers and ours agree byte
    # for byte), and the rounding costs ~1e-3 of the quantisation error. Values beyond float16's range, which that
    # pipeline could not carry, are quantised from float32.
    half = rows.to(torch.float16)
    source = half.float() if torch.isfinite(half).all() else rows
    if ggml_type.name in kquants.K_TYPES:
        # The gguf package decodes K-quants but cannot write them.
        return kquants.quantize(source.contiguous().numpy(), ggml_type.name)
    return gguf.quants.quantize(source.contiguous().numpy(), ggml_type)


def _store(
    gguf: Any, name: str, shape: tuple[int, ...], blocks: Iterable[torch.Tensor], ggml_type: Any, scratch: BinaryIO
) -> _Stored:
    offset = scratch.tell()
    row_bytes = 0
    fp16_fix = "export with quantization='bf16' or 'f32'" if ggml_type == gguf.GGMLQuantizationType.F16 else None
    for block in blocks:
        check_block(block, name, "fastft.save_gguf", fp16_fix)
        rows = block.reshape(-1, block.shape[-1]) if block.dim() > 1 else block.reshape(1, -1)
        step = max(1, _CHUNK_ELEMENTS // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            encoded = _encode(gguf, rows[start : start + step], ggml_type)
            row_bytes = encoded.shape[-1]
            scratch.write(encoded.tobytes())
    nbytes = scratch.tell() - offset
    return _Stored(name, ggml_type, (*shape[:-1], row_bytes), offset, nbytes)


class _ScratchBytes:
    """One tensor's bytes in the scratch file, in the two members ``GGUFWriter.write_tensor_data`` reads.

    It copies them into the output a block at a time: an array (or a memory map, whose touched pages count as
    resident) would hold the whole tensor, and the largest one, the embeddings, is bigger than a decoder layer.
    """

    def __init__(self, path: str, offset: int, nbytes: int) -> None:
        self.path, self.offset, self.nbytes = path, offset, nbytes

    def tofile(self, out: BinaryIO) -> None:
        with open(self.path, "rb") as source:
            source.seek(self.offset)
            left = self.nbytes
            while left:
                block = source.read(min(left, _COPY_BYTES))
                if not block:
                    raise OSError(f"fastft.save_gguf: the scratch file {self.path} ended early.")
                out.write(block)
                left -= len(block)


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    """The llama.cpp pre-tokenizer name for a byte-level ``tokenizer.json`` pre_tokenizer section."""
    if pre is None:
        return "default"
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [step.get("type") for step in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        if pattern in _SPLIT_PRE_NAMES and str(steps[0].get("behavior", "")).lower() == "isolated":
            return _SPLIT_PRE_NAMES[pattern]
    logger.warning(
        "fastft.save_gguf: the tokenizer's pre-tokenizer (%s) matches none llama.cpp is known to name; writing "
        "'default'. transformers reloads the same vocabulary, but llama.cpp may split some text differently.",
        json.dumps(pre)[:200],
    )
    return "default"


def _adds(tokenizer: PreTrainedTokenizerBase, token_id: int | None, position: int) -> bool:
    if token_id is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[position] == token_id


def _write_tokenizer(writer: Any, gguf: Any, tokenizer: PreTrainedTokenizerBase, n_vocab: int) -> None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"fastft.save_gguf: expected a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}; load "
            "it with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    spec = json.loads(backend.to_str())
    model_spec = spec.get("model", {})
    if model_spec.get("type") != "BPE" or not has_byte_level(spec.get("pre_tokenizer")):
        raise ValueError(
            f"fastft.save_gguf: only byte-level BPE tokenizers (GPT-2 / Llama 3 / SmolLM style) are exported; this "
            f"one is a {model_spec.get('type')!r} model with pre-tokenizer "
            f"{(spec.get('pre_tokenizer') or {}).get('type')!r} (a SentencePiece tokenizer, as Llama 2 and "
            "TinyLlama use, is not supported yet). Save with FastModel.save_merged and convert with llama.cpp's "
            "convert_hf_to_gguf.py."
        )
    vocab = backend.get_vocab(with_added_tokens=True)
    largest = max(vocab.values())
    if largest >= n_vocab:
        raise ValueError(
            f"fastft.save_gguf: the tokenizer has token id {largest} but the model's embedding has only {n_vocab} "
            "rows; resize the embeddings (model.resize_token_embeddings(len(tokenizer))) before training and export."
        )
    token_type = gguf.TokenType
    # Ids the tokenizer does not use (an embedding padded past the vocabulary) get placeholder tokens, as llama.cpp's
    # converter writes them, so that the token count equals the embedding rows.
    tokens = [f"[PAD{index}]" for index in range(n_vocab)]
    types = [int(token_type.UNUSED)] * n_vocab
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = int(token_type.NORMAL)
    for index, added in tokenizer.added_tokens_decoder.items():
        if index < n_vocab:
            types[index] = int(token_type.CONTROL if added.special else token_type.USER_DEFINED)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model_spec.get("merges", [])]

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    special = {
        writer.add_bos_token_id: tokenizer.bos_token_id,
        writer.add_eos_token_id: tokenizer.eos_token_id,
        writer.add_unk_token_id: tokenizer.unk_token_id,
        writer.add_pad_token_id: tokenizer.pad_token_id,
    }
    for add, token_id in special.items():
        if token_id is not None:
            add(int(token_id))
    # Read off the tokenizer's behaviour rather than its flags, which not every tokenizer class sets.
    writer.add_add_bos_token(_adds(tokenizer, tokenizer.bos_token_id, 0))
    writer.add_add_eos_token(_adds(tokenizer, tokenizer.eos_token_id, -1))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        writer.add_chat_template([{"name": name, "template": text} for name, text in template.items()])
    elif template:
        writer.add_chat_template(template)
    else:
        logger.info("fastft.save_gguf: the tokenizer has no chat template; none is written.")


def write_shape_metadata(writer: Any, config: Any, stem: str) -> None:
    """The keys every language model's file opens with: its type and name, and the decoder's shape from ``config``
    (a text config: a vision-language model passes its language model's)."""
    heads = config.num_attention_heads
    writer.add_type("model")
    writer.add_name(stem)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or heads))


def _write_model_metadata(
    writer: Any, gguf: Any, base: PreTrainedModel, arch: Arch, stem: str, quantization: str
) -> None:
    config = base.config
    heads = config.num_attention_heads
    head_dim = _head_dim(config)
    theta, rope_type, params = _rope(base)
    write_shape_metadata(writer, config, stem)
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(base.model.embed_tokens.weight.shape[0]))
    if head_dim * heads != config.hidden_size or arch.head_norms:
        # llama.cpp assumes head_dim = hidden / heads unless told otherwise (and transformers' Qwen3 loader reads
        # head_dim from it, else taking the config class's default).
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    if arch.experts:
        write_expert_metadata(writer, arch, config)
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    if rope_type != "default":
        logger.warning(
            "fastft.save_gguf: rope scaling %r is written for llama.cpp, but transformers' GGUF loader ignores it: "
            "a model reloaded with from_pretrained(..., gguf_file=...) computes plain RoPE.",
            rope_type,
        )
    writer.add_file_type(int(getattr(gguf.LlamaFileType, FILE_TYPES[quantization][1])))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_stored(writer: Any, stored: list[_Stored], scratch_name: str, progress: bool) -> None:
    """Write the header, the metadata, the tensor infos and then every converted tensor from the scratch file: the
    GGUF header needs each tensor's type and shape before the first byte of data."""
    for entry in stored:
        writer.add_tensor_info(entry.name, entry.byte_shape, np.dtype(np.uint8), entry.nbytes, entry.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(entry.nbytes for entry in stored)
    with tqdm(total=total, desc="fastft: writing GGUF", unit="B", unit_scale=True, disable=not progress) as bar:
        for entry in stored:
            writer.write_tensor_data(_ScratchBytes(scratch_name, entry.offset, entry.nbytes))
            bar.update(entry.nbytes)


def save_gguf(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    path: str | Path,
    quantization: str = "f16",
) -> Path:
    """Merge the LoRA adapters and write one GGUF file. See ``FastModel.save_gguf``."""
    refuse_vision_language(model)
    gguf = _import_gguf()
    if not isinstance(quantization, str) or quantization.lower() not in QUANTIZATIONS:
        raise ValueError(f"fastft.save_gguf: quantization={quantization!r} is not one of {list(QUANTIZATIONS)}.")
    quantization = quantization.lower()
    if tokenizer is None:
        raise ValueError(
            "fastft.save_gguf: a tokenizer is required (a GGUF file carries its vocabulary); pass the tokenizer "
            "from FastModel.from_pretrained."
        )
    base: PreTrainedModel = model.get_base_model() if isinstance(model, PeftModel) else model
    arch = _check_model(base)
    stem = _model_stem(base)
    out = _output_file(path, stem, quantization)
    out.parent.mkdir(parents=True, exist_ok=True)
    progress = _progress_bars_enabled()
    logger.info("fastft.save_gguf: writing %s (%s)", out, quantization)

    tensors = _gguf_tensors(base, gguf, arch)
    names = {tensor.name for tensor in tensors}
    required = {"token_embd.weight", "output_norm.weight"}
    for block in range(base.config.num_hidden_layers):
        required.update(f"blk.{block}.{part}.weight" for part in arch.layer_tensors())
    missing = sorted(required - names)
    if missing:
        raise ValueError(f"fastft.save_gguf: the merged model has no tensors for {missing[:5]} (of {len(missing)}).")
    mixture = _mixture_model(base, arch, names)
    _fallbacks(tensors, quantization, mixture)

    scratch_fd, scratch_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".scratch")
    partial_fd, partial_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    os.close(partial_fd)
    writer: gguf_types.GGUFWriter | None = None
    try:
        writer = gguf.GGUFWriter(partial_name, arch=gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch.gguf_arch)])
        _write_model_metadata(writer, gguf, base, arch, stem, quantization)
        _write_tokenizer(writer, gguf, tokenizer, int(base.model.embed_tokens.weight.shape[0]))

        stored: list[_Stored] = []
        with os.fdopen(scratch_fd, "wb") as scratch, torch.no_grad():
            scratch_fd = -1
            theta, rope_type, _ = _rope(base)
            if rope_type == "llama3":
                factors = _rope_frequency_factors(base, theta, _head_dim(base.config))
                f32 = gguf.GGMLQuantizationType.F32
                stored.append(_store(gguf, "rope_freqs.weight", tuple(factors.shape), [factors], f32, scratch))
            for tensor in tqdm(tensors, desc="fastft: merging for GGUF", unit="tensor", disable=not progress):
                ggml_type = _tensor_type(gguf, tensor.shape, quantization, tensor.name, mixture)
                stored.append(_store(gguf, tensor.name, tensor.shape, tensor.blocks(), ggml_type, scratch))

        write_stored(writer, stored, scratch_name, progress)
        writer.close()
        writer = None
        with open(partial_name, "rb") as handle:
            # On disk before the rename, so that a power loss cannot leave the final name on a truncated file.
            os.fsync(handle.fileno())
        as_if_created(partial_name)
        os.replace(partial_name, out)
    except BaseException:
        if writer is not None:
            writer.close()
        Path(partial_name).unlink(missing_ok=True)
        raise
    finally:
        if scratch_fd != -1:
            os.close(scratch_fd)
        Path(scratch_name).unlink(missing_ok=True)
    logger.info("fastft.save_gguf: wrote %s (%.1f MB)", out, out.stat().st_size / 1e6)
    return out
