"""GGUF of a vision-language model as llama.cpp runs it: the language model plus the projector (``mmproj``) file.

Qwen2.5-VL, written as llama.cpp's own ``convert_hf_to_gguf.py`` writes it (once plain, once with ``--mmproj``):

- **language model** ``<stem>-<Q>.gguf``: architecture ``qwen2vl`` (Qwen2 with M-RoPE): the q / k / v biases, q and
  k rows as transformers keeps them (llama.cpp's M-RoPE rotates halves, as transformers does, so no interleaving),
  ``rope.dimension_sections`` = the config's ``mrope_section`` padded to four, the tokenizer and chat template;
- **projector** ``mmproj-<stem>-f16.gguf``: architecture ``clip``, ``clip.projector_type = qwen2.5vl_merger``, the
  vision hparams, the image processor's mean and std, and the tower under llama.cpp's clip names: the Conv3d patch
  embedding split into its two temporal slices (``v.patch_embd.weight`` and ``v.patch_embd.weight.1``), each block's
  fused qkv split into ``attn_q`` / ``attn_k`` / ``attn_v`` (rows then bias), the merger's norm as ``v.post_ln`` and
  its two linears as ``mm.0`` / ``mm.2``. Matrices are f16, vectors f32, as the converter writes an f16 mmproj.

Every tensor comes from :func:`fastft.export.merge.merge_plan`, so language-model and vision-tower adapters are both
merged, and is streamed through the single-file writer's scratch-file machinery (:mod:`fastft.export.gguf_export`).
Both files are written under temporary names and renamed only when both are complete.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peft import PeftModel
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from fastft.contracts import ShapeContractError
from fastft.export.file_modes import as_if_created
from fastft.export.gguf_arch import PlannedTensor
from fastft.export.gguf_export import (
    QUANTIZATIONS,
    _fallbacks,
    _import_gguf,
    _model_stem,
    _progress_bars_enabled,
    _store,
    _Stored,
    _tensor_type,
    _write_tokenizer,
    write_shape_metadata,
    write_stored,
)
from fastft.export.gguf_mixtures import FILE_TYPES, MixtureModel
from fastft.export.gguf_vision import refuse_unexported_family, vision_family
from fastft.export.merge import MergedTensor, merge_plan
from fastft.export.shards import BLOCK_ELEMENTS

logger = logging.getLogger("fastft.gguf_export")

_LANGUAGE = "model.language_model."
_VISUAL = "model.visual."
# llama.cpp's qwen2.5vl_merger graph hard-codes these (a 2 x 2 merge, two temporal slices of the patch embedding).
_LLAMACPP_MERGE, _LLAMACPP_TEMPORAL = 2, 2
# The attention window llama.cpp's clip uses for qwen2.5vl_merger, in pixels (it reads no window size for it).
_LLAMACPP_WINDOW = 112
# Every file type the one-file writer has, K-quant mixtures included: the language model takes llama.cpp's per-tensor
# choices as a text model's file would (gguf_mixtures); the mmproj stays f16.
_FILE_TYPES = {name: file_type for name, (_, file_type) in FILE_TYPES.items()}
# The converter's default when the vision config names no image size (Qwen2.5-VL's has none).
_DEFAULT_IMAGE_SIZE = 560


class VisionGGUF(NamedTuple):
    """The two files of a vision-language model's GGUF export.

    Attributes:
        model: The language model (``<stem>-<QUANTIZATION>.gguf``).
        mmproj: The projector file (``mmproj-<stem>-f16.gguf``), llama.cpp's ``--mmproj`` argument.
    """

    model: Path
    mmproj: Path

    def __str__(self) -> str:
        return f"{self.model} and {self.mmproj}"


class _File(NamedTuple):
    out: Path
    arch: str
    metadata: Callable[[Any], None]
    tensors: list[tuple[PlannedTensor, Any]]  # (tensor, ggml type)


def _fail(message: str) -> ValueError:
    return ValueError(f"fastft.save_gguf: {message}")


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else getattr(config, "text_config", config)


def _mrope(text: Any) -> tuple[float, list[int]]:
    """The rope theta and the M-RoPE sections (padded to four, as llama.cpp reads them)."""
    # transformers >= 5 keeps theta and the sections in rope_parameters; 4.x in rope_theta and rope_scaling.
    params = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    sections = [int(size) for size in params.get("mrope_section") or []]
    if rope_type not in ("default", "mrope") or not sections:
        raise _fail(
            f"llama.cpp's qwen2vl computes M-RoPE without scaling; this config has rope_type {rope_type!r} and "
            f"mrope_section {sections or None}. Export with FastModel.save_merged instead."
        )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if sum(sections) * 2 != head_dim or len(sections) > 4:
        raise ShapeContractError(
            f"fastft.save_gguf: mrope_section {sections} must have at most four sections summing to head_dim / 2 = "
            f"{head_dim // 2}; got a sum of {sum(sections)}. Check the model's config.json."
        )
    theta = float(params.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
    return theta, (sections + [0, 0, 0, 0])[:4]


def _wa_pattern(vision: Any) -> int:
    """llama.cpp's ``n_wa_pattern``: every n-th block attends to the whole image, the others within windows."""
    full = [int(index) for index in getattr(vision, "fullatt_block_indexes", None) or []]
    depth = int(vision.depth)
    pattern = full[0] + 1 if full else 0
    expected = [index for index in range(depth) if pattern and (index + 1) % pattern == 0]
    if not full or full != expected:
        raise _fail(
            f"llama.cpp's qwen2.5vl_merger makes every n-th vision block a full-attention one (n_wa_pattern); this "
            f"config's fullatt_block_indexes {full} over {depth} blocks is not such a pattern (expected e.g. "
            f"{expected or [depth - 1]}). Export with FastModel.save_merged instead."
        )
    return pattern


def _check_qwen2_5_vl(base: PreTrainedModel) -> None:
    config = base.config
    text, vision = _text_config(config), config.vision_config
    for name, value, expected in (
        ("vision_config.spatial_merge_size", vision.spatial_merge_size, _LLAMACPP_MERGE),
        ("vision_config.temporal_patch_size", vision.temporal_patch_size, _LLAMACPP_TEMPORAL),
        ("vision_config.hidden_act", vision.hidden_act, "silu"),
        ("text_config.hidden_act", getattr(text, "hidden_act", "silu"), "silu"),
    ):
        if value != expected:
            raise _fail(
                f"llama.cpp's qwen2vl / qwen2.5vl_merger graphs assume {name} = {expected!r}; this config has "
                f"{value!r}. Export with FastModel.save_merged instead."
            )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_dim * text.num_attention_heads != text.hidden_size:
        raise ShapeContractError(
            f"fastft.save_gguf: llama.cpp's qwen2vl expects attn_output [{text.hidden_size}, {text.hidden_size}], "
            f"i.e. heads x head_dim = hidden_size; this config has {text.num_attention_heads} x {head_dim} = "
            f"{text.num_attention_heads * head_dim}. Export with FastModel.save_merged instead."
        )
    if getattr(text, "use_sliding_window", False):
        raise _fail("llama.cpp's qwen2vl has no sliding-window attention; this config has use_sliding_window=True.")
    _mrope(text)
    _wa_pattern(vision)
    window = int(getattr(vision, "window_size", _LLAMACPP_WINDOW))
    if window != _LLAMACPP_WINDOW:
        logger.warning(
            "fastft.save_gguf: this vision tower attends within %d-pixel windows; llama.cpp's qwen2.5vl_merger always "
            "uses %d-pixel windows, so llama.cpp encodes images with more than one window differently.",
            window,
            _LLAMACPP_WINDOW,
        )


def _tokenizer_and_image_stats(processor: Any, base: PreTrainedModel) -> tuple[Any, list[float], list[float]]:
    """The tokenizer, and the image processor's mean and std (from the processor, else the model folder's
    ``preprocessor_config.json``, which is where llama.cpp's converter reads them)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    image_processor = getattr(processor, "image_processor", None)
    stats = None
    if image_processor is not None and getattr(image_processor, "image_mean", None) is not None:
        stats = (image_processor.image_mean, image_processor.image_std)
    else:
        source = Path(str(getattr(base.config, "_name_or_path", "") or ""))
        config_file = source / "preprocessor_config.json"
        if config_file.is_file():
            saved = json.loads(config_file.read_text())
            if "image_mean" in saved and "image_std" in saved:
                stats = (saved["image_mean"], saved["image_std"])
    if tokenizer is None or stats is None:
        raise _fail(
            "a vision-language model's export needs its processor: the tokenizer for the language model's file and "
            "the image mean / std for the mmproj file. Pass the processor FastModel.from_pretrained returned (or a "
            "tokenizer of a model whose folder has preprocessor_config.json); got "
            f"{type(processor).__name__}, and {base.config._name_or_path!r} has no preprocessor_config.json."
        )
    mean, std = [float(value) for value in stats[0]], [float(value) for value in stats[1]]
    if len(mean) != 3 or len(std) != 3:
        raise _fail(f"the image processor's image_mean {mean} and image_std {std} must have three values (RGB).")
    return tokenizer, mean, std


def _chunks(tensor: MergedTensor) -> Callable[[], Iterator[torch.Tensor]]:
    return lambda: tensor.chunks(BLOCK_ELEMENTS)


def _rows(tensor: MergedTensor, start: int, stop: int) -> Callable[[], Iterator[torch.Tensor]]:
    # One fused qkv projection (a vision block's, small beside a language-model layer) is merged whole and sliced.
    return lambda: iter([tensor.whole()[start:stop]])


def _temporal_slice(tensor: MergedTensor, index: int) -> Callable[[], Iterator[torch.Tensor]]:
    return lambda: iter([tensor.whole()[:, :, index].contiguous()])


def _language_tensors(gguf: Any, base: PreTrainedModel, merged: list[MergedTensor]) -> list[PlannedTensor]:
    text = _text_config(base.config)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, int(text.num_hidden_layers))
    planned = []
    for tensor in merged:
        # Named as a Qwen2 checkpoint (model.layers.N...), which is what gguf's qwen2vl map knows.
        source = "model." + tensor.name[len(_LANGUAGE) :] if tensor.name.startswith(_LANGUAGE) else tensor.name
        gguf_name = name_map.get_name(source, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise _fail(
                f"the merged tensor {tensor.name} {tensor.shape} has no qwen2vl GGUF name; export this model with "
                "FastModel.save_merged instead."
            )
        planned.append(PlannedTensor(gguf_name, tensor.shape, _chunks(tensor)))
    required = {"token_embd.weight", "output_norm.weight"}
    for block in range(int(text.num_hidden_layers)):
        for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"):
            required.add(f"blk.{block}.{part}.weight")
        required.update(f"blk.{block}.{part}.bias" for part in ("attn_q", "attn_k", "attn_v"))
        required.update(f"blk.{block}.{part}.weight" for part in ("ffn_gate", "ffn_up", "ffn_down"))
    missing = sorted(required - {tensor.name for tensor in planned})
    if missing:
        raise _fail(f"the merged language model has no tensors for {missing[:5]} (of {len(missing)} missing).")
    return planned


def _vision_name(gguf: Any, key: str, block: int | None = None) -> str:
    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, key)].format(bid=block)


# Vision-tower names (after model.visual.) -> (gguf MODEL_TENSOR, block index or None) for the 1:1 tensors.
_BLOCK_PARTS = {
    "norm1": "V_ENC_INPUT_NORM",
    "norm2": "V_ENC_POST_ATTN_NORM",
    "attn.proj": "V_ENC_ATTN_O",
    "mlp.gate_proj": "V_ENC_FFN_GATE",
    "mlp.up_proj": "V_ENC_FFN_UP",
    "mlp.down_proj": "V_ENC_FFN_DOWN",
}


def _vision_tensors(gguf: Any, base: PreTrainedModel, merged: list[MergedTensor]) -> list[PlannedTensor]:
    vision = base.config.vision_config
    hidden = int(vision.hidden_size)
    planned: list[PlannedTensor] = []
    for tensor in merged:
        name = tensor.name[len(_VISUAL) :]
        stem, _, suffix = name.rpartition(".")
        if name == "patch_embed.proj.weight":
            _expect(tensor, (hidden, 3, _LLAMACPP_TEMPORAL, vision.patch_size, vision.patch_size))
            patch = _vision_name(gguf, "V_ENC_EMBD_PATCH") + ".weight"
            shape = (hidden, 3, int(vision.patch_size), int(vision.patch_size))
            planned.append(PlannedTensor(patch, shape, _temporal_slice(tensor, 0)))
            planned.append(PlannedTensor(patch + ".1", shape, _temporal_slice(tensor, 1)))
        elif stem.startswith("blocks.") and stem.endswith(".attn.qkv"):
            block = int(stem.split(".")[1])
            _expect(tensor, (3 * hidden, hidden) if suffix == "weight" else (3 * hidden,))
            for index, key in enumerate(("V_ENC_ATTN_Q", "V_ENC_ATTN_K", "V_ENC_ATTN_V")):
                rows = _rows(tensor, index * hidden, (index + 1) * hidden)
                planned.append(
                    PlannedTensor(f"{_vision_name(gguf, key, block)}.{suffix}", (hidden, *tensor.shape[1:]), rows)
                )
        elif stem.startswith("blocks.") and stem.split(".", 2)[2] in _BLOCK_PARTS:
            block, part = int(stem.split(".")[1]), stem.split(".", 2)[2]
            planned.append(
                PlannedTensor(
                    f"{_vision_name(gguf, _BLOCK_PARTS[part], block)}.{suffix}", tensor.shape, _chunks(tensor)
                )
            )
        elif stem == "merger.ln_q":
            planned.append(
                PlannedTensor(f"{_vision_name(gguf, 'V_POST_NORM')}.{suffix}", tensor.shape, _chunks(tensor))
            )
        elif stem in ("merger.mlp.0", "merger.mlp.2"):
            # llama.cpp's clip reads the merger's two linears as mm.0 and mm.2 (the GELU between them is mlp.1).
            index = int(stem[-1])
            planned.append(
                PlannedTensor(f"{_vision_name(gguf, 'V_MMPROJ', index)}.{suffix}", tensor.shape, _chunks(tensor))
            )
        else:
            raise _fail(
                f"the vision tower's merged tensor {tensor.name} {tensor.shape} has no place in llama.cpp's "
                "qwen2.5vl_merger mmproj; export this model with FastModel.save_merged instead."
            )
    return planned


def _expect(tensor: MergedTensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(int(size) for size in expected):
        raise ShapeContractError(
            f"fastft.save_gguf: {tensor.name} has shape {tuple(tensor.shape)}, expected {tuple(expected)} from the "
            "vision config (hidden size, patch size, temporal patch size); the config and the weights disagree. "
            "Check the model's config.json."
        )


def _required_vision(gguf: Any, depth: int) -> set[str]:
    """The mmproj tensors llama.cpp's clip loader requires for qwen2.5vl_merger (clip.cpp's load_tensors)."""
    names = {_vision_name(gguf, "V_ENC_EMBD_PATCH") + ".weight", _vision_name(gguf, "V_ENC_EMBD_PATCH") + ".weight.1"}
    for index in (0, 2):
        names.update(f"{_vision_name(gguf, 'V_MMPROJ', index)}.{suffix}" for suffix in ("weight", "bias"))
    for block in range(depth):
        for key in ("V_ENC_ATTN_Q", "V_ENC_ATTN_K", "V_ENC_ATTN_V", "V_ENC_ATTN_O", "V_ENC_FFN_UP", "V_ENC_FFN_DOWN"):
            names.add(f"{_vision_name(gguf, key, block)}.weight")
        names.update(
            f"{_vision_name(gguf, key, block)}.bias" for key in ("V_ENC_ATTN_Q", "V_ENC_ATTN_K", "V_ENC_ATTN_V")
        )
    return names


def _language_metadata(gguf: Any, base: PreTrainedModel, tokenizer: Any, stem: str, quantization: str) -> Callable:
    text = _text_config(base.config)
    theta, sections = _mrope(text)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    n_vocab = int(base.get_input_embeddings().weight.shape[0])

    def write(writer: Any) -> None:
        write_shape_metadata(writer, text, stem)
        writer.add_rope_dimension_count(int(head_dim))
        writer.add_rope_dimension_sections(sections)
        writer.add_rope_freq_base(theta)
        writer.add_layer_norm_rms_eps(float(text.rms_norm_eps))
        writer.add_vocab_size(n_vocab)
        writer.add_file_type(int(getattr(gguf.LlamaFileType, _FILE_TYPES[quantization])))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_tokenizer(writer, gguf, tokenizer, n_vocab)

    return write


def _vision_metadata(gguf: Any, base: PreTrainedModel, stem: str, mean: list[float], std: list[float]) -> Callable:
    config = base.config
    vision, text = config.vision_config, _text_config(config)
    # The tower's own RMSNorm epsilon (transformers fixes it in the module, not the config).
    eps = float(getattr(base.model.visual.blocks[0].norm1, "variance_epsilon", 1e-6))

    def write(writer: Any) -> None:
        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_name(stem)
        writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        writer.add_vision_projection_dim(int(text.hidden_size))
        writer.add_vision_image_size(int(getattr(vision, "image_size", None) or _DEFAULT_IMAGE_SIZE))
        writer.add_vision_patch_size(int(vision.patch_size))
        writer.add_vision_embedding_length(int(vision.hidden_size))
        writer.add_vision_feed_forward_length(int(vision.intermediate_size))
        writer.add_vision_block_count(int(vision.depth))
        writer.add_vision_head_count(int(vision.num_heads))
        writer.add_vision_image_mean(mean)
        writer.add_vision_image_std(std)
        writer.add_vision_use_silu(True)
        writer.add_vision_n_wa_pattern(_wa_pattern(vision))
        writer.add_vision_spatial_merge_size(int(vision.spatial_merge_size))
        writer.add_vision_attention_layernorm_eps(eps)

    return write


def _mmproj_type(gguf: Any, shape: tuple[int, ...]) -> Any:
    # As the converter writes an f16 mmproj: vectors (norms, biases) float32, matrices and the patch kernels f16.
    types = gguf.GGMLQuantizationType
    return types.F32 if len(shape) == 1 else types.F16


def _output_files(path: str | Path, stem: str, quantization: str) -> tuple[Path, Path]:
    target = Path(path)
    if target.suffix.lower() == ".gguf" and not target.is_dir():
        return target, target.with_name(f"mmproj-{target.stem}-f16.gguf")
    return target / f"{stem}-{quantization.upper()}.gguf", target / f"mmproj-{stem}-f16.gguf"


def _write(gguf: Any, file: _File, partial: str, progress: bool) -> None:
    """Write ``file`` to ``partial`` (the tensors merged once, through a scratch file beside it)."""
    scratch_fd, scratch_name = tempfile.mkstemp(dir=file.out.parent, prefix=f".{file.out.name}.", suffix=".scratch")
    writer = None
    try:
        writer = gguf.GGUFWriter(partial, arch=file.arch)
        file.metadata(writer)
        stored: list[_Stored] = []
        with os.fdopen(scratch_fd, "wb") as scratch, torch.no_grad():
            scratch_fd = -1
            desc = f"fastft: merging for {file.out.name}"
            for tensor, ggml_type in tqdm(file.tensors, desc=desc, unit="tensor", disable=not progress):
                stored.append(_store(gguf, tensor.name, tensor.shape, tensor.blocks(), ggml_type, scratch))
        write_stored(writer, stored, scratch_name, progress)
        writer.close()
        writer = None
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
    finally:
        if writer is not None:
            writer.close()
        if scratch_fd != -1:
            os.close(scratch_fd)
        Path(scratch_name).unlink(missing_ok=True)


def save_vlm_gguf(model: torch.nn.Module, processor: Any, path: str | Path, quantization: str = "f16") -> VisionGGUF:
    """Merge the LoRA adapters and write a vision-language model's two GGUF files. See ``FastModel.save_gguf``.

    Args:
        model: A Qwen2.5-VL model from ``FastModel.from_pretrained`` / ``get_peft_model`` (adapters on the language
            model, the vision tower or both), or a merged one.
        processor: Its processor (or its tokenizer, when the model's folder has ``preprocessor_config.json``).
        path: A folder (files ``<stem>-<QUANTIZATION>.gguf`` and ``mmproj-<stem>-f16.gguf``), or the language
            model's ``.gguf`` path (the mmproj goes beside it as ``mmproj-<name>-f16.gguf``).
        quantization: The language model's tensor type (as for a text model); the mmproj is always f16.

    Returns:
        Both paths.

    Raises:
        ValueError: A family fastft does not export (with the reason), a config llama.cpp would compute
            differently, no image mean / std, an unknown quantization.
        ShapeContractError: Weights that disagree with the config.
    """
    refuse_unexported_family(model)
    gguf = _import_gguf()
    # The language model's types this writer has file-type metadata for; a type the one-file writer gained later
    # (its QUANTIZATIONS) is refused by name rather than written with the wrong general.file_type.
    supported = [name for name in QUANTIZATIONS if name in _FILE_TYPES]
    if not isinstance(quantization, str) or quantization.lower() not in supported:
        raise _fail(
            f"quantization={quantization!r} is not one of {supported} (the types a vision-language model's language "
            "model is written in)."
        )
    quantization = quantization.lower()
    base: PreTrainedModel = model.get_base_model() if isinstance(model, PeftModel) else model
    family = vision_family(base)
    if family != "qwen2_5_vl":  # refuse_unexported_family passed, so EXPORTED and this dispatch disagree
        raise _fail(f"no two-file writer for {family!r}.")
    _check_qwen2_5_vl(base)
    tokenizer, mean, std = _tokenizer_and_image_stats(processor, base)
    stem = _model_stem(base)
    out, mmproj_out = _output_files(path, stem, quantization)

    merged = merge_plan(base).tensors
    stray = [tensor.name for tensor in merged if not tensor.name.startswith((_LANGUAGE, _VISUAL, "lm_head."))]
    if stray:
        raise _fail(f"the merged model has tensors outside the language model and vision tower: {stray[:5]}.")
    language = _language_tensors(gguf, base, [t for t in merged if not t.name.startswith(_VISUAL)])
    visual = _vision_tensors(gguf, base, [t for t in merged if t.name.startswith(_VISUAL)])
    missing = sorted(_required_vision(gguf, int(base.config.vision_config.depth)) - {t.name for t in visual})
    if missing:
        raise _fail(f"the merged vision tower has no tensors for {missing[:5]} (of {len(missing)} missing).")

    names = {t.name for t in language}
    mixture = MixtureModel(int(_text_config(base.config).num_hidden_layers), tied="output.weight" not in names)
    _fallbacks(language, quantization, mixture)
    files = [
        _File(
            out,
            gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2VL],
            _language_metadata(gguf, base, tokenizer, stem, quantization),
            [(t, _tensor_type(gguf, t.shape, quantization, t.name, mixture)) for t in language],
        ),
        _File(
            mmproj_out,
            gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ],
            _vision_metadata(gguf, base, stem, mean, std),
            [(t, _mmproj_type(gguf, t.shape)) for t in visual],
        ),
    ]
    progress = _progress_bars_enabled()
    partials: list[str] = []
    try:
        for file in files:
            file.out.parent.mkdir(parents=True, exist_ok=True)
            partial_fd, partial = tempfile.mkstemp(dir=file.out.parent, prefix=f".{file.out.name}.", suffix=".partial")
            os.close(partial_fd)
            partials.append(partial)
            logger.info("fastft.save_gguf: writing %s", file.out)
            _write(gguf, file, partial, progress)
        # Renamed only once both are complete, so a failure leaves neither file (a model without its projector, or
        # a projector of another model's weights, would load and give wrong answers).
        for file, partial in zip(files, partials, strict=True):
            as_if_created(partial)
            os.replace(partial, file.out)
    except BaseException:
        for partial in partials:
            Path(partial).unlink(missing_ok=True)
        raise
    for file in files:
        logger.info("fastft.save_gguf: wrote %s (%.1f MB)", file.out, file.out.stat().st_size / 1e6)
    return VisionGGUF(out, mmproj_out)


__all__ = ["VisionGGUF", "save_vlm_gguf"]
