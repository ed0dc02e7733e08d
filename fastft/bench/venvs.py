"""Competitor environments for ``fastft bench``: one virtual environment per competitor, built once and reused.

Each venv is made with ``--system-site-packages``, so it uses the torch (and triton) this machine already has, CPU
or CUDA build; pip then installs the competitor's pins into the venv, where they shadow the harness's own
transformers, peft and trl. pip, not uv, because pip counts the system's torch as installed: a resolver that
ignores it would fetch PyPI's CUDA torch (gigabytes) on a CPU machine, and nothing on an offline GPU machine. pip
reads its usual configuration, so ``PIP_NO_INDEX=1 PIP_FIND_LINKS=<wheel folder>`` builds from carried wheels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fastft.bench.systems import VENVS

logger = logging.getLogger(__name__)
STAMP = "fastft-bench-venv.json"


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
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def wanted_stamp(name: str) -> dict[str, object]:
    """What a venv must have been built from to be reused: the pins and the interpreter and torch underneath."""
    import torch

    spec = VENVS[name]
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return {"name": name, "spec": digest, "python": sys.executable, "torch": torch.__version__}


def ensure(name: str, root: Path | None = None, rebuild: bool = False) -> Path:
    """The Python of competitor ``name``'s venv, building it first when missing, stale or ``rebuild``.

    Raises:
        KeyError: ``name`` is not a competitor with a venv.
        VenvError: An install step failed (its output is in ``<venv>/build.log``).
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
    steps = [
        ("creating the venv", [sys.executable, "-m", "venv", "--system-site-packages", str(venv)]),
        ("installing its pins", [str(python_of(venv)), "-m", "pip", "install", "-q", *spec["requirements"]]),
        ("installing it", [str(python_of(venv)), "-m", "pip", "install", "-q", "--no-deps", *spec["no_deps"]]),
    ]
    with log.open("w") as handle:
        for what, command in steps:
            handle.write(f"$ {' '.join(command)}\n")
            handle.flush()
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False)
            if result.returncode != 0:
                raise VenvError(
                    f"fastft bench: {what} for the {name} venv failed (exit {result.returncode}); see {log}. "
                    f"Offline, point pip at wheels: PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder>."
                )
    stamp_path.write_text(json.dumps(wanted, indent=2) + "\n")
    logger.info("fastft bench: %s venv ready in %.0f s", name, time.perf_counter() - started)
    return python_of(venv)
