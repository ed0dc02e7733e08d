"""Competitor venvs built from an interpreter that is itself a venv, as on the GPU image (``python3`` is
``/opt/torch/.venv/bin/python3``): the competitor venv must see that venv's packages, pip (offline) must count them
as installed, and the competitor's own pins must win over the parent's and over ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from synthetic_wheels import build_wheel, installed_package

from fastft.bench import venvs


def _run(python: Path, code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def _site_packages(python: Path) -> Path:
    return Path(_run(python, "import sysconfig; print(sysconfig.get_path('purelib'))"))


def test_parent_site_dirs_lists_site_packages_and_existing_pythonpath_entries(tmp_path, monkeypatch):
    carried = tmp_path / "carried"
    carried.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(carried), str(tmp_path / "absent"), str(carried)]))
    folders = venvs.parent_site_dirs()
    import site

    assert folders[: len(site.getsitepackages())] == [os.path.abspath(p) for p in site.getsitepackages()]
    # Each folder once; one that does not exist is left out.
    assert folders.count(str(carried)) == 1 and str(tmp_path / "absent") not in folders


def test_a_competitor_venv_built_from_a_venv_sees_its_packages_and_keeps_its_own_pins(tmp_path):
    # The test's interpreter plays the base; venv A plays /opt/torch/.venv (torch, transformers and fastft installed
    # there: here, seen through venvs.create), and has one package of its own. Competitor venv B is built from A's
    # Python by venvs.ensure, offline.
    parent = tmp_path / "A"
    parent_python = venvs.create(parent, with_pip=False)
    parent_site = _site_packages(parent_python)
    installed_package(parent_site, "only_in_a", "1.0", "WHERE = 'A'\n")

    # What broke on the H100: a plain --system-site-packages venv made from A's Python does not see A's packages.
    plain = tmp_path / "plain"
    command = [str(parent_python), "-m", "venv", "--system-site-packages", "--without-pip", str(plain)]
    subprocess.run(command, check=True)
    hidden = subprocess.run([str(venvs.python_of(plain)), "-c", "import only_in_a"], capture_output=True, check=False)
    assert hidden.returncode != 0

    # A carried wheel folder holds the competitor's pin; PYTHONPATH (where gpu_check.sh installs the harness's
    # carried wheels) holds another version of the same package, which must not shadow the pin.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels, "pinned_pkg", "1.0", {"pinned_pkg/__init__.py": b"VERSION = '1.0'\n"})
    carried = tmp_path / "carried"
    carried.mkdir()
    installed_package(carried, "pinned_pkg", "2.0", "VERSION = '2.0'\n")
    env = {
        **os.environ,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PYTHONPATH": str(carried),
    }
    root = tmp_path / "venvs"
    spec = {"requirements": ["only_in_a==1.0", "pinned_pkg==1.0", "pytest"], "no_deps": []}
    code = (
        "import json, sys; from pathlib import Path; from fastft.bench import venvs; "
        f"venvs.VENVS['probe'] = {spec!r}; print(venvs.ensure('probe', Path(sys.argv[1])))"
    )
    result = subprocess.run(
        [str(parent_python), "-c", code, str(root)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    log = (root / "probe-build.log").read_text() if (root / "probe-build.log").exists() else ""
    assert result.returncode == 0, result.stdout + result.stderr + log
    competitor = Path(result.stdout.strip().splitlines()[-1])
    assert competitor == venvs.python_of(root / "probe")
    # Offline pip counted A's package and the test interpreter's pytest as installed (it has no wheel for either),
    # and installed only the pin.
    competitor_site = _site_packages(competitor)
    assert (competitor_site / "pinned_pkg" / "__init__.py").exists()
    assert not (competitor_site / "only_in_a").exists() and not (competitor_site / "pytest").exists()

    probe = (
        "import json, only_in_a, pinned_pkg, pytest, fastft; "
        "print(json.dumps([only_in_a.WHERE, pinned_pkg.VERSION, pinned_pkg.__file__]))"
    )
    where, version, location = json.loads(_run(competitor, probe, env=env, cwd=tmp_path))
    assert where == "A"
    # The pin wins even with PYTHONPATH naming the parent's other version (the H100's Unsloth ran trl 1.16).
    assert version == "1.0" and Path(location).parent.parent == competitor_site
    # Without PYTHONPATH at run time the carried folder is still seen, behind the venv's own.
    bare = {key: value for key, value in env.items() if key != "PYTHONPATH"}
    paths = json.loads(_run(competitor, "import json, sys; print(json.dumps(sys.path))", env=bare, cwd=tmp_path))
    paths = [os.path.realpath(entry) for entry in paths]
    order = [paths.index(os.path.realpath(folder)) for folder in (competitor_site, parent_site, carried)]
    assert order == sorted(order), paths

    stamp = json.loads((root / "probe" / venvs.STAMP).read_text())
    assert stamp["python"] == str(parent_python) and str(carried) in stamp["parents"]


def test_a_failed_creation_names_the_venv_and_its_log(tmp_path, monkeypatch):
    def broken(venv, with_pip=True, parents=None):
        raise venvs.VenvError("fastft.bench.venvs: `python -m venv` failed (exit 1): no space left")

    monkeypatch.setattr(venvs, "create", broken)
    with pytest.raises(venvs.VenvError, match=r"creating the liger venv failed; see .*liger-build\.log"):
        venvs.ensure("liger", tmp_path)
    assert "no space left" in (tmp_path / "liger-build.log").read_text()
