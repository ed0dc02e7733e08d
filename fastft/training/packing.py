"""Packing and padding-free batches: several tokenized examples in one row, each attending only to itself.

A packed row holds whole examples one after another. Three things keep it equal to the padded batch of the same
examples:

- ``position_ids`` restart at 0 at each example, so RoPE sees the positions each example would have alone;
- no ``attention_mask`` is passed and the KV cache is off (``use_cache=False``). Then transformers (5.x
  ``masking_utils``; 4.53+ likewise) reads the restarts in ``position_ids`` as example boundaries and builds a block
  causal mask for eager and sdpa attention (flash attention gets ``cu_seq_lens_*`` instead). fastft's patched
  attention passes that mask to the attention function unchanged. transformers only looks for restarts when the
  2-D mask is ``None`` *and* there is no cache object: a model called in training mode with ``config.use_cache``
  on builds an empty ``DynamicCache`` and, with it, a plain causal mask in which examples see each other.
  :class:`PaddingFreeCollator` therefore puts ``use_cache=False`` in every batch (trl's ``SFTTrainer`` and
  :meth:`fastft.FastModel.get_peft_model` turn the cache off as well);
- the label of each example's first token is ``-100``, so the last token of one example is never trained to predict
  the first token of the next. (In a padded batch the first label of a row is never a target anyway: the causal-LM
  loss predicts token t + 1 from position t.) The number of targets, and so the token-mean loss, is the same.

Two ways in:

- :func:`pack_dataset` / :func:`pack_examples` fill rows of at most ``max_length`` tokens with whole examples
  (best-fit decreasing by default) and record each row's ``seq_lengths``;
- :class:`PaddingFreeCollator` turns a list of examples (plain tokenized ones, or packed rows) into one row with no
  pad tokens: ``input_ids``, ``labels``, ``position_ids`` and the flash-attention boundaries.

With trl, ``SFTConfig(packing=True)`` (its default ``packing_strategy="bfd"``) and ``SFTConfig(padding_free=True)``
give the same batches through trl's own collator; ``tests/test_packing.py`` checks both on fastft models.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from datasets import Dataset

IGNORE_INDEX = -100
STRATEGIES = ("bfd", "ordered")

_Segment = tuple[list[int], list[int]]


def _as_list(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return [int(value) for value in values]


def _segments(example: Mapping[str, Any], where: str, index: int) -> list[_Segment]:
    """The (input_ids, labels) of each example in one dataset row: the row itself, or its packed parts."""
    if "input_ids" not in example:
        raise ValueError(
            f"{where}: example {index} has no 'input_ids' (keys: {sorted(example)}); tokenize the dataset first, "
            "or let trl's SFTTrainer do it with SFTConfig(packing=True)."
        )
    input_ids = _as_list(example["input_ids"])
    labels = _as_list(example["labels"]) if example.get("labels") is not None else list(input_ids)
    if len(labels) != len(input_ids):
        raise ValueError(
            f"{where}: example {index} has {len(input_ids)} input_ids but {len(labels)} labels; they must be the "
            "same length (labels are aligned with input_ids; the model shifts them)."
        )
    mask = example.get("attention_mask")
    if mask is not None and example.get("seq_lengths") is None:
        keep = [bool(value) for value in _as_list(mask)]
        if len(keep) != len(input_ids):
            raise ValueError(
                f"{where}: example {index} has {len(input_ids)} input_ids but an attention_mask of {len(keep)}."
            )
        # Pad tokens have no place in a packed row: they would be attended by the tokens after them.
        input_ids = [token for token, kept in zip(input_ids, keep, strict=True) if kept]
        labels = [label for label, kept in zip(labels, keep, strict=True) if kept]
    lengths = example.get("seq_lengths")
    if lengths is None:
        return [(input_ids, labels)] if input_ids else []
    lengths = _as_list(lengths)
    if sum(lengths) != len(input_ids) or any(length < 0 for length in lengths):
        raise ValueError(
            f"{where}: example {index} has seq_lengths {lengths} (sum {sum(lengths)}) for {len(input_ids)} tokens; "
            "they must be non-negative and add up to the row's length."
        )
    parts, start = [], 0
    for length in lengths:
        if length:
            parts.append((input_ids[start : start + length], labels[start : start + length]))
        start += length
    return parts


def _mask_first(labels: list[int]) -> list[int]:
    return [IGNORE_INDEX, *labels[1:]] if labels else labels


def packed_position_ids(seq_lengths: Sequence[int]) -> torch.Tensor:
    """Position ids that restart at 0 at the start of each packed example.

    Args:
        seq_lengths: Lengths of the examples, in row order.

    Returns:
        A ``torch.long`` tensor of ``sum(seq_lengths)`` positions, e.g. ``[0, 1, 2, 0, 1]`` for ``[3, 2]``.
    """
    if not seq_lengths:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(int(length), dtype=torch.long) for length in seq_lengths])


def _bins(lengths: list[int], max_length: int, strategy: str) -> list[list[int]]:
    """Group example indices into rows whose lengths add up to at most ``max_length``."""
    if strategy == "ordered":
        rows: list[list[int]] = []
        used = max_length
        for index, length in enumerate(lengths):
            if used + length > max_length:
                rows.append([])
                used = 0
            rows[-1].append(index)
            used += length
        return rows
    # Best-fit decreasing: longest first, each into the open row it fills most tightly.
    rows = []
    free: list[tuple[int, int]] = []  # (space left, row), kept sorted
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            space, row = free.pop(slot)
            rows[row].append(index)
        else:
            space, row = max_length, len(rows)
            rows.append([index])
        if space - length > 0:
            bisect.insort(free, (space - length, row))
    # Dataset order inside a row: easier to read back, and the loss does not depend on it.
    return [sorted(row) for row in rows]


def pack_examples(
    examples: Iterable[Mapping[str, Any]],
    max_length: int,
    strategy: str = "bfd",
    truncate: bool = True,
) -> list[dict[str, list[int]]]:
    """Pack tokenized examples into rows of at most ``max_length`` tokens, whole examples only.

    Args:
        examples: Mappings with ``input_ids`` and optionally ``labels`` (same length, ``-100`` where no loss is
            wanted; the input ids otherwise) and ``attention_mask`` (tokens where it is 0 are dropped as padding).
            Tensors or lists.
        max_length: Longest packed row.
        strategy: ``"bfd"`` (best-fit decreasing: fewest rows, examples reordered) or ``"ordered"`` (examples in
            their order, a new row whenever the next one does not fit).
        truncate: Cut examples longer than ``max_length`` to their first ``max_length`` tokens; ``False`` raises
            instead.

    Returns:
        One dict per row: ``input_ids``, ``labels`` (each example's first label set to ``-100``, so no loss
        crosses a boundary) and ``seq_lengths`` (the examples' lengths, in row order). Empty examples are dropped.

    Raises:
        ValueError: A bad ``max_length`` or ``strategy``, an example without ``input_ids``, labels of another
            length, or (``truncate=False``) an example longer than ``max_length``.
    """
    where = "fastft.packing.pack_examples"
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        raise ValueError(f"{where}: max_length must be a positive int, got {max_length!r}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: strategy must be one of {STRATEGIES}, got {strategy!r}.")
    segments: list[_Segment] = []
    for index, example in enumerate(examples):
        for input_ids, labels in _segments(example, where, index):
            if len(input_ids) > max_length:
                if not truncate:
                    raise ValueError(
                        f"{where}: example {index} has {len(input_ids)} tokens, more than max_length={max_length}; "
                        "pass truncate=True to keep its first max_length tokens, or raise max_length."
                    )
                input_ids, labels = input_ids[:max_length], labels[:max_length]
            segments.append((input_ids, labels))
    rows = []
    for members in _bins([len(ids) for ids, _ in segments], max_length, strategy):
        rows.append(
            {
                "input_ids": [token for i in members for token in segments[i][0]],
                "labels": [label for i in members for label in _mask_first(segments[i][1])],
                "seq_lengths": [len(segments[i][0]) for i in members],
            }
        )
    return rows


def pack_dataset(dataset: Dataset, max_length: int, strategy: str = "bfd", truncate: bool = True) -> Dataset:
    """Pack a tokenized ``datasets.Dataset`` into rows of at most ``max_length`` tokens.

    Train on the result through :class:`PaddingFreeCollator` (or trl's collator with ``padding_free=True``, which
    also reads ``seq_lengths``): a collator that pads rows and passes an ``attention_mask`` lets the examples of a
    row attend to each other.

    Args:
        dataset: Rows with ``input_ids`` and optionally ``labels`` and ``attention_mask`` (see
            :func:`pack_examples`); other columns are dropped.
        max_length: Longest packed row.
        strategy: ``"bfd"`` or ``"ordered"`` (see :func:`pack_examples`).
        truncate: Cut longer examples to ``max_length`` tokens; ``False`` raises instead.

    Returns:
        A ``Dataset`` with columns ``input_ids``, ``labels`` and ``seq_lengths``.

    Raises:
        ValueError: No ``input_ids`` column, or what :func:`pack_examples` refuses.
    """
    from datasets import Dataset

    if "input_ids" not in dataset.column_names:
        raise ValueError(
            f"fastft.packing.pack_dataset: expected a tokenized dataset with an 'input_ids' column, found "
            f"{dataset.column_names}; tokenize it first (dataset.map with the tokenizer), or let trl's SFTTrainer "
            "tokenize and pack with SFTConfig(packing=True)."
        )
    columns = [name for name in ("input_ids", "labels", "attention_mask") if name in dataset.column_names]
    rows = pack_examples(dataset.select_columns(columns), max_length, strategy=strategy, truncate=truncate)
    return Dataset.from_dict(
        {
            "input_ids": [row["input_ids"] for row in rows],
            "labels": [row["labels"] for row in rows],
            "seq_lengths": [row["seq_lengths"] for row in rows],
        }
    )


@dataclass
class PaddingFreeCollator:
    """Collate examples into one row without pad tokens, each example attending only to itself.

    Takes plain tokenized examples (``input_ids``, optional ``labels`` and ``attention_mask``) or packed rows from
    :func:`pack_dataset` (``seq_lengths``), and returns a batch of one row:

    - ``input_ids`` and ``labels`` ``[1, tokens]``, each example's first label ``-100``;
    - ``position_ids`` ``[1, tokens]``, restarting at 0 at each example, and no ``attention_mask``;
    - with ``flash_kwargs``: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 example boundaries) and
      ``max_length_q`` / ``max_length_k``, which flash attention reads instead of deriving them from the positions;
      eager and sdpa ignore them;
    - with ``disable_cache``: ``use_cache=False`` (see the module docstring: with a cache object, transformers builds
      a plain causal mask and the examples see each other).

    Args:
        pad_token_id: Fills the tail when ``pad_to_multiple_of`` is set.
        pad_to_multiple_of: Pad the row to a multiple of this many tokens (the tail is a separate, loss-free
            sequence of its own).
        flash_kwargs: Add the flash-attention boundaries.
        disable_cache: Add ``use_cache=False``.

    Example:
        >>> collator = PaddingFreeCollator()
        >>> batch = collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}])
        >>> batch["position_ids"].tolist(), batch["labels"].tolist()
        ([[0, 1, 2, 0, 1]], [[-100, 6, 7, -100, 9]])
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    flash_kwargs: bool = True
    disable_cache: bool = True

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Collate ``examples`` into one padding-free row.

        Args:
            examples: The examples of one batch.

        Returns:
            The batch (see the class docstring).

        Raises:
            ValueError: No tokens at all, or a malformed example.
        """
        where = "fastft.packing.PaddingFreeCollator"
        segments = [part for index, example in enumerate(examples) for part in _segments(example, where, index)]
        if not segments:
            raise ValueError(f"{where}: the batch of {len(examples)} examples holds no tokens.")
        input_ids = [token for ids, _ in segments for token in ids]
        labels = [label for _, lab in segments for label in _mask_first(lab)]
        lengths = [len(ids) for ids, _ in segments]
        if self.pad_to_multiple_of:
            tail = -len(input_ids) % self.pad_to_multiple_of
            if tail:
                input_ids += [self.pad_token_id] * tail
                labels += [IGNORE_INDEX] * tail
                lengths.append(tail)
        batch: dict[str, Any] = {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": packed_position_ids(lengths)[None],
        }
        if self.flash_kwargs:
            bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = bounds
            batch["max_length_q"] = batch["max_length_k"] = max(lengths)
        if self.disable_cache:
            batch["use_cache"] = False
        return batch


__all__ = ["PaddingFreeCollator", "pack_dataset", "pack_examples", "packed_position_ids"]
