"""The model's Jinja chat template as an Ollama ``TEMPLATE`` (Go ``text/template``), proven equal before it is used.

A template is recognised by the markers its rendering emits, never by the model's name: Llama 3 headers
(``<|start_header_id|>``), ChatML (``<|im_start|>``: Qwen2 / 2.5 / 3, SmolLM2), Gemma turns (``<start_of_turn>``, the
system text folded into the first user turn) and Mistral ``[INST]``. What varies inside a family (a default system
prompt, Llama 3.1's dated system preamble, Gemma's separator after the system text, a literal BOS) is read off probe
renderings. The Go template built from that is then rendered, the way Ollama's server does it (its ``SYSTEM`` added
when a request has no system message, consecutive turns of one role joined), on several conversations and compared
with the Jinja text; any difference is a refusal that says where, so a Modelfile is only written when it renders
what the model was trained on.

BOS: llama.cpp (and so Ollama) adds BOS itself when the GGUF says ``tokenizer.ggml.add_bos_token``, which fastft sets
from the tokenizer's own behaviour. When it does, a BOS the Jinja prints is left out of the Go template (else the
prompt would start with two); when it does not, the Go template prints it as text, which llama.cpp parses back into
the BOS token.

Content whitespace: Llama 3.1 and Gemma's Jinja strip each message; Go templates have no such function and Ollama's
own templates print content as given, so the probes use contents without surrounding whitespace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from fastft.export.go_template import GoTemplateError, parse, render

logger = logging.getLogger("fastft.ollama")

FAMILIES = ("llama3", "chatml", "gemma", "mistral")
_MARKERS = {
    "llama3": ("<|start_header_id|>", "<|end_header_id|>"),
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "mistral": ("[INST]", "[/INST]"),
}
_STOPS = {
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<end_of_turn>",),
    "mistral": ("[INST]", "[/INST]"),
}
# Probe texts: distinct, no surrounding whitespace (see the module docstring), one with an inner newline.
_S, _U1, _A1, _U2, _A2, _U3 = "SYS-7 rules.", "Hi there\nfriend", "Hello! How can I help?", "U-two?", "A-two.", "U-3"


class OllamaTemplateError(ValueError):
    """The chat template cannot be written as an Ollama template (the GGUF is still written)."""


@dataclass(frozen=True)
class ChatFormat:
    """An Ollama chat format: the Go ``TEMPLATE``, the default ``SYSTEM`` (or None) and the stop strings."""

    family: str
    template: str
    system: str | None
    stop: tuple[str, ...]


def _conversations(with_system: bool) -> dict[str, list[dict[str, str]]]:
    plain = {
        "user": [{"role": "user", "content": _U1}],
        "user-assistant-user": [
            {"role": "user", "content": _U1},
            {"role": "assistant", "content": _A1},
            {"role": "user", "content": _U2},
        ],
        "three turns": [
            {"role": "user", "content": _U1},
            {"role": "assistant", "content": _A1},
            {"role": "user", "content": _U2},
            {"role": "assistant", "content": _A2},
            {"role": "user", "content": _U3},
        ],
    }
    if not with_system:
        return plain
    system = {"role": "system", "content": _S}
    return {**plain, **{f"system-{name}": [system, *messages] for name, messages in plain.items()}}


def ollama_prompt(template: str | list[Any], messages: list[dict[str, str]], system: str | None = None) -> str:
    """The text Ollama's server renders for a chat request, as its ``/api/chat`` path builds it.

    The Modelfile's ``SYSTEM`` goes first when the request's first message is not a system message; consecutive
    messages of one role are joined with a blank line; ``.System`` is every system message joined the same way.
    """
    if system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": system}, *messages]
    collated: list[dict[str, Any]] = []
    for message in messages:
        if collated and collated[-1]["Role"] == message["role"]:
            collated[-1]["Content"] += "\n\n" + message["content"]
        else:
            collated.append({"Role": message["role"], "Content": message["content"], "Thinking": "", "ToolCalls": None})
    systems = [message["content"] for message in messages if message["role"] == "system"]
    data = {"System": "\n\n".join(systems), "Messages": collated, "Tools": None, "Response": "", "Think": False}
    return render(template, data)


def _literal(text: str) -> str:
    """``text`` as Go template source: as is, or as a quoted string action where it holds a delimiter."""
    if "{{" not in text and "}}" not in text:
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '{{ "' + escaped + '" }}'


def _between(text: str, start: str, end: str) -> str | None:
    """The text between the first ``start`` and the next ``end`` after it, or None."""
    head = text.find(start)
    if head < 0:
        return None
    tail = text.find(end, head + len(start))
    return None if tail < 0 else text[head + len(start) : tail]


def _build(family: str, probe: dict[str, str], bos: str) -> tuple[str, str | None]:
    """The family's Go template and default system prompt, with what varies read off the probe renderings."""
    user, system_user = probe["user"], probe.get("system-user")
    if family == "chatml":
        default = _between(user, "<|im_start|>system\n", "<|im_end|>")
        body = (
            "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
        )
        return bos + body, default
    if family == "llama3":
        block = _between(user, "<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>")
        turns = (
            '{{- range .Messages }}{{- if ne .Role "system" }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n'
            "{{ .Content }}<|eot_id|>{{- end }}{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        if block is None:
            # Llama 3.0: a system turn only when there is a system message.
            head = "{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{- end }}"
        else:
            # Llama 3.1 / 3.2 / 3.3: a system turn always, opening with a fixed preamble (knowledge date).
            head = "<|start_header_id|>system<|end_header_id|>\n\n" + _literal(block) + "{{ .System }}<|eot_id|>"
        return bos + head + turns, None
    if family == "gemma":
        separator = "\n\n"
        if system_user is not None:
            found = _between(system_user, _S, _U1)
            separator = found if found is not None else separator
        body = (
            '{{- $first := true }}{{- range .Messages }}{{- if eq .Role "system" }}{{- continue }}{{- end }}'
            '<start_of_turn>{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}\n'
            "{{ if $first }}{{ $first = false }}{{ if $.System }}{{ $.System }}" + _literal(separator) + "{{ end }}"
            "{{ end }}{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n"
        )
        return bos + body, None
    # Mistral [INST]: the pieces around a user and an assistant turn, read off two renderings. No trim markers
    # beside them: a closing "[/INST] " keeps its space.
    three = probe["user-assistant-user"]
    if _U1 not in user or _A1 not in three:
        return bos, None  # the probe check below refuses it, naming the difference
    opening, closing = user[: user.find(_U1)], user[user.find(_U1) + len(_U1) :]
    after = _between(three, _A1, opening) or ""
    between = three[three.find(closing) + len(closing) : three.find(_A1)] if closing in three else ""
    body = (
        '{{- range .Messages }}{{ if eq .Role "user" }}'
        + _literal(opening)
        + "{{ .Content }}"
        + _literal(closing)
        + '{{ else if eq .Role "assistant" }}'
        + _literal(between)
        + "{{ .Content }}"
        + _literal(after)
        + "{{ end }}{{ end }}"
    )
    return bos + body, None


def _first_difference(expected: str, actual: str) -> str:
    pairs = zip(expected, actual, strict=False)
    at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(expected), len(actual)))
    return (
        f"at character {at}: the chat template gives {expected[at : at + 60]!r}, the Go template "
        f"{actual[at : at + 60]!r}"
    )


def translate_chat_template(tokenizer: Any, adds_bos: bool) -> ChatFormat:
    """Translate ``tokenizer.chat_template`` into an Ollama chat format, or refuse with the reason.

    Args:
        tokenizer: A Hugging Face tokenizer with a Jinja ``chat_template``.
        adds_bos: Whether llama.cpp adds BOS to the prompt (the GGUF's ``tokenizer.ggml.add_bos_token``).

    Returns:
        The :class:`ChatFormat`, checked to render the same text as the chat template (without the BOS llama.cpp
        adds) on conversations with and without a system message, ending with a user turn and the generation
        prompt.

    Raises:
        OllamaTemplateError: No chat template, markers of no supported family, or a rendering that differs.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise OllamaTemplateError(
            "fastft.save_ollama: the tokenizer has no chat template to translate; set tokenizer.chat_template, or "
            "pass template= (an Ollama Go template) and write the chat format yourself."
        )

    def jinja(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    try:
        probes = {name: jinja(messages) for name, messages in _conversations(with_system=False).items()}
    except Exception as error:
        raise OllamaTemplateError(
            f"fastft.save_ollama: the chat template fails on a plain user / assistant conversation "
            f"({type(error).__name__}: {error}), so there is nothing to translate. The GGUF is written; write the "
            "Modelfile TEMPLATE by hand, or pass template= (an Ollama Go template)."
        ) from error
    try:
        probes.update({name: jinja(messages) for name, messages in _conversations(with_system=True).items()})
    except TemplateError as error:
        # raise_exception() in the template: it refuses system messages (Mistral v0.1, Gemma 2), a property of the
        # format rather than a failure; the Go template is then checked on conversations without one.
        logger.info("fastft.save_ollama: the chat template refuses a system message (%s); checked without one.", error)
        system_refused = True
    else:
        system_refused = False
    bos = getattr(tokenizer, "bos_token", None) or ""
    # Printed by the template itself, not a marker that happens to be the BOS token too (SmolLM2's <|im_start|>).
    printed_bos = bool(bos) and "bos_token" in template and all(text.startswith(bos) for text in probes.values())
    bare = {name: text[len(bos) :] for name, text in probes.items()} if printed_bos else probes
    first = bare["user"]
    family = next((name for name, markers in _MARKERS.items() if markers[0] in first), None)
    if family is None:
        raise OllamaTemplateError(
            "fastft.save_ollama: the chat template's markers match none of the families fastft translates "
            f"({', '.join(FAMILIES)}); a user turn renders as {first[:160]!r}. The GGUF is written; write the "
            "Modelfile TEMPLATE by hand, or pass template= (an Ollama Go template)."
        )
    go_template, system = _build(family, bare, bos if printed_bos and not adds_bos else "")
    if adds_bos:
        probes = bare
    try:
        nodes = parse(go_template)
    except GoTemplateError as error:
        raise OllamaTemplateError(f"fastft.save_ollama: the {family} Go template does not parse: {error}") from error
    conversations = _conversations(with_system=not system_refused)
    for name, messages in conversations.items():
        actual = ollama_prompt(nodes, messages, system)
        if actual != probes[name]:
            raise OllamaTemplateError(
                f"fastft.save_ollama: the chat template looks like {family} (it emits {_MARKERS[family][0]}) but "
                f"differs from fastft's {family} Ollama template on a {name} conversation, "
                f"{_first_difference(probes[name], actual)}. The GGUF is written; write the Modelfile TEMPLATE by "
                "hand, or pass template= (an Ollama Go template)."
            )
    if "strftime_now" in template:
        # Llama 3.2 dates its system turn with the day it renders; Ollama's currentDate has another format.
        logger.warning(
            "fastft.save_ollama: the chat template writes today's date into the prompt (strftime_now); the Modelfile "
            "carries the date of this export instead."
        )
    stops = list(_STOPS[family])
    eos = getattr(tokenizer, "eos_token", None)
    if eos and eos not in stops:
        stops.append(eos)
    return ChatFormat(family, go_template, system, tuple(stops))
