"""Training data for ``fastft train``: reading a file or the shipped demo set, and shaping rows for trl."""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, load_dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from fastft.demo import demo_path

_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_FORMATS = (
    "'messages' (chat turns), 'text', 'prompt' + 'completion', or 'instruction' + 'response' "
    "(or 'output'), with an optional 'input'"
)


def load_rows(data: str | None) -> Dataset:
    """Read a training set.

    Args:
        data: ``None`` or ``"demo"`` for the shipped demo set; else a ``.jsonl``, ``.json``, ``.csv``,
            ``.parquet`` or ``.txt`` file, or a folder written by ``Dataset.save_to_disk``.

    Returns:
        The rows as a ``datasets.Dataset``.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: An unknown file type, or an empty file.
    """
    path = demo_path() if data in (None, "demo") else Path(data)
    if not path.exists():
        raise FileNotFoundError(f"fastft train: --data {data} does not exist; give a file, a dataset folder or 'demo'.")
    if path.is_dir():
        dataset = load_from_disk(str(path))
    else:
        loader = _LOADERS.get(path.suffix.lower())
        if loader is None:
            raise ValueError(f"fastft train: cannot read {path.name}; use one of {sorted(_LOADERS)}.")
        dataset = load_dataset(loader, data_files=str(path), split="train")
    if len(dataset) == 0:
        raise ValueError(f"fastft train: {path} holds no rows.")
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
        raise ValueError(f"fastft train: the data has columns {sorted(columns)}; expected {_FORMATS}.")
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
