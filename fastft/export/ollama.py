"""Export for Ollama: the GGUF file plus a ``Modelfile`` beside it (``ollama create NAME -f DIR/Modelfile``).

The Modelfile holds ``FROM ./<file>.gguf``, the chat ``TEMPLATE`` translated from the model's Jinja chat template
and checked to render the same text (:mod:`fastft.export.ollama_template`), ``SYSTEM`` when the chat template has a
default system prompt, ``PARAMETER stop`` for the end-of-turn markers, and default sampling parameters: the model's
``generation_config`` where it samples (temperature, top_p, top_k, repetition penalty), else temperature 0.7 and
top_p 0.9, and a context of ``min(max_position_embeddings, 4096)`` tokens (Ollama's own default is smaller).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from fastft.export.file_modes import as_if_created
from fastft.export.gguf_export import _adds, save_gguf
from fastft.export.go_template import GoTemplateError, parse
from fastft.export.ollama_template import ChatFormat, OllamaTemplateError, translate_chat_template

logger = logging.getLogger("fastft.ollama")

DEFAULT_PARAMETERS: dict[str, float | int] = {"temperature": 0.7, "top_p": 0.9}
MAX_DEFAULT_CONTEXT = 4096
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repeat_penalty",
}
# transformers' GenerationConfig defaults: a value equal to these was not chosen by the model's authors.
_UNSET = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def default_parameters(model: torch.nn.Module) -> dict[str, float | int]:
    """The ``PARAMETER`` lines fastft writes for ``model`` (see the module docstring)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    parameters: dict[str, float | int] = dict(DEFAULT_PARAMETERS)
    generation = getattr(base, "generation_config", None)
    if generation is not None and getattr(generation, "do_sample", False):
        for key, name in _GENERATION_KEYS.items():
            value = getattr(generation, key, None)
            if value is not None and value != _UNSET[key]:
                parameters[name] = value
    context = getattr(base.config, "max_position_embeddings", None)
    if context:
        parameters["num_ctx"] = int(min(context, MAX_DEFAULT_CONTEXT))
    return parameters


def _quoted(value: str, what: str) -> str:
    if '"""' in value:
        raise OllamaTemplateError(
            f'fastft.save_ollama: the {what} contains """, which ends a Modelfile block early; remove it or write '
            "the Modelfile by hand."
        )
    return f'"""{value}"""'


def modelfile_text(gguf_name: str, chat: ChatFormat, parameters: dict[str, Any]) -> str:
    """The Modelfile for ``gguf_name`` (beside it) with ``chat`` and ``parameters``."""
    lines = [
        "# Written by fastft. Create the model with: ollama create NAME -f Modelfile",
        f"FROM ./{gguf_name}",
        f"TEMPLATE {_quoted(chat.template, 'chat template')}",
    ]
    if chat.system:
        lines.append(f"SYSTEM {_quoted(chat.system, 'default system prompt')}")
    for stop in chat.stop:
        if '"' in stop or "\n" in stop or not stop:
            raise OllamaTemplateError(f"fastft.save_ollama: the stop string {stop!r} cannot be written as a PARAMETER.")
        lines.append(f'PARAMETER stop "{stop}"')
    for name, value in parameters.items():
        lines.append(f"PARAMETER {name} {value}")
    return "\n".join(lines) + "\n"


def _chat_format(
    tokenizer: PreTrainedTokenizerBase, template: str | None, system: str | None, stop: list[str] | None
) -> ChatFormat:
    if template is None:
        chat = translate_chat_template(tokenizer, adds_bos=_adds(tokenizer, tokenizer.bos_token_id, 0))
        return ChatFormat(chat.family, chat.template, system if system is not None else chat.system, chat.stop)
    try:
        parse(template)
    except GoTemplateError as error:
        raise OllamaTemplateError(f"fastft.save_ollama: template= is not a valid Go template: {error}") from error
    stops = tuple(stop) if stop else tuple(token for token in [getattr(tokenizer, "eos_token", None)] if token)
    return ChatFormat("given", template, system, stops)


def save_ollama(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    directory: str | Path,
    quantization: str = "q8_0",
    template: str | None = None,
    system: str | None = None,
    stop: list[str] | None = None,
    parameters: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write the GGUF and a Modelfile into ``directory``; returns both paths. See ``FastModel.save_ollama``."""
    target = Path(directory).expanduser()
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"fastft.save_ollama: {target} is a file; pass a folder for the GGUF and Modelfile.")
    refusal: OllamaTemplateError | None = None
    try:
        chat = _chat_format(tokenizer, template, system, stop)
        merged = {**default_parameters(model), **(parameters or {})}
        modelfile_text("model.gguf", chat, merged)  # refuses what a Modelfile cannot hold before the GGUF is written
    except OllamaTemplateError as error:
        # The GGUF is still useful without a Modelfile (llama.cpp, LM Studio, a hand-written Modelfile).
        refusal = error
    gguf = save_gguf(model, tokenizer, target, quantization)
    if refusal is not None:
        raise OllamaTemplateError(f"{refusal} (The GGUF is at {gguf}; no Modelfile was written.)") from refusal
    text = modelfile_text(gguf.name, chat, merged)
    handle, partial = tempfile.mkstemp(dir=target, prefix=".Modelfile.", suffix=".partial")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())  # on disk before the rename, as the GGUF is
        as_if_created(partial)
        os.replace(partial, target / "Modelfile")
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    logger.info("fastft.save_ollama: wrote %s and %s (%s chat template)", gguf, target / "Modelfile", chat.family)
    return gguf, target / "Modelfile"
