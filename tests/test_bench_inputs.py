"""`fastft bench`'s and `fastft doctor`'s bad inputs: one `error:` line naming the flag as typed, exit 2, before
anything loads, runs or is written (issue 30, point 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastft.cli import main


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    a_file = tmp / "a-file.txt"
    a_file.write_text("not a folder")
    not_json = tmp / "notes.json"
    not_json.write_text("timings, by hand\n")
    other = tmp / "host.json"
    other.write_text(json.dumps({"benchmark": "bench/host.py", "systems": {}}))
    return {
        "readme-from missing": (["--readme-from", str(tmp / "missing.json")], "--readme-from"),
        "readme-from not json": (["--readme-from", str(not_json)], "--readme-from"),
        "readme-from another record": (["--readme-from", str(other)], "--readme-from"),
        "output-dir is a file": (["--quick", "--output-dir", str(a_file)], "--output-dir"),
        "output-dir under a file": (["--quick", "--output-dir", str(a_file / "out")], "--output-dir"),
        "venv-root is a file": (["--quick", "--venv-root", str(a_file)], "--venv-root"),
        "readme is a folder": (["--quick", "--readme", str(tmp)], "--readme"),
        "readme under a file": (["--quick", "--readme", str(a_file / "README.md")], "--readme"),
        "timeout 0": (["--quick", "--timeout", "0"], "--timeout"),
        "steps 0": (["--quick", "--steps", "0"], "--steps"),
        "longest-budget negative": (["--quick", "--longest", "--longest-budget", "-5"], "--longest-budget"),
        "unknown system": (["--quick", "--systems", "nosuch"], "nosuch"),
        "unknown workload": (["--quick", "--workloads", "nosuch"], "nosuch"),
    }


CASES = [
    "readme-from missing",
    "readme-from not json",
    "readme-from another record",
    "output-dir is a file",
    "output-dir under a file",
    "venv-root is a file",
    "readme is a folder",
    "readme under a file",
    "timeout 0",
    "steps 0",
    "longest-budget negative",
    "unknown system",
    "unknown workload",
]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_is_one_error_line_before_anything_runs(case, tmp_path, capsys, monkeypatch):
    cases = _bad_inputs(tmp_path)
    assert sorted(cases) == sorted(CASES)
    argv, flag = cases[case]
    before = sorted(tmp_path.rglob("*"))
    ran = []
    if not case.startswith("unknown"):
        # Refused by the command itself: the harness must not even start. Unknown names are the harness's own check
        # (before any process starts), so those run it.
        monkeypatch.setattr("fastft.bench.run", lambda options: ran.append(options))
    assert main(["bench", "--device", "cpu", "--no-plot", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0], err
    assert ran == [], "measured before refusing"
    assert sorted(tmp_path.rglob("*")) == before, "wrote something before refusing"


@pytest.mark.parametrize("where", ["under a file", "a folder", "without --compile"])
def test_doctor_refuses_an_output_it_cannot_write_before_running(where, tmp_path, capsys):
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("not a folder")
    argv = {
        "under a file": ["--compile", "--output", str(a_file / "compile.json")],
        "a folder": ["--compile", "--output", str(tmp_path)],
        "without --compile": ["--output", str(tmp_path / "compile.json")],
    }[where]
    before = sorted(tmp_path.rglob("*"))
    assert main(["doctor", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: fastft doctor") and "--output" in err[0], err
    assert captured.out == "", "the report ran before refusing"
    assert sorted(tmp_path.rglob("*")) == before
