"""Checks of ``fastft bench``'s flags that need the file system, run before anything is measured or written.

Each failure is a :class:`~fastft.bench.harness.BenchError` whose message names the flag as typed, what was wrong and
what to do, so ``fastft bench`` prints it as one ``error:`` line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fastft.bench.harness import BenchError

# What `fastft bench --readme-from` reads of a record (written by fastft.bench.harness).
RECORD_KEYS = ("benchmark", "device", "settings", "runs")


def check_folder(path: Path | None, flag: str, command: str = "fastft bench") -> None:
    """Refuse a folder flag whose path is a file, or that cannot be created or written (it is created when missing).

    Args:
        path: The folder the flag names (None: not given, nothing to check).
        flag: The flag as typed, for the message.
        command: The command the message names.
    """
    if path is None:
        return
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise BenchError(f"{command} {flag} {path}: {where}; name a folder (it is created when missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BenchError(
            f"fastft bench {flag} {path}: {existing} is not writable by this user; name a folder you can write"
        )


def check_readme(path: Path | None, flag: str = "--readme") -> None:
    """Refuse a README path that is a folder, or whose folder cannot be created (a missing README is created, its
    section for the device added)."""
    if path is None:
        return
    if path.is_dir():
        raise BenchError(f"fastft bench {flag} {path}: is a folder; name the markdown file to update (bench/README.md)")
    check_folder(path.parent, f"{flag} {path}: its folder")


def read_record(path: Path) -> dict[str, Any]:
    """The record ``--readme-from`` names, refused unless it is a JSON written by ``fastft bench``."""
    flag = f"--readme-from {path}"
    if not path.is_file():
        raise BenchError(
            f"fastft bench {flag}: no such file; pass a JSON that fastft bench wrote (bench/results/bench-*.json)"
        )
    try:
        record = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BenchError(f"fastft bench {flag}: not JSON ({error}); pass a JSON that fastft bench wrote") from error
    missing = [key for key in RECORD_KEYS if not isinstance(record, dict) or key not in record]
    if missing or record.get("benchmark") != "fastft bench":
        found = record.get("benchmark") if isinstance(record, dict) else type(record).__name__
        raise BenchError(
            f"fastft bench {flag}: not a fastft bench record (benchmark {found!r}, missing {missing}); bench/lora.py, "
            "bench/kernels.py and bench/host.py records have tables of their own in bench/README.md"
        )
    return record


__all__ = ["RECORD_KEYS", "check_folder", "check_readme", "read_record"]
