"""Streaming ``save_merged``: bounded memory, shards and index as transformers writes them, all-or-nothing writes,
tied embeddings, and ``fastft export`` on the adapter ``fastft train`` writes."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import lora_model

import fastft.export.merged_save
from fastft import FastModel

TESTS = Path(__file__).parent
FASTFT = [sys.executable, "-m", "fastft.cli"]


def _env() -> dict[str, str]:
    # Reference kernels: training through Triton's interpreter would take minutes a step.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "FASTFT_DISABLE_TRITON": "1", "TOKENIZERS_PARALLELISM": "false"}


def _lora_model(folder: Path, **kwargs):
    model, tokenizer = lora_model(folder, use_gradient_checkpointing=False, **kwargs)
    return FastModel.for_inference(model), tokenizer


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 19), generator=torch.Generator().manual_seed(3))


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _memory_worker(mode: str, smol_tokenizer, tmp_path: Path, result: str) -> dict:
    """Run ``export_memory_worker.py`` in a process of its own and return what it measured."""
    tokenizer_dir = tmp_path / "tokenizer"
    smol_tokenizer.save_pretrained(tokenizer_dir)
    command = [sys.executable, str(TESTS / "export_memory_worker.py"), mode, str(tokenizer_dir), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=TESTS, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads((tmp_path / result).read_text())
    print(json.dumps(record, indent=2))
    return record


def test_memory_stays_within_one_layer_and_the_output_reloads(smol_tokenizer, tmp_path):
    record = _memory_worker("exports", smol_tokenizer, tmp_path, "memory.json")
    assert record["weight_bytes"] >= 300e6
    bound = 1.5 * (record["layer_merged_bytes"] + record["block_bytes"])
    for export in ("save_merged", "save_gguf"):
        measured = record[export]
        assert measured["reset_ok"], "the kernel did not reset the peak-RSS counter; the figure would be meaningless"
        assert measured["growth"] <= bound, (
            f"{export} grew the resident set by {measured['growth'] / 1e6:.1f} MB, over 1.5 x (one merged layer "
            f"{record['layer_merged_bytes'] / 1e6:.1f} MB + one block {record['block_bytes'] / 1e6:.1f} MB) = "
            f"{bound / 1e6:.1f} MB"
        )
    # float32 both sides: the reloaded folder computes what peft's own merge of the same model computes.
    assert record["logits_max_abs_diff"] <= 1e-5 * max(1.0, record["logits_max_abs"])
    assert len(record["shards"]) > 1
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == record["shards"]


def test_training_checkpoints_stay_within_the_same_bound(smol_tokenizer, tmp_path):
    record = _memory_worker("checkpoints", smol_tokenizer, tmp_path, "checkpoints.json")
    assert len(record["checkpoints"]) == 3 and record["checkpoint_bytes"] > 0
    bound = 1.5 * (record["layer_merged_bytes"] + record["block_bytes"])
    for save in record["checkpoints"]:
        assert save["reset_ok"]
        assert save["growth"] <= bound, f"a checkpoint grew the resident set by {save['growth'] / 1e6:.1f} MB"


# Per-version: transformers' shard order, index and tied-weight handling changed across 4.x and 5.x.
@pytest.mark.lane
def test_shards_and_index_are_those_transformers_writes(tiny_llama_dir, tmp_path):
    from safetensors import safe_open

    model, tokenizer = _lora_model(tiny_llama_dir)
    # The 12.6 MB embedding gets a shard of its own; the layers (about 100 KB each) spread over several.
    ours = FastModel.save_merged(model, tokenizer, tmp_path / "ours", dtype=torch.float32, max_shard_size="100KB")
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(tmp_path / "stock", max_shard_size="100KB")
    index = "model.safetensors.index.json"
    assert json.loads((ours / index).read_text()) == json.loads((tmp_path / "stock" / index).read_text())
    shards = sorted(path.name for path in ours.glob("*.safetensors"))
    assert len(shards) > 2
    assert shards == sorted(path.name for path in (tmp_path / "stock").glob("*.safetensors"))
    for shard in shards:
        with safe_open(str(ours / shard), "pt") as mine, safe_open(str(tmp_path / "stock" / shard), "pt") as theirs:
            assert set(mine.keys()) == set(theirs.keys())
            for key in mine.keys():  # noqa: SIM118 (safe_open is not a dict)
                torch.testing.assert_close(mine.get_tensor(key), theirs.get_tensor(key), rtol=1e-6, atol=1e-6)
    config = json.loads((ours / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (ours / "generation_config.json").is_file() and (ours / "tokenizer.json").is_file()


@pytest.mark.lane
def test_a_lora_on_the_tied_head_unties_it(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = _lora_model(tiny_llama_dir, target_modules=["q_proj", "v_proj", "lm_head"])
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        expected = model(ids).logits
    folder = FastModel.save_merged(model, tokenizer, tmp_path / "untied", dtype=torch.float32)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


class _Interrupted(BaseException):
    """Stands in for a KeyboardInterrupt or a full disk after the first shard."""


def _fail_after_first_shard(monkeypatch, error: BaseException) -> list[Path]:
    written: list[Path] = []
    real = fastft.export.merged_save.write_shard

    def write_then_fail(path, *args, **kwargs):
        if written:
            raise error
        result = real(path, *args, **kwargs)
        written.append(path)
        return result

    monkeypatch.setattr(fastft.export.merged_save, "write_shard", write_then_fail)
    return written


@pytest.mark.parametrize("error", [_Interrupted(), OSError(28, "No space left on device")], ids=["interrupt", "enospc"])
@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "overwrite"])
def test_a_save_that_fails_after_the_first_shard_leaves_the_target_as_it_was(
    tiny_llama_dir, tmp_path, monkeypatch, error, existing
):
    model, tokenizer = _lora_model(tiny_llama_dir)
    target = tmp_path / "merged"
    if existing:
        FastModel.save_merged(model, tokenizer, target, dtype=torch.float32)
    before = _snapshot(target) if existing else None
    written = _fail_after_first_shard(monkeypatch, error)
    with pytest.raises(type(error)):
        FastModel.save_merged(model, tokenizer, target, max_shard_size="600KB", overwrite=existing)
    assert len(written) == 1, "the fault was injected after the first shard was complete"
    if existing:
        assert _snapshot(target) == before
    else:
        assert not target.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == (["merged"] if existing else [])


def test_a_non_empty_folder_needs_overwrite(tiny_llama_dir, tmp_path):
    model, tokenizer = _lora_model(tiny_llama_dir)
    target = tmp_path / "merged"
    target.mkdir()
    FastModel.save_merged(model, None, target)  # an empty folder is taken as it is
    (target / "notes.txt").write_text("keep me")
    before = _snapshot(target)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        FastModel.save_merged(model, tokenizer, target)
    assert _snapshot(target) == before
    FastModel.save_merged(model, tokenizer, target, overwrite=True)
    assert not (target / "notes.txt").exists() and (target / "tokenizer.json").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["merged"]


@pytest.mark.lane
def test_a_4bit_base_merges_block_by_block_like_the_whole_merge(tiny_llama_dir, tmp_path):
    from fastft.export.merge import merge_plan, merged_state_dict

    model, _ = lora_model(tiny_llama_dir, load_in_4bit=True, use_gradient_checkpointing=False)
    whole = merged_state_dict(model, torch.float32)
    for tensor in merge_plan(model).tensors:
        # Blocks of 100 values: several blocks per projection row range.
        blocks = torch.cat(list(tensor.chunks(100))) if len(tensor.shape) > 1 else tensor.whole()
        torch.testing.assert_close(blocks, whole[tensor.name], rtol=0, atol=1e-6, msg=tensor.name)


@pytest.fixture(scope="module")
def trained_adapter(tiny_llama_dir, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("trained") / "run"
    command = [
        *FASTFT,
        "train",
        "--model",
        str(tiny_llama_dir),
        "--output",
        str(output),
        "--max-steps",
        "3",
        "--seq-len",
        "64",
        "--batch-size",
        "2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=output.parent, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return output


def test_fastft_export_writes_both_outputs_from_a_trained_adapter(trained_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged, gguf = tmp_path / "merged", tmp_path / "model.gguf"
    command = [
        *FASTFT,
        "export",
        "--adapter",
        str(trained_adapter),
        "--merged",
        str(merged),
        "--gguf",
        str(gguf),
        "--dtype",
        "float32",
        "--quantization",
        "f32",
        "--max-shard-size",
        "600KB",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "fastft export: wrote" in result.stdout
    assert "fastft: merging into" in result.stderr and "fastft: writing GGUF" in result.stderr  # progress bars
    assert (merged / "model.safetensors.index.json").is_file() and gguf.is_file()

    base_name = json.loads((trained_adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_name), str(trained_adapter))
    ids = _ids(adapted.config.vocab_size)
    with torch.no_grad():
        expected = adapted(ids).logits
        from_merged = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        from_gguf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name)(ids).logits
    torch.testing.assert_close(from_merged, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_gguf, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [(float("nan"), torch.float32, "holds NaN or inf"), (1e6, torch.float16, "beyond float16's range")],
    ids=["nan", "fp16-overflow"],
)
def test_diverged_or_fp16_overflowing_weights_are_refused_and_nothing_is_left(
    tiny_llama_dir, tmp_path, value, dtype, expected
):
    model, tokenizer = _lora_model(tiny_llama_dir)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n and "layers.1." in n).fill_(value)
    with pytest.raises(ValueError, match=expected) as raised:
        FastModel.save_merged(model, tokenizer, tmp_path / "merged", dtype=dtype)
    assert "model.layers.1." in str(raised.value)
    with pytest.raises(ValueError, match=expected):
        FastModel.save_gguf(model, tokenizer, tmp_path / "model.gguf", quantization="f16")
    assert list(tmp_path.iterdir()) == []
