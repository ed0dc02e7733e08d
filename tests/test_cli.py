"""The `fastft` command: doctor, and a training run that is killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FASTFT = [sys.executable, "-m", "fastft.cli"]


def _env(reference_kernels: bool = True) -> dict[str, str]:
    # One torch thread comes from tests/conftest.py (OMP_NUM_THREADS=1 for the session and what it starts).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if reference_kernels:
        # Training through Triton's interpreter would take minutes a step; the kernels are checked elsewhere.
        env["FASTFT_DISABLE_TRITON"] = "1"
    else:
        env.pop("FASTFT_DISABLE_TRITON", None)
    return env


def _run(args: list[str], tmp_path: Path, reference_kernels: bool = True, **kwargs) -> subprocess.CompletedProcess:
    # Run outside the checkout: `python -m` puts the working directory on sys.path, and the repository's
    # kernels/ folder would then pose as the PyPI package `kernels` that bitsandbytes and transformers import.
    env = _env(reference_kernels)
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, **kwargs)


def test_doctor_reports_versions_device_and_patches(tmp_path):
    result = _run([*FASTFT, "doctor"], tmp_path, reference_kernels=False, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for name in ("python", "torch", "triton", "transformers", "peft", "trl", "bitsandbytes"):
        assert f"  {name} " in out, name
    assert "device        cpu" in out
    # the suite runs with TRITON_INTERPRET=1 (conftest), which the doctor must report as the kernels' path
    assert "kernels       triton interpreter" in out
    assert "patch report" in out
    for name in ("llama.rms_norm", "llama.attention", "llama.mlp"):
        assert f"  {name} " in out and "transformers >=" in out, name


def test_version_flag(tmp_path):
    from fastft import __version__

    result = _run([*FASTFT, "--version"], tmp_path, timeout=120)
    assert result.stdout.strip() == f"fastft {__version__}"
    # --version and every --help are built without the training libraries, whose import takes 13 s here.
    probe = (
        "import sys\nfrom fastft.cli import main\n"
        "for argv in (['--version'], ['train', '--help'], ['export', '--help'], ['bench', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('loaded:', sorted(m for m in ('transformers', 'peft', 'trl', 'datasets') if m in sys.modules))"
    )
    result = _run([sys.executable, "-c", probe], tmp_path, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("loaded: []"), result.stdout + result.stderr


def _wait_for_complete_checkpoint(output: Path, process: subprocess.Popen, timeout: float = 600) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = sorted(output.glob("checkpoint-*/trainer_state.json"))
        if done:
            return done[0].parent
        if process.poll() is not None:
            pytest.fail(f"training ended (rc {process.returncode}) before the first checkpoint")
        time.sleep(0.02)
    pytest.fail("no checkpoint appeared in time")


def _train_command(model_dir: Path, output: Path, steps: int) -> list[str]:
    return [
        *FASTFT,
        "train",
        "--model",
        str(model_dir),
        "--output",
        str(output),
        "--max-steps",
        str(steps),
        "--save-steps",
        "3",
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--lr",
        "3e-2",
        "--warmup-steps",
        "0",
    ]


def test_train_killed_and_resumed_logs_every_step_once(tiny_llama_dir, tmp_path):
    output = tmp_path / "run"
    steps = 30
    command = _train_command(tiny_llama_dir, output, steps)
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), cwd=tmp_path)
    checkpoint = _wait_for_complete_checkpoint(output, first)
    first.send_signal(signal.SIGKILL)
    first_log = first.communicate(timeout=60)[0].decode(errors="replace")
    assert first.returncode == -signal.SIGKILL, "the first run must be killed mid-way, not finish"
    assert not (output / "metrics.json").exists()
    assert "it/s" in first_log or "s/it" in first_log, "training shows a progress bar"

    # Without --resume the run refuses to overwrite the checkpoints it would lose.
    refused = _run(command, tmp_path, timeout=600)
    assert refused.returncode != 0 and "--resume" in refused.stderr

    resumed = _run([*command, "--resume"], tmp_path, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["completed"] is True
    assert metrics["resumed_from"] is not None
    assert int(metrics["resumed_from"].split("-")[1]) >= int(checkpoint.name.split("-")[1])
    assert [row["step"] for row in metrics["steps"]] == list(range(1, steps + 1))
    assert metrics["loss_fell"] is True
    assert (output / "adapter_model.safetensors").exists()
    assert (output / "adapter_config.json").exists()
    assert (output / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_sigterm_saves_a_checkpoint_then_resume_finishes(tiny_llama_dir, tmp_path):
    output = tmp_path / "run"
    steps = 30
    command = _train_command(tiny_llama_dir, output, steps)
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), cwd=tmp_path)
    _wait_for_complete_checkpoint(output, first)
    first.send_signal(signal.SIGTERM)
    log = first.communicate(timeout=300)[0].decode(errors="replace")
    assert first.returncode == 130, log[-3000:]
    stopped = json.loads((output / "metrics.json").read_text())
    assert stopped["completed"] is False and stopped["global_step"] < steps
    # The stop saved the step it ended on, so nothing finished is redone.
    assert (output / f"checkpoint-{stopped['global_step']}" / "trainer_state.json").exists()
    assert "--resume" in log

    resumed = _run([*command, "--resume"], tmp_path, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["resumed_from"] == f"checkpoint-{stopped['global_step']}"
    assert [row["step"] for row in metrics["steps"]] == list(range(1, steps + 1))
    assert metrics["global_step"] == metrics["max_steps"] == steps
    # The checkpoints end at --max-steps (save_total_limit keeps the newest two), none past it.
    numbers = sorted(int(path.name.split("-")[1]) for path in output.glob("checkpoint-*"))
    assert numbers[-1] == steps and len(numbers) == 2, numbers

    # Resuming the finished run again trains nothing.
    again = _run([*command, "--resume"], tmp_path, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"already finished its {steps} steps; nothing trained" in again.stdout
    assert sorted(int(path.name.split("-")[1]) for path in output.glob("checkpoint-*")) == numbers


def test_train_bad_data_path_is_named(tiny_llama_dir, tmp_path):
    command = [
        *FASTFT,
        "train",
        "--model",
        str(tiny_llama_dir),
        "--output",
        str(tmp_path / "o"),
        "--data",
        "nope.jsonl",
    ]
    result = _run(command, tmp_path, timeout=600)
    assert result.returncode != 0
    assert "nope.jsonl does not exist" in result.stderr
    assert not (tmp_path / "o").exists(), "a refused run leaves no output folder behind"


def test_train_bad_columns_are_named_before_the_model_loads(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"question": "2 + 2?", "good": "4", "bad": "5"}) + "\n")
    # A model that does not exist: the data check must refuse the run before anything tries to load it.
    command = [
        *FASTFT,
        "train",
        "--method",
        "dpo",
        "--model",
        str(tmp_path / "no-model"),
        "--output",
        str(tmp_path / "o"),
    ]
    result = _run([*command, "--data", str(data)], tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: fastft train: {data} has the columns ['bad', 'good', 'question']" in result.stderr
    assert "--method dpo needs 'prompt', 'chosen', 'rejected'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists(), "a refused run leaves no output folder behind"


def _assert_preference_run(output: Path, method: str, steps: int) -> dict:
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["completed"] is True and metrics["method"] == method
    assert [row["step"] for row in metrics["steps"]] == list(range(1, steps + 1))
    watched = {"dpo": "rewards/margins", "kto": "rewards/margins", "grpo": "reward"}[method]
    assert metrics["watched"]["metric"] == watched
    assert all(watched in row for row in metrics["steps"]), metrics["steps"][0]
    assert (output / "adapter_model.safetensors").exists() and (output / "adapter_config.json").exists()
    # The adapter alone: trl's frozen "ref" copy of the fresh adapter is dropped
    # (fastft.training.train._drop_reference_copy).
    assert not (output / "ref").exists()
    assert (output / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return metrics


def test_train_dpo_killed_and_resumed_on_the_demo_preferences(tiny_llama_dir, tmp_path):
    output = tmp_path / "run"
    steps = 12
    command = [*_train_command(tiny_llama_dir, output, steps), "--method", "dpo"]
    env = _env()
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    _wait_for_complete_checkpoint(output, first)
    first.send_signal(signal.SIGKILL)
    first_log = first.communicate(timeout=60)[0].decode(errors="replace")
    assert first.returncode == -signal.SIGKILL, "the first run must be killed mid-way, not finish"
    assert "it/s" in first_log or "s/it" in first_log, "training shows a progress bar"

    resumed = _run([*command, "--resume"], tmp_path, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    metrics = _assert_preference_run(output, "dpo", steps)
    assert metrics["resumed_from"] is not None
    assert metrics["steps"][0]["rewards/margins"] == 0.0, "step 1: the policy is the reference"
    assert "rewards/margins" in resumed.stdout


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        # Also the "sqrt" checkpointer (layer inputs replayed in backward) through the CLI.
        ("kto", ["--batch-size", "2", "--gradient-checkpointing", "sqrt"]),
        ("grpo", ["--batch-size", "4", "--num-generations", "2", "--max-completion-length", "8"]),
    ],
)
def test_train_kto_and_grpo_on_the_demo_preferences(tiny_llama_dir, tmp_path, method, extra):
    output = tmp_path / "run"
    steps = 4
    command = [*_train_command(tiny_llama_dir, output, steps), "--method", method, "--save-steps", "2", *extra]
    result = _run(command, tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_preference_run(output, method, steps)
    assert (output / f"checkpoint-{steps}" / "trainer_state.json").exists()
    expected = extra[extra.index("--gradient-checkpointing") + 1] if "--gradient-checkpointing" in extra else "offload"
    assert metrics["options"]["gradient_checkpointing"] == expected


@pytest.mark.slow
def test_dpo_on_the_embedded_model_raises_the_reward_margin(tmp_path):
    # `fastft train --method dpo` as a user runs it on the embedded SmolLM2-135M and the shipped preference split, made
    # short: the demo pairs are at most 58 tokens, and a higher learning rate moves the margin within 10 steps (it
    # jumps at step 6: margins of about 0.01 over steps 1-3, 0.3 over steps 8-10; 16 steps ended at the same 0.3).
    output = tmp_path / "dpo"
    steps = 10
    command = [
        *FASTFT,
        "train",
        "--method",
        "dpo",
        "--output",
        str(output),
        "--max-steps",
        str(steps),
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--lr",
        "5e-4",
        "--warmup-steps",
        "0",
        "--save-steps",
        "5",
    ]
    result = _run(command, tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_preference_run(output, "dpo", steps)
    margins = [row["rewards/margins"] for row in metrics["steps"]]
    head, tail = sum(margins[:3]) / 3, sum(margins[-3:]) / 3
    assert tail > head + 0.1, margins
    assert metrics["watched"]["rose"] is True
    assert sum(row["rewards/accuracies"] for row in metrics["steps"][-4:]) / 4 > 0.5, metrics["steps"][-4:]
    assert (output / f"checkpoint-{steps}" / "trainer_state.json").exists()
    assert "rewards/margins" in result.stdout


def test_train_compile_reports_its_compile_time(tiny_llama_dir, tmp_path):
    """`fastft train --compile`: the decoder layers compiled regionally, the seconds spent compiling in metrics.json
    and in the closing line."""
    output = tmp_path / "compiled"
    done = _run([*_train_command(tiny_llama_dir, output, 2), "--compile"], tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["options"]["compile"] is True
    assert metrics["compile_s"] > 0
    assert "s of it compiling" in done.stdout
