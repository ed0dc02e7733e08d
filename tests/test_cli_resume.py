"""`fastft train --resume` stops where it should: a run continued to a larger --max-steps ends exactly there, a
finished run is not trained again; and a batch larger than the data is clamped and recorded as trained."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from fastft.export.file_modes import current_umask

FASTFT = [sys.executable, "-m", "fastft.cli"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # The reference kernels: Triton's interpreter would take minutes a step. Run outside the checkout, whose
    # kernels/ folder would pose as the PyPI package `kernels`.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "FASTFT_DISABLE_TRITON": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    return subprocess.run([*FASTFT, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


def _checkpoints(output: Path) -> list[int]:
    return sorted(int(path.name.split("-")[1]) for path in output.glob("checkpoint-*"))


def test_resume_runs_to_exactly_max_steps_and_a_finished_run_is_left_alone(tiny_llama_dir, tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}: the quick brown fox"}) + "\n" for i in range(3)))
    output = tmp_path / "run"
    common = ["train", "--model", str(tiny_llama_dir), "--data", str(data), "--output", str(output)]
    common += ["--save-steps", "2", "--seq-len", "32", "--warmup-steps", "0", "--batch-size", "8"]

    # The run "stopped early": four of the eight steps the resumed command asks for.
    first = _run([*common, "--max-steps", "4"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("--batch-size 8 is more than the 3 examples") == 1, first.stderr[-3000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["options"]["batch_size"] == 3 and metrics["batch_size_requested"] == 8
    assert metrics["global_step"] == 4 and _checkpoints(output) == [2, 4]
    card = (output / "README.md").read_text()
    assert f"base_model: {tiny_llama_dir}" in card and "[None]" not in card and 'model="None"' not in card
    # safetensors' 0600 temporary files are given the mode the umask gives new files (0644 under umask 022).
    expected = 0o666 & ~current_umask()
    written = [output / "adapter_model.safetensors", *(output / "checkpoint-4").iterdir()]
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in written if path.is_file()} == {
        path.name: expected for path in written if path.is_file()
    }

    resumed = _run([*common, "--max-steps", "8", "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["resumed_from"] == "checkpoint-4"
    assert metrics["global_step"] == 8 and metrics["max_steps"] == 8
    assert [row["step"] for row in metrics["steps"]] == list(range(1, 9))
    # save_total_limit keeps the last two checkpoints; none past --max-steps.
    assert _checkpoints(output) == [6, 8]

    again = _run([*common, "--max-steps", "8", "--resume"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished its 8 steps; nothing trained" in again.stdout
    assert _checkpoints(output) == [6, 8]
    assert json.loads((output / "metrics.json").read_text()) == metrics


def test_a_checkpoint_cut_short_while_its_state_was_written_is_skipped(tmp_path, caplog):
    """A kill while the Trainer wrote trainer_state.json (its last file) leaves it empty or cut: resuming from it
    would fail in json.loads, so the newest checkpoint whose state parses whole is the one resumed from."""
    from fastft.training.train import last_complete_checkpoint

    for step, state in ((2, '{"global_step": 2}'), (4, '{"global_step": 4, "log_hi'), (6, ""), (8, None)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if state is not None:
            (folder / "trainer_state.json").write_text(state)
    with caplog.at_level("WARNING", logger="fastft.train"):
        assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    skipped = [record.getMessage() for record in caplog.records if "is incomplete" in record.getMessage()]
    assert [message.split("/")[-1].split(" ")[0] for message in skipped] == [
        "checkpoint-8",
        "checkpoint-6",
        "checkpoint-4",
    ]
