"""Response-only loss: labels of -100 on every token outside the assistant's turns.

``train_on_responses_only`` takes a trl ``SFTTrainer`` (or any transformers ``Trainer``) or a tokenized dataset. The
turns are found by :mod:`fastft.training.turns` (chat markers, read from the template when not given).

What is trained: every token after a response marker up to the next marker that opens another turn, including the
assistant's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``), so the model learns to stop. Whitespace
tokens between that end-of-turn token and the next turn (ChatML's ``"\\n"``) and the markers themselves are masked.

An example left with no token to train on (its reply truncated away, a row without an assistant turn) is refused
with a ``ValueError`` naming it, both when the masking is set up and in the collator, so a batch of -100 never
reaches the loss silently (trl would reduce it to a loss of zero).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastft.training.turns import (
    IGNORE_INDEX,
    NAME,
    ChatMarkers,
    ResponseMasker,
    as_numpy,
    build_masker,
    detect_chat_markers,
    detect_markers,
    lengths_from_starts,
    segment_starts,
    snippet,
    text_tokenizer,
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
                f"{NAME}: the wrapped data collator {type(self.collator).__name__} returned no 'input_ids' (keys: "
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
        raise ValueError(f"{NAME}: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} differ in shape")
    ids = as_numpy(input_ids).reshape(input_ids.shape[0], -1)
    old = as_numpy(labels).reshape(ids.shape)
    valid = (
        np.ones(ids.shape, dtype=bool) if attention_mask is None else as_numpy(attention_mask).reshape(ids.shape) != 0
    )
    positions = None if position_ids is None else as_numpy(position_ids).reshape(ids.shape)
    keep = np.zeros(ids.shape, dtype=bool)
    for row in range(ids.shape[0]):
        where = np.flatnonzero(valid[row])
        tokens = ids[row, where]
        starts = segment_starts(positions[row, where]) if positions is not None else [0] if len(where) else []
        for number, (start, length) in enumerate(zip(starts, lengths_from_starts(starts, len(where)), strict=True)):
            segment = where[start : start + length]
            segment_keep = masker.mask(tokens[start : start + length]) & (old[row, segment] != IGNORE_INDEX)
            if not segment_keep.any() and (old[row, segment] != IGNORE_INDEX).any():
                where_text = f"row {row}" + (f", example {number} of that packed row" if len(starts) > 1 else "")
                raise ValueError(
                    f"{NAME}: batch {where_text} has no assistant token left to train on: "
                    f"{snippet(masker.tokenizer, tokens[start : start + length])}. Its reply was probably cut off by "
                    "max_length, or it has no assistant turn marked by "
                    f"response_part={masker.response_part!r}; raise max_length, or drop such rows from the dataset."
                )
            keep[row, segment] = segment_keep
    if not keep.any():
        raise ValueError(
            f"{NAME}: this batch has no token to train on after response-only masking (every label is -100), so "
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
        positions = as_numpy(row["position_ids"])
        if len(positions) == n:
            starts = segment_starts(positions)
            return lengths_from_starts(starts, n) if len(starts) > 1 else None
    return None


def _row_keep(
    masker: ResponseMasker, row: Mapping[str, Any], extra_masks: Sequence[str] = ()
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Which tokens of a dataset row to train on, and the (example number, start, end) of examples left empty."""
    ids = as_numpy(row["input_ids"])
    n = len(ids)
    allowed = np.ones(n, dtype=bool)
    if row.get("labels") is not None:
        allowed &= as_numpy(row["labels"]) != IGNORE_INDEX
    for column in extra_masks:
        if row.get(column) is not None:
            allowed &= as_numpy(row[column]) != 0
    # Padding is left out before matching, so a reply's closing whitespace is found at the end of the real tokens.
    valid = np.ones(n, dtype=bool) if row.get("attention_mask") is None else as_numpy(row["attention_mask"]) != 0
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
    ids = as_numpy(row_ids)[start:end]
    packed = f" (example {number} of that packed row)" if number or end - start != len(row_ids) else ""
    indices = sorted({item[0] for item in empty})
    shown = ", ".join(str(i) for i in indices[:10]) + (", ..." if len(indices) > 10 else "")
    count = (
        f"{name} row {index} has" if total is None else f"{len(indices)} of {total} {name} rows (index {shown}) have"
    )
    raise ValueError(
        f"{NAME}: {count} no assistant token left to train on; row {index}{packed} is {len(ids)} tokens: "
        f"{snippet(masker.tokenizer, ids)}. The reply was probably cut off by max_length (truncation), or the row "
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
            f"{NAME}: packing_strategy={strategy!r} cuts conversations mid-turn, so a packed row can start inside a "
            "reply whose marker went to the previous row, and the turns cannot be found again. Use "
            "packing_strategy='bfd' (keeps each example whole), or mask before packing: "
            "train_dataset = train_on_responses_only(tokenized_dataset, tokenizer=tokenizer) gives rows with "
            "input_ids and labels that SFTTrainer (trl >= 1.15) packs as they are."
        )
    collator = trainer.data_collator
    if isinstance(collator, ResponseOnlyCollator):
        collator = collator.collator  # applying twice re-masks with the new markers instead of stacking wrappers
    if collator is None:
        raise ValueError(f"{NAME}: the trainer has no data_collator to wrap; give it one (trl's SFTTrainer does).")
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
    values = as_numpy(source if source is not None else row["input_ids"])
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
            f"{NAME}: expected an SFTTrainer (or Trainer), a datasets.Dataset or a list of dicts with 'input_ids'; "
            f"got {type(rows).__name__}."
        )
    columns = rows.column_names if is_dataset else sorted({key for row in rows for key in row})
    if "input_ids" not in columns:
        raise ValueError(
            f"{NAME}: the rows have no 'input_ids' (columns: {columns}); tokenize them first, e.g. "
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
            f"{NAME}: a tokenizer is needed to find the turn markers in token ids; pass tokenizer= (the one the "
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
    return [text_tokenizer(tokenizer).decode(run) for run in runs]


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
