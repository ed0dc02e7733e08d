"""Where the assistant's turns are: a tokenizer's chat markers, read from its template, matched on token ids.

Turns are found by two markers: the text that opens a user turn (``instruction_part``) and the text that opens an
assistant turn (``response_part``). Without them, the markers are read from the tokenizer's chat template by
rendering a probe conversation; SmolLM2's ChatML gives ``"<|im_start|>user\\n"`` and ``"<|im_start|>assistant\\n"``.

Markers are matched on token ids, not on text. A marker can tokenize differently depending on what precedes it
(SentencePiece's leading ``"▁"``, a space merged into the next word), so each marker is kept as the set of id
sequences it takes in the probe conversation and in a few typical contexts; whitespace tokens at its edges are left
out of the match, since they merge with neighbouring whitespace (content that starts with ``"\\n"``).

:mod:`fastft.training.responses` applies the :class:`ResponseMasker` built here to a trainer, a dataset or a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
NAME = "fastft.train_on_responses_only"

# Probe contents: plain words that no template contains, so each can be found once in the rendered text. They start
# with a letter, so no BPE merge joins them to the marker before them.
_SYSTEM = "Kilo probe system text"
_USER_1 = "Alpha probe user text"
_ASSISTANT_1 = "Bravo probe reply text"
_USER_2 = "Charlie probe user text"
_ASSISTANT_2 = "Delta probe reply text"
_TOOL = "Echo probe tool text"

# Marker contexts besides the probe conversation: at the start of a text, after a newline, after a space, glued to a
# word. The trailing word keeps the marker's last characters from merging with the end of the text.
_CONTEXTS = (("", "Zulu"), ("\n", "Zulu"), (" ", "Zulu"), ("Zulu", "Zulu"), ("Zulu\n\n", "Zulu"))

_PASS_MARKERS = (
    "pass instruction_part= and response_part= (the text that opens a user turn and an assistant turn, e.g. "
    "instruction_part='<|im_start|>user\\n', response_part='<|im_start|>assistant\\n' for ChatML)"
)


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise TypeError(f"{NAME}: apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
    return text


def _try_render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str | None:
    # Templates refuse what they do not support (a system role, a tool turn, non-alternating roles) by raising.
    try:
        return _render(tokenizer, messages, add_generation_prompt)
    except Exception:  # noqa: BLE001 - any template error means "this shape is not supported"
        return None


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters or token ids) ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def text_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer inside a processor (multimodal models), or the tokenizer itself."""
    inner = getattr(tokenizer, "tokenizer", None)
    return inner if inner is not None and hasattr(inner, "apply_chat_template") else tokenizer


@dataclass(frozen=True)
class ChatMarkers:
    """The turn markers found in a chat template.

    Attributes:
        instruction_part: Text that opens a user turn.
        response_part: Text that opens an assistant turn.
        other_parts: Texts that open other non-assistant turns (system, tool) in the same template; they end an
            assistant turn like ``instruction_part`` does.
    """

    instruction_part: str
    response_part: str
    other_parts: tuple[str, ...] = ()


def _probe_conversation(system: bool) -> list[dict[str, str]]:
    turns = [
        {"role": "user", "content": _USER_1},
        {"role": "assistant", "content": _ASSISTANT_1},
        {"role": "user", "content": _USER_2},
        {"role": "assistant", "content": _ASSISTANT_2},
    ]
    return ([{"role": "system", "content": _SYSTEM}] if system else []) + turns


def detect_chat_markers(tokenizer: Any) -> ChatMarkers:
    """Read the user and assistant turn markers from a tokenizer's chat template.

    A probe conversation (user, assistant, user, assistant) is rendered: the user marker is the text before the
    second user message, less the assistant's end-of-turn text (what follows the last reply); the assistant marker
    is the generation prompt (what ``add_generation_prompt=True`` appends), or, for templates without one, the text
    between a user message and the reply. System and tool markers are derived from the user marker by swapping the
    role name, and kept only where the template renders them that way.

    Args:
        tokenizer: A tokenizer (or processor) with a chat template.

    Returns:
        The markers.

    Raises:
        ValueError: The tokenizer has no chat template, or the template has no recognisable turn markers.
    """
    tokenizer = text_tokenizer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{NAME}: the tokenizer ({type(tokenizer).__name__}) has no chat template, so the turn markers cannot be "
            f"detected; {_PASS_MARKERS}."
        )
    conversation = _probe_conversation(system=False)
    text = _try_render(tokenizer, conversation)
    if text is None:
        raise ValueError(
            f"{NAME}: the chat template failed to render a user/assistant/user/assistant conversation, so the turn "
            f"markers cannot be detected; {_PASS_MARKERS}."
        )
    spans = {}
    cursor = 0
    for content in (_USER_1, _ASSISTANT_1, _USER_2, _ASSISTANT_2):
        start = text.find(content, cursor)
        if start < 0:
            raise ValueError(
                f"{NAME}: the chat template does not render message contents verbatim ({content!r} is missing from "
                f"{text!r}), so the turn markers cannot be detected; {_PASS_MARKERS}."
            )
        spans[content] = (start, start + len(content))
        cursor = start + len(content)
    user_to_reply = text[spans[_USER_1][1] : spans[_ASSISTANT_1][0]]
    reply_to_user = text[spans[_ASSISTANT_1][1] : spans[_USER_2][0]]
    after_reply = text[spans[_ASSISTANT_2][1] :]
    # What follows the last reply is the assistant's end-of-turn text; what follows it before the next user message
    # opens the user turn.
    instruction = reply_to_user[_common_prefix(reply_to_user, after_reply) :]

    response = ""
    plain = _try_render(tokenizer, conversation[:1])
    prompted = _try_render(tokenizer, conversation[:1], add_generation_prompt=True)
    if plain is not None and prompted is not None and prompted.startswith(plain):
        response = prompted[len(plain) :]
    if not response.strip() or not user_to_reply.endswith(response):
        # No generation prompt (Llama 2, Mistral): the reply opens after the user turn's own closing text.
        user_end = plain[plain.find(_USER_1) + len(_USER_1) :] if plain is not None and _USER_1 in plain else ""
        response = user_to_reply[_common_prefix(user_to_reply, user_end) :]
        if not response.strip():
            response = user_to_reply

    if not instruction.strip() or not response.strip() or instruction.strip() == response.strip():
        raise ValueError(
            f"{NAME}: the chat template has no turn markers to tell user and assistant turns apart (between a user "
            f"message and the reply it renders {user_to_reply!r}, between a reply and the next user message "
            f"{reply_to_user!r}); {_PASS_MARKERS}."
        )

    others = []
    if instruction.count("user") == 1:
        system_text = _try_render(tokenizer, _probe_conversation(system=True))
        candidate = instruction.replace("user", "system")
        if system_text is not None and candidate + _SYSTEM in system_text:
            others.append(candidate)
        tool_turns = conversation[:2] + [{"role": "tool", "content": _TOOL}] + conversation[3:]
        tool_text = _try_render(tokenizer, tool_turns)
        candidate = instruction.replace("user", "tool")
        if tool_text is not None and candidate + _TOOL in tool_text:
            others.append(candidate)
    return ChatMarkers(instruction, response, tuple(others))


def detect_markers(tokenizer: Any) -> tuple[str, str]:
    """The ``(instruction_part, response_part)`` a tokenizer's chat template uses.

    Args:
        tokenizer: A tokenizer (or processor) with a chat template.

    Returns:
        The text that opens a user turn and the text that opens an assistant turn, e.g.
        ``("<|im_start|>user\\n", "<|im_start|>assistant\\n")`` for ChatML.

    Raises:
        ValueError: No chat template, or no recognisable markers in it.
    """
    markers = detect_chat_markers(tokenizer)
    return markers.instruction_part, markers.response_part


@dataclass(frozen=True)
class _Pattern:
    ids: tuple[int, ...]
    tail: tuple[int, ...]  # whitespace tokens that usually follow (skipped when present)
    opens_response: bool


class ResponseMasker:
    """Finds the assistant tokens of a tokenized conversation from its turn markers.

    Args:
        tokenizer: The tokenizer the ids come from.
        instruction_parts: Texts that open a non-assistant turn (user first; system, tool, ...).
        response_part: Text that opens an assistant turn.
        contexts: Rendered texts in which the markers appear (the probe conversation); each occurrence adds the
            marker's in-context tokenization to the patterns matched.

    Raises:
        ValueError: A marker is empty or whitespace only, or the two kinds of marker tokenize the same.
    """

    def __init__(
        self,
        tokenizer: Any,
        instruction_parts: Sequence[str],
        response_part: str,
        contexts: Sequence[str] = (),
    ) -> None:
        self.tokenizer = text_tokenizer(tokenizer)
        self.instruction_parts = tuple(instruction_parts)
        self.response_part = response_part
        self._whitespace: dict[int, bool] = {}
        patterns: dict[tuple[int, ...], _Pattern] = {}
        for marker, opens in [(part, False) for part in self.instruction_parts] + [(response_part, True)]:
            if not isinstance(marker, str) or not marker.strip():
                raise ValueError(f"{NAME}: a marker must be non-blank text, got {marker!r}; {_PASS_MARKERS}.")
            found = self._variants(marker, contexts)
            if not found:
                raise ValueError(f"{NAME}: the marker {marker!r} tokenizes to nothing; {_PASS_MARKERS}.")
            for ids, tail in found:
                previous = patterns.get(ids)
                if previous is not None and previous.opens_response != opens:
                    raise ValueError(
                        f"{NAME}: instruction_part {self.instruction_parts} and response_part {response_part!r} "
                        f"tokenize to the same ids {list(ids)}, so user and assistant turns cannot be told apart; "
                        "pass markers that differ in a non-whitespace token."
                    )
                if previous is None or len(tail) > len(previous.tail):
                    patterns[ids] = _Pattern(ids, tail, opens)
        # Longest first: at a position where several patterns match, the longest one is the marker there.
        self.patterns = sorted(patterns.values(), key=lambda p: -len(p.ids))

    def is_whitespace(self, token_id: int) -> bool:
        """Whether a token decodes to whitespace only (cached: asked for a few tokens per turn)."""
        answer = self._whitespace.get(token_id)
        if answer is None:
            answer = not self.tokenizer.decode([int(token_id)]).strip()
            self._whitespace[token_id] = answer
        return answer

    def _inside(self, text: str, start: int, end: int) -> list[int]:
        """Ids of the tokens of ``text`` that lie inside characters [start, end)."""
        if getattr(self.tokenizer, "is_fast", False):
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return [
                token
                for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
                if start <= a and b <= end and b > a
            ]
        # Without offsets: the tokens added by extending the text from `start` to `end`.
        before = self.tokenizer.encode(text[:start], add_special_tokens=False)
        through = self.tokenizer.encode(text[:end], add_special_tokens=False)
        return through[_common_prefix(before, through) :]

    def _variants(self, marker: str, contexts: Sequence[str]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        texts = [(text, text.find(marker), True) for text in contexts]
        texts += [(before + marker + after, len(before), False) for before, after in _CONTEXTS]
        variants = []
        whole = _squeeze(marker)
        for text, start, real in texts:
            while start >= 0:
                ids = self._inside(text, start, start + len(marker))
                lead = 0
                while lead < len(ids) and self.is_whitespace(ids[lead]):
                    lead += 1
                end = len(ids)
                while end > lead and self.is_whitespace(ids[end - 1]):
                    end -= 1
                # Tokens that spell less than the marker lost an edge to a merge with a neighbour (the "><" of
                # "<|eot_id|><|start_header_id|>" when those are not special tokens). Where the template itself
                # put the marker, that is how it tokenizes in real data, so most of the marker is kept as a variant;
                # from a made-up context it is only noise ("INST]" of " [INST]" would fire inside "[/INST]").
                spelled = _squeeze(self.tokenizer.decode(ids[lead:end])) if end > lead else ""
                if spelled == whole or (real and spelled in whole and 2 * len(spelled) >= len(whole)):
                    variant = (tuple(ids[lead:end]), tuple(ids[end:]))
                    if variant not in variants:
                        variants.append(variant)
                start = text.find(marker, start + 1)
        return variants

    def mask(self, input_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """Which tokens of one tokenized example belong to an assistant reply.

        Args:
            input_ids: The example's token ids (one conversation; see :meth:`mask_segments` for packed rows).

        Returns:
            A boolean array, ``True`` on the tokens to train on.
        """
        ids = as_numpy(input_ids)
        n = len(ids)
        events = []
        for pattern in self.patterns:
            width = len(pattern.ids)
            if n < width:
                continue
            starts = np.flatnonzero(ids[: n - width + 1] == pattern.ids[0])
            for offset in range(1, width):
                starts = starts[ids[starts + offset] == pattern.ids[offset]]
            events.extend((int(s), -width, pattern) for s in starts)
        events.sort(key=lambda event: (event[0], event[1]))
        mask = np.zeros(n, dtype=bool)
        reply_start = None
        cursor = 0
        for start, negative_width, pattern in events:
            if start < cursor:
                continue  # inside a marker already consumed (a shorter pattern at the same or a later position)
            if reply_start is not None:
                self._close(ids, mask, reply_start, start)
                reply_start = None
            cursor = start - negative_width
            if pattern.opens_response:
                tail = len(pattern.tail)
                if tail and tuple(ids[cursor : cursor + tail].tolist()) == pattern.tail:
                    cursor += tail
                reply_start = cursor
        if reply_start is not None:
            self._close(ids, mask, reply_start, n)
        return mask

    def _close(self, ids: np.ndarray, mask: np.ndarray, start: int, end: int) -> None:
        # The separator between the end-of-turn token and the next turn is not the assistant's text.
        while end > start and self.is_whitespace(int(ids[end - 1])):
            end -= 1
        mask[start:end] = True

    def mask_segments(self, input_ids: Sequence[int] | np.ndarray, lengths: Sequence[int] | None) -> np.ndarray:
        """:meth:`mask` of a row that holds several examples back to back (a packed row).

        Args:
            input_ids: The row's token ids.
            lengths: Length of each example in the row, in order; ``None`` for a row that is one example.

        Returns:
            A boolean array over the row, ``True`` on the tokens to train on.
        """
        ids = as_numpy(input_ids)
        if lengths is None:
            return self.mask(ids)
        out = np.zeros(len(ids), dtype=bool)
        start = 0
        for length in lengths:
            out[start : start + length] = self.mask(ids[start : start + length])
            start += length
        return out


def _squeeze(text: str) -> str:
    return "".join(text.split())


def as_numpy(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64)


def segment_starts(positions: np.ndarray) -> list[int]:
    """Where examples start in a packed row: position 0, and wherever the position ids stop increasing."""
    if len(positions) == 0:
        return []
    return [0] + (np.flatnonzero(positions[1:] <= positions[:-1]) + 1).tolist()


def lengths_from_starts(starts: list[int], total: int) -> list[int]:
    return [end - start for start, end in zip(starts, starts[1:] + [total], strict=True)]


def snippet(tokenizer: Any, ids: Sequence[int], limit: int = 60) -> str:
    text = tokenizer.decode([int(i) for i in ids])
    if len(text) <= 2 * limit:
        return repr(text)
    return f"{text[:limit]!r} ... {text[-limit:]!r}"


def build_masker(
    tokenizer: Any, instruction_part: str | Sequence[str] | None = None, response_part: str | None = None
) -> ResponseMasker:
    """A :class:`ResponseMasker` for explicit markers, or for markers read from the chat template.

    Args:
        tokenizer: The tokenizer (or processor) the data is tokenized with.
        instruction_part: Text (or texts) that opens a non-assistant turn; detected when ``None``.
        response_part: Text that opens an assistant turn; detected when ``None``.

    Returns:
        The masker.

    Raises:
        ValueError: A marker was not given and cannot be detected, or detected markers fail the self-check on the
            probe conversation.
    """
    tokenizer = text_tokenizer(tokenizer)
    if tokenizer is None:
        raise ValueError(f"{NAME}: a tokenizer is needed to match the markers on token ids; pass tokenizer=.")
    detected = None
    if instruction_part is None or response_part is None:
        detected = detect_chat_markers(tokenizer)
    if instruction_part is None:
        instructions = (detected.instruction_part, *detected.other_parts)
    elif isinstance(instruction_part, str):
        instructions = (instruction_part,)
    else:
        instructions = tuple(instruction_part)
    response = detected.response_part if response_part is None else response_part

    contexts = []
    if getattr(tokenizer, "chat_template", None):
        for system in (False, True):
            text = _try_render(tokenizer, _probe_conversation(system))
            if text is not None:
                contexts.append(text)
    masker = ResponseMasker(tokenizer, instructions, response, contexts)
    if instruction_part is None and response_part is None and contexts:
        _self_check(masker, contexts[-1])
    return masker


def _self_check(masker: ResponseMasker, text: str) -> None:
    """Detected markers must train exactly on the probe's replies: else detection misread the template."""
    tokenizer = masker.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    mask = masker.mask(ids)
    trained = tokenizer.decode([token for token, keep in zip(ids, mask, strict=True) if keep])
    masked = tokenizer.decode([token for token, keep in zip(ids, mask, strict=True) if not keep])
    replies_in = _ASSISTANT_1 in trained and _ASSISTANT_2 in trained
    others_out = not any(probe in trained for probe in (_USER_1, _USER_2, _SYSTEM))
    if not (replies_in and others_out and _USER_1 in masked):
        raise ValueError(
            f"{NAME}: the markers read from the chat template (instruction_part={masker.instruction_parts}, "
            f"response_part={masker.response_part!r}) do not isolate the assistant's replies in a probe conversation "
            f"(trained text: {trained!r}); {_PASS_MARKERS}."
        )
