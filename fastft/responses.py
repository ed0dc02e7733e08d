"""Response-only loss: labels of -100 on every token outside the assistant's turns.

``train_on_responses_only`` takes a trl ``SFTTrainer`` (or any transformers ``Trainer``) or a tokenized dataset.
Turns are found by two markers: the text that opens a user turn (``instruction_part``) and the text that opens an
assistant turn (``response_part``). Without them, the markers are read from the tokenizer's chat template by
rendering a probe conversation; SmolLM2's ChatML gives ``"<|im_start|>user\\n"`` and ``"<|im_start|>assistant\\n"``.

What is trained: every token after a response marker up to the next marker that opens another turn, including the
assistant's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``), so the model learns to stop. Whitespace
tokens between that end-of-turn token and the next turn (ChatML's ``"\\n"``) and the markers themselves are masked.

Markers are matched on token ids, not on text. A marker can tokenize differently depending on what precedes it
(SentencePiece's leading ``"▁"``, a space merged into the next word), so each marker is kept as the set of id
sequences it takes in the probe conversation and in a few typical contexts; whitespace tokens at its edges are left
out of the match, since they merge with neighbouring whitespace (content that starts with ``"\\n"``).

An example left with no token to train on (its reply truncated away, a row without an assistant turn) is refused
with a ``ValueError`` naming it, both when the masking is set up and in the collator, so a batch of -100 never
reaches the loss silently (trl would reduce it to a loss of zero).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
_NAME = "fastft.train_on_responses_only"

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
        raise TypeError(f"{_NAME}: apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
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


def _text_tokenizer(tokenizer: Any) -> Any:
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
    tokenizer = _text_tokenizer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{_NAME}: the tokenizer ({type(tokenizer).__name__}) has no chat template, so the turn markers cannot be "
            f"detected; {_PASS_MARKERS}."
        )
    conversation = _probe_conversation(system=False)
    text = _try_render(tokenizer, conversation)
    if text is None:
        raise ValueError(
            f"{_NAME}: the chat template failed to render a user/assistant/user/assistant conversation, so the turn "
            f"markers cannot be detected; {_PASS_MARKERS}."
        )
    spans = {}
    cursor = 0
    for content in (_USER_1, _ASSISTANT_1, _USER_2, _ASSISTANT_2):
        start = text.find(content, cursor)
        if start < 0:
            raise ValueError(
                f"{_NAME}: the chat template does not render message contents verbatim ({content!r} is missing from "
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
            f"{_NAME}: the chat template has no turn markers to tell user and assistant turns apart (between a user "
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
        self.tokenizer = _text_tokenizer(tokenizer)
        self.instruction_parts = tuple(instruction_parts)
        self.response_part = response_part
        self._whitespace: dict[int, bool] = {}
        patterns: dict[tuple[int, ...], _Pattern] = {}
        for marker, opens in [(part, False) for part in self.instruction_parts] + [(response_part, True)]:
            if not isinstance(marker, str) or not marker.strip():
                raise ValueError(f"{_NAME}: a marker must be non-blank text, got {marker!r}; {_PASS_MARKERS}.")
            found = self._variants(marker, contexts)
            if not found:
                raise ValueError(f"{_NAME}: the marker {marker!r} tokenizes to nothing; {_PASS_MARKERS}.")
            for ids, tail in found:
                previous = patterns.get(ids)
                if previous is not None and previous.opens_response != opens:
                    raise ValueError(
                        f"{_NAME}: instruction_part {self.instruction_parts} and response_part {response_part!r} "
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
        ids = _as_numpy(input_ids)
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
        ids = _as_numpy(input_ids)
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


def _as_numpy(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64)


def _segment_starts(positions: np.ndarray) -> list[int]:
    """Where examples start in a packed row: position 0, and wherever the position ids stop increasing."""
    if len(positions) == 0:
        return []
    return [0] + (np.flatnonzero(positions[1:] <= positions[:-1]) + 1).tolist()


def _lengths_from_starts(starts: list[int], total: int) -> list[int]:
    return [end - start for start, end in zip(starts, starts[1:] + [total], strict=True)]


def _snippet(tokenizer: Any, ids: Sequence[int], limit: int = 60) -> str:
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
    tokenizer = _text_tokenizer(tokenizer)
    if tokenizer is None:
        raise ValueError(f"{_NAME}: a tokenizer is needed to match the markers on token ids; pass tokenizer=.")
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
            f"{_NAME}: the markers read from the chat template (instruction_part={masker.instruction_parts}, "
            f"response_part={masker.response_part!r}) do not isolate the assistant's replies in a probe conversation "
            f"(trained text: {trained!r}); {_PASS_MARKERS}."
        )


class ResponseOnlyCollator:
    """Wraps a data collator: the batch it returns gets labels of -100 outside assistant turns.

    Labels the wrapped collator already set to -100 (padding, a prompt, packing boundaries) stay -100. Packed rows
    (padding-free batches) are split into examples at the restarts of ``position_ids``.

    Args:
        collator: The collator to wrap (trl's ``DataCollatorForLanguageModeling`` or any callable that returns
            ``input_ids`` and, usually, ``labels``).
        masker: Finds the assistant tokens.

    Raises:
        ValueError: (when called) An example of the batch has no token left to train on.
    """

    def __init__(self, collator: Callable[[list[Any]], Mapping[str, Any]], masker: ResponseMasker) -> None:
        self.collator = collator
        self.masker = masker

    def __getattr__(self, name: str) -> Any:
        # Trainers read attributes of their collator (pad_token_id, padding_free, tokenizer): answer for the inner one.
        if name in ("collator", "masker"):
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, examples: list[Any]) -> Any:
        batch = self.collator(examples)
        if "input_ids" not in batch:
            raise ValueError(
                f"{_NAME}: the wrapped data collator {type(self.collator).__name__} returned no 'input_ids' (keys: "
                f"{sorted(batch)}); response-only masking needs token ids."
            )
        input_ids = batch["input_ids"]
        attention = batch.get("attention_mask")
        labels = batch.get("labels")
        if labels is None:
            labels = input_ids.clone()
            if attention is not None:
                labels[attention == 0] = IGNORE_INDEX
        batch["labels"] = mask_labels(self.masker, input_ids, labels, attention, batch.get("position_ids"))
        return batch


def mask_labels(
    masker: ResponseMasker,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Labels of a collated batch with -100 outside assistant turns.

    Args:
        masker: Finds the assistant tokens.
        input_ids: [batch, length] token ids.
        labels: [batch, length] labels (unshifted, as transformers' causal-LM loss takes them).
        attention_mask: [batch, length], 0 on padding; ``None`` when there is no padding (padding-free batches).
        position_ids: [batch, length]; where they restart, a new example begins (packed rows).

    Returns:
        New labels.

    Raises:
        ValueError: An example that had tokens to train on has none left, or the whole batch has none.
    """
    if input_ids.shape != labels.shape:
        raise ValueError(
            f"{_NAME}: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} differ in shape"
        )
    ids = _as_numpy(input_ids).reshape(input_ids.shape[0], -1)
    old = _as_numpy(labels).reshape(ids.shape)
    valid = (
        np.ones(ids.shape, dtype=bool) if attention_mask is None else _as_numpy(attention_mask).reshape(ids.shape) != 0
    )
    positions = None if position_ids is None else _as_numpy(position_ids).reshape(ids.shape)
    keep = np.zeros(ids.shape, dtype=bool)
    for row in range(ids.shape[0]):
        where = np.flatnonzero(valid[row])
        tokens = ids[row, where]
        starts = _segment_starts(positions[row, where]) if positions is not None else [0] if len(where) else []
        for number, (start, length) in enumerate(zip(starts, _lengths_from_starts(starts, len(where)), strict=True)):
            segment = where[start : start + length]
            segment_keep = masker.mask(tokens[start : start + length]) & (old[row, segment] != IGNORE_INDEX)
            if not segment_keep.any() and (old[row, segment] != IGNORE_INDEX).any():
                where_text = f"row {row}" + (f", example {number} of that packed row" if len(starts) > 1 else "")
                raise ValueError(
                    f"{_NAME}: batch {where_text} has no assistant token left to train on: "
                    f"{_snippet(masker.tokenizer, tokens[start : start + length])}. Its reply was probably cut off by "
                    "max_length, or it has no assistant turn marked by "
                    f"response_part={masker.response_part!r}; raise max_length, or drop such rows from the dataset."
                )
            keep[row, segment] = segment_keep
    if not keep.any():
        raise ValueError(
            f"{_NAME}: this batch has no token to train on after response-only masking (every label is -100), so "
            "its loss would be empty; check that the data holds assistant turns and that max_length keeps them."
        )
    out = labels.clone()
    out[torch.from_numpy(~keep).reshape(labels.shape).to(out.device)] = IGNORE_INDEX
    return out


def _row_lengths(row: Mapping[str, Any], n: int) -> list[int] | None:
    """Example lengths of a packed dataset row (trl's ``seq_lengths`` or restarting ``position_ids``)."""
    if row.get("seq_lengths") is not None:
        lengths = [int(x) for x in row["seq_lengths"]]
        return lengths if sum(lengths) == n else None
    if row.get("position_ids") is not None:
        positions = _as_numpy(row["position_ids"])
        if len(positions) == n:
            starts = _segment_starts(positions)
            return _lengths_from_starts(starts, n) if len(starts) > 1 else None
    return None


def _row_keep(
    masker: ResponseMasker, row: Mapping[str, Any], extra_masks: Sequence[str] = ()
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Which tokens of a dataset row to train on, and the (example number, start, end) of examples left empty."""
    ids = _as_numpy(row["input_ids"])
    n = len(ids)
    allowed = np.ones(n, dtype=bool)
    if row.get("labels") is not None:
        allowed &= _as_numpy(row["labels"]) != IGNORE_INDEX
    for column in extra_masks:
        if row.get(column) is not None:
            allowed &= _as_numpy(row[column]) != 0
    # Padding is left out before matching, so a reply's closing whitespace is found at the end of the real tokens.
    valid = np.ones(n, dtype=bool) if row.get("attention_mask") is None else _as_numpy(row["attention_mask"]) != 0
    keep = np.zeros(n, dtype=bool)
    empty = []
    start = 0
    for number, length in enumerate(_row_lengths(row, n) or [n]):
        segment = np.arange(start, start + length)
        segment = segment[valid[segment]]
        if len(segment):
            keep[segment] = masker.mask(ids[segment]) & allowed[segment]
            if not keep[segment].any():
                empty.append((number, start, start + length))
        start += length
    return keep, empty


def _refuse_empty(
    masker: ResponseMasker, name: str, empty: list[tuple[int, int, int, int]], total: int | None, rows: Any
) -> None:
    index, number, start, end = empty[0]
    row_ids = rows[index]["input_ids"]
    ids = _as_numpy(row_ids)[start:end]
    packed = f" (example {number} of that packed row)" if number or end - start != len(row_ids) else ""
    indices = sorted({item[0] for item in empty})
    shown = ", ".join(str(i) for i in indices[:10]) + (", ..." if len(indices) > 10 else "")
    count = (
        f"{name} row {index} has" if total is None else f"{len(indices)} of {total} {name} rows (index {shown}) have"
    )
    raise ValueError(
        f"{_NAME}: {count} no assistant token left to train on; row {index}{packed} is {len(ids)} tokens: "
        f"{_snippet(masker.tokenizer, ids)}. The reply was probably cut off by max_length (truncation), or the row "
        f"has no assistant turn opened by response_part={masker.response_part!r}. Raise max_length, shorten or drop "
        "those rows (dataset.filter / dataset.select), or pass the markers the data uses."
    )


def _check_dataset(masker: ResponseMasker, dataset: Any, name: str, extra_masks: Sequence[str]) -> None:
    """Refuse a prepared (tokenized) trainer dataset with an example that would train on nothing."""
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency of trl
        return
    if not isinstance(dataset, Dataset) or "input_ids" not in dataset.column_names:
        return  # streamed or untokenized: the collator checks every batch instead
    columns = [
        c
        for c in ("input_ids", "labels", "attention_mask", "seq_lengths", "position_ids", *extra_masks)
        if c in dataset.column_names
    ]
    rows = dataset.select_columns(columns)
    empty = []
    for index, row in enumerate(rows):
        _, row_empty = _row_keep(masker, row, extra_masks)
        empty.extend((index, number, start, end) for number, start, end in row_empty)
    if empty:
        _refuse_empty(masker, name, empty, len(rows), rows)


def _trainer_datasets(trainer: Any) -> list[tuple[str, Any]]:
    found = [("train", getattr(trainer, "train_dataset", None))]
    eval_dataset = getattr(trainer, "eval_dataset", None)
    if isinstance(eval_dataset, Mapping):
        found += [(f"eval ({key})", value) for key, value in eval_dataset.items()]
    else:
        found.append(("eval", eval_dataset))
    return [(name, dataset) for name, dataset in found if dataset is not None]


def _apply_to_trainer(trainer: Any, masker: ResponseMasker) -> Any:
    args = getattr(trainer, "args", None)
    strategy = getattr(args, "packing_strategy", None)
    if getattr(args, "packing", False) and strategy in ("wrapped", "bfd_split", "bfd-requeue"):
        raise ValueError(
            f"{_NAME}: packing_strategy={strategy!r} cuts conversations mid-turn, so a packed row can start inside a "
            "reply whose marker went to the previous row, and the turns cannot be found again. Use "
            "packing_strategy='bfd' (keeps each example whole), or mask before packing: "
            "train_dataset = train_on_responses_only(tokenized_dataset, tokenizer=tokenizer) gives rows with "
            "input_ids and labels that SFTTrainer (trl >= 1.15) packs as they are."
        )
    collator = trainer.data_collator
    if isinstance(collator, ResponseOnlyCollator):
        collator = collator.collator  # applying twice re-masks with the new markers instead of stacking wrappers
    if collator is None:
        raise ValueError(f"{_NAME}: the trainer has no data_collator to wrap; give it one (trl's SFTTrainer does).")
    extra = []
    if getattr(trainer, "completion_only_loss", False):
        extra.append("completion_mask")
    extra.append("assistant_masks")
    for name, dataset in _trainer_datasets(trainer):
        _check_dataset(masker, dataset, name, extra)
    trainer.data_collator = ResponseOnlyCollator(collator, masker)
    return trainer


def _row_labels(masker: ResponseMasker, row: Mapping[str, Any], keep: np.ndarray) -> list[int]:
    source = row.get("labels")
    values = _as_numpy(source if source is not None else row["input_ids"])
    return np.where(keep, values, IGNORE_INDEX).tolist()


def _apply_to_rows(masker: ResponseMasker, rows: Any) -> Any:
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(rows, (DatasetDict, IterableDatasetDict)):
        return type(rows)({split: _apply_to_rows(masker, part) for split, part in rows.items()})
    if isinstance(rows, IterableDataset):

        def label_streamed(row: dict, index: int) -> dict:
            keep, empty = _row_keep(masker, row)
            if empty:
                _refuse_empty(masker, "streamed", [(index, *item) for item in empty], None, {index: row})
            return {"labels": _row_labels(masker, row, keep)}

        return rows.map(label_streamed, with_indices=True)

    is_dataset = isinstance(rows, Dataset)
    if not is_dataset and not (isinstance(rows, Sequence) and all(isinstance(row, Mapping) for row in rows)):
        raise TypeError(
            f"{_NAME}: expected an SFTTrainer (or Trainer), a datasets.Dataset or a list of dicts with 'input_ids'; "
            f"got {type(rows).__name__}."
        )
    columns = rows.column_names if is_dataset else sorted({key for row in rows for key in row})
    if "input_ids" not in columns:
        raise ValueError(
            f"{_NAME}: the rows have no 'input_ids' (columns: {columns}); tokenize them first, e.g. "
            "rows.map(lambda r: {'input_ids': tokenizer.apply_chat_template(r['messages'], tokenize=True, "
            "return_dict=True)['input_ids']}), or pass the SFTTrainer built on them."
        )
    labels, empty = [], []
    for index, row in enumerate(rows):
        keep, row_empty = _row_keep(masker, row)
        empty.extend((index, *item) for item in row_empty)
        labels.append(_row_labels(masker, row, keep))
    if empty:
        _refuse_empty(masker, "dataset", empty, len(rows), rows)
    if not is_dataset:
        return [{**row, "labels": row_labels} for row, row_labels in zip(rows, labels, strict=True)]
    if "labels" in rows.column_names:
        rows = rows.remove_columns("labels")
    # A fingerprint from the input's and the markers' (datasets cannot hash the tokenizer-holding masker reliably).
    key = repr((rows._fingerprint, masker.instruction_parts, masker.response_part, [p.ids for p in masker.patterns]))
    return rows.add_column("labels", labels, new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16])


def train_on_responses_only(
    trainer_or_dataset: Any,
    instruction_part: str | Sequence[str] | None = None,
    response_part: str | None = None,
    tokenizer: Any = None,
) -> Any:
    """Train on the assistant's replies only: labels of -100 on every token outside assistant turns.

    With a trainer (trl's ``SFTTrainer``, trl 0.19 to 1.16, or a transformers ``Trainer``), its data collator is
    wrapped so that every training and evaluation batch is masked; its prepared datasets are checked first. With a
    tokenized dataset, a ``labels`` column is added (or narrowed, if there is one).

    Trained: each reply and its end-of-turn token (``<|im_end|>`` in ChatML), so the model learns to stop.
    Masked: system, user and tool turns, the turn markers, the whitespace between turns, and padding.

    Args:
        trainer_or_dataset: An ``SFTTrainer`` / ``Trainer``; or a ``datasets.Dataset`` / ``DatasetDict`` /
            ``IterableDataset`` or a list of dicts, with ``input_ids`` (and optionally ``labels``,
            ``attention_mask``, and ``seq_lengths`` or ``position_ids`` for packed rows).
        instruction_part: Text that opens a user turn (or a list of texts that open non-assistant turns). Read
            from the chat template when ``None``, with the system and tool markers added where the template has
            them.
        response_part: Text that opens an assistant turn. Read from the chat template when ``None``.
        tokenizer: The tokenizer the ids come from. Required for a dataset; a trainer's ``processing_class`` is
            used when ``None``.

    Returns:
        The same trainer (its ``data_collator`` wrapped), or a new dataset / list with masked ``labels``.

    Raises:
        ValueError: No tokenizer for a dataset; no markers given and none detectable in the chat template; a
            trainer packing with a strategy that cuts conversations; an example with no assistant token left
            (named, with what to do).

    Example::

        trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=chats, args=config)
        trainer = train_on_responses_only(trainer)  # markers from the chat template
        trainer.train()
    """
    is_trainer = hasattr(trainer_or_dataset, "data_collator") and hasattr(trainer_or_dataset, "args")
    if tokenizer is None and is_trainer:
        tokenizer = getattr(trainer_or_dataset, "processing_class", None) or getattr(
            trainer_or_dataset, "tokenizer", None
        )
    if tokenizer is None:
        raise ValueError(
            f"{_NAME}: a tokenizer is needed to find the turn markers in token ids; pass tokenizer= (the one the "
            "input_ids were made with)."
        )
    masker = build_masker(tokenizer, instruction_part, response_part)
    if is_trainer:
        return _apply_to_trainer(trainer_or_dataset, masker)
    return _apply_to_rows(masker, trainer_or_dataset)


def response_texts(tokenizer: Any, input_ids: Iterable[int], labels: Iterable[int]) -> list[str]:
    """The trained stretches of one example, decoded: a quick way to see what a masking trains on.

    Args:
        tokenizer: The tokenizer the ids come from.
        input_ids: The example's ids.
        labels: Its labels (-100 where masked).

    Returns:
        One string per run of consecutive trained tokens.
    """
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(input_ids, labels, strict=True):
        trained = int(label) != IGNORE_INDEX
        if trained and not previous:
            runs.append([])
        if trained:
            runs[-1].append(int(token))
        previous = trained
    return [_text_tokenizer(tokenizer).decode(run) for run in runs]


__all__ = [
    "ChatMarkers",
    "ResponseMasker",
    "ResponseOnlyCollator",
    "build_masker",
    "detect_chat_markers",
    "detect_markers",
    "mask_labels",
    "response_texts",
    "train_on_responses_only",
]
