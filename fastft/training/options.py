"""What ``fastft train`` takes: the trainer methods and the run's settings, in a module that imports nothing heavy.

``fastft --help`` and ``fastft --version`` build their parser from these, so they answer without importing
transformers, peft, trl or datasets (13 s on a 2-core machine); :mod:`fastft.training.train` and
:mod:`fastft.training.data` re-export both names.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("sft", "dpo", "kto", "grpo")


@dataclass
class TrainOptions:
    """Settings of one ``fastft train`` run (the command's flags)."""

    output: str
    model: str = "smollm2-135m"
    method: str = "sft"
    data: str | None = None
    max_steps: int = 60
    epochs: float = 1.0
    lr: float = 2e-4
    r: int = 16
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    seq_len: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    load_in_4bit: bool = False
    dtype: str | None = None
    gradient_checkpointing: str = "offload"
    compile: bool = False
    warmup_steps: int = 2
    save_steps: int = 10
    seed: int = 3407
    tokenizer: str | None = None
    resume: bool = False
    overwrite: bool = False
    beta: float = 0.1
    num_generations: int = 4
    max_completion_length: int = 64
