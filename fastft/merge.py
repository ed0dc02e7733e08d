"""Merging LoRA adapters into dense base weights, and saving the result as a plain transformers model."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastft.contracts import ShapeContractError
from fastft.kernels import dequantize_nf4

logger = logging.getLogger(__name__)


def dense_weight(name: str, parameter: torch.Tensor) -> torch.Tensor:
    """A float32 dense copy of a parameter, dequantising bitsandbytes 4-bit weights.

    Args:
        name: The parameter's name, for error messages.
        parameter: A plain tensor or a bitsandbytes ``Params4bit``.

    Returns:
        A float32 tensor on the parameter's device.

    Raises:
        ShapeContractError: A 4-bit weight that lost its ``quant_state``.
        NotImplementedError: An 8-bit weight.
    """
    kind = type(parameter).__name__
    if kind == "Params4bit":
        import bitsandbytes.functional as bnb_functional

        packed, state = parameter.data, parameter.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes' CPU inference path repacks the weight in place into a kernel-specific layout.
            packed, state = bnb_functional._convert_weight_packed_for_cpu_inverse(packed, copy.deepcopy(state))
        if state is not None and state.quant_type != "nf4":
            return bnb_functional.dequantize_4bit(packed, state).float()
        try:
            # fastft's dequantiser rather than bitsandbytes': bnb 0.50's AVX-512 CPU dequantize_4bit scales by the
            # wrong block when in_features is not a multiple of the blocksize. It also refuses a lost quant_state.
            return dequantize_nf4(packed, state).float()
        except ShapeContractError as error:
            raise ShapeContractError(f"{name}: {error}") from error
    if kind == "Int8Params":
        raise NotImplementedError(f"{name}: merging into 8-bit bitsandbytes weights is not supported; load in 4-bit.")
    return parameter.detach().float()


def _lora_delta(name: str, layer: LoraLayer) -> torch.Tensor | None:
    if layer.merged or layer.disable_adapters:
        # A merged layer's base weight already holds the update; a disabled one contributes none.
        return None
    delta = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            raise NotImplementedError(f"{name}: merging LoRA adapter {adapter!r} of this layer type is not supported.")
        if layer.use_dora.get(adapter, False):
            raise NotImplementedError(f"{name}: merging DoRA adapters is not supported yet.")
        lora_a = layer.lora_A[adapter].weight.float()
        lora_b = layer.lora_B[adapter].weight.float()
        update = (lora_b @ lora_a) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):
            update = update.T
        delta = update if delta is None else delta + update
    return delta


def _config_has_dtype() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (4, 56)


def merged_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's state dict with every active LoRA update merged in, in ``dtype`` on the CPU.

    Args:
        model: A ``PeftModel`` with LoRA adapters, or a plain ``PreTrainedModel``.
        dtype: dtype of the floating-point tensors returned.

    Returns:
        Tensors keyed by the names plain transformers expects.
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    state: dict[str, torch.Tensor] = {}
    handled: list[str] = []
    for name, module in base.named_modules():
        if any(name.startswith(prefix) for prefix in handled):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, LoraLayer):
            base_layer = module.get_base_layer()
            weight = dense_weight(f"{prefix}weight", base_layer.weight)
            delta = _lora_delta(name, module)
            if delta is not None:
                weight = weight + delta.to(weight.device)
            state[f"{prefix}weight"] = weight.to(dtype).cpu()
            if getattr(base_layer, "bias", None) is not None:
                state[f"{prefix}bias"] = base_layer.bias.detach().to(dtype).cpu()
            handled.append(prefix)
        elif isinstance(module, ModulesToSaveWrapper):
            chosen = (
                module.original_module if module.disable_adapters else module.modules_to_save[module.active_adapter]
            )
            for key, tensor in chosen.state_dict().items():
                state[f"{prefix}{key}"] = dense_weight(key, tensor).to(dtype).cpu()
            handled.append(prefix)
        else:
            for key, parameter in module.named_parameters(recurse=False):
                state[f"{prefix}{key}"] = dense_weight(f"{prefix}{key}", parameter).to(dtype).cpu()
            for key, buffer in module.named_buffers(recurse=False):
                if key not in module._non_persistent_buffers_set:
                    cast = buffer.to(dtype) if buffer.is_floating_point() else buffer
                    state[f"{prefix}{key}"] = cast.detach().cpu()
    return state


def save_merged(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    save_directory: str | Path,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write the merged model as safetensors with its config and tokenizer. See ``FastModel.save_merged``."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fastft.save_merged: dtype={dtype} is not supported; use float32, float16 or bfloat16.")
    base: PreTrainedModel = model.get_base_model() if isinstance(model, PeftModel) else model
    state = merged_state_dict(model, dtype)
    config = copy.deepcopy(base.config)
    # The saved weights are dense: a bitsandbytes or GGUF entry would make transformers expect packed ones.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # transformers 4.x records the pre-quantisation torch.dtype on 4-bit loads and drops it on save only while
    # quantization_config is still there; left alone it breaks the JSON of the saved config.
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    # Before 4.56 the config serialises only `torch_dtype` (a torch.dtype under `dtype` is not JSON).
    setattr(config, "dtype" if _config_has_dtype() else "torch_dtype", dtype)
    config.use_cache = True
    embed, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    tied = getattr(config, "tie_word_embeddings", False) and embed is not None and head is not None
    if tied and not torch.equal(embed, head):
        # An adapter on the head (or the embeddings) unties them; keep both so neither update is lost.
        config.tie_word_embeddings = False
    with torch.device("meta"):
        shell = type(base)(config)
    shell.generation_config = copy.deepcopy(base.generation_config)
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    shell.save_pretrained(out, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    logger.info("fastft: merged model written to %s (%s)", out, dtype)
    return out
