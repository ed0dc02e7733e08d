"""The per-version lanes: their pins, CI's call of .ci/lanes.py, and the README table they back (no venv is built)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PINNED = ("transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets")
# The supported sets (issue 4), written out here so that an edit of a lane file has to be made twice to pass.
SUPPORTED = {
    "oldest": ("4.53.3", "0.16.0", "0.19.1", "0.46.1", "1.8.1", "3.6.0"),
    "last-4x": ("4.57.6", "0.17.1", "0.24.0", "0.48.2", "1.10.1", "4.0.0"),
    "early-5x": ("5.5.4", "0.19.1", "1.0.0", "0.49.2", "1.13.0", "4.7.0"),
    "newest": ("5.24.0", "0.21.2", "1.16.0", "0.50.2", "1.15.0", "5.2.0"),
}


@pytest.fixture(scope="module")
def lanes():
    """.ci/lanes.py imported as a module (it is a script in a dot-folder, not a package)."""
    spec = importlib.util.spec_from_file_location("fastft_ci_lanes", ROOT / ".ci" / "lanes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_lane_files_pin_exactly_the_supported_sets(lanes):
    found = {lane.name: lane for lane in lanes.all_lanes() if lane.is_version_lane}
    assert list(found) == list(SUPPORTED), "lanes, oldest transformers first"
    for name, versions in SUPPORTED.items():
        assert found[name].pins == dict(zip(PINNED, versions, strict=True)), name
        assert found[name].path.read_text().splitlines()[0].startswith(f"# lane: {name} ")


def test_constraints_pin_torch_2_13_only():
    text = (ROOT / ".ci" / "lanes" / "constraints.txt").read_text()
    requirements = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert requirements == ["torch==2.13.0"]


def test_pyproject_lower_bounds_are_the_oldest_lane(lanes):
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["dev"]]
    oldest = {lane.name: lane for lane in lanes.all_lanes()}["oldest"].pins
    for name in PINNED:
        (bound,) = [spec for r in requirements if r.name == name for spec in r.specifier if spec.operator == ">="]
        assert Version(bound.version) == Version(oldest[name]), name
    # Every other runtime dependency is installed into each lane by the script.
    extras = {Requirement(text).name for text in lanes.EXTRA_REQUIREMENTS}
    missing = [r.name for r in requirements if r.name not in (*PINNED, "torch", "ruff") and r.name not in extras]
    assert missing == [], f"add to EXTRA_REQUIREMENTS in .ci/lanes.py: {missing}"


def test_a_lane_file_must_pin_exactly_and_name_itself(lanes, tmp_path):
    good = ["transformers==4.53.3", "peft==0.16.0", "trl==0.19.1", "bitsandbytes==0.46.1", "accelerate==1.8.1"]
    path = tmp_path / "mine.txt"
    path.write_text("\n".join(["# lane: mine", *good, "datasets>=3.6"]))
    with pytest.raises(lanes.LaneError, match=r"mine.txt:7: expected an exact pin 'name==version', found 'datasets>="):
        lanes.read_lane(path)
    path.write_text("\n".join(["# lane: other", *good, "datasets==3.6.0"]))
    with pytest.raises(lanes.LaneError, match="first line must be '# lane: mine"):
        lanes.read_lane(path)
    path.write_text("\n".join(["# lane: mine", *good]))
    with pytest.raises(lanes.LaneError, match="pins no version of datasets"):
        lanes.read_lane(path)


def test_version_check_names_each_library_off_its_pin(lanes, tmp_path, monkeypatch):
    # A "venv" whose python is this interpreter, so the check reads this environment's versions. Not a symlink: a venv's
    # python looks for its pyvenv.cfg beside the path it was started by, so when the suite itself runs in a venv, a link
    # to it from elsewhere starts the bare base interpreter, which lacks the venv's packages. A script that execs
    # sys.executable by its own path stays in whatever environment runs the suite.
    python = tmp_path / "here" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    probe = [str(python), "-c", "import sys; print(sys.prefix)"]
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == sys.prefix
    monkeypatch.setattr(lanes, "VENVS", tmp_path)
    monkeypatch.setattr(lanes, "TORCH_VERSION", metadata.version("torch"))
    installed = {name: metadata.version(name) for name in PINNED}
    lanes.check_versions(lanes.Lane("here", tmp_path / "here.txt", installed))

    with pytest.raises(lanes.LaneError, match=rf"peft is {re.escape(installed['peft'])}, expected 0\.0\.1"):
        lanes.check_versions(lanes.Lane("here", tmp_path / "here.txt", {**installed, "peft": "0.0.1"}))
    monkeypatch.setattr(lanes, "TORCH_VERSION", "2.13.0+cu130")
    with pytest.raises(lanes.LaneError, match=r"torch is .*, expected 2\.13\.0\+cu130.*--rebuild"):
        lanes.check_versions(lanes.Lane("here", tmp_path / "here.txt", installed))


def test_torch_comes_from_a_local_cpu_wheel(lanes, tmp_path, monkeypatch):
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheel = tmp_path / f"torch-2.13.0+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl"
    wheel.touch()
    monkeypatch.delenv("FASTFT_TORCH_WHEEL", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert lanes.find_torch_wheel() == wheel
    monkeypatch.setenv("FASTFT_TORCH_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(lanes.LaneError, match="missing.whl is not a file"):
        lanes.find_torch_wheel()


def test_list_shows_every_lane_oldest_first():
    result = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "lanes.py"), "--list"], capture_output=True, text=True, check=True
    )
    names = [line.split()[0] for line in result.stdout.splitlines() if not line.startswith("warning:")]
    assert names == [*SUPPORTED, "axolotl", "llamacpp"], "the version lanes oldest first, then the feature lanes"
    assert "transformers 4.53.3 peft 0.16.0 trl 0.19.1" in result.stdout


def test_ci_runs_every_lane_after_the_main_suite():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in lines
    main = next(index for index, line in enumerate(lines) if "pytest -q" in line and not line.startswith("#"))
    assert any(line.startswith("python .ci/lanes.py") for line in lines[main + 1 :])


def test_the_lane_the_main_run_already_covered_is_recognised(lanes):
    from importlib import metadata

    here = {name: metadata.version(name) for name in lanes.PINNED}
    torch_version = metadata.version("torch")
    lane = lanes.Lane("here", ROOT / "here.txt", here)
    assert lanes.same_as_main(lane) is (torch_version == lanes.TORCH_VERSION)
    assert not lanes.same_as_main(lanes.Lane("other", ROOT / "other.txt", {**here, "peft": "0.0.1"}))


def _supported_versions_table(readme: str) -> list[list[str]]:
    lines = readme.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("#") and "Supported versions" in line), None)
    assert start is not None, "README.md has no heading containing 'Supported versions'"
    header = "| lane | " + " | ".join(PINNED) + " |"
    rows, in_table = [], False
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if not in_table:
            in_table = re.sub(r"\s+", " ", line.strip()) == header
        elif not line.strip().startswith("|"):
            break
        elif not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
            rows.append(cells)
    assert in_table, f"README.md's 'Supported versions' section has no table with the header {header}"
    return rows


def test_the_table_reader_takes_only_the_lane_table_of_its_section():
    readme = "\n".join(
        [
            "## Install",
            "| lane | transformers | peft | trl | bitsandbytes | accelerate | datasets |",
            "|---|---|---|---|---|---|---|",
            "| wrong | 1 | 1 | 1 | 1 | 1 | 1 |",
            "## Supported versions",
            "| library | lowest |",
            "|---|---|",
            "| torch | 2.11 |",
            "",
            "|  lane  | transformers | peft | trl | bitsandbytes | accelerate | datasets |",
            "|:-------|---|---|---|---|---|---:|",
            "| `oldest` | 4.53.3 | 0.16.0 | 0.19.1 | 0.46.1 | 1.8.1 | 3.6.0 |",
            "| newest | 5.23.0 | 0.21.2 | 1.16.0 | 0.50.2 | 1.15.0 | 5.2.0 |",
            "",
            "| newer | 9 | 9 | 9 | 9 | 9 | 9 |",
        ]
    )
    assert _supported_versions_table(readme) == [
        ["oldest", "4.53.3", "0.16.0", "0.19.1", "0.46.1", "1.8.1", "3.6.0"],
        ["newest", "5.23.0", "0.21.2", "1.16.0", "0.50.2", "1.15.0", "5.2.0"],
    ]


def test_readme_supported_versions_table_lists_exactly_the_lanes(lanes):
    rows = _supported_versions_table((ROOT / "README.md").read_text())
    expected = [
        [lane.name, *(lane.pins[name] for name in PINNED)] for lane in lanes.all_lanes() if lane.is_version_lane
    ]
    assert rows == expected


def test_the_llamacpp_lane_is_the_newest_set_plus_a_portable_llama_cpp_build(lanes):
    found = {lane.name: lane for lane in lanes.all_lanes()}
    lane = found["llamacpp"]
    assert not lane.is_version_lane and lane.marker == "llamacpp"
    assert lane.pins == {**found["newest"].pins, "llama-cpp-python": "0.3.36"}
    # Not -march=native: a wheel built on one CI machine must run on the next.
    arguments = shlex.split(lane.env["CMAKE_ARGS"])
    assert "-DGGML_NATIVE=OFF" in arguments
    # llama.cpp's common library (43 % of the build) is not built: the Python package loads libllama and libmtmd only.
    include = ROOT / ".ci" / "lanes" / "llamacpp-no-common.cmake"
    assert f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={include.resolve()}" in arguments
    assert lane.env_files == (include,) and "set(LLAMA_BUILD_COMMON OFF)" in include.read_text()
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("llamacpp:") for marker in markers)
    assert lanes.same_as_main(lane) is False, "the main run has no llama.cpp, so it never covers this lane"


def test_a_feature_lane_runs_its_marker_and_builds_with_its_settings(lanes, tmp_path, monkeypatch):
    pins = ["transformers==5.24.0", "peft==0.21.2", "trl==1.16.0", "bitsandbytes==0.50.2", "accelerate==1.15.0"]
    path = tmp_path / "feat.txt"
    path.write_text("\n".join(["# lane: feat - a feature", "# marker: feat", "# env: CMAKE_ARGS=-DA=1 -DB=2", *pins]))
    path.write_text(path.read_text() + "\ndatasets==5.2.0\nextra-lib==1.0\n")
    lane = lanes.read_lane(path)
    assert (lane.marker, lane.env, lane.pins["extra-lib"]) == ("feat", {"CMAKE_ARGS": "-DA=1 -DB=2"}, "1.0")
    path.write_text("\n".join(["# lane: feat", "# env: cmake args", *pins, "datasets==5.2.0"]))
    with pytest.raises(lanes.LaneError, match=r"feat.txt:2: '# env:' takes NAME=value, found 'cmake args'"):
        lanes.read_lane(path)
    # {lanes} is the lane file's folder; a file named there must exist, and its bytes are part of the venv's stamp.
    path.write_text("\n".join(["# lane: feat", "# env: CMAKE_ARGS='-DX={lanes}/x.cmake'", *pins, "datasets==5.2.0"]))
    with pytest.raises(lanes.LaneError, match=r"feat.txt:2: '# env:' names \{lanes\}/x.cmake, which is not in"):
        lanes.read_lane(path)
    (tmp_path / "x.cmake").write_text("set(A 1)\n")
    named = lanes.read_lane(path)
    assert named.env == {"CMAKE_ARGS": f"'-DX={tmp_path.resolve()}/x.cmake'"}
    assert named.env_files == (tmp_path / "x.cmake",)
    stamp = lanes._stamps(named, tmp_path / "torch.whl")["dependencies"]
    (tmp_path / "x.cmake").write_text("set(A 2)\n")
    assert lanes._stamps(named, tmp_path / "torch.whl")["dependencies"] != stamp

    calls = []

    def fake_run(command, **kwargs):
        calls.append((command, kwargs.get("env", {})))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(lanes.subprocess, "run", fake_run)
    monkeypatch.setattr(lanes, "VENVS", tmp_path / "venvs")
    feature = lanes.Lane("feat", path, {}, "feat", {"CMAKE_ARGS": "-DA=1"})
    lanes.run_tests(feature, ["-x"])
    command, env = calls[-1]
    assert command[command.index("-m", 2) + 1] == "feat" and command[-1] == "-x"
    assert "CMAKE_ARGS" not in env, "build settings are for the install only"

    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    wheel.touch()
    monkeypatch.setenv("FASTFT_TORCH_WHEEL", str(wheel))
    monkeypatch.setattr(lanes, "check_versions", lambda lane: None)
    monkeypatch.setattr(lanes, "_create_venv", lambda installer, lane: lane.venv.mkdir(parents=True))
    calls.clear()
    assert lanes.build(feature, "pip", rebuild=True) == "built"
    (install, install_env), *_ = [call for call in calls if "-r" in call[0]]
    # Installers cache built wheels by source archive, blind to CMAKE_ARGS: the build must not come from a cache.
    assert install_env["CMAKE_ARGS"] == "-DA=1" and "--no-cache-dir" in install


def test_the_axolotl_lane_installs_axolotl_without_its_pins_and_runs_its_marker(lanes, tmp_path, monkeypatch):
    found = {lane.name: lane for lane in lanes.all_lanes()}
    lane = found["axolotl"]
    assert not lane.is_version_lane and lane.marker == "axolotl"
    assert lane.pins == {**found["newest"].pins, "pydantic": "2.12.5"}
    assert lane.no_deps == ("axolotl==0.19.0", "addict==2.4.0")
    test_file = (ROOT / "tests" / "test_axolotl_plugin.py").read_text()
    assert "pytestmark = pytest.mark.axolotl" in test_file

    calls = []
    monkeypatch.setattr(
        lanes.subprocess,
        "run",
        lambda command, **kwargs: calls.append(command) or subprocess.CompletedProcess(command, 0),
    )
    monkeypatch.setattr(lanes, "VENVS", tmp_path / "venvs")
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    wheel.touch()
    monkeypatch.setenv("FASTFT_TORCH_WHEEL", str(wheel))
    monkeypatch.setattr(lanes, "check_versions", lambda lane: None)
    monkeypatch.setattr(lanes, "_create_venv", lambda installer, lane: lane.venv.mkdir(parents=True))
    assert lanes.build(lane, "pip", rebuild=True) == "built"
    (no_deps,) = [command for command in calls if "axolotl==0.19.0" in command]
    assert "--no-deps" in no_deps and "addict==2.4.0" in no_deps and "-r" not in no_deps

    path = tmp_path / "bad.txt"
    path.write_text("# lane: bad\n# no-deps: axolotl>=0.19\n")
    with pytest.raises(lanes.LaneError, match=r"bad.txt:2: '# no-deps:' takes an exact pin name==version"):
        lanes.read_lane(path)


def test_lanes_run_at_a_time_start_longest_first(lanes, tmp_path, monkeypatch):
    """Each lane file says how long its tests took in CI; with two at a time the longest start first, so the longest
    lane does not start last while the other worker idles. The summary keeps the lanes' own order."""
    # Every lane CI tests: all but newest, the main run's own set, which .ci/run skips (--skip-main-set).
    durations = {lane.name: lane.test_seconds for lane in lanes.all_lanes() if lane.name != "newest"}
    assert all(seconds > 0 for seconds in durations.values()), durations
    pins = ["transformers==5.24.0", "peft==0.21.2", "trl==1.16.0", "bitsandbytes==0.50.2", "accelerate==1.15.0"]
    path = tmp_path / "mine.txt"
    path.write_text("\n".join(["# lane: mine", "# test-seconds: 12.5", *pins, "datasets==5.2.0"]))
    assert lanes.read_lane(path).test_seconds == 12.5
    # A new timing changes no dependency: the venv it was built into stays current.
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    timed = lanes._stamps(lanes.read_lane(path), wheel)
    path.write_text(path.read_text().replace("# test-seconds: 12.5\n", ""))
    assert lanes._stamps(lanes.read_lane(path), wheel) == timed
    path.write_text(path.read_text().replace("datasets==5.2.0", "datasets==5.1.0"))
    assert lanes._stamps(lanes.read_lane(path), wheel)["dependencies"] != timed["dependencies"]
    path.write_text("\n".join(["# lane: mine", "# test-seconds: ten", *pins, "datasets==5.2.0"]))
    with pytest.raises(lanes.LaneError, match=r"mine.txt:2: '# test-seconds:' takes a number, found 'ten'"):
        lanes.read_lane(path)

    chosen = [lanes.Lane(name, path, {}, test_seconds=seconds) for name, seconds in [("a", 5), ("b", 50), ("c", 20)]]
    started = []
    monkeypatch.setattr(lanes, "build_lane", lambda lane, installer, rebuild: lanes.Outcome(lane, "reused"))
    monkeypatch.setattr(lanes, "run_lane_tests", lambda outcome, args, log=None: started.append(outcome.lane.name))
    outcomes = lanes.run_lanes(chosen, "pip", False, [], jobs=1)
    assert started == ["a", "b", "c"]  # one at a time: the lanes' own order
    started.clear()
    outcomes = lanes.run_lanes(chosen, "pip", False, [], jobs=2)
    assert started[0] == "b" and sorted(started) == ["a", "b", "c"]
    assert [outcome.lane.name for outcome in outcomes] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "broken"),
    [
        ("3.6.0", "2.4.1", True),  # torch 2.11's CUDA pin under the newest numpy: the interpreter fails
        ("3.7.1", "2.4.0", True),
        ("3.8.0", "2.2.6", False),  # Python 3.10: no triton 3.9, no numpy 2.3+; the kernel tests pass there
        ("3.9.0", "2.4.1", False),
        ("3.9.0", "2.2.6", False),
    ],
)
def test_the_interpreter_gate_refuses_only_triton_older_than_3_9_under_numpy_2_4(triton_version, numpy_version, broken):
    from conftest import interpreter_loops_broken

    assert interpreter_loops_broken(triton_version, numpy_version) is broken
