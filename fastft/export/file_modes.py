"""Give files fastft writes the permissions the user's umask gives new files (0644 / 0755 by default).

``tempfile.mkstemp`` and ``mkdtemp`` (the atomic writes' staging files and folders) and safetensors' own atomic
writer create 0600 files and 0700 folders, which another user, or a container running as another uid, cannot read.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_lock = threading.Lock()


def current_umask() -> int:
    """The process's umask (read by setting and restoring it: POSIX has no call that only reads it)."""
    with _lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def as_if_created(path: str | os.PathLike, recursive: bool = False) -> None:
    """Set ``path``'s mode to what ``open()`` / ``mkdir()`` would have given it under the current umask.

    Args:
        path: A file or folder fastft wrote.
        recursive: For a folder, also every file and folder inside it.
    """
    mask = current_umask()
    path = Path(path)
    paths = [path]
    if recursive and path.is_dir():
        paths += list(path.rglob("*"))
    for item in paths:
        if item.is_symlink():
            continue
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
