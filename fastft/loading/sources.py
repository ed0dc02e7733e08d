"""Where a model comes from: local paths, hub ids, the tokenizer's files, and how many positions the model covers.

Checked by :meth:`fastft.FastModel.from_pretrained` before any weight is loaded, so a typo, a missing folder, an
unreachable hub or a too-long ``max_seq_length`` is refused by name instead of failing inside transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class HubFetchError(OSError):
    """A hub id that :meth:`FastModel.from_pretrained` could not fetch: offline mode, no network, a misspelt id or a
    gated or private repository. The message says which and what to do; transformers' own error is the
    ``__cause__``.

    Attributes:
        repo_id: The hub id that could not be fetched.
    """

    def __init__(self, message: str, repo_id: str) -> None:
        super().__init__(message)
        self.repo_id = repo_id


def looks_like_path(name: str | os.PathLike) -> bool:
    # A hub id is "name" or "org/name". Anything with a root, a home or relative prefix, a backslash or a second
    # separator can only be a filesystem path, so it is never sent to the hub (which would answer with a repo-id
    # validation error that does not say the folder is missing).
    if isinstance(name, os.PathLike):
        return True
    return (
        os.path.isabs(name)
        or name.startswith(("~", "./", "../", ".\\", "..\\"))
        or name in (".", "..")
        or "\\" in name
        or name.count("/") > 1
        or name.endswith("/")
    )


def existing_path(name: str | os.PathLike, argument: str, saver: str) -> str:
    """``name`` with ``~`` expanded when it is a filesystem path; a path that does not exist is refused."""
    if not looks_like_path(name):
        return str(name)
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"fastft.from_pretrained: {argument}={os.fspath(name)!r} is a local path and does not exist "
            f"(looked for {path.resolve()}). Fix the path, pass the folder {saver} wrote, or pass a hub id "
            "such as 'HuggingFaceTB/SmolLM2-135M-Instruct'."
        )
    # Otherwise as given: it becomes config._name_or_path, which peft saves as an adapter's base_model_name_or_path.
    return str(path) if os.fspath(name).startswith("~") else os.fspath(name)


# What AutoTokenizer builds a tokenizer from: a fast tokenizer's serialisation, a slow tokenizer's vocabulary (BPE,
# WordPiece, SentencePiece, tiktoken, Mistral's tekken), or a tokenizer_config.json naming a class that needs no file.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)
_TOKENIZER_PATTERNS = ("*.model", "*.tiktoken")


def has_tokenizer(folder: Path) -> bool:
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return True
    return any(next(folder.glob(pattern), None) is not None for pattern in _TOKENIZER_PATTERNS)


def hub_fetch_error(argument: str, name: str, error: OSError, hub_kwargs: dict[str, Any]) -> HubFetchError:
    from transformers.utils.hub import is_offline_mode

    if is_offline_mode() or hub_kwargs.get("local_files_only"):
        reason = "offline mode is on (HF_HUB_OFFLINE=1 or local_files_only=True) and it is not in the local cache"
        fix = (
            "connect to the network and unset HF_HUB_OFFLINE (or drop local_files_only=True); or download it "
            f"first where there is a network (`hf download {name}`) and pass the folder, or load it with "
            "local_files_only=True from that cache"
        )
    else:
        reason = "the hub could not be reached, or has no repository of that name that this token may read"
        fix = (
            "check the network and the id's spelling; for a gated or private model accept its licence on the hub "
            f"and pass token=... (or run `hf auth login`); or download it (`hf download {name}`) and pass the folder"
        )
    upstream = next(iter(str(error).strip().splitlines()), "") or type(error).__name__
    local = Path(name).resolve()
    return HubFetchError(
        f"fastft.from_pretrained: {argument}={name!r} is not a local folder ({local} does not exist) and could not "
        f"be fetched from the Hugging Face hub: {reason}. Fix: {fix}. (transformers: {upstream})",
        repo_id=name,
    )


# The default max_seq_length when the config's position range allows it.
DEFAULT_MAX_SEQ_LENGTH = 2048
# Rope scalings that stretch a model past the max_position_embeddings in its config, by their factor. Llama 3's
# "llama3" and Phi-3's "longrope" already state the extended range in max_position_embeddings.
_STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def position_range(config: Any) -> int | None:
    """How many positions ``config``'s model covers: ``max_position_embeddings``, stretched by the factor of a linear,
    dynamic or YaRN rope scaling (over ``original_max_position_embeddings`` where given).

    Args:
        config: A transformers config (a multimodal one is read through its text config).

    Returns:
        The number of positions, or ``None`` when the config names no ``max_position_embeddings``.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None
    # transformers 5.x names it rope_parameters (per layer type on models with sliding layers); 4.x rope_scaling.
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    scalings = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    longest = limit
    for scaling in scalings:
        factor = scaling.get("factor")
        if scaling.get("rope_type", scaling.get("type")) in _STRETCHING_ROPE_TYPES and isinstance(factor, (int, float)):
            original = scaling.get("original_max_position_embeddings") or limit
            longest = max(longest, int(original * factor))
    return longest


def resolve_max_seq_length(max_seq_length: int | None, config: Any, source: str) -> int:
    limit = position_range(config)
    if max_seq_length is None:
        return DEFAULT_MAX_SEQ_LENGTH if limit is None else min(DEFAULT_MAX_SEQ_LENGTH, limit)
    if limit is not None and max_seq_length > limit:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        stated = text.max_position_embeddings
        stretched = "" if stated == limit else f", {limit} with its rope scaling"
        raise ValueError(
            f"fastft.from_pretrained: max_seq_length={max_seq_length} is past the positions {source} covers "
            f"(max_position_embeddings={stated}{stretched}); its position embedding was not trained that far. Pass "
            f"max_seq_length={limit} or less (leaving it out gives min({DEFAULT_MAX_SEQ_LENGTH}, {limit})), or use a "
            "model, or a rope scaling in its config (e.g. YaRN), made for longer context."
        )
    return max_seq_length
