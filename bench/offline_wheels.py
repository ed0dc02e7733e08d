"""Build the folder of wheels a GPU machine without network needs for bench/gpu_check.sh, trimmed to fit a transfer.

    python bench/offline_wheels.py --out .whl                    # the image's defaults (below); about 80 MB fetched
    python bench/offline_wheels.py --out .whl --cuda 12.8 --python 3.11 --report bench/results/offline-wheels.json

The target is the GPU image of bench/README.md: Python 3.12, CUDA 13.0, torch 2.11, transformers 5.17, peft 0.21.0 and
accelerate 1.15 already installed. Every wheel is a pinned version fetched with ``pip download --no-deps
--only-binary=:all:`` for that Python and manylinux x86_64, then two are repacked:

- bitsandbytes keeps only the native libraries of the CUDA major present (plus its tiny CPU library): the wheel ships
  one per CUDA release and per ROCm / XPU release, 43 MB in all, of which the machine loads one;
- Unsloth drops ``studio/``, its web app (80 % of the wheel), which ``import unsloth`` never touches (only the
  ``unsloth`` command line's studio commands import it).

A repacked wheel's RECORD is rewritten from its new contents, so pip installs it as any other. Two folders come out:
``OUT/`` holds what fastft, its tests and the harness import (gpu_check.sh installs every ``OUT/*.whl`` onto
``PYTHONPATH``), ``OUT/competitors/`` what only the competitor venvs take (``PIP_FIND_LINKS="OUT OUT/competitors"``
while fastft bench builds them): Unsloth pins trl 1.15 and datasets 4.x, which must not replace fastft's.

The script then checks that every requirement those installs resolve (fastft's own from pyproject.toml, each venv's
from ``fastft.bench.systems.VENVS``, and each bundled wheel's) is met by a bundled wheel or by a package the image
has, and writes a report with every size; ``--max-mb`` (default 60) fails the run when the total is larger.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
FASTFT, COMPETITORS = "fastft", "competitors"
MIB = 1 << 20


@dataclass(frozen=True)
class Pin:
    """One wheel of the bundle.

    Attributes:
        requirement: ``name==version``.
        side: ``"fastft"`` (installed onto the harness's path) or ``"competitors"`` (only for the venvs' pip).
        why: Who needs it.
    """

    requirement: str
    side: str
    why: str

    @property
    def name(self) -> str:
        return canonicalize_name(Requirement(self.requirement).name)


# The versions are the newest that fit the image's torch and the competitors' caps on the day they were chosen;
# move them together with .ci/lanes and fastft.bench.systems.VENVS.
PINS: tuple[Pin, ...] = (
    Pin("bitsandbytes==0.50.2", FASTFT, "NF4 (fastft, the tests, every system's NF4 workloads)"),
    Pin("trl==1.16.0", FASTFT, "fastft.training.trl, the SFT / DPO / GRPO tests, bench/preference.py"),
    Pin("datasets==5.2.0", FASTFT, "trl's trainers"),
    Pin("dill==0.4.1", FASTFT, "datasets"),
    Pin("multiprocess==0.70.19", FASTFT, "datasets"),
    Pin("gguf==0.19.0", FASTFT, "fastft's GGUF export and the tests' embedded tokenizer"),
    Pin("unsloth==2026.10.9", COMPETITORS, "the unsloth system"),
    Pin("unsloth_zoo==2026.10.9", COMPETITORS, "unsloth"),
    Pin("trl==1.15.0", COMPETITORS, "unsloth caps trl at 1.15"),
    Pin("datasets==4.8.5", COMPETITORS, "unsloth caps datasets below 5"),
    Pin("fsspec==2026.2.0", COMPETITORS, "datasets 4.8 caps fsspec at 2026.2.0 (the image has a newer one)"),
    Pin("peft==0.21.2", COMPETITORS, "the unsloth venv's pin"),
    Pin("torchao==0.18.0", COMPETITORS, "unsloth_zoo (0.18 is built for torch >= 2.11)"),
    Pin("cut_cross_entropy==25.1.1", COMPETITORS, "unsloth_zoo"),
    Pin("tyro==1.0.17", COMPETITORS, "unsloth"),
    Pin("docstring_parser==0.18.0", COMPETITORS, "tyro"),
    Pin("typeguard==4.6.1", COMPETITORS, "tyro"),
    Pin("msgspec==0.22.0", COMPETITORS, "unsloth_zoo"),
    Pin("hf_transfer==0.1.9", COMPETITORS, "unsloth"),
    Pin("json5==0.17.3", COMPETITORS, "unsloth"),
    Pin("nest-asyncio==1.6.0", COMPETITORS, "unsloth"),
    Pin("einops==0.8.2", COMPETITORS, "unsloth_zoo"),
    Pin("sentencepiece==0.2.3", COMPETITORS, "unsloth"),
    Pin("protobuf==7.36.2", COMPETITORS, "unsloth"),
    Pin("typer==0.29.2", COMPETITORS, "the unsloth venv's pins"),
    Pin("annotated-doc==0.0.4", COMPETITORS, "typer"),
    Pin("click==8.5.1", COMPETITORS, "typer"),
    Pin("rich==15.0.0", COMPETITORS, "the unsloth venv's pins, typer"),
    Pin("markdown-it-py==4.3.0", COMPETITORS, "rich"),
    Pin("mdurl==0.1.2", COMPETITORS, "markdown-it-py"),
    Pin("pydantic==2.14.4", COMPETITORS, "the unsloth venv's pins, typer"),
    Pin("pydantic-core==2.50.5", COMPETITORS, "pydantic (its exact pin)"),
    Pin("annotated-types==0.8.0", COMPETITORS, "pydantic"),
    Pin("typing-inspection==0.4.5", COMPETITORS, "pydantic"),
    Pin("typing-extensions==4.16.0", COMPETITORS, "pydantic wants >= 4.16 (only taken where the image's is older)"),
    Pin("wheel==0.48.0", COMPETITORS, "the unsloth venv's pins"),
    Pin("liger-kernel==0.8.5", COMPETITORS, "the liger system"),
)

# What the image has, with the version where bench/README.md states it. The others are assumed from what those
# packages depend on (torch, transformers, accelerate, huggingface_hub), from pytest's plugins seen in its logs, and
# from what the 2026-11-25 run imported without carrying it (matplotlib drew the plots; datasets 5.2 imported).
# The report lists every requirement that rests on an assumed one; gpu_check.sh's preflight prints what imports.
STATED = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "peft": "0.21.0", "accelerate": "1.15.0"}
ASSUMED = [
    "numpy",
    "packaging",
    "pyyaml",
    "regex",
    "tqdm",
    "filelock",
    "fsspec",
    "jinja2",
    "sympy",
    "networkx",
    "psutil",
    "safetensors",
    "tokenizers",
    "huggingface-hub",
    "hf-xet",
    "httpx",
    "requests",
    "certifi",
    "typer-slim",
    "shellingham",
    "setuptools",
    "pillow",
    "matplotlib",
    "pandas",
    "pyarrow",
    "xxhash",
    "aiohttp",
    "pygments",
    "pytest",
    "pytest-xdist",
    "pytest-benchmark",
]
# Installed with --no-deps by fastft.bench.venvs (their declared dependencies include packages text LoRA never
# imports: xformers, torchvision, diffusers); the venv's own requirements list what they import instead.
NO_DEPS = {"unsloth", "unsloth-zoo", "liger-kernel"}


class BundleError(RuntimeError):
    """The bundle cannot be built as asked; the message says what and what to do."""


# --- wheels: reading, verifying, repacking ---------------------------------------------------------------------


def record_hash(data: bytes) -> str:
    """RECORD's hash field for ``data``: ``sha256=`` and the urlsafe base64 digest without padding."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def dist_info(archive: zipfile.ZipFile) -> str:
    """The wheel's ``*.dist-info`` folder name.

    Raises:
        BundleError: It has none, or several.
    """
    folders = {name.split("/")[0] for name in archive.namelist() if name.split("/")[0].endswith(".dist-info")}
    if len(folders) != 1:
        raise BundleError(f"offline_wheels: {archive.filename} has {len(folders)} .dist-info folders, expected one")
    return folders.pop()


def verify(wheel: Path) -> None:
    """Check that RECORD lists every file of ``wheel`` with its right hash and size, and nothing else.

    Raises:
        BundleError: The first mismatch, named.
    """
    with zipfile.ZipFile(wheel) as archive:
        record_name = f"{dist_info(archive)}/RECORD"
        rows = list(csv.reader(io.StringIO(archive.read(record_name).decode())))
        listed = {row[0]: row for row in rows if row}
        members = [info.filename for info in archive.infolist() if not info.is_dir()]
        for name in members:
            if name not in listed:
                raise BundleError(f"offline_wheels: {wheel.name}: {name} is not in its RECORD")
            if name == record_name:
                continue
            data = archive.read(name)
            _, digest, size = listed[name]
            if digest != record_hash(data) or int(size) != len(data):
                raise BundleError(f"offline_wheels: {wheel.name}: RECORD's hash or size of {name} is wrong")
        for name in listed:
            if name not in members:
                raise BundleError(f"offline_wheels: {wheel.name}: RECORD lists {name}, which the wheel lacks")


def repack(
    source: Path, target: Path, drop: Callable[[str], bool], edit: Callable[[str, bytes], bytes] | None = None
) -> list[dict[str, Any]]:
    """Copy wheel ``source`` to ``target`` without the files ``drop`` selects, ``edit`` applied to the rest.

    RECORD is written anew from the contents kept (a signature over the old RECORD, RECORD.jws / .p7s, is dropped:
    it no longer holds). Returns the dropped files, each ``{"path", "bytes", "compressed_bytes"}``.
    """
    dropped = []
    with zipfile.ZipFile(source) as archive:
        info_dir = dist_info(archive)
        record_name = f"{info_dir}/RECORD"
        signatures = {f"{record_name}.jws", f"{record_name}.p7s"}
        kept: list[tuple[zipfile.ZipInfo, bytes]] = []
        for info in archive.infolist():
            if info.filename == record_name or info.is_dir():
                continue
            if info.filename in signatures or drop(info.filename):
                dropped.append({"path": info.filename, "bytes": info.file_size, "compressed_bytes": info.compress_size})
                continue
            data = archive.read(info)
            kept.append((info, edit(info.filename, data) if edit else data))
    rows = [f"{info.filename},{record_hash(data)},{len(data)}" for info, data in kept]
    record = "\n".join([*rows, f"{record_name},,"]) + "\n"
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as out:
        for info, data in kept:
            copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            copy.external_attr, copy.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            out.writestr(copy, data)
        out.writestr(zipfile.ZipInfo(record_name, date_time=(1980, 1, 1, 0, 0, 0)), record)
    partial.replace(target)
    return dropped


_NATIVE = re.compile(r"^bitsandbytes/libbitsandbytes_(cuda|rocm|xpu)(\d+)\.(so|dll|dylib)$")


def bitsandbytes_drop(cuda_major: int) -> Callable[[str], bool]:
    """What to drop from bitsandbytes: every native library but those of CUDA ``cuda_major`` (``cuda130``,
    ``cuda132`` for 13; bitsandbytes picks the best one of the running CUDA's major), and the ROCm and XPU ones.
    The CPU library stays (18 kB)."""

    def drop(name: str) -> bool:
        match = _NATIVE.match(name)
        if match is None:
            return False
        kind, version = match.group(1), match.group(2)
        # Versions are major and one minor digit: 118, 124, 130.
        return kind != "cuda" or version[:-1] != str(cuda_major)

    return drop


def unsloth_drop(name: str) -> bool:
    """Unsloth's web app: the top-level ``studio/`` folder."""
    return name.startswith("studio/")


def unsloth_edit(name: str, data: bytes) -> bytes:
    """``top_level.txt`` without ``studio``, which the wheel no longer has."""
    if name.endswith(".dist-info/top_level.txt"):
        return "".join(line for line in data.decode().splitlines(keepends=True) if line.strip() != "studio").encode()
    return data


# --- fetching ----------------------------------------------------------------------------------------------------


def pip_download(pin: Pin, folder: Path, python: str, platforms: tuple[str, ...]) -> Path:
    """``pip download`` one pinned wheel (no dependencies, binaries only) for ``python`` / ``platforms``; its path.

    Raises:
        BundleError: pip failed (its output is in the message), or wrote no wheel of that name.
    """
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version"]
    command += [python, "--implementation", "cp", "-d", str(folder), "--disable-pip-version-check", "-q"]
    for platform in platforms:
        command += ["--platform", platform]
    result = subprocess.run([*command, pin.requirement], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BundleError(
            f"offline_wheels: `pip download {pin.requirement}` for Python {python} failed "
            f"(exit {result.returncode}): {(result.stdout + result.stderr).strip()[-3000:]}"
        )
    return find_wheel(folder, pin)


def find_wheel(folder: Path, pin: Pin) -> Path:
    """The wheel of ``pin`` (name and version) in ``folder``.

    Raises:
        BundleError: None is there.
    """
    version = Version(pin.requirement.split("==", 1)[1])
    for wheel in sorted(folder.glob("*.whl")):
        name, found = wheel.name.split("-")[:2]
        if canonicalize_name(name) == pin.name and Version(found) == version:
            return wheel
    raise BundleError(f"offline_wheels: no wheel of {pin.requirement} in {folder} after downloading it")


# --- the requirement check ---------------------------------------------------------------------------------------


def marker_environment(python: str) -> dict[str, str]:
    """Marker variables of CPython ``python`` on Linux x86_64, for evaluating ``Requires-Dist`` lines."""
    return {
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": python if python.count(".") == 2 else f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of ``wheel``'s METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{dist_info(archive)}/METADATA").decode()
    headers = metadata.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in headers.splitlines() if line.startswith("Requires-Dist:")]


def resolve(
    requirements: list[tuple[str, str]], bundled: dict[str, list[str]], python: str, present: dict[str, str | None]
) -> dict[str, list[dict[str, str]]]:
    """Where each ``(requirement, who)`` is met: a bundled wheel, a package the image is stated to have, one it is
    assumed to have, or nowhere (``unresolved``). Requirements whose marker is false on the target are left out.

    Args:
        requirements: Requirement strings and who asks for them.
        bundled: Canonical name to the versions bundled where this install looks.
        python: The target's Python version.
        present: Canonical name to the image's version, ``None`` where only assumed.
    """
    environment = marker_environment(python)
    verdicts: dict[str, list[dict[str, str]]] = {"bundled": [], "stated": [], "assumed": [], "unresolved": []}
    for text, who in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        row = {"requirement": text, "by": who}
        versions = [v for v in bundled.get(name, []) if requirement.specifier.contains(v, prereleases=True)]
        if versions:
            verdicts["bundled"].append({**row, "met_by": f"{name}=={versions[0]}"})
        elif name in present and present[name] is not None:
            if requirement.specifier.contains(present[name], prereleases=True):
                verdicts["stated"].append({**row, "met_by": f"{name}=={present[name]} (image)"})
            else:
                verdicts["unresolved"].append({**row, "met_by": f"the image has {name}=={present[name]}"})
        elif name in present:
            verdicts["assumed"].append({**row, "met_by": f"{name} (assumed on the image)"})
        else:
            verdicts["unresolved"].append({**row, "met_by": "nothing bundled or on the image"})
    return verdicts


def _load_venvs() -> dict[str, dict[str, list[str]]]:
    # By path: fastft/__init__ imports torch, which this script has no need for.
    spec = importlib.util.spec_from_file_location("_fastft_bench_systems", ROOT / "fastft" / "bench" / "systems.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules.
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module.VENVS


def fastft_requirements() -> list[str]:
    """fastft's runtime dependencies and its ``cuda`` extra, from pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError as error:
        raise BundleError("offline_wheels: needs Python >= 3.11 here (tomllib) to read pyproject.toml") from error
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["cuda"]]


def check_requirements(wheels: dict[str, list[Path]], python: str) -> dict[str, Any]:
    """What each install on the target resolves, and where each requirement is met (see :func:`resolve`)."""
    present: dict[str, str | None] = {canonicalize_name(name): None for name in ASSUMED}
    present.update({canonicalize_name(name): version for name, version in STATED.items()})

    def versions(paths: list[Path]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for path in paths:
            name, version = path.name.split("-")[:2]
            found.setdefault(canonicalize_name(name), []).append(version)
        return found

    own = wheels[FASTFT]
    asks = [(text, "fastft (pyproject.toml)") for text in fastft_requirements()]
    asks += [(text, wheel.name.split("-")[0]) for wheel in own for text in requires(wheel)]
    result = {FASTFT: resolve(asks, versions(own), python, present)}
    everything = [*own, *wheels[COMPETITORS]]
    for venv, spec in _load_venvs().items():
        asks = [(text, f"{venv} venv") for text in [*spec["requirements"], *spec["no_deps"]]]
        for wheel in everything:
            if canonicalize_name(wheel.name.split("-")[0]) not in NO_DEPS:
                asks += [(text, wheel.name.split("-")[0]) for text in requires(wheel)]
        result[venv] = resolve(asks, versions(everything), python, present)
    return result


# --- the bundle --------------------------------------------------------------------------------------------------


def build(
    out: Path,
    python: str = "3.12",
    cuda: str = "13.0",
    max_mb: float = 60.0,
    cache: Path | None = None,
    fetch: Callable[[Pin, Path, str, tuple[str, ...]], Path] | None = None,
    pins: tuple[Pin, ...] = PINS,
) -> dict[str, Any]:
    """Fetch, trim and check every pinned wheel into ``out`` (and ``out/competitors``); the report.

    Raises:
        BundleError: A download failed, a repacked wheel does not verify, or the total is over ``max_mb``.
    """
    cuda_major = int(cuda.split(".")[0])
    fetch = fetch or pip_download
    cache = cache or Path.home() / ".cache" / "fastft" / "offline-wheels" / f"py{python}"
    folders = {FASTFT: out, COMPETITORS: out / COMPETITORS}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.whl"):
            stale.unlink()
    rows, placed = [], {FASTFT: [], COMPETITORS: []}
    for pin in pins:
        source = fetch(pin, cache, python, PLATFORMS)
        target = folders[pin.side] / source.name
        dropped: list[dict[str, Any]] = []
        if pin.name == "bitsandbytes":
            dropped = repack(source, target, bitsandbytes_drop(cuda_major))
            if not _kept_cuda(target):
                raise BundleError(
                    f"offline_wheels: {source.name} has no native library for CUDA {cuda_major}; "
                    f"pick a bitsandbytes release that ships one, or --cuda of a major it has"
                )
        elif pin.name == "unsloth":
            dropped = repack(source, target, unsloth_drop, unsloth_edit)
        else:
            shutil.copyfile(source, target)
        verify(target)
        placed[pin.side].append(target)
        rows.append(
            {
                "wheel": target.name,
                "side": pin.side,
                "why": pin.why,
                "downloaded_bytes": source.stat().st_size,
                "bytes": target.stat().st_size,
                "dropped_files": len(dropped),
                "dropped_bytes": sum(row["bytes"] for row in dropped),
                "dropped": _summarise(dropped),
            }
        )
    total = sum(row["bytes"] for row in rows)
    report = {
        "target": {"python": python, "cuda": cuda, "platforms": list(PLATFORMS), "image_has": STATED},
        "wheels": rows,
        "total_bytes": total,
        "downloaded_bytes": sum(row["downloaded_bytes"] for row in rows),
        "limit_bytes": int(max_mb * MIB),
        "requirements": check_requirements(placed, python),
    }
    if total > max_mb * MIB:
        largest = ", ".join(f"{row['wheel']} {row['bytes'] / MIB:.1f} MiB" for row in _largest(rows))
        raise BundleError(
            f"offline_wheels: the bundle is {total / MIB:.1f} MiB, over --max-mb {max_mb:g}; largest: {largest}. "
            f"Trim more, or raise --max-mb if the transfer allows it"
        )
    return report


def _kept_cuda(wheel: Path) -> bool:
    with zipfile.ZipFile(wheel) as archive:
        return any((m := _NATIVE.match(name)) and m.group(1) == "cuda" for name in archive.namelist())


def _largest(rows: list[dict[str, Any]], count: int = 3) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda row: -row["bytes"])[:count]


def _summarise(dropped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dropped files grouped by their first two path parts (a folder of thousands becomes one line)."""
    groups: dict[str, dict[str, Any]] = {}
    for row in dropped:
        parts = row["path"].split("/")
        key = "/".join(parts[:2]) + ("/" if len(parts) > 2 else "")
        group = groups.setdefault(key, {"path": key, "files": 0, "bytes": 0, "compressed_bytes": 0})
        group["files"] += 1
        group["bytes"] += row["bytes"]
        group["compressed_bytes"] += row["compressed_bytes"]
    return sorted(groups.values(), key=lambda group: -group["compressed_bytes"])


def describe(report: dict[str, Any]) -> str:
    """The report as lines for a terminal: each wheel, the total, and the requirements not met by a bundled wheel."""
    lines = [f"{'wheel':<78} {'side':<11} {'MiB':>6} {'was':>6}"]
    for row in report["wheels"]:
        lines.append(
            f"{row['wheel']:<78} {row['side']:<11} {row['bytes'] / MIB:6.2f} {row['downloaded_bytes'] / MIB:6.2f}"
        )
    lines.append(
        f"total {report['total_bytes'] / MIB:.1f} MiB (fetched {report['downloaded_bytes'] / MIB:.1f} MiB; "
        f"limit {report['limit_bytes'] / MIB:.0f} MiB)"
    )
    for install, verdicts in report["requirements"].items():
        assumed = sorted({row["met_by"].split(" ")[0] for row in verdicts["assumed"]})
        lines.append(
            f"{install}: {len(verdicts['bundled'])} met by bundled wheels, {len(verdicts['stated'])} by the "
            f"image's stated packages, {len(verdicts['assumed'])} by packages assumed there: {assumed}"
        )
        for row in verdicts["unresolved"]:
            lines.append(f"  UNRESOLVED {row['requirement']} (asked by {row['by']}): {row['met_by']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: build the bundle, print and write the report; 1 when over the limit or unresolved (--strict)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".whl", help="wheel folder (default: .whl in the checkout)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version (default 3.12)")
    parser.add_argument("--cuda", default="13.0", help="its torch's CUDA version, torch.version.cuda (default 13.0)")
    parser.add_argument("--max-mb", type=float, default=60.0, help="fail above this many MiB in all (default 60)")
    parser.add_argument("--cache", type=Path, help="where downloads are kept (default ~/.cache/fastft/offline-wheels)")
    parser.add_argument("--report", type=Path, help="also write the report here (always OUT/bundle-report.json)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a requirement is met by nothing")
    args = parser.parse_args(argv)
    try:
        report = build(args.out, args.python, args.cuda, args.max_mb, args.cache)
    except BundleError as error:
        print(error, file=sys.stderr)
        return 1
    text = json.dumps(report, indent=2) + "\n"
    (args.out / "bundle-report.json").write_text(text)
    if args.report:
        args.report.write_text(text)
    print(describe(report))
    unresolved = sum(len(verdicts["unresolved"]) for verdicts in report["requirements"].values())
    return 1 if args.strict and unresolved else 0


if __name__ == "__main__":
    sys.exit(main())
