"""`fastft train`'s bad input: one `error:` line naming the flag, exit 2, before any weight loads or folder appears.

Each test runs the command in-process with the loader replaced by one that fails the test, so a check that came
after loading would show up as that failure rather than pass by luck.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastft import cli
from fastft.model import FastModel


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(FastModel, "from_pretrained", staticmethod(refuse))


def _train(tmp_path: Path, capsys, *flags: str) -> tuple[int, str]:
    code = cli.main(["train", "--output", str(tmp_path / "out"), *flags])
    return code, capsys.readouterr().err


def _refused(tmp_path: Path, capsys, *flags: str) -> str:
    code, err = _train(tmp_path, capsys, *flags)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists(), "a refused run leaves no output folder behind"
    return lines[0]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_folder_with_only_config_is_missing_its_weights(tmp_path, capsys, no_loading, tiny_llama_dir):
    folder = tmp_path / "cfgonly"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    line = _refused(tmp_path, capsys, "--model", str(folder))
    assert f"--model {folder} has config.json but no weights" in line
    assert "model.safetensors" in line and "tokenizer" not in line


def test_config_and_tokenizer_without_weights_names_the_weights(tmp_path, capsys, no_loading, tiny_llama_dir):
    folder = tmp_path / "cfgtok"
    folder.mkdir()
    for child in tiny_llama_dir.iterdir():
        if not child.name.endswith(".safetensors"):
            (folder / child.name).write_bytes(child.read_bytes())
    line = _refused(tmp_path, capsys, "--model", str(folder))
    assert f"--model {folder} has config.json but no weights" in line


def test_a_folder_without_config_is_not_a_model(tmp_path, capsys, no_loading):
    folder = tmp_path / "empty"
    folder.mkdir()
    assert f"--model {folder} has no config.json" in _refused(tmp_path, capsys, "--model", str(folder))


def test_a_missing_model_path_is_named(tmp_path, capsys, no_loading):
    line = _refused(tmp_path, capsys, "--model", str(tmp_path / "nowhere"))
    assert f"--model {tmp_path / 'nowhere'} does not exist" in line


def _weights_only(tmp_path, tiny_llama_dir):
    """A model folder with config and weights but no tokenizer files."""
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tiny_llama_dir / name).read_bytes())
    return folder


def test_a_missing_tokenizer_names_the_tokenizer_flag(tmp_path, capsys, no_loading, tiny_llama_dir):
    folder = _weights_only(tmp_path, tiny_llama_dir)
    line = _refused(tmp_path, capsys, "--model", str(folder))
    assert f"--model {folder} has no tokenizer files" in line and "pass --tokenizer" in line
    # --tokenizer pointing at a folder without one is refused too, by its own name.
    line = _refused(tmp_path, capsys, "--model", str(folder), "--tokenizer", str(tmp_path))
    assert f"--tokenizer {tmp_path} holds no tokenizer files" in line


def test_tokenizer_flag_is_passed_to_the_loader(tmp_path, capsys, monkeypatch, tiny_llama_dir):
    folder = _weights_only(tmp_path, tiny_llama_dir)
    seen = {}

    def record(model_name, **kwargs):
        seen.update(kwargs, model_name=model_name)
        raise FileNotFoundError("stop after the call")

    monkeypatch.setattr(FastModel, "from_pretrained", staticmethod(record))
    code, err = _train(tmp_path, capsys, "--model", str(folder), "--tokenizer", str(tiny_llama_dir))
    assert code == 2 and "stop after the call" in err
    assert seen["model_name"] == str(folder) and seen["tokenizer_name"] == str(tiny_llama_dir)


def test_data_that_is_not_json_lines_names_the_line(tmp_path, capsys, no_loading):
    data = tmp_path / "notjson.jsonl"
    data.write_text('{"text": "fine"}\n\n{"text": "also fine"}\nthis is not json\n')
    line = _refused(tmp_path, capsys, "--data", str(data))
    assert f"--data {data} line 4 is not JSON (Expecting value at column 1)" in line


def test_a_row_missing_the_text_field_is_named(tmp_path, capsys, no_loading):
    data = _jsonl(tmp_path / "rows.jsonl", [{"text": "a"}, {"text": "b"}, {"body": "c"}, {"text": "d"}])
    line = _refused(tmp_path, capsys, "--data", str(data))
    assert f'--data {data} row 3 (line 3) has no "text"' in line and "--method sft" in line


def test_a_preference_row_missing_rejected_is_named(tmp_path, capsys, no_loading):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "c"}]
    data = _jsonl(tmp_path / "pairs.jsonl", rows)
    line = _refused(tmp_path, capsys, "--method", "dpo", "--data", str(data))
    assert 'row 2 (line 2) has no "rejected"' in line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--seq-len", "0"], "--seq-len is tokens per example and must be at least 1; got 0"),
        (["--r", "-1"], "--r is the LoRA rank and must be at least 1; got -1"),
        (["--lora-alpha", "0"], "--lora-alpha is the LoRA scale numerator and must be at least 1; got 0"),
        (["--batch-size", "0"], "--batch-size is examples per step and must be at least 1; got 0"),
        (["--grad-accum", "0"], "--grad-accum is batches per optimizer step and must be at least 1; got 0"),
        (["--save-steps", "0"], "--save-steps is steps between checkpoints and must be at least 1; got 0"),
        (["--warmup-steps", "-3"], "--warmup-steps is warm-up steps and must be at least 0; got -3"),
        (["--lr", "0"], "--lr must be a positive number; got 0.0"),
        (["--lr", "nan"], "--lr must be a positive number; got nan"),
        (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1); got 1.0"),
        (["--max-steps", "0", "--epochs", "0"], "--epochs, which must be positive; got 0.0"),
        (["--method", "dpo", "--beta", "0"], "--beta must be a positive number; got 0.0"),
        (["--method", "grpo", "--num-generations", "1"], "--num-generations is completions per prompt"),
        (["--seed", "-1"], "--seed is the random seed and must be at least 0; got -1"),
    ],
)
def test_numbers_out_of_range_name_the_flag(tmp_path, capsys, no_loading, flags, expected):
    line = _refused(tmp_path, capsys, *flags)
    assert expected in line and "Pass" in line


def test_seq_len_past_the_model_range_names_the_flag(tmp_path, capsys, no_loading, tiny_llama_dir):
    limit = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    line = _refused(tmp_path, capsys, "--model", str(tiny_llama_dir), "--seq-len", str(limit + 1))
    assert f"--seq-len {limit + 1} is past the {limit} positions" in line
    assert "max_seq_length" not in line


def test_output_that_is_a_file_is_refused(tmp_path, capsys, no_loading):
    (tmp_path / "out").write_text("not a folder")
    code, err = _train(tmp_path, capsys)
    assert code == 2 and f"error: fastft train: --output {tmp_path / 'out'} is a file" in err


def test_a_failure_after_loading_removes_the_folder_it_created(tmp_path, capsys, monkeypatch):
    # A loaded text model as far as the job reads one before adding the adapter: its config's model_type.
    loaded = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
    monkeypatch.setattr(FastModel, "from_pretrained", staticmethod(lambda *a, **k: (loaded, object())))

    def fail(*args, **kwargs):
        raise FileNotFoundError("the adapter could not be added")

    monkeypatch.setattr(FastModel, "get_peft_model", staticmethod(fail))
    code, err = _train(tmp_path, capsys)
    assert code == 2 and "the adapter could not be added" in err
    assert not (tmp_path / "out").exists()


def test_resume_of_a_finished_run_trains_nothing(tmp_path, capsys, no_loading):
    output = tmp_path / "out"
    (output / "checkpoint-5").mkdir(parents=True)
    (output / "checkpoint-5" / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    (output / "metrics.json").write_text(json.dumps({"completed": True, "global_step": 5, "max_steps": 5}))
    code = cli.main(["train", "--output", str(output), "--max-steps", "5", "--resume"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "already finished its 5 steps; nothing trained" in captured.out
    assert sorted(path.name for path in output.iterdir()) == ["checkpoint-5", "metrics.json"]


def test_data_of_an_unknown_type_names_the_flag(tmp_path, capsys, no_loading):
    data = tmp_path / "rows.xlsx"
    data.write_text("a table")
    line = _refused(tmp_path, capsys, "--data", str(data))
    assert f"--data {data} has the suffix '.xlsx'" in line and "'.jsonl'" in line


def test_a_csv_row_missing_its_text_is_named(tmp_path, capsys, no_loading):
    data = tmp_path / "rows.csv"
    data.write_text("text,source\nfirst,a\n,b\n")
    line = _refused(tmp_path, capsys, "--data", str(data))
    assert f'--data {data} row 2 has no "text"' in line


def test_doctor_output_without_compile_is_refused(tmp_path, capsys):
    code = cli.main(["doctor", "--output", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert code == 2 and "error: fastft doctor: --output" in err and "add --compile" in err
    assert not (tmp_path / "c.json").exists()


def test_a_seq_len_that_leaves_no_example_is_named(tmp_path, capsys, tiny_llama_dir):
    # Found only once the tokenizer has cut the examples, so the model has loaded; the folder is still removed.
    data = _jsonl(tmp_path / "qa.jsonl", [{"instruction": "Say something long. " * 20, "response": "ok"}] * 2)
    line = _refused(tmp_path, capsys, "--model", str(tiny_llama_dir), "--data", str(data), "--seq-len", "8")
    assert "none of the 2 examples" in line and "at --seq-len 8" in line and "pass a larger --seq-len" in line
