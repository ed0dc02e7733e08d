"""bench/gpu_check.sh on a machine without a GPU: its syntax, what it refuses, and the commands each part runs
(printed by --dry-run, and run for real against a stub Python that records every call); and the 30-minute window:
`start` (one background job of fake, fast parts), `status` (progress, one archive of what is done) while a part runs,
after a failure, a time-out, a failed set-up and a job that died."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
PARTS = ("tests", "tune", "lora", "step", "pref")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the script is bash")

# Records its call (working folder, arguments, the variables the script sets) as one JSON line, writes what the
# real command would (--out FILE, --out-dir DIR, --output-dir DIR), and fails when told to.
STUB = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
names = ("FASTFT_GEMM", "FASTFT_CACHE_DIR", "TRITON_INTERPRET", "PYTHONPATH")
call = {{"cwd": os.getcwd(), "args": args, "env": {{n: os.environ.get(n) for n in names}}}}
with open(os.environ["STUB_LOG"], "a") as stream:
    stream.write(json.dumps(call) + "\\n")
for flag, value in zip(args, args[1:]):
    if flag == "--out":
        Path(value).write_text("{{}}")
    elif flag == "--out-dir":
        (Path(value) / "lora-stub.json").write_text("{{}}")
    elif flag == "--output-dir":
        (Path(value) / "bench-stub.json").write_text("{{}}")
fail = os.environ.get("STUB_FAIL_ON")
sys.exit(3 if fail and fail in args else 0)
"""


def _script(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("GPU_CHECK_", "STEP_", "LORA_", "NF4_", "LONGEST_"))
    }
    base.pop("GPU_TESTS", None)
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=cwd or ROOT,
        timeout=120,
    )


@pytest.fixture
def stub(tmp_path: Path) -> dict[str, str]:
    """Variables that point the script at the stub Python and at one dummy wheel."""
    python = tmp_path / "python3"
    python.write_text(STUB)
    python.chmod(0o755)
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "dummy-1.0-py3-none-any.whl").write_bytes(b"")
    return {
        "PYTHON": str(python),
        "STUB_LOG": str(tmp_path / "calls.jsonl"),
        "GPU_CHECK_WHEELS": str(wheels),
        "GPU_CHECK_SITE": str(tmp_path / "site"),
        # A real nvidia-smi on the test machine would only add a line; keep the calls the stub sees the same.
        "PATH": "/usr/bin:/bin",
    }


def _calls(stub: dict[str, str]) -> list[dict]:
    log = Path(stub["STUB_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "expected OUTDIR"),
        (("/nonexistent/fastft-gpu-check",), "is not a directory"),
        (("",), "OUTDIR is empty"),
        # `bash bench/gpu_check.sh $OUT tests` with OUT unset: the part must not be taken for the folder.
        (("tests",), "is a part name"),
        (("{out}", "bogus"), "unknown PART 'bogus'"),
        (("{out}", "tune", "lora"), "at most one PART"),
        (("--frobnicate", "{out}"), "unknown option"),
    ],
)
def test_refuses_bad_arguments_with_a_message_and_runs_nothing(tmp_path, stub, args, message):
    out = tmp_path / "out"
    out.mkdir()
    result = _script(*[arg.format(out=out) for arg in args], env=stub)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert _calls(stub) == [] and list(out.iterdir()) == []


def test_help_names_every_part():
    result = _script("--help")
    assert result.returncode == 0
    assert all(part in result.stderr for part in (*PARTS, "all"))


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        (
            "tests",
            [
                "(cd {root}/tests) python3 -m pytest -q -p no:cacheprovider -m cuda test_checkpoint_offload_cuda.py",
                "(cd {root}/tests) python3 -m pytest -q -p no:cacheprovider -n 4 test_kernel_",
            ],
        ),
        (
            "tune",
            [
                "env FASTFT_GEMM=auto FASTFT_CACHE_DIR={out}/cache python3 {root}/bench/lora.py --tune-only --device "
                "cuda --shapes llama-3.2-1b --dtypes bf16 nf4 --groups qkv o mlp --out {out}/tuner.json"
            ],
        ),
        ("lora", ["env FASTFT_CACHE_DIR={out}/cache python3 {root}/bench/lora.py --device cuda --out-dir {out}"]),
        (
            "step",
            [
                "env FASTFT_CACHE_DIR={out}/cache python3 {root}/bench/run.py --device cuda --workloads "
                "llama-3.2-1b-bf16-4x2048 --systems transformers+peft transformers+peft+gc fastft fastft+offload "
                "--rounds 2 --timeout 240 --output-dir {out} --readme {out}/bench-readme-section.md"
            ],
        ),
        ("pref", ["python3 {root}/bench/preference.py --device cuda --out {out}/preference-cuda.json"]),
    ],
)
def test_dry_run_prints_each_parts_commands_and_writes_nothing(tmp_path, part, expected):
    out = tmp_path / "out"
    out.mkdir()
    result = _script("--dry-run", str(out), part, env={"GPU_CHECK_WHEELS": str(tmp_path / "none")})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    commands = [line for line in lines if line.startswith("+ ")]
    # The set-up every part starts with: this checkout installed without dependencies and without build isolation
    # (no index to fetch setuptools from), then the import and GPU check.
    assert f"python3 -m pip install -q --no-deps --no-build-isolation -e {ROOT}" in commands[0]
    assert "preflight.py" in commands[1] and str(ROOT) in commands[1]
    for text in expected:
        assert any(text.format(root=ROOT, out=out) in command for command in commands), (text, commands)
    assert f"gpu_check: part '{part}' took" in result.stdout and "gpu_check: setup took" in result.stdout
    assert list(out.iterdir()) == []


def test_dry_run_all_runs_every_part_in_order(tmp_path):
    result = _script("--dry-run", str(tmp_path), env={"GPU_CHECK_WHEELS": str(tmp_path / "none")})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    started = [line.split("'")[1] for line in lines if line.startswith("gpu_check: part '") and line.endswith("'")]
    assert started == list(PARTS)


@pytest.mark.parametrize("part", PARTS)
def test_each_part_runs_its_commands_outside_the_checkout_root(tmp_path, stub, part):
    out = tmp_path / "out"
    out.mkdir()
    result = _script(str(out), part, env=stub, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = _calls(stub)
    site = stub["GPU_CHECK_SITE"]

    install = calls[0]["args"]
    assert install[:3] == ["-m", "pip", "install"] and {"--no-index", "--no-deps"} <= set(install)
    assert install[install.index("--target") + 1] == site and install[-1].endswith("dummy-1.0-py3-none-any.whl")
    assert calls[1]["args"][-4:] == ["--no-deps", "--no-build-isolation", "-e", str(ROOT)]
    preflight = calls[2]["args"]
    assert preflight[0].endswith("preflight.py") and preflight[1] == str(ROOT)
    for call in calls:
        # From the checkout's root, kernels/ would shadow the PyPI `kernels` that bitsandbytes imports.
        assert Path(call["cwd"]) != ROOT, call
        assert call["env"]["TRITON_INTERPRET"] == "0", call
    for call in calls[1:]:
        # The carried wheels are importable by everything after their install.
        assert call["env"]["PYTHONPATH"].split(":")[0] == site, call

    work = [call for call in calls[3:] if call["args"][:2] != ["-c", "import xdist"]]
    if part == "tests":
        assert [call["cwd"] for call in work] == [str(ROOT / "tests")] * 2
        assert work[0]["args"][:2] == ["-m", "pytest"] and "-m" in work[0]["args"][2:]
        assert "cuda" in work[0]["args"] and "test_checkpoint_offload_cuda.py" in work[0]["args"]
        assert any(arg.startswith("test_kernel_") for arg in work[1]["args"])
    elif part == "tune":
        (call,) = work
        assert call["args"][0] == str(ROOT / "bench" / "lora.py") and "--tune-only" in call["args"]
        assert call["env"]["FASTFT_GEMM"] == "auto" and call["env"]["FASTFT_CACHE_DIR"] == str(out / "cache")
        assert (out / "tuner.json").exists()
    elif part == "lora":
        (call,) = work
        assert call["args"][0] == str(ROOT / "bench" / "lora.py") and "--tune-only" not in call["args"]
        assert call["args"][call["args"].index("--out-dir") + 1] == str(out)
        assert call["env"]["FASTFT_CACHE_DIR"] == str(out / "cache")
    elif part == "pref":
        (call,) = work
        assert call["args"][0] == str(ROOT / "bench" / "preference.py") and "cuda" in call["args"]
        assert (out / "preference-cuda.json").exists()
    else:
        (call,) = work
        assert call["args"][0] == str(ROOT / "bench" / "run.py")
        assert call["args"][call["args"].index("--workloads") + 1] == "llama-3.2-1b-bf16-4x2048"
        assert call["args"][call["args"].index("--output-dir") + 1] == str(out)

    assert f"gpu_check: part '{part}' took" in result.stdout
    summary = (out / "gpu_check.log").read_text()
    assert f"part '{part}' took" in summary and "setup took" in summary
    # Each command and its output are kept in the part's log.
    assert "+ (cd " in (out / "setup.log").read_text() and "+ (cd " in (out / f"{part}.log").read_text()


def test_lora_args_reach_bench_lora(tmp_path, stub):
    result = _script(str(tmp_path), "lora", env={**stub, "LORA_ARGS": "--shapes llama-3.2-1b --repeats 10"})
    assert result.returncode == 0, result.stdout + result.stderr
    (call,) = [call for call in _calls(stub) if call["args"] and call["args"][0].endswith("lora.py")]
    assert call["args"][-4:] == ["--shapes", "llama-3.2-1b", "--repeats", "10"]


def test_a_failing_command_stops_the_script_and_names_the_part(tmp_path, stub):
    result = _script(str(tmp_path), "all", env={**stub, "STUB_FAIL_ON": "pytest"})
    assert result.returncode == 3, result.stdout + result.stderr
    assert "part 'tests' FAILED (exit 3)" in result.stderr and f"{tmp_path}/tests.log" in result.stderr
    # Nothing after the failure ran: the first pytest call is the last call.
    calls = _calls(stub)
    assert calls[-1]["args"][:2] == ["-m", "pytest"]
    assert "setup took" in result.stdout and "FAILED" in (tmp_path / "gpu_check.log").read_text()


def test_a_missing_output_file_fails_the_part(tmp_path, stub):
    # The stub writes --out files; without the flag being honoured the part must not pass silently.
    stub_python = Path(stub["PYTHON"])
    stub_python.write_text(stub_python.read_text().replace('flag == "--out"', 'flag == "--never"'))
    result = _script(str(tmp_path), "tune", env=stub)
    assert result.returncode != 0
    assert f"wrote no {tmp_path}/tuner.json" in result.stderr


# --- the window: one background job, polled with `status` -------------------------------------------------------

WINDOW = ("tests", "modes", "nf4", "longest", "lora", "kernels", "pref")
# Stands in for each part's commands: writes <part>.json, fails for nf4, outlives longest's box, and waits for a
# file named after the part when one is asked for (so a test can look at the job while a part runs).
FAKE = (
    'while [ -e "$GATES/$1.hold" ]; do sleep 0.1; done; echo "{\\"part\\": \\"$1\\"}" > "$2/$1.json"; '
    '[ "$1" != nf4 ] || exit 5; [ "$1" != longest ] || sleep 30'
)


@pytest.fixture
def window(tmp_path: Path, stub: dict[str, str]) -> dict[str, str]:
    """Variables for a window job with fake parts and its state in tmp_path; the job is stopped at the end."""
    gates = tmp_path / "gates"
    gates.mkdir()
    env = {
        **stub,
        "GPU_CHECK_STATE": str(tmp_path / "state"),
        "GPU_CHECK_FAKE": FAKE,
        "GPU_CHECK_BOX_LONGEST": "2",
        "GATES": str(gates),
    }
    yield env
    pid_file = tmp_path / "state" / "pid"
    if pid_file.exists() and not (tmp_path / "state" / "finished").exists():
        # The job is a session of its own (setsid): its id is its process group's.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def _wait_until_finished(state: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not (state / "finished").exists():
        assert time.monotonic() < deadline, (state / "job.log").read_text()
        time.sleep(0.2)


def _status_rows(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        words = line.split()
        if line.startswith("  ") and words and words[0] in ("setup", *WINDOW):
            rows[words[0]] = words[1]
    return rows


def _archive(out: Path) -> set[str]:
    with tarfile.open(out / "gpu-check.tar.gz") as archive:
        return set(archive.getnames())


def test_start_returns_at_once_and_status_reports_and_packs_every_part(tmp_path, window):
    out = tmp_path / "out"
    out.mkdir()
    began = time.monotonic()
    started = _script("start", str(out), env=window, cwd=tmp_path)
    assert started.returncode == 0, started.stdout + started.stderr
    # longest alone holds the job for its 2 s box, so start must have come back before the job's end.
    assert time.monotonic() - began < 10 and "poll it with: bash bench/gpu_check.sh status" in started.stdout
    state = tmp_path / "state"
    _wait_until_finished(state)

    result = _script("status", str(out), env=window, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "window job finished (exit 0)" in result.stdout
    rows = _status_rows(result.stdout)
    assert list(rows) == ["setup", *WINDOW]
    assert rows == {"setup": "done", **dict.fromkeys(WINDOW, "done"), "nf4": "failed", "longest": "timeout"}
    assert "exit 5" in result.stdout and "exit 124" in result.stdout
    assert (out / "status.txt").read_text().startswith(result.stdout.splitlines()[0])
    # One archive: every part's log and what it wrote, the job's log and the progress it kept.
    names = _archive(out)
    assert {f"out/{part}.json" for part in WINDOW} <= names and {f"out/{part}.log" for part in WINDOW} <= names
    assert {"job.log", "out/setup.log", "out/gpu_check.log", "parts/setup"} <= names
    assert sorted(path.name for path in out.iterdir()) == ["gpu-check.tar.gz", "status.txt"]

    # The parts ran in order, outside the checkout root, after the set-up and each after its import check.
    calls = _calls(window)
    assert calls[0]["args"][:3] == ["-m", "pip", "install"] and calls[1]["args"][-2:] == ["-e", str(ROOT)]
    checks = [call for call in calls if call["args"] and call["args"][0].endswith("find.py")]
    tests_needs = ["triton", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "gguf"]
    assert checks[0]["args"][1:] == tests_needs
    assert len(checks) == len(WINDOW) and all(Path(call["cwd"]) != ROOT for call in calls)
    assert "part 'longest' timeout" in (state / "out" / "gpu_check.log").read_text()


def test_status_while_a_part_runs_packs_what_is_done_so_far(tmp_path, window):
    out = tmp_path / "out"
    out.mkdir()
    gate = Path(window["GATES"]) / "modes.hold"
    gate.touch()
    assert _script("start", str(out), env=window, cwd=tmp_path).returncode == 0
    state = tmp_path / "state"
    deadline = time.monotonic() + 30
    while not (state / "out" / "modes.log").exists():
        assert time.monotonic() < deadline, (state / "job.log").read_text()
        time.sleep(0.1)

    result = _script("status", str(out), env=window, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "window job running (pid" in result.stdout
    rows = _status_rows(result.stdout)
    assert rows["setup"] == rows["tests"] == "done" and rows["modes"] == "running"
    assert all(rows[part] == "waiting" for part in WINDOW[2:])
    assert re.search(r"modes\s+running\s+\d+ s of its 360 s box", result.stdout)
    names = _archive(out)
    assert "out/tests.json" in names and "out/modes.json" not in names and "out/modes.log" in names

    # Another start while it runs is refused; nothing of the running job is touched.
    again = _script("start", str(out), env=window, cwd=tmp_path)
    assert again.returncode == 2 and "already running" in again.stderr
    gate.unlink()
    _wait_until_finished(state)
    assert _script("status", str(out), env=window, cwd=tmp_path).returncode == 0
    assert "out/modes.json" in _archive(out)


def test_a_new_start_moves_the_finished_run_aside(tmp_path, window):
    out = tmp_path / "out"
    out.mkdir()
    env = {**window, "GPU_CHECK_WINDOW": "kernels"}
    assert _script("start", str(out), env=env, cwd=tmp_path).returncode == 0
    _wait_until_finished(tmp_path / "state")
    second = _script("start", str(out), env=env, cwd=tmp_path)
    assert second.returncode == 0 and "moved the previous run's state to" in second.stdout
    (aside,) = [path for path in tmp_path.iterdir() if path.name.startswith("state.")]
    assert (aside / "out" / "kernels.json").exists()
    _wait_until_finished(tmp_path / "state")


def test_a_failed_setup_ends_the_job_and_status_says_which(tmp_path, window):
    out = tmp_path / "out"
    out.mkdir()
    assert _script("start", str(out), env={**window, "STUB_FAIL_ON": "pip"}, cwd=tmp_path).returncode == 0
    _wait_until_finished(tmp_path / "state")
    result = _script("status", str(out), env=window, cwd=tmp_path)
    assert "window job finished (exit 3)" in result.stdout
    rows = _status_rows(result.stdout)
    assert rows["setup"] == "failed" and all(rows[part] == "waiting" for part in WINDOW)
    assert "part 'setup' FAILED (exit 3)" in (tmp_path / "state" / "job.log").read_text()


def test_status_says_when_the_job_died(tmp_path, window):
    out = tmp_path / "out"
    out.mkdir()
    (Path(window["GATES"]) / "tests.hold").touch()
    assert _script("start", str(out), env=window, cwd=tmp_path).returncode == 0
    state = tmp_path / "state"
    os.killpg(int((state / "pid").read_text()), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        result = _script("status", str(out), env=window, cwd=tmp_path)
        if "DIED" in result.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "DIED: its process is gone and it never finished" in result.stdout
    assert (out / "gpu-check.tar.gz").exists()


def test_status_without_a_job_and_bad_window_settings_are_refused(tmp_path, window):
    out = tmp_path / "out"
    out.mkdir()
    result = _script("status", str(out), env=window, cwd=tmp_path)
    assert result.returncode == 2 and "no window job has run here" in result.stderr
    result = _script("start", str(out), env={**window, "GPU_CHECK_WINDOW": "tests bogus"}, cwd=tmp_path)
    assert result.returncode == 2 and "GPU_CHECK_WINDOW names 'bogus'" in result.stderr
    assert _script("start", env=window, cwd=tmp_path).returncode == 2
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        (
            "modes",
            "bench/run.py --device cuda --modes --workloads llama-3.2-1b-bf16-4x2048 --rounds 1 --timeout 150 "
            "--output-dir {out}/modes --readme {out}/modes/bench-readme-section.md",
        ),
        (
            "nf4",
            "bench/run.py --device cuda --workloads llama-3.2-1b-nf4-4x2048 --systems transformers+peft fastft "
            "unsloth fastft+offload --rounds 1 --timeout 120 --output-dir {out}/nf4",
        ),
        (
            "longest",
            "bench/run.py --device cuda --longest --longest-budget 50 --rounds 0 --workloads "
            "llama-3.2-1b-bf16-4x2048 --systems transformers+peft+gc unsloth fastft+offload --timeout 110 "
            "--output-dir {out}/longest",
        ),
        ("kernels", "bench/kernels.py --device cuda --output {out}/kernels-cuda-bf16.json"),
    ],
)
def test_dry_run_of_the_window_parts(tmp_path, part, expected):
    out = tmp_path / "out"
    out.mkdir()
    result = _script("--dry-run", str(out), part, env={"GPU_CHECK_WHEELS": str(tmp_path / "none")})
    assert result.returncode == 0, result.stdout + result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
    assert any(expected.format(out=out) in command for command in commands), commands
