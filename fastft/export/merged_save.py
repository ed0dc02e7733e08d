"""``FastModel.save_merged``: the merged model written as a plain transformers folder, streamed and all-or-nothing.

The merge is streamed (:mod:`.merge` plans it, :mod:`.shards` writes each tensor's rows as they are
merged), so host memory beyond the loaded model stays within one block of merged rows, or one dequantised projection
of a 4-bit base. Everything goes into a hidden staging folder beside the target, which is renamed into place only
when complete: a full disk, an exception or an interrupt leaves the target as it was (absent, or the old model).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from peft import PeftModel
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from fastft.export.expert_split import split_experts
from fastft.export.file_modes import as_if_created
from fastft.export.merge import MergedTensor, MergePlan, merge_plan
from fastft.export.shards import WEIGHTS_NAME, Producer, parse_shard_size, plan_shards, write_index, write_shard
from fastft.loading.dtypes import DTYPES
from fastft.patches.causal_lm import unpatched_class

try:
    from transformers.core_model_loading import revert_weight_conversion
except ImportError:  # transformers < 5 saves tensors under their in-memory names
    revert_weight_conversion = None

# The name it had as fastft/merged_save.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.merged_save")

SAVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_save_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` of :func:`save_merged` as a torch dtype: float32, float16 or bfloat16, or one of their names.

    Raises:
        ValueError: Any other dtype or name.
    """
    resolved = DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in SAVE_DTYPES:
        raise ValueError(
            f"fastft.save_merged: dtype={dtype!r} is not one the merged model can be saved in; pass torch.float16 "
            f"(the default), torch.bfloat16 or torch.float32 (or one of the names {sorted(DTYPES)})."
        )
    return resolved


def check_target(
    target: Path, overwrite: bool, where: str = "fastft.save_merged", overwrite_name: str = "overwrite=True"
) -> None:
    """Refuse a target that is a file, or a non-empty folder without ``overwrite=True``, before anything is written.

    Args:
        target: The folder to write.
        overwrite: Whether a non-empty folder may be replaced.
        where: The entry point and argument, first in the message.
        overwrite_name: How the caller spells the override (``"--overwrite"`` on the command line).

    Raises:
        FileExistsError: The target is a file, or a folder with files in it and ``overwrite`` is false.
    """
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{where}: {target} is a file; pass a folder path (it is created if missing).")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{where}: {target} already exists and is not empty; pass {overwrite_name} to replace it (the old folder "
            "is removed only once the new one is complete), or choose another folder."
        )


def _publish(staging: Path, target: Path) -> None:
    """Put the complete ``staging`` folder at ``target``, replacing what was there, by renames on one filesystem."""
    if not target.exists():
        os.replace(staging, target)
        return
    retired = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
    os.rmdir(retired)
    os.replace(target, retired)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(retired, target)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def _config_has_dtype() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (4, 56)


def plain_config(base: PreTrainedModel, dtype: torch.dtype, untied: bool = False) -> PretrainedConfig:
    """A copy of ``base``'s config for its merged, dense weights in ``dtype``.

    Args:
        base: The model the weights come from.
        dtype: dtype of the saved weights.
        untied: An adapter changed one of a tied embeddings pair, so both are saved and must load untied.
    """
    config = copy.deepcopy(base.config)
    # The saved weights are dense: a bitsandbytes or GGUF entry would make transformers expect packed ones.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # transformers 4.x records the pre-quantisation torch.dtype on 4-bit loads and drops it on save only while
    # quantization_config is still there; left alone it breaks the JSON of the saved config.
    # A vision-language config's text and vision configs get it too (4.57).
    for part in (config, *(value for value in vars(config).values() if isinstance(value, PretrainedConfig))):
        if hasattr(part, "_pre_quantization_dtype"):
            del part._pre_quantization_dtype
    # Before 4.56 the config serialises only `torch_dtype` (a torch.dtype under `dtype` is not JSON).
    key = "dtype" if _config_has_dtype() else "torch_dtype"
    setattr(config, key, dtype)
    for part in vars(config).values():
        # A vision-language model's text and vision configs name their dtype too: the saved one, not the loaded one.
        if isinstance(part, PretrainedConfig) and getattr(part, key, None) is not None:
            setattr(part, key, dtype)
    # The upstream class, not fastft's patched subclass (FastLlamaForCausalLM): tools that read `architectures`
    # (vLLM, TGI, the hub's widgets) know only transformers' names.
    config.architectures = [unpatched_class(type(base)).__name__]
    config.use_cache = True
    if untied:
        config.tie_word_embeddings = False
    return config


def _renamed(
    by_name: dict[str, MergedTensor], shapes: dict[str, torch.Tensor], reverted: dict[str, torch.Tensor]
) -> list[Producer] | None:
    """The plan's tensors under the names transformers 5 reverted them to, when the reversal only renamed them
    (each shape-only tensor given comes back once, unchanged: vision-language models saved with their hub names,
    ``model.layers.*`` and ``visual.*`` for Qwen2.5-VL's in-memory ``model.language_model.*`` / ``model.visual.*``);
    ``None`` when it did more."""
    origin = {id(tensor): name for name, tensor in shapes.items()}
    names = [origin.get(id(tensor)) for tensor in reverted.values()]
    if None in names or len(set(names)) != len(shapes):
        return None
    return [dataclasses.replace(by_name[old], name=new) for new, old in zip(reverted, names, strict=True)]


def _legacy_names(base: PreTrainedModel, tensors: list[MergedTensor]) -> list[Producer]:
    """transformers 4.x's save names for a vision-language model: its ``_checkpoint_conversion_mapping`` (hub name
    pattern -> in-memory name) reversed, the first pattern that matches each name, as its ``save_pretrained`` does;
    other models keep their in-memory names."""
    mapping = getattr(base, "_checkpoint_conversion_mapping", None) or {}
    if not mapping:
        return tensors
    # The reversed pattern is the in-memory prefix; the replacement is the hub pattern without its anchors and
    # lookaheads, as 4.x strips them.
    reverse = [(memory, re.sub(r"\(.*\)", "", hub.lstrip("^"))) for hub, memory in mapping.items()]
    out: list[Producer] = []
    for tensor in tensors:
        name = tensor.name
        for pattern, replacement in reverse:
            name, count = re.subn(pattern, replacement, name)
            if count:
                break
        out.append(tensor if name == tensor.name else dataclasses.replace(tensor, name=name))
    return out


def _disk_order(base: PreTrainedModel, plan: MergePlan) -> list[Producer]:
    """The plan's tensors in the order transformers' ``save_pretrained`` would write them.

    transformers 5 passes the state dict through its weight-conversion reversal before sharding (which also sorts
    the keys), and renames or fuses some checkpoints' tensors there (MoE experts, say); the shard split depends on
    that order, so it is taken from transformers itself, on shape-only tensors.

    Raises:
        NotImplementedError: The model's tensors have other names or another layout on disk than in memory.
    """
    if revert_weight_conversion is None:
        return _legacy_names(base, plan.tensors)
    by_name = {tensor.name: tensor for tensor in plan.tensors}
    shapes = {name: torch.empty(tensor.shape, device="meta") for name, tensor in by_name.items()}
    reverted = revert_weight_conversion(base, dict(shapes))
    if set(reverted) == set(shapes):
        return [by_name[name] for name in reverted]
    renamed = _renamed(by_name, shapes, reverted)
    if renamed is not None:
        return renamed
    # transformers 5 saves fused MoE experts one tensor per expert: slices of the merged fused tensors.
    split = split_experts(by_name, reverted)
    if split is None:
        raise NotImplementedError(
            f"fastft.save_merged: {type(base).__name__} stores its weights on disk under other names or in another "
            "layout than in memory (transformers' weight conversion), which the streaming merge does not write yet. "
            "Merge with peft instead: model.merge_and_unload().save_pretrained(folder)."
        )
    return split


# What a vision-language checkpoint's AutoProcessor reads besides the tokenizer's files.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def _image_processor_files(base: PreTrainedModel, staging: Path) -> None:
    """Copy a vision-language model's image (and video) processor configs from the checkpoint it was loaded from,
    where the merged folder has none yet: ``save_merged`` is often handed the tokenizer alone (fastft returns it when
    the processor cannot be built), and without them ``AutoProcessor`` cannot load the merged folder."""
    if getattr(base.config, "vision_config", None) is None:
        return
    from transformers.utils import cached_file

    source = getattr(base, "name_or_path", "")
    copied = []
    for name in PROCESSOR_FILES:
        if (staging / name).exists():
            copied.append(name)
            continue
        found = (
            cached_file(
                source,
                name,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
            if source
            else None
        )
        if found is not None:
            shutil.copyfile(found, staging / name)
            copied.append(name)
    if "preprocessor_config.json" not in copied:
        logger.warning(
            "fastft.save_merged: %s is a vision-language model, but no image processor config was found (not in the "
            "processor passed, nor in %r); save it beside the weights (processor.save_pretrained(folder)) before "
            "loading the folder with AutoProcessor.",
            type(base).__name__,
            source,
        )


def save_merged(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    save_directory: str | Path,
    dtype: torch.dtype | str = torch.float16,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write the merged model as safetensors shards with its config and tokenizer. See ``FastModel.save_merged``."""
    dtype = resolve_save_dtype(dtype)
    shard_bytes = parse_shard_size(max_shard_size)
    target = Path(save_directory).expanduser()
    check_target(target, overwrite)
    if not isinstance(model, (PeftModel, PreTrainedModel)):
        raise TypeError(
            f"fastft.save_merged: model must be a transformers PreTrainedModel or a peft PeftModel, got "
            f"{type(model).__name__}; pass the model from FastModel.from_pretrained or get_peft_model."
        )
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(
            f"fastft.save_merged: tokenizer must be a transformers tokenizer (or None), got {type(tokenizer).__name__}."
        )
    base: PreTrainedModel = model.get_base_model() if isinstance(model, PeftModel) else model
    plan = merge_plan(model)
    ordered = _disk_order(base, plan)
    config = plain_config(base, dtype, untied=plan.untied)
    files, metadata = plan_shards(ordered, dtype, shard_bytes)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    total = metadata["total_size"]
    try:
        config.save_pretrained(staging)
        if base.can_generate() and getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(staging)
        with (
            hf_logging.tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"fastft: merging into {len(files)} shard{'s' if len(files) > 1 else ''}",
            ) as bar,
            torch.no_grad(),
        ):
            for file, tensors in files.items():
                write_shard(staging / file, tensors, dtype, bar)
        if len(files) > 1:
            write_index(staging, files, metadata, plan.parameters)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _image_processor_files(base, staging)
        as_if_created(staging, recursive=True)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "fastft: merged model written to %s (%s, %d shard%s, %.1f MB)",
        target,
        str(dtype).removeprefix("torch."),
        len(files),
        "s" if len(files) > 1 else "",
        total / 1e6,
    )
    return target


__all__ = ["SAVE_DTYPES", "WEIGHTS_NAME", "check_target", "plain_config", "resolve_save_dtype", "save_merged"]
