"""Checks of ``fastft train``'s flags, model folder and data file, run before any weight loads or any file is written.

Every message names the flag as the user typed it (``--seq-len``, not ``max_seq_length``), what was wrong, and what
to do instead, so ``fastft train`` can print it as one ``error:`` line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastft.loading.sources import TOKENIZER_FILES, has_tokenizer, looks_like_path, position_range
from fastft.training.data import ANSWER_COLUMNS, DataError


class OptionsError(ValueError):
    """Settings of ``fastft train`` that cannot work (found before the model is loaded)."""


# (flag, lowest allowed, what the number is, a value that works); checked for every method unless listed below.
_AT_LEAST = {
    "r": ("--r", 1, "the LoRA rank", "16"),
    "lora_alpha": ("--lora-alpha", 1, "the LoRA scale numerator", "16 (the rank) or 32"),
    "seq_len": ("--seq-len", 1, "tokens per example", "256"),
    "batch_size": ("--batch-size", 1, "examples per step", "4"),
    "grad_accum": ("--grad-accum", 1, "batches per optimizer step", "1"),
    "warmup_steps": ("--warmup-steps", 0, "warm-up steps", "2"),
    "save_steps": ("--save-steps", 1, "steps between checkpoints", "10"),
    "seed": ("--seed", 0, "the random seed", "3407"),
}
_METHOD_AT_LEAST = {
    "num_generations": ("grpo", "--num-generations", 2, "completions per prompt", "4"),
    "max_completion_length": ("grpo", "--max-completion-length", 1, "tokens per completion", "64"),
}
# Weight files transformers loads from a folder (sharded ones through their index).
_WEIGHT_PATTERNS = (
    "*.safetensors",
    "pytorch_model*.bin",
    "*.gguf",
    "*.index.json",
    "tf_model.h5",
    "flax_model.msgpack",
)


def check_numbers(options: Any) -> None:
    """Refuse numbers out of range, naming the flag.

    Args:
        options: A :class:`fastft.training.train.TrainOptions`.

    Raises:
        OptionsError: The first flag out of range, its value and one that works.
    """
    bounds = [(name, *bound) for name, bound in _AT_LEAST.items()]
    bounds += [(name, *bound) for name, (method, *bound) in _METHOD_AT_LEAST.items() if method == options.method]
    for name, flag, lowest, what, example in bounds:
        value = getattr(options, name)
        if value < lowest:
            raise OptionsError(
                f"fastft train: {flag} is {what} and must be at least {lowest}; got {value}. "
                f"Pass e.g. {flag} {example}."
            )
    if options.seed >= 2**32:
        raise OptionsError(f"fastft train: --seed must be below 2**32; got {options.seed}. Pass e.g. --seed 3407.")
    if not (math.isfinite(options.lr) and options.lr > 0):
        raise OptionsError(f"fastft train: --lr must be a positive number; got {options.lr}. Pass e.g. --lr 2e-4.")
    if not 0 <= options.lora_dropout < 1:
        raise OptionsError(
            f"fastft train: --lora-dropout must be in [0, 1); got {options.lora_dropout}. Pass --lora-dropout 0 (the "
            "fused kernels' path) or a small value such as 0.05."
        )
    if options.method in ("dpo", "kto") and not (math.isfinite(options.beta) and options.beta > 0):
        raise OptionsError(f"fastft train: --beta must be a positive number; got {options.beta}. Pass e.g. --beta 0.1.")
    if options.max_steps <= 0 and not (math.isfinite(options.epochs) and options.epochs > 0):
        raise OptionsError(
            f"fastft train: with --max-steps {options.max_steps} the run lasts --epochs, which must be positive; got "
            f"{options.epochs}. Pass e.g. --epochs 1, or --max-steps 60."
        )


def _has_weights(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in _WEIGHT_PATTERNS)


def check_model(model: str, tokenizer: str | None, seq_len: int) -> None:
    """Refuse a local ``--model`` folder that cannot load, and a ``--tokenizer`` that holds no tokenizer.

    Hub ids and ``smollm2-135m`` are left to the loader: only local folders can be looked at without a download.

    Args:
        model: ``--model`` as typed.
        tokenizer: ``--tokenizer`` as typed, or ``None``.
        seq_len: ``--seq-len``, checked against a local config's position range.

    Raises:
        FileNotFoundError: A path that does not exist, a folder without config.json or without weights, or no
            tokenizer in the folder and no ``--tokenizer``.
    """
    if tokenizer is not None and looks_like_path(tokenizer):
        folder = Path(tokenizer).expanduser()
        if not folder.is_dir() or not has_tokenizer(folder):
            found = "does not exist" if not folder.exists() else "holds no tokenizer files"
            raise FileNotFoundError(
                f"fastft train: --tokenizer {tokenizer} {found}; pass a folder with tokenizer.json or "
                "tokenizer_config.json (tokenizer.save_pretrained(folder) writes them), or a hub id."
            )
    if not looks_like_path(model) and not Path(model).expanduser().is_dir():
        return
    folder = Path(model).expanduser()
    if not folder.exists():
        raise FileNotFoundError(
            f"fastft train: --model {model} does not exist (looked for {folder.resolve()}); fix the path, pass the "
            "folder model.save_pretrained(folder) wrote, a hub id, or leave --model out for the embedded smollm2-135m."
        )
    if not folder.is_dir() or (folder / "adapter_config.json").is_file():
        return  # a GGUF file or an adapter folder: the loader checks those and names their problems
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"fastft train: --model {model} has no config.json, so it is not a model folder; pass the folder "
            "model.save_pretrained(folder) wrote, or a hub id."
        )
    if not _has_weights(folder):
        raise FileNotFoundError(
            f"fastft train: --model {model} has config.json but no weights (no model.safetensors or "
            "pytorch_model.bin); copy the weight files into it (model.save_pretrained(folder) writes both), or pass "
            "the hub id the config came from."
        )
    if tokenizer is None and not has_tokenizer(folder):
        raise FileNotFoundError(
            f"fastft train: --model {model} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); pass "
            "--tokenizer with the folder or hub id that has them, or save them beside the weights: "
            "tokenizer.save_pretrained(folder)."
        )
    from transformers import AutoConfig

    limit = position_range(AutoConfig.from_pretrained(folder))
    if limit is not None and seq_len > limit:
        raise OptionsError(
            f"fastft train: --seq-len {seq_len} is past the {limit} positions --model {model} covers; pass "
            f"--seq-len {min(limit, 2048)} or less."
        )


def check_json_lines(path: Path, flag: str = "--data") -> list[int]:
    """Refuse a JSON lines file with a line that is not a JSON object.

    Args:
        path: The ``.jsonl`` file.
        flag: The flag that named it, for the message.

    Returns:
        The 1-based line number of each row, blank lines skipped (as the reader skips them).

    Raises:
        DataError: The first bad line: its number, the parser's complaint, and what a line should look like.
    """
    numbers = []
    with path.open(encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"fastft train: {flag} {path} line {number} is not JSON ({error.msg} at column {error.colno}); "
                    'a JSON lines file holds one object per line, such as {"text": "..."}. Fix that line, or pass '
                    "a .csv, .parquet or .txt file."
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"fastft train: {flag} {path} line {number} is a JSON {type(row).__name__}, not an object; "
                    'write each row as an object such as {"text": "..."}.'
                )
            numbers.append(number)
    return numbers


def row_fields(columns: set[str], method: str) -> list[str]:
    """The columns every row must fill for ``method``, in the format the trainer will read (that of
    :func:`fastft.training.data.to_sft_rows` and its siblings)."""
    if method == "sft":
        if "messages" in columns:
            return ["messages"]
        if "text" in columns:
            return ["text"]
        if {"prompt", "completion"} <= columns:
            return ["prompt", "completion"]
        return ["instruction", "response" if "response" in columns else "output"]
    if method == "kto" and {"prompt", "completion", "label"} <= columns:
        return ["prompt", "completion", "label"]
    if method in ("dpo", "kto"):
        return [name for name in ("prompt", "chosen", "rejected") if name in columns]
    return ["prompt", next(name for name in ANSWER_COLUMNS if name in columns)]


def check_rows(dataset: Any, method: str, source: str | Path, lines: list[int] | None = None) -> None:
    """Refuse a row that leaves out a field the other rows have and the trainer reads.

    Args:
        dataset: The rows (their columns already checked by :func:`fastft.training.data.check_columns`).
        method: The training method.
        source: The file, for the message.
        lines: Each row's line number in a JSON lines file, when known.

    Raises:
        DataError: The first such row (1-based), its line, and the field.
    """
    for name in row_fields(set(dataset.column_names), method):
        for index, value in enumerate(dataset[name]):
            if value is None:
                where = f"row {index + 1}"
                if lines is not None and len(lines) == len(dataset):
                    where += f" (line {lines[index]})"
                raise DataError(
                    f'fastft train: --data {source} {where} has no "{name}", which --method {method} reads from every '
                    f'row; give that row a "{name}" or remove it.'
                )
