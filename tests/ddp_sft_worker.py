"""One rank of the DDP test (``tests/test_distributed.py``): a few SFTTrainer steps on a tiny Llama with LoRA.

Run as ``torchrun --nproc_per_node=N ddp_sft_worker.py MODEL OUT GLOBAL_BATCH [--4bit]`` or as a plain
``python`` process (one rank). Every rank writes its LoRA weights to ``OUT/rank<R>.safetensors`` and what it saw
(world size, the wrapper Trainer trained, checkpointing mode, the first token of every row it trained on,
losses) to ``OUT/rank<R>.json``; rank 0 also writes the
weights before training to ``OUT/initial.safetensors``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from conftest import lora_weights
from datasets import Dataset
from safetensors.torch import save_file
from trl import SFTTrainer

from fastft import FastModel
from fastft.checkpointing.modes import get_mode
from fastft.training.trl import sft_config

STEPS, LENGTH, ROWS = 3, 24, 16


def main() -> None:
    model_dir, out, global_batch = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    four_bit = "--4bit" in sys.argv
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = FastModel.from_pretrained(
        str(model_dir), max_seq_length=64, dtype="float32", load_in_4bit=four_bit
    )
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing="offload", random_state=7)
    if rank == 0:
        save_file(lora_weights(model), str(out / "initial.safetensors"))
    # Equal-length, pre-tokenized rows: no padding, so a rank's mean loss is the same kind of mean as one process's.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tokenizer) - 10, (ROWS, LENGTH), generator=generator).tolist()
    dataset = Dataset.from_dict({"input_ids": ids})
    config = sft_config(
        str(out / "trainer"),
        torch.float32,
        64,
        max_steps=STEPS,
        per_device_train_batch_size=global_batch // world,
        learning_rate=1e-2,
        warmup_steps=0,
        save_strategy="no",
        logging_steps=1,
        seed=11,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=config)
    seen_rows: list[list[int]] = []
    collator = trainer.data_collator

    def recording(examples):
        seen_rows.append([example["input_ids"][0] for example in examples])
        return collator(examples)

    trainer.data_collator = recording
    trainer.train()
    save_file(lora_weights(model), str(out / f"rank{rank}.safetensors"))
    seen = {
        "rank": rank,
        "world_size": world,
        "wrapper": type(trainer.model_wrapped).__name__,
        "checkpointing": get_mode(model.get_base_model()),
        "rows": seen_rows,
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
