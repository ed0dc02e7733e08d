"""`fastft train --method dpo | kto | grpo` without a model: column checks, KTO unpairing, the GRPO answer reward,
the trl config builders. The runs themselves are in tests/test_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from fastft.demo import demo_path, preferences_path
from fastft.training.data import (
    DataError,
    check_columns,
    contains_answer,
    load_rows,
    to_dpo_rows,
    to_grpo_rows,
    to_kto_rows,
    unpair_preferences,
)
from fastft.training.train import OptionsError, TrainOptions, _config, _watched
from fastft.training.trl import answer_reward, dpo_config, grpo_config, kto_config, sft_config


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("method", "needs"),
    [
        ("dpo", "'prompt', 'chosen', 'rejected'"),
        ("kto", "'prompt', 'completion', 'label'"),
        ("grpo", "'prompt' and the answer its reward checks, 'answer' (or 'solution')"),
        ("sft", "'messages' (chat turns)"),
    ],
)
def test_wrong_columns_name_the_file_the_columns_found_and_needed(tmp_path, method, needs):
    path = _jsonl(tmp_path / "mine.jsonl", [{"question": "2 + 2?", "reply": "4"}])
    with pytest.raises(DataError) as raised:
        load_rows(str(path), method)
    message = str(raised.value)
    assert str(path) in message
    assert "['question', 'reply']" in message
    assert f"--method {method} needs {needs}" in message
    assert isinstance(raised.value, ValueError)


def test_each_method_accepts_its_columns_and_defaults_to_its_demo_file(tmp_path):
    paired = _jsonl(tmp_path / "paired.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    implicit = _jsonl(
        tmp_path / "implicit.jsonl",
        [
            {
                "chosen": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "b"}],
            }
        ],
    )
    unpaired = _jsonl(tmp_path / "unpaired.jsonl", [{"prompt": "p", "completion": "a", "label": True}])
    solution = _jsonl(tmp_path / "solution.jsonl", [{"prompt": "p", "solution": "4"}])
    for method, path in [
        ("dpo", paired),
        ("dpo", implicit),
        ("kto", paired),
        ("kto", unpaired),
        ("grpo", solution),
    ]:
        assert len(load_rows(str(path), method)) == 1, (method, path)
    with pytest.raises(DataError, match="--method grpo needs"):
        load_rows(str(unpaired), "grpo")
    with pytest.raises(DataError, match="--method dpo needs"):
        load_rows(str(unpaired), "dpo")
    # Without --data: the instructions for SFT, the preference split for the others.
    assert load_rows(None, "sft").column_names == ["instruction", "response"]
    assert load_rows(None).column_names == ["instruction", "response"]
    assert demo_path() != preferences_path()
    for method in ("dpo", "kto", "grpo"):
        assert set(load_rows(None, method).column_names) == {"prompt", "chosen", "rejected", "answer"}


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        check_columns(Dataset.from_dict({"prompt": ["p"]}), "ppo", "x.jsonl")


def test_dpo_rows_keep_the_three_columns_and_split_an_implicit_prompt():
    rows = load_rows(None, "dpo")
    shaped = to_dpo_rows(rows)
    assert shaped.column_names == ["prompt", "chosen", "rejected"]
    assert shaped[0] == {key: rows[0][key] for key in ("prompt", "chosen", "rejected")}
    implicit = Dataset.from_list(
        [
            {
                "chosen": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
                "rejected": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "5"}],
            }
        ]
    )
    row = to_dpo_rows(implicit)[0]
    assert row["prompt"] == [{"role": "user", "content": "2 + 2?"}]
    assert row["chosen"] == [{"role": "assistant", "content": "4"}]
    assert row["rejected"] == [{"role": "assistant", "content": "5"}]


def test_kto_unpairs_paired_rows_alternating_labels_with_mismatched_neighbours():
    n = 7
    paired = Dataset.from_dict(
        {
            "prompt": [f"p{i}" for i in range(n)],
            "chosen": [f"good{i}" for i in range(n)],
            "rejected": [f"bad{i}" for i in range(n)],
            "answer": [str(i) for i in range(n)],
        }
    )
    rows = to_kto_rows(paired)
    assert rows.column_names == ["prompt", "completion", "label"]
    assert len(rows) == 2 * n
    # Every chosen completion once as desirable, every rejected once as undesirable, each with its own prompt.
    assert sorted((r["prompt"], r["completion"]) for r in rows if r["label"]) == sorted(
        (f"p{i}", f"good{i}") for i in range(n)
    )
    assert sorted((r["prompt"], r["completion"]) for r in rows if not r["label"]) == sorted(
        (f"p{i}", f"bad{i}") for i in range(n)
    )
    # Labels alternate (a short run, which KTO reads in order, sees both kinds), and neighbours never share a
    # prompt (KTO's KL term scores each prompt with its neighbour's completion).
    assert rows["label"] == [True, False] * n
    assert all(a != b for a, b in zip(rows["prompt"], rows["prompt"][1:], strict=False))


def test_kto_unpairs_the_demo_split_and_an_implicit_prompt():
    rows = unpair_preferences(load_rows(None, "kto"))
    assert len(rows) == 2 * len(load_rows(None, "kto"))
    assert rows["label"][:4] == [True, False, True, False]
    first = rows[0]
    assert first["prompt"][0]["role"] == "user" and first["completion"][0]["role"] == "assistant"
    implicit = Dataset.from_list(
        [
            {
                "chosen": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
                "rejected": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"x{i}"}],
            }
            for i in range(2)
        ]
    )
    rows = to_kto_rows(implicit)
    assert rows[0] == {
        "prompt": [{"role": "user", "content": "q0"}],
        "completion": [{"role": "assistant", "content": "a0"}],
        "label": True,
    }
    assert rows[1]["prompt"] == [{"role": "user", "content": "q1"}] and rows[1]["label"] is False


def test_kto_unpaired_rows_pass_with_boolean_labels():
    rows = to_kto_rows(
        Dataset.from_dict({"prompt": ["a", "b"], "completion": ["x", "y"], "label": [1, 0], "n": [1, 2]})
    )
    assert rows.column_names == ["prompt", "completion", "label"]
    assert rows["label"] == [True, False]
    with pytest.raises(DataError, match="found 'yes'"):
        to_kto_rows(Dataset.from_dict({"prompt": ["a"], "completion": ["x"], "label": ["yes"]}))


def test_grpo_rows_are_prompt_and_answer():
    rows = to_grpo_rows(Dataset.from_dict({"prompt": ["2 + 2?"], "solution": ["4"], "other": [0]}))
    assert rows.column_names == ["prompt", "answer"] and rows[0] == {"prompt": "2 + 2?", "answer": "4"}
    demo = to_grpo_rows(load_rows(None, "grpo"))
    assert demo.column_names == ["prompt", "answer"]


def test_answer_reward():
    completions = [
        "37 + 15 = 52.",
        "It is   52",
        "The answer is 152.",
        "52.5",
        "I don't know.",
        [{"role": "assistant", "content": "The day after Monday is TUESDAY."}],
        [{"role": "assistant", "content": "The day after Monday is Wednesday."}],
        "The word 'apple' reversed is 'elppa'.",
    ]
    answers = ["52", "52", "52", "52", "52", "Tuesday", "Tuesday", "elppa"]
    assert answer_reward(completions, answers, trainer_state=None) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert answer_reward(["12 apples"], [12]) == [1.0]  # a number read from JSON
    assert contains_answer("new  York", "New York")
    assert not contains_answer("apples", "apple")
    assert not contains_answer("anything", "  ")


def test_config_builders_share_fastfts_settings(tmp_path):
    out = str(tmp_path)
    configs = {
        "sft": sft_config(out, torch.float32, 96),
        "dpo": dpo_config(out, torch.float32, 96, beta=0.25),
        "kto": kto_config(out, "float32", 96),
        "grpo": grpo_config(out, None, max_completion_length=24, num_generations=2, per_device_train_batch_size=4),
    }
    for method, config in configs.items():
        assert config.use_cpu is True and config.bf16 is False and config.fp16 is False, method
        assert config.logging_steps == 1 and config.report_to in ("none", [], ["none"]), method
        assert config.save_total_limit == 2 and config.disable_tqdm is False, method
        # fastft's own checkpointing mode stays in charge; trl's default (on) is turned off.
        assert getattr(config, "activation_checkpointing", getattr(config, "gradient_checkpointing", None)) is False
    for method in ("sft", "dpo", "kto"):
        assert configs[method].max_length == 96
    assert configs["dpo"].beta == 0.25 and configs["kto"].beta == 0.1
    grpo = configs["grpo"]
    assert grpo.max_completion_length == 24 and grpo.num_generations == 2 and grpo.use_vllm is False
    assert not hasattr(grpo, "max_length")  # a default the config has no field for is left out
    assert dpo_config(out, "bfloat16", 64, learning_rate=1e-5).bf16 is True
    with pytest.raises(TypeError):
        dpo_config(out, None, 64, no_such_field=1)  # an override is never dropped


def test_grpo_settings_trl_refuses_are_an_options_error_before_loading(tmp_path):
    options = TrainOptions(output=str(tmp_path / "o"), method="grpo", batch_size=3, num_generations=2)
    with pytest.raises(OptionsError, match=r"--method grpo: .*divisible by num_generations"):
        _config(options, tmp_path / "o", torch.float32)
    assert not (tmp_path / "o").exists()


def test_watched_compares_the_first_and_last_fifth():
    history = [{"step": i, "loss": 1.0, "rewards/margins": float(i)} for i in range(1, 11)]
    watched = _watched("dpo", history)
    assert watched == {
        "metric": "rewards/margins",
        "first": 1.0,
        "last": 10.0,
        "head_mean": 1.5,
        "tail_mean": 9.5,
        "rose": True,
    }
    assert _watched("grpo", [{"step": 1, "loss": 0.0, "reward": 0.5}])["rose"] is False
    assert _watched("sft", history) is None
