"""Bad input on the public API (issue 21): each row of the README's "Bad input" table raises its named exception
before any weight is loaded and before anything is written, with a message that names the entry point, the argument
and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama_config
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

from fastft import FastModel, HubFetchError
from fastft.loading.sources import position_range
from fastft.model import DEFAULT_TARGET_MODULES


def _tree(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its size: what a refused call must leave unchanged."""
    return {str(path.relative_to(folder)): path.stat().st_size for path in folder.rglob("*") if path.is_file()}


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Fail the test if a model or tokenizer is loaded; yields the list of attempted loads."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError(f"loaded {args[:1]} although the input was bad")

    for cls in (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    yield calls
    assert not calls


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working directory, home and fastft cache inside ``tmp_path``, so "nothing written" can be checked."""
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FASTFT_CACHE", str(tmp_path / "fastft-cache"))
    return tmp_path


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Offline mode with an empty hub cache: no request can leave the machine, and no id is cached."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny Llama saved with model.save_pretrained only: weights and config.json, no tokenizer."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("bare-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(smol_tokenizer)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base_model(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    return model


# --- from_pretrained: paths and the hub ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./no/such/folder", "no/such/folder", "{tmp}/x/y", "~/no-such-model", "../gone"])
def test_missing_path_is_file_not_found_without_the_hub(sandbox, nothing_loaded, monkeypatch, name):
    import transformers.utils.hub

    def no_hub(*args, **kwargs):
        raise AssertionError("a filesystem path was sent to the hub")

    monkeypatch.setattr(transformers.utils.hub, "cached_files", no_hub)
    name = name.format(tmp=sandbox)
    before = _tree(sandbox)
    with pytest.raises(FileNotFoundError) as raised:
        FastModel.from_pretrained(name)
    message = str(raised.value)
    assert message.startswith("fastft.from_pretrained: ")
    assert f"model_name={name!r}" in message and "does not exist" in message
    assert "save_pretrained(folder)" in message and "hub id" in message
    assert _tree(sandbox) == before


def test_home_folder_is_expanded(sandbox, tiny_llama_dir, nothing_loaded):
    (sandbox / "home" / "model").symlink_to(tiny_llama_dir, target_is_directory=True)
    # Past the position range: refused after the config is read, which proves "~/model" was found.
    with pytest.raises(ValueError, match=rf"max_seq_length=4096 is past the positions {sandbox}/home/model covers"):
        FastModel.from_pretrained("~/model", max_seq_length=4096)


def test_folder_without_config_is_file_not_found(sandbox, nothing_loaded):
    folder = sandbox / "weights-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    before = _tree(sandbox)
    with pytest.raises(FileNotFoundError, match=r"fastft.from_pretrained: .*weights-only has no config.json") as raised:
        FastModel.from_pretrained(str(folder))
    assert "model.save_pretrained(folder)" in str(raised.value)
    assert _tree(sandbox) == before


def test_hub_id_offline_is_a_hub_fetch_error(sandbox, offline, nothing_loaded):
    before = _tree(sandbox)
    with pytest.raises(HubFetchError) as raised:
        FastModel.from_pretrained("fastft-tests/no-such-model")
    error = raised.value
    assert isinstance(error, OSError) and isinstance(error.__cause__, OSError)
    assert error.repo_id == "fastft-tests/no-such-model"
    message = str(error)
    assert message.startswith("fastft.from_pretrained: model_name='fastft-tests/no-such-model'")
    assert "could not be fetched" in message and "offline mode is on" in message
    fixes = ("unset HF_HUB_OFFLINE", "hf download fastft-tests/no-such-model", "pass the folder", "local_files_only")
    assert all(fix in message for fix in fixes), message
    assert _tree(sandbox) == before


def test_adapter_whose_base_folder_is_gone(sandbox, nothing_loaded):
    adapter = sandbox / "adapter"
    adapter.mkdir()
    gone = sandbox / "gone" / "base"
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(gone), "r": 8, "lora_alpha": 16})
    )
    before = _tree(sandbox)
    with pytest.raises(FileNotFoundError) as raised:
        FastModel.from_pretrained(str(adapter))
    message = str(raised.value)
    assert message.startswith(f"fastft.from_pretrained: the adapter {adapter} ")
    assert f"base_model_name_or_path={str(gone)!r}" in message and "does not exist" in message
    assert f"FastModel.load_adapter(model, {str(adapter)!r})" in message
    assert f"set base_model_name_or_path in {adapter / 'adapter_config.json'}" in message
    assert _tree(sandbox) == before


def test_adapter_whose_base_hub_id_cannot_be_fetched(sandbox, offline, nothing_loaded):
    adapter = sandbox / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": "fastft-tests/no-such-base"})
    )
    with pytest.raises(HubFetchError) as raised:
        FastModel.from_pretrained(str(adapter))
    message = str(raised.value)
    assert f"the adapter {adapter} was trained on base_model_name_or_path='fastft-tests/no-such-base'" in message
    assert "FastModel.load_adapter" in message and "offline mode is on" in message
    assert isinstance(raised.value.__cause__, HubFetchError)


# --- from_pretrained: arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp8", "float64", torch.float64, torch.float8_e4m3fn, "int4"])
def test_unknown_dtype_names_the_accepted_ones(tiny_llama_dir, nothing_loaded, dtype):
    with pytest.raises(ValueError) as raised:
        FastModel.from_pretrained(str(tiny_llama_dir), dtype=dtype)
    message = str(raised.value)
    assert message.startswith(f"fastft.from_pretrained: dtype={dtype!r} is not one of ")
    assert "'bf16'" in message and "'fp16'" in message and "'fp32'" in message and "dtype=None" in message
    if "64" in str(dtype):
        assert "32 bits at most" in message
    if "8" in str(dtype):
        assert "load_in_4bit=True" in message


def test_max_seq_length_past_the_position_range(tiny_llama_dir, nothing_loaded):
    # tiny_llama_config: max_position_embeddings=512.
    with pytest.raises(ValueError) as raised:
        FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=4096)
    message = str(raised.value)
    assert message.startswith("fastft.from_pretrained: max_seq_length=4096 is past the positions ")
    assert "max_position_embeddings=512" in message
    assert "max_seq_length=512 or less" in message and "min(2048, 512)" in message and "rope scaling" in message


def test_max_seq_length_defaults_to_the_position_range_when_shorter(tiny_llama_dir):
    model, tokenizer = FastModel.from_pretrained(str(tiny_llama_dir))
    assert model.max_seq_length == tokenizer.model_max_length == 512
    model, tokenizer = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=512)
    assert model.max_seq_length == 512


def test_position_range_follows_stretching_rope_scalings():
    plain = LlamaConfig(max_position_embeddings=4096)
    assert position_range(plain) == 4096
    linear = LlamaConfig(max_position_embeddings=4096, rope_parameters={"rope_type": "linear", "factor": 4.0})
    assert position_range(linear) == 16384
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert position_range(LlamaConfig(max_position_embeddings=32768, rope_parameters=yarn)) == 131072
    # Llama 3.1's "llama3" scaling already states its range in max_position_embeddings.
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert position_range(LlamaConfig(max_position_embeddings=131072, rope_parameters=llama3)) == 131072


# --- from_pretrained: the tokenizer -------------------------------------------------------------------------------


def test_model_folder_without_tokenizer_names_both_ways_out(bare_model_dir, nothing_loaded):
    before = _tree(bare_model_dir)
    with pytest.raises(ValueError) as raised:
        FastModel.from_pretrained(str(bare_model_dir))
    message = str(raised.value)
    assert message.startswith(f"fastft.from_pretrained: the model folder {bare_model_dir} holds no tokenizer")
    assert "tokenizer.json" in message and "tokenizer_config.json" in message
    assert "tokenizer_name=" in message and f"tokenizer.save_pretrained({str(bare_model_dir)!r})" in message
    assert _tree(bare_model_dir) == before


def test_tokenizer_name_that_does_not_exist_or_holds_no_tokenizer(bare_model_dir, sandbox, nothing_loaded):
    with pytest.raises(FileNotFoundError, match=r"fastft.from_pretrained: tokenizer_name='./no/tokenizer' is a local"):
        FastModel.from_pretrained(str(bare_model_dir), tokenizer_name="./no/tokenizer")
    with pytest.raises(ValueError, match=r"tokenizer_name=.*is a folder with no tokenizer.*tokenizer.save_pretrained"):
        FastModel.from_pretrained(str(bare_model_dir), tokenizer_name=str(bare_model_dir))


def test_tokenizer_name_loads_the_tokenizer_from_another_folder(bare_model_dir, tiny_llama_dir, smol_tokenizer):
    model, tokenizer = FastModel.from_pretrained(str(bare_model_dir), max_seq_length=64, tokenizer_name=tiny_llama_dir)
    assert tokenizer.name_or_path == str(tiny_llama_dir)
    assert tokenizer.get_vocab() == smol_tokenizer.get_vocab() and tokenizer.model_max_length == 64
    assert model.config._name_or_path == str(bare_model_dir)


def test_adapter_over_a_bare_base_uses_the_tokenizer_saved_beside_it(bare_model_dir, tiny_llama_dir, tmp_path):
    model, tokenizer = FastModel.from_pretrained(str(bare_model_dir), max_seq_length=64, tokenizer_name=tiny_llama_dir)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)  # what `fastft train` writes
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(bare_model_dir)
    loaded, loaded_tokenizer = FastModel.from_pretrained(str(adapter), max_seq_length=64)
    assert isinstance(loaded, PeftModel) and loaded_tokenizer.name_or_path == str(adapter)
    # An explicit tokenizer_name is passed on to the base's load.
    _, chosen = FastModel.from_pretrained(str(adapter), max_seq_length=64, tokenizer_name=str(tiny_llama_dir))
    assert chosen.name_or_path == str(tiny_llama_dir)


# --- get_peft_model -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names", "fix"),
    [
        ({"r": 0}, "r must be a positive int, got 0", "use r=8 or r=16"),
        ({"r": 8, "lora_alpha": -16}, "lora_alpha must be a positive number, got -16", "lora_alpha=r"),
        ({"lora_dropout": 1.0}, "lora_dropout must be in [0, 1), got 1.0", "use 0.0"),
        ({"target_modules": ["q_prj"]}, "target_modules ['q_prj'] are not linear layers", "did you mean 'q_proj'?"),
        ({"target_modules": []}, "target_modules is empty", "target_modules=None"),
    ],
)
def test_get_peft_model_refuses_bad_lora_settings_and_leaves_the_model_alone(base_model, kwargs, names, fix):
    state = {name: (p.requires_grad, p.data_ptr()) for name, p in base_model.named_parameters()}
    modules = [name for name, _ in base_model.named_modules()]
    with pytest.raises(ValueError) as raised:
        FastModel.get_peft_model(base_model, use_gradient_checkpointing=False, **kwargs)
    message = str(raised.value)
    assert message.startswith("fastft.get_peft_model: ")
    assert names in message and fix in message
    if "target_modules" in kwargs:
        for name in DEFAULT_TARGET_MODULES:
            assert repr(name) in message
    assert not isinstance(base_model, PeftModel)
    assert [name for name, _ in base_model.named_modules()] == modules
    assert {name: (p.requires_grad, p.data_ptr()) for name, p in base_model.named_parameters()} == state


def test_target_modules_as_one_name(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    peft_model = FastModel.get_peft_model(model, r=4, target_modules="q_proj", use_gradient_checkpointing=False)
    assert set(peft_model.peft_config["default"].target_modules) == {"q_proj"}


# --- fastft train ---------------------------------------------------------------------------------------------------


def test_train_data_without_known_columns_is_refused_before_the_model(tmp_path, monkeypatch):
    from fastft.training.data import DataError
    from fastft.training.train import TrainOptions, run

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded although the data was bad")

    monkeypatch.setattr(FastModel, "from_pretrained", refuse)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "2 + 2?", "reply": "4"}) + "\n")
    output = tmp_path / "out"
    with pytest.raises(DataError) as raised:
        run(TrainOptions(output=str(output), data=str(data), model=str(tmp_path / "no-model")))
    message = str(raised.value)
    assert message.startswith(f"fastft train: {data} has the columns ['question', 'reply']; --method sft needs ")
    assert "'messages' (chat turns), 'text', 'prompt' + 'completion'" in message
    assert "Rename the file's columns" in message and "--method" in message
    assert not output.exists()


def test_train_with_a_missing_model_leaves_no_output_folder(sandbox, nothing_loaded):
    from fastft.training.train import TrainOptions, run

    output = sandbox / "out"
    with pytest.raises(FileNotFoundError, match="--model .* does not exist"):
        run(TrainOptions(output=str(output), model=str(sandbox / "no-model")))
    assert not output.exists()


# --- save_merged, save_gguf and fastft export ----------------------------------------------------------------------


@pytest.fixture
def nothing_written(monkeypatch):
    """Fail the test if a merged shard or a GGUF tensor is written."""
    import fastft.export.gguf_export
    import fastft.export.merged_save

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was written although the input was bad")

    monkeypatch.setattr(fastft.export.merged_save, "write_shard", refuse)
    monkeypatch.setattr(fastft.export.gguf_export, "_store", refuse)


@pytest.mark.parametrize(
    ("kwargs", "error", "names", "fix"),
    [
        ({}, FileExistsError, "is not empty", "overwrite=True"),
        ({"max_shard_size": "5 gigs"}, ValueError, "max_shard_size='5 gigs'", "'5GB', '500MB'"),
        ({"max_shard_size": 0}, ValueError, "max_shard_size=0", "'5GB'"),
        ({"dtype": torch.int8}, ValueError, "dtype=torch.int8", "torch.bfloat16 or torch.float32"),
        ({"dtype": "fp8"}, ValueError, "dtype='fp8'", "torch.float16 (the default)"),
    ],
    ids=["non-empty-folder", "shard-size-words", "shard-size-zero", "dtype-int8", "dtype-name"],
)
def test_save_merged_refuses_before_writing(base_model, tmp_path, nothing_written, kwargs, error, names, fix):
    target = tmp_path / "merged"
    target.mkdir()
    (target / "keep.txt").write_text("an earlier run")
    before = _tree(tmp_path)
    with pytest.raises(error) as raised:
        FastModel.save_merged(base_model, None, target, **kwargs)
    message = str(raised.value)
    assert message.startswith("fastft.save_merged: ")
    assert names in message and fix in message
    assert _tree(tmp_path) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["merged"]


def test_save_gguf_refuses_a_quantization_it_does_not_write(base_model, smol_tokenizer, tmp_path, nothing_written):
    with pytest.raises(ValueError) as raised:
        FastModel.save_gguf(base_model, smol_tokenizer, tmp_path / "model.gguf", quantization="q4_k")
    message = str(raised.value)
    assert message.startswith("fastft.save_gguf: quantization='q4_k'")
    assert all(name in message for name in ("'f16'", "'bf16'", "'f32'", "'q8_0'"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("setup", "outputs", "expected"),
    [
        ("missing", ["--merged", "{merged}"], "does not exist"),
        ("no-config", ["--merged", "{merged}"], "has no adapter_config.json"),
        ("non-empty-merged", ["--merged", "{merged}"], "pass --overwrite to replace it"),
        ("adapter", ["--merged", "{merged}", "--max-shard-size", "lots"], "--max-shard-size 'lots' is not"),
        ("adapter", [], "nothing to write; pass --merged DIR, --gguf FILE, or both"),
        ("adapter", ["--gguf", "{adapter}/model.gguf"], "would go into the adapter folder"),
        ("adapter", ["--gguf", "{adapter}"], "e.g. --gguf run-gguf/model.gguf"),
    ],
    ids=[
        "missing",
        "no-adapter-config",
        "non-empty-merged",
        "bad-shard-size",
        "no-output",
        "gguf-in-adapter",
        "gguf-adapter-dir",
    ],
)
def test_fastft_export_refuses_before_loading(sandbox, nothing_loaded, capsys, setup, outputs, expected):
    from fastft.cli import main

    adapter, merged = sandbox / "run", sandbox / "merged"
    if setup != "missing":
        adapter.mkdir()
    if setup in ("adapter", "non-empty-merged"):
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(sandbox / "base")}))
    if setup == "non-empty-merged":
        merged.mkdir()
        (merged / "config.json").write_text("{}")
    before = _tree(sandbox)
    code = main(["export", "--adapter", str(adapter), *(arg.format(merged=merged, adapter=adapter) for arg in outputs)])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith("error: fastft export") and expected in error
    if setup in ("missing", "no-config"):
        assert f"--adapter {adapter}" in error and "fastft train --output" in error
    assert _tree(sandbox) == before
