"""One rank of the FSDP test (``tests/test_distributed.py``): LoRA steps on a tiny Llama sharded with FSDP2.

accelerate only turns its FSDP plugin on for GPUs (on CPU it trains with DDP instead), so this shards with
PyTorch's own ``fully_shard`` (what the plugin calls with ``fsdp_version=2``): each decoder layer, then the whole
model. Run as ``torchrun --nproc_per_node=N fsdp_lora_worker.py MODEL OUT [--4bit]`` or as a plain ``python``
process (one rank, no sharding). Rank 0 writes the full LoRA weights to ``OUT/weights.safetensors`` (and the
weights before training to ``OUT/initial.safetensors``); a failure is written to ``OUT/error-rank<R>.txt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import lora_weights
from safetensors.torch import save_file

from fastft import FastModel

STEPS, GLOBAL_BATCH, LENGTH = 3, 4, 24


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = FastModel.from_pretrained(
        str(model_dir), max_seq_length=64, dtype="float32", load_in_4bit="--4bit" in sys.argv
    )
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing="offload", random_state=7)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    initial = lora_weights(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tokenizer) - 10, (STEPS * GLOBAL_BATCH, LENGTH), generator=generator)
    try:
        for step in range(STEPS):
            # Equal-length rows: each rank's mean loss over its share averages to the one process's mean.
            batch = ids[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH].chunk(world)[rank]
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:
        (out / f"error-rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        raise
    weights = lora_weights(model)
    if rank == 0:
        save_file(initial, str(out / "initial.safetensors"))
        save_file(weights, str(out / "weights.safetensors"))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
