"""Several processes: DDP and FSDP under torchrun (gloo, CPU), and no nn.DataParallel for fastft models."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from safetensors.torch import load_file

TESTS = Path(__file__).parent


def _env(processes: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    # Several processes share the machine's cores; each takes its share, or they fight over them.
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    env.update(OMP_NUM_THREADS=threads, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONSAFEPATH", None)
    return env


def _run(args: list[str], cwd: Path, processes: int = 1, succeed: bool = True) -> subprocess.CompletedProcess:
    """Run a script (or ``-m module``) as one plain process, or under torchrun with ``processes`` ranks."""
    launcher = (
        [] if processes == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    )
    # cwd is a temporary folder: run from the repository root, the local kernels/ would shadow the PyPI package.
    done = subprocess.run(
        [sys.executable, *launcher, *args], cwd=cwd, env=_env(processes), capture_output=True, text=True, timeout=600
    )
    assert (done.returncode == 0) == succeed, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return done


def _updates_match(actual: dict, expected: dict, initial: dict) -> float:
    # LoRA A barely moves in a few steps, so comparing weights alone would hide a wrong update; compare the updates.
    worst = 0.0
    for name, weight in expected.items():
        update = weight.double() - initial[name].double()
        assert update.norm() > 1e-4 * weight.double().norm().clamp_min(1e-12), f"{name} did not train"
        worst = max(worst, relative_error(actual[name] - initial[name], weight - initial[name]))
    return worst


@pytest.fixture(scope="module")
def sft_runs(tiny_llama_dir, tmp_path_factory):
    """The SFT worker run once as one process (batch 4) and once under torchrun as two ranks (batch 2 each)."""
    root = tmp_path_factory.mktemp("ddp")
    worker = str(TESTS / "ddp_sft_worker.py")
    _run([worker, str(tiny_llama_dir), str(root / "one"), "4"], root)
    _run([worker, str(tiny_llama_dir), str(root / "two"), "4"], root, processes=2)
    return root


@pytest.mark.lane
def test_ddp_two_ranks_train_like_one_process_with_the_same_global_batch(sft_runs):
    one, two = sft_runs / "one", sft_runs / "two"
    seen = [json.loads((two / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    single = json.loads((one / "rank0.json").read_text())
    for rank, record in enumerate(seen):
        assert record["world_size"] == 2 and record["rank"] == rank
        assert record["wrapper"] == "DistributedDataParallel", record
        assert record["checkpointing"] == "offload"
    # Each rank trained on its own half of every global batch, and together on exactly the one process's batches.
    for step, rows in enumerate(single["rows"][:3]):
        assert sorted(seen[0]["rows"][step] + seen[1]["rows"][step]) == sorted(rows)
        assert not set(map(tuple, [seen[0]["rows"][step]])) & set(map(tuple, [seen[1]["rows"][step]]))
    rank0, rank1 = load_file(str(two / "rank0.safetensors")), load_file(str(two / "rank1.safetensors"))
    alone, initial = load_file(str(one / "rank0.safetensors")), load_file(str(one / "initial.safetensors"))
    assert rank0.keys() == alone.keys() and len(alone) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for name in alone:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs between the ranks"
        assert rank0[name].dtype == torch.float32
        assert relative_error(rank0[name], alone[name]) <= 1e-5, name
    assert _updates_match(rank0, alone, initial) <= 1e-3
    assert seen[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_ddp_qlora_on_a_4bit_base(tiny_llama_dir, tmp_path):
    worker = str(TESTS / "ddp_sft_worker.py")
    _run([worker, str(tiny_llama_dir), str(tmp_path / "one"), "4", "--4bit"], tmp_path)
    _run([worker, str(tiny_llama_dir), str(tmp_path / "two"), "4", "--4bit"], tmp_path, processes=2)
    seen = [json.loads((tmp_path / "two" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    single = json.loads((tmp_path / "one" / "rank0.json").read_text())
    assert [record["wrapper"] for record in seen] == ["DistributedDataParallel"] * 2
    rank0 = load_file(str(tmp_path / "two" / "rank0.safetensors"))
    rank1 = load_file(str(tmp_path / "two" / "rank1.safetensors"))
    alone = load_file(str(tmp_path / "one" / "rank0.safetensors"))
    for name in alone:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs between the ranks"
        # trl casts QLoRA adapters to bf16, whose rounding turns fp32 reduction-order noise into a few ulps.
        assert relative_error(rank0[name], alone[name]) <= 5e-2, name
    assert seen[0]["losses"] == pytest.approx(single["losses"], rel=1e-3)


def test_fsdp2_sharded_16bit_lora_trains_like_one_process(tiny_llama_dir, tmp_path):
    worker = str(TESTS / "fsdp_lora_worker.py")
    _run([worker, str(tiny_llama_dir), str(tmp_path / "one")], tmp_path)
    _run([worker, str(tiny_llama_dir), str(tmp_path / "two")], tmp_path, processes=2)
    sharded = load_file(str(tmp_path / "two" / "weights.safetensors"))
    alone = load_file(str(tmp_path / "one" / "weights.safetensors"))
    initial = load_file(str(tmp_path / "one" / "initial.safetensors"))
    for name in alone:
        assert relative_error(sharded[name], alone[name]) <= 1e-5, name
    assert _updates_match(sharded, alone, initial) <= 1e-3


def test_fsdp2_of_a_4bit_base_is_refused_by_name(tiny_llama_dir, tmp_path):
    worker = str(TESTS / "fsdp_lora_worker.py")
    _run([worker, str(tiny_llama_dir), str(tmp_path / "two"), "--4bit"], tmp_path, processes=2, succeed=False)
    error = (tmp_path / "two" / "error-rank0.txt").read_text()
    assert error.startswith("ShapeContractError: model.layers.0.self_attn.q_proj: expected a 4-bit weight")
    assert "FSDP needs a 16-bit base (load_in_4bit=False)" in error and "torchrun --nproc_per_node" in error


def test_fastft_train_under_torchrun_only_rank_0_writes_and_prints(tiny_llama_dir, tmp_path):
    output = tmp_path / "run"
    done = _run(
        ["-m", "fastft.cli", "train", "--model", str(tiny_llama_dir), "--output", str(output)]
        + ["--max-steps", "2", "--seq-len", "64", "--batch-size", "1", "--save-steps", "1", "--lora-r", "4"],
        tmp_path,
        processes=2,
    )
    assert done.stdout.count("fastft train: 2 steps") == 1, done.stdout
    assert done.stderr.count("fastft.model: fastft: loaded") == 1, done.stderr[-3000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["global_step"] == 2 and metrics["completed"]
    assert (output / "adapter_model.safetensors").is_file() and (output / "loss.png").is_file()
    # Trainer's checkpoints hold each rank's RNG state: both ranks took part in every step.
    assert {path.name for path in (output / "checkpoint-2").glob("rng_state_*.pth")} == {
        "rng_state_0.pth",
        "rng_state_1.pth",
    }


# ---- nn.DataParallel: Trainer's fallback when one process sees several GPUs, simulated on CPU ----


@pytest.fixture
def lora_model(tiny_llama_dir):
    from fastft import FastModel

    model, tokenizer = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64, dtype="float32")
    return FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload"), tokenizer


def _dataset(tokenizer, rows: int = 8):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tokenizer) - 10, (rows, 16), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids})


def _config(tmp_path, gpus: int):
    from fastft.training.trl import sft_config

    config = sft_config(str(tmp_path), torch.float32, 64, max_steps=1, per_device_train_batch_size=2)
    # What TrainingArguments records when one process sees `gpus` CUDA devices.
    config._n_gpu = gpus
    return config


@pytest.mark.lane
def test_trainer_falls_back_to_data_parallel_and_fastft_refuses_the_copy(lora_model, tmp_path, monkeypatch):
    from transformers import DataCollatorForLanguageModeling, Trainer

    from fastft.loading.distributed import DataParallelRefused

    model, tokenizer = lora_model
    # transformers' Trainer (and trl's SFTTrainer before 1.16, which since refuses n_gpu > 1 itself) takes this path.
    trainer = Trainer(
        model=model,
        args=_config(tmp_path, 2),
        train_dataset=_dataset(tokenizer),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    assert trainer._train_batch_size == 4
    wrapped = trainer._wrap_model(trainer.model_wrapped)
    assert isinstance(wrapped, torch.nn.DataParallel)

    # DataParallel.forward replicates the module onto each GPU; broadcast to "GPUs" on CPU by plain copies.
    def broadcast(tensors, devices, detach=False):
        return [[tensor.detach().clone() for tensor in tensors] for _ in devices]

    monkeypatch.setattr(
        importlib.import_module("torch.nn.parallel.replicate"), "_broadcast_coalesced_reshape", broadcast
    )
    with pytest.raises(DataParallelRefused) as caught:
        torch.nn.parallel.replicate(wrapped.module, [0, 1])
    message = str(caught.value)
    assert message.startswith("fastft: nn.DataParallel tried to copy LlamaForCausalLM onto")
    assert "torchrun --nproc_per_node=" in message and "accelerate launch --num_processes=" in message
    assert "one_gpu_per_process" in message and "CUDA_VISIBLE_DEVICES=0" in message


@pytest.mark.lane
def test_one_gpu_per_process_keeps_trainer_off_data_parallel(lora_model, tmp_path, caplog):
    from trl import SFTTrainer

    from fastft.loading.distributed import one_gpu_per_process

    model, tokenizer = lora_model
    config = _config(tmp_path, 2)
    with caplog.at_level(logging.WARNING, logger="fastft.distributed"):
        assert one_gpu_per_process(config) is config
    assert config.n_gpu == 1
    [record] = [record for record in caplog.records if record.name == "fastft.distributed"]
    assert "2 GPUs visible to one process" in record.getMessage()
    assert "torchrun --nproc_per_node=2 train.py" in record.getMessage()
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=_dataset(tokenizer), args=config)
    assert trainer._train_batch_size == 2
    assert trainer._wrap_model(trainer.model_wrapped) is trainer.model_wrapped
    trainer.train()
    assert trainer.state.global_step == 1 and not isinstance(trainer.model_wrapped, torch.nn.DataParallel)


def test_one_gpu_per_process_leaves_a_single_gpu_alone(tmp_path, caplog):
    from fastft.loading.distributed import one_gpu_per_process

    config = _config(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="fastft.distributed"):
        one_gpu_per_process(config)
    assert config.n_gpu == 1 and not caplog.records


def test_data_parallel_guard_survives_copies_and_is_added_once(lora_model):
    from fastft.loading.distributed import DataParallelRefused, guard_data_parallel

    model, _ = lora_model
    base = model.get_base_model()
    guard = base.__dict__["_replicate_for_data_parallel"]
    guard_data_parallel(base)
    assert base.__dict__["_replicate_for_data_parallel"] is guard
    with pytest.raises(DataParallelRefused):
        copy.deepcopy(model).get_base_model()._replicate_for_data_parallel()
    with pytest.raises(DataParallelRefused):
        pickle.loads(pickle.dumps(guard))()


# ---- the launch environment ----


def test_launch_reads_torchrun_variables(monkeypatch):
    from fastft.loading.distributed import Launch, launch

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launch() == Launch(0, 0, 1) and launch().is_main and not launch().distributed
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch() == Launch(3, 1, 4) and launch().distributed and not launch().is_main
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not an integer"):
        launch()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK=3 does not fit WORLD_SIZE=2"):
        launch()


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda reporting two GPUs, recording set_device."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return chosen


def test_device_map_is_the_local_rank_gpu_under_torchrun(two_gpus, monkeypatch):
    from fastft.loading.distributed import device_map

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert device_map() == {"": 1}
    assert two_gpus == [1]  # Triton launches on the current device, so it must be the rank's
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 but this process sees 2 GPU\(s\)"):
        device_map()


def test_device_map_of_one_process_seeing_two_gpus_warns_with_the_launch_commands(two_gpus, caplog, monkeypatch):
    from fastft import distributed

    monkeypatch.setattr(distributed, "_warned_single_process", False)
    with caplog.at_level(logging.WARNING, logger="fastft.distributed"):
        assert distributed.device_map() == {"": 0}
        assert distributed.device_map() == {"": 0}
    [record] = caplog.records  # once per process
    assert "this one process sees 2 GPUs; it trains on cuda:0 only" in record.getMessage()
    assert "torchrun --nproc_per_node=2" in record.getMessage()
    assert two_gpus == []
