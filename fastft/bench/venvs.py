"""Competitor environments for ``fastft bench``: one virtual environment per competitor, built once and reused.

Each venv must use the torch (and triton) this machine already has, CPU or CUDA build, and pip must count what the
harness's interpreter has as installed, so that ``PIP_NO_INDEX=1 PIP_FIND_LINKS=<wheel folder>`` only has to supply
what is missing. ``--system-site-packages`` alone is not enough for that: it exposes the *base* interpreter's
packages, and when the running interpreter is itself a venv (the GPU image's ``python3`` is
``/opt/torch/.venv/bin/python3``) torch and transformers live in that venv, not in the base. So :func:`create` adds a
``.pth`` file to the new venv that puts the running interpreter's package folders (and ``PYTHONPATH``'s) on its
path, after the venv's own folder: the competitor's pins, installed into the venv, shadow the harness's
transformers, peft and trl, and everything else comes from the parent.

pip, not uv, because pip counts the system's torch as installed: a resolver that ignores it would fetch PyPI's CUDA
torch (gigabytes) on a CPU machine, and nothing on an offline GPU machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

from fastft.bench.systems import VENVS

logger = logging.getLogger(__name__)
STAMP = "fastft-bench-venv.json"
PTH_NAME = "fastft-parent-site.pth"

# The module the .pth imports at every start of the venv's Python. Its name carries a digest of the venv's path:
# a venv built from another such venv processes the parent's .pth too, and a shared module name would already be in
# sys.modules there, silently skipping the parent's own parents.
_HELPER = '''"""Written by fastft.bench.venvs: this venv sees the package folders of the interpreter that built it."""

import os
import site
import sys

PARENT_DIRS = {dirs}
OWN = os.path.dirname(os.path.abspath(__file__))


def _install():
    for folder in PARENT_DIRS:
        # After this venv's own folder, with the folder's .pth files (editable installs, namespace packages).
        site.addsitedir(folder)
    # PYTHONPATH precedes every site folder, so a carried trl 1.16 there would shadow this venv's pinned 1.15:
    # this venv's own folder moves in front of the first PYTHONPATH entry.
    extra = {{os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry}}
    first = next((i for i, entry in enumerate(sys.path) if entry and os.path.abspath(entry) in extra), None)
    if first is not None and OWN in sys.path and sys.path.index(OWN) > first:
        sys.path.remove(OWN)
        sys.path.insert(first, OWN)


_install()
'''


class VenvError(RuntimeError):
    """A competitor's venv could not be built; the message names it, the failing step and where its log is."""


def default_root() -> Path:
    """``FASTFT_BENCH_VENVS``, else ``.bench/venvs`` in a source checkout, else ``~/.cache/fastft/bench-venvs``."""
    override = os.environ.get("FASTFT_BENCH_VENVS")
    if override:
        return Path(override)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists() and (checkout / "bench").is_dir():
        return checkout / ".bench" / "venvs"
    return Path.home() / ".cache" / "fastft" / "bench-venvs"


def python_of(venv: Path) -> Path:
    """The Python executable of ``venv``."""
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def parent_site_dirs() -> list[str]:
    """The package folders the running interpreter imports from, in its order, that exist.

    Its site-packages (a venv's own, and the base's when that venv has system site packages), the user site when
    Python enables it, and the ``PYTHONPATH`` entries (where ``bench/gpu_check.sh`` installs carried wheels). Not the
    script's folder or the current one: from the checkout's root, ``kernels/`` would shadow the PyPI ``kernels``.
    """
    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    folders += [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    seen: dict[str, None] = {}
    for folder in folders:
        if os.path.isdir(folder):
            seen.setdefault(os.path.abspath(folder), None)
    return list(seen)


def _own_path(python: Path) -> list[str]:
    """``sys.path`` of a fresh venv's Python, without ``PYTHONPATH``: the folders it sees on its own (resolved)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [str(python), "-c", "import json, sys; print(json.dumps(sys.path))"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        raise VenvError(
            f"fastft.bench.venvs: the new venv's Python {python} does not start (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}; delete its folder and build it again"
        )
    return [os.path.realpath(entry) for entry in json.loads(result.stdout.strip().splitlines()[-1]) if entry]


def _site_packages(python: Path) -> Path:
    """The venv's own site-packages folder (where pip installs into it)."""
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    result = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise VenvError(
            f"fastft.bench.venvs: cannot ask {python} for its site-packages (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}"
        )
    return Path(result.stdout.strip())


def create(venv: Path, with_pip: bool = True, parents: list[str] | None = None) -> Path:
    """Make ``venv`` from the running interpreter so that it sees that interpreter's packages; its Python.

    The venv has ``--system-site-packages`` (the base interpreter's packages) and a ``.pth`` naming
    ``parents`` (default :func:`parent_site_dirs`) less what it already sees, after its own folder: what is installed
    into the venv wins, and pip counts everything else as installed.

    Args:
        venv: The folder to create; an existing one is replaced.
        with_pip: Give the venv its own pip (``ensurepip``), as a build needs.
        parents: The folders to expose; default the running interpreter's.

    Raises:
        VenvError: ``python -m venv`` failed, or the new Python does not start.
    """
    command = [sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv)]
    if not with_pip:
        command.append("--without-pip")
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise VenvError(
            f"fastft.bench.venvs: `{' '.join(command)}` failed (exit {result.returncode}): "
            f"{(result.stdout + result.stderr).strip()[-2000:]}"
        )
    python = python_of(venv)
    seen = set(_own_path(python))
    wanted = parent_site_dirs() if parents is None else parents
    missing = [folder for folder in wanted if os.path.realpath(folder) not in seen]
    own = _site_packages(python)
    module = "_fastft_parent_" + hashlib.sha256(str(own).encode()).hexdigest()[:12]
    (own / f"{module}.py").write_text(_HELPER.format(dirs=json.dumps(missing, indent=4)))
    (own / PTH_NAME).write_text(f"import {module}\n")
    return python


def wanted_stamp(name: str) -> dict[str, object]:
    """What a venv must have been built from to be reused: the pins, the interpreter, its torch and its folders."""
    import torch

    spec = VENVS[name]
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "name": name,
        "spec": digest,
        "python": sys.executable,
        "torch": torch.__version__,
        "parents": parent_site_dirs(),
    }


def ensure(name: str, root: Path | None = None, rebuild: bool = False) -> Path:
    """The Python of competitor ``name``'s venv, building it first when missing, stale or ``rebuild``.

    Raises:
        KeyError: ``name`` is not a competitor with a venv.
        VenvError: An install step failed (its output is in ``<root>/<name>-build.log``).
    """
    spec = VENVS[name]
    venv = (root or default_root()) / name
    stamp_path = venv / STAMP
    wanted = wanted_stamp(name)
    if not rebuild and stamp_path.exists() and json.loads(stamp_path.read_text()) == wanted:
        logger.info("fastft bench: reusing the %s venv at %s", name, venv)
        return python_of(venv)
    started = time.perf_counter()
    logger.info("fastft bench: building the %s venv at %s (about a minute; reused on later runs)", name, venv)
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{name}-build.log"
    with log.open("w") as handle:
        handle.write(f"$ create {venv} from {sys.executable}, exposing {wanted['parents']}\n")
        try:
            python = create(venv)
        except VenvError as error:
            handle.write(f"{error}\n")
            raise VenvError(f"fastft bench: creating the {name} venv failed; see {log}. {error}") from None
        pip = [str(python), "-m", "pip", "install", "-q"]
        steps = [("installing its pins", [*pip, *spec["requirements"]])]
        if spec.get("no_deps"):
            steps.append(("installing it", [*pip, "--no-deps", *spec["no_deps"]]))
        for what, command in steps:
            handle.write(f"$ {' '.join(command)}\n")
            handle.flush()
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False)
            if result.returncode != 0:
                raise VenvError(
                    f"fastft bench: {what} for the {name} venv failed (exit {result.returncode}); see {log}. "
                    f"Offline, point pip at wheels: PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder> "
                    f"(bench/offline_wheels.py builds that folder)."
                )
    stamp_path.write_text(json.dumps(wanted, indent=2) + "\n")
    logger.info("fastft bench: %s venv ready in %.0f s", name, time.perf_counter() - started)
    return python_of(venv)
