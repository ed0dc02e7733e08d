"""Small, valid wheels built with zipfile for the tests of the venv builder and the offline wheel bundle: no index,
no download. A wheel here is what pip installs: the files, ``METADATA``, ``WHEEL`` and a ``RECORD`` that lists every
file with its sha256 and size."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def record_hash(data: bytes) -> str:
    """The ``sha256=...`` field RECORD gives a file: urlsafe base64 of the digest, without padding."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(
    folder: Path,
    name: str,
    version: str,
    files: dict[str, bytes],
    tag: str = "py3-none-any",
    requires: tuple[str, ...] = (),
) -> Path:
    """Write ``<name>-<version>-<tag>.whl`` into ``folder`` holding ``files`` (archive paths to contents).

    Args:
        folder: Where the wheel goes.
        name: The distribution name (``-`` becomes ``_`` in file names, as wheels spell it).
        version: Its version.
        files: Paths inside the wheel and their bytes, besides the dist-info.
        tag: The wheel's tag (``cp312-cp312-manylinux_2_28_x86_64`` for a native one).
        requires: ``Requires-Dist`` lines.
    """
    stem = name.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    metadata = "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {line}\n" for line in requires)
    purelib = "true" if tag.endswith("-none-any") else "false"
    wheel = f"Wheel-Version: 1.0\nGenerator: fastft-tests\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n"
    entries = {**files, f"{info}/METADATA": metadata.encode(), f"{info}/WHEEL": wheel.encode()}
    record = "".join(f"{path},{record_hash(data)},{len(data)}\n" for path, data in entries.items())
    record += f"{info}/RECORD,,\n"
    entries[f"{info}/RECORD"] = record.encode()
    path = folder / f"{stem}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, data in entries.items():
            archive.writestr(member, data)
    return path


def installed_package(site_packages: Path, name: str, version: str, source: str) -> None:
    """Lay out an installed package by hand (module, dist-info with METADATA and INSTALLER), as pip would."""
    module = site_packages / name
    module.mkdir(parents=True)
    (module / "__init__.py").write_text(source)
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
