"""Training data for ``fastft train``: reading a file or the shipped demo set, checking its columns for the
training method, and shaping rows for trl's trainers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from fastft.demo import demo_path, preferences_path
from fastft.training.options import METHODS

_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_FORMATS = (
    "'messages' (chat turns), 'text', 'prompt' + 'completion', or 'instruction' + 'response' "
    "(or 'output'), with an optional 'input'"
)
# What each method needs, in the words of the errors.
_NEEDS = {
    "sft": _FORMATS,
    "dpo": "'prompt', 'chosen', 'rejected' (the prompt may be left out when chosen and rejected are conversations "
    "that begin with the prompt's turns)",
    "kto": "'prompt', 'completion', 'label' (true for a desirable completion), or the paired 'prompt', 'chosen', "
    "'rejected' of DPO, which is unpaired",
    "grpo": "'prompt' and the answer its reward checks, 'answer' (or 'solution')",
}
ANSWER_COLUMNS = ("answer", "solution")


class DataError(ValueError):
    """Training data that ``fastft train`` cannot use: a missing or empty file, an unknown type, wrong columns."""


def default_data(method: str = "sft") -> Path:
    """The shipped demo file a method trains on when ``--data`` is not given.

    Args:
        method: ``"sft"`` (the instructions), ``"dpo"``, ``"kto"`` or ``"grpo"`` (the preference split).

    Returns:
        The path.
    """
    return demo_path() if method == "sft" else preferences_path()


def _sft_columns_ok(columns: set[str]) -> bool:
    if {"messages"} <= columns or {"text"} <= columns or {"prompt", "completion"} <= columns:
        return True
    return "instruction" in columns and ("response" in columns or "output" in columns)


def _columns_ok(columns: set[str], method: str) -> bool:
    if method == "sft":
        return _sft_columns_ok(columns)
    if method == "dpo":
        return {"chosen", "rejected"} <= columns
    if method == "kto":
        return {"prompt", "completion", "label"} <= columns or {"chosen", "rejected"} <= columns
    if method == "grpo":
        return "prompt" in columns and any(name in columns for name in ANSWER_COLUMNS)
    raise ValueError(f"fastft train: unknown method {method!r}; choose one of {', '.join(METHODS)}.")


def check_columns(dataset: Dataset, method: str, source: str | Path) -> None:
    """Refuse rows that lack the columns ``method`` trains on.

    Args:
        dataset: The rows.
        method: ``"sft"``, ``"dpo"``, ``"kto"`` or ``"grpo"``.
        source: The file the rows came from, for the message.

    Raises:
        DataError: Naming the file, the columns it has and the ones the method needs.
    """
    columns = set(dataset.column_names)
    if not _columns_ok(columns, method):
        raise DataError(
            f"fastft train: {source} has the columns {sorted(columns)}; --method {method} needs {_NEEDS[method]}. "
            "Rename the file's columns to those, or pass the --method whose columns it has."
        )


def load_rows(data: str | None, method: str | None = None) -> Dataset:
    """Read a training set, and check its columns when the method is given.

    Args:
        data: ``None`` or ``"demo"`` for the shipped demo set of the method (:func:`default_data`); else a
            ``.jsonl``, ``.json``, ``.csv``, ``.parquet`` or ``.txt`` file, or a folder written by
            ``Dataset.save_to_disk``.
        method: ``"sft"``, ``"dpo"``, ``"kto"`` or ``"grpo"``: the rows must have that method's columns
            (:func:`check_columns`). ``None`` reads the SFT demo set and checks nothing.

    Returns:
        The rows as a ``datasets.Dataset``.

    Raises:
        FileNotFoundError: The path does not exist.
        DataError: An unknown file type, an empty file, or (with ``method``) columns the method cannot train on.
    """
    path = default_data(method or "sft") if data in (None, "demo") else Path(data)
    if not path.exists():
        raise FileNotFoundError(f"fastft train: --data {data} does not exist; give a file, a dataset folder or 'demo'.")
    if path.is_dir():
        dataset = load_from_disk(str(path))
    else:
        loader = _LOADERS.get(path.suffix.lower())
        if loader is None:
            raise DataError(
                f"fastft train: --data {path} has the suffix {path.suffix or '(none)'!r}, which fastft cannot read; "
                f"save it as one of {sorted(_LOADERS)}, or pass a Dataset.save_to_disk folder."
            )
        try:
            dataset = load_dataset(loader, data_files=str(path), split="train")
        except Exception as error:  # noqa: BLE001 - datasets wraps every reader's failure in its own types
            # The reader's traceback runs to dozens of lines of pyarrow internals; its last message is what helps.
            cause = error.__cause__ or error
            raise DataError(
                f"fastft train: --data {path} cannot be read as {path.suffix.lower()} ({type(cause).__name__}: "
                f"{str(cause).strip().splitlines()[-1] if str(cause).strip() else 'no message'}); fix the file, or "
                f"save it in one of {sorted(_LOADERS)}."
            ) from error
    if len(dataset) == 0:
        raise DataError(f"fastft train: {path} holds no rows.")
    if method is not None:
        check_columns(dataset, method, path)
    return dataset


def to_sft_rows(dataset: Dataset, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """Shape rows into a format trl's ``SFTTrainer`` reads.

    ``messages``, ``text`` and ``prompt``/``completion`` rows pass through. Instruction rows become
    prompt/completion pairs, as chat turns when the tokenizer has a chat template, so trl computes the loss on
    the response only.

    Args:
        dataset: Rows from :func:`load_rows`.
        tokenizer: The model's tokenizer.

    Returns:
        The dataset, possibly with new columns.

    Raises:
        ValueError: The rows have none of the accepted formats.
    """
    columns = set(dataset.column_names)
    if {"messages"} <= columns or {"text"} <= columns or {"prompt", "completion"} <= columns:
        return dataset
    answer = "response" if "response" in columns else "output" if "output" in columns else None
    if "instruction" not in columns or answer is None:
        raise DataError(f"fastft train: the data has columns {sorted(columns)}; expected {_FORMATS}.")
    chat = tokenizer.chat_template is not None

    def convert(row: dict) -> dict:
        question = row["instruction"]
        if row.get("input"):
            question = f"{question}\n\n{row['input']}"
        if chat:
            return {
                "prompt": [{"role": "user", "content": question}],
                "completion": [{"role": "assistant", "content": row[answer]}],
            }
        return {
            "prompt": f"### Instruction:\n{question}\n\n### Response:\n",
            "completion": f"{row[answer]}{tokenizer.eos_token or ''}",
        }

    return dataset.map(convert, remove_columns=dataset.column_names)


def _with_prompt(dataset: Dataset) -> Dataset:
    """Paired rows with a ``prompt`` column: an implicit prompt (the turns chosen and rejected begin with) is split
    off by trl's ``extract_prompt``."""
    if "prompt" in dataset.column_names:
        return dataset
    from trl.data_utils import extract_prompt

    return dataset.map(extract_prompt)


def to_dpo_rows(dataset: Dataset) -> Dataset:
    """Shape paired preference rows for trl's ``DPOTrainer``: ``prompt``, ``chosen``, ``rejected`` and nothing else.

    Args:
        dataset: Rows with ``chosen`` and ``rejected`` (plain strings or message lists) and usually ``prompt``.

    Returns:
        The three columns.
    """
    check_columns(dataset, "dpo", "the data")
    dataset = _with_prompt(dataset)
    return dataset.select_columns(["prompt", "chosen", "rejected"])


def unpair_preferences(dataset: Dataset) -> Dataset:
    """Turn paired preference rows into KTO's unpaired ones: each pair gives a desirable (``chosen``, label true) and
    an undesirable (``rejected``, label false) row.

    trl's own ``unpair_preference_dataset`` puts every chosen completion before every rejected one, and KTO reads its
    data in order, so a short run would see only desirable rows. Here the two kinds alternate, and the rejected row
    beside pair ``i``'s chosen one belongs to pair ``i + n // 2``: neighbours never share a prompt, so the KL term
    (each prompt scored with its neighbour's completion) sees mismatched pairs, as KTO intends.

    Args:
        dataset: Paired rows (``chosen``, ``rejected``, and ``prompt`` or an implicit prompt).

    Returns:
        Twice as many rows, with ``prompt``, ``completion`` and ``label``.
    """
    dataset = _with_prompt(dataset)
    n = len(dataset)
    shift = n // 2 if n > 1 else 0
    prompts, chosen, rejected = dataset["prompt"], dataset["chosen"], dataset["rejected"]
    rows: dict[str, list] = {"prompt": [], "completion": [], "label": []}
    for i in range(n):
        j = (i + shift) % n
        rows["prompt"] += [prompts[i], prompts[j]]
        rows["completion"] += [chosen[i], rejected[j]]
        rows["label"] += [True, False]
    return Dataset.from_dict(rows)


def to_kto_rows(dataset: Dataset) -> Dataset:
    """Shape rows for trl's ``KTOTrainer``: ``prompt``, ``completion`` and a boolean ``label``.

    Args:
        dataset: Unpaired rows (``prompt``, ``completion``, ``label`` as a bool or 0 / 1), or paired ones, which
            :func:`unpair_preferences` unpairs.

    Returns:
        The three columns.

    Raises:
        DataError: A label that is neither a bool nor 0 / 1.
    """
    check_columns(dataset, "kto", "the data")
    if not {"prompt", "completion", "label"} <= set(dataset.column_names):
        return unpair_preferences(dataset)
    bad = [label for label in dataset["label"] if not isinstance(label, bool) and label not in (0, 1)]
    if bad:
        raise DataError(f"fastft train: KTO labels must be true / false (or 1 / 0); found {bad[0]!r}.")
    dataset = dataset.select_columns(["prompt", "completion", "label"])
    return dataset.map(lambda row: {"label": bool(row["label"])})


def to_grpo_rows(dataset: Dataset) -> Dataset:
    """Shape rows for trl's ``GRPOTrainer`` with :func:`fastft.training.trl.answer_reward`: ``prompt`` and ``answer``.

    Args:
        dataset: Rows with ``prompt`` (a string or message list) and ``answer`` or ``solution``.

    Returns:
        The two columns; a ``solution`` column is renamed ``answer``.
    """
    check_columns(dataset, "grpo", "the data")
    answer = next(name for name in ANSWER_COLUMNS if name in dataset.column_names)
    dataset = dataset.select_columns(["prompt", answer])
    return dataset if answer == "answer" else dataset.rename_column(answer, "answer")


def prepare_rows(dataset: Dataset, method: str, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """The rows ``method``'s trl trainer reads (:func:`to_sft_rows`, :func:`to_dpo_rows`, :func:`to_kto_rows`,
    :func:`to_grpo_rows`)."""
    if method == "sft":
        return to_sft_rows(dataset, tokenizer)
    return {"dpo": to_dpo_rows, "kto": to_kto_rows, "grpo": to_grpo_rows}[method](dataset)


def completion_text(completion: Any) -> str:
    """The text of a completion: a string as it is; a list of messages (conversational data) as the contents of its
    messages, joined by newlines."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return "\n".join(completion_text(message) for message in completion)


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def contains_answer(text: str, answer: str) -> bool:
    """Whether ``text`` states ``answer`` as a whole word or number, ignoring case and runs of whitespace.

    ``answer`` may not be part of a longer word or number: ``"52"`` is in ``"37 + 15 = 52."`` but not in
    ``"152"``, ``"52.5"`` or ``"1,52"``; ``"monday"`` is in ``"It is Monday."``.

    Args:
        text: The completion.
        answer: The expected answer.

    Returns:
        ``True`` when it is there.
    """
    answer = _normalise(answer)
    if not answer:
        return False
    pattern = rf"(?<!\w)(?<!\d[.,]){re.escape(answer)}(?!\w)(?![.,]\d)"
    return re.search(pattern, _normalise(text)) is not None
