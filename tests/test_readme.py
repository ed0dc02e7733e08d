"""The README's test command is what CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _command_after(marker: str, text: str) -> str:
    block = text.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip()


def test_ci_runs_the_readme_test_command():
    command = _command_after("<!-- test-command -->", (ROOT / "README.md").read_text())
    assert command.startswith("python -m pip install torch==2.13.0 && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    assert command in ci.splitlines()


def test_readme_train_command_installs_cpu_torch_first():
    text = (ROOT / "README.md").read_text()
    train = [line for line in text.splitlines() if "fastft train --output runs/demo" in line]
    assert len(train) == 1 and train[0].startswith("python -m pip install torch==2.13.0 && ")
