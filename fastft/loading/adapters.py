"""A saved LoRA adapter put back on a model (``FastModel.load_adapter``), each tensor checked against its base first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from fastft.contracts import check_adapter_layout, check_adapter_tensors, check_lora
from fastft.loading.lora import check_base, keep_trainable_fp32

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_file(adapter_path: str | Path, filename: str, hub_kwargs: dict[str, Any]) -> Path | None:
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
    for filename in ADAPTER_WEIGHTS:
        file = adapter_file(adapter_path, filename, hub_kwargs)
        if file is None:
            continue
        if filename.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(file), "pt") as handle:
                return {key: torch.empty(handle.get_slice(key).get_shape(), device="meta") for key in handle.keys()}  # noqa: SIM118
        # weights_only refuses pickled code, so an old-style .bin adapter is read as plain tensors.
        state = torch.load(file, map_location="cpu", weights_only=True)
        return {key: torch.empty(tensor.shape, device="meta") for key, tensor in state.items()}
    raise FileNotFoundError(f"fastft.load_adapter: {adapter_path} has neither of {list(ADAPTER_WEIGHTS)}.")


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
        ShapeContractError: A tensor (named by its key) whose shape does not fit the base model, an adapter whose
            expert weights are for the other MoE layout, or a base model that breaks a contract itself.
        ValueError: The adapter is not a LoRA adapter.
        FileNotFoundError: No ``adapter_config.json`` or adapter weights.
    """
    config_file = adapter_file(adapter_path, ADAPTER_CONFIG, hub_kwargs)
    if config_file is None:
        raise FileNotFoundError(f"fastft.load_adapter: {adapter_path} has no {ADAPTER_CONFIG}.")
    adapter_config = json.loads(config_file.read_text())
    if adapter_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(
            f"fastft.load_adapter: {adapter_path} is a {adapter_config.get('peft_type')} adapter; fastft loads "
            "LoRA adapters. Use peft.PeftModel.from_pretrained for other methods."
        )
    check_base(model)
    tensors = _adapter_tensors(adapter_path, hub_kwargs)
    check_adapter_layout(model, tensors, f"fastft.load_adapter({adapter_path})")
    check_adapter_tensors(model, tensors, adapter_config)
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
