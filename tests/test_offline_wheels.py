"""bench/offline_wheels.py without a network: synthetic wheels stand in for the downloads, and the tests check which
files each repacked wheel keeps, that its RECORD is right (and pip installs it), the two folders, the requirement
check and the size limit."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from synthetic_wheels import build_wheel

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("offline_wheels", ROOT / "bench" / "offline_wheels.py")
offline_wheels = importlib.util.module_from_spec(_spec)
sys.modules["offline_wheels"] = offline_wheels
_spec.loader.exec_module(offline_wheels)

NATIVE = "cp312-cp312-manylinux_2_28_x86_64"
BNB_LIBS = ("cuda118", "cuda124", "cuda128", "cuda130", "cuda132", "rocm64", "rocm72", "xpu2026", "cpu")


def _bitsandbytes(folder: Path) -> Path:
    files = {f"bitsandbytes/libbitsandbytes_{lib}.so": lib.encode() * 4000 for lib in BNB_LIBS}
    files["bitsandbytes/__init__.py"] = b"__version__ = '0.50.2'\n"
    return build_wheel(folder, "bitsandbytes", "0.50.2", files, tag="py3-none-manylinux_2_24_x86_64")


def _unsloth(folder: Path) -> Path:
    files = {
        "unsloth/__init__.py": b"LOADED = True\n",
        "unsloth_cli/__init__.py": b"",
        "studio/frontend/dist/app.js": b"x" * 50_000,
        "studio/backend/run.py": b"y" * 20_000,
        "unsloth-2026.10.9.dist-info/top_level.txt": b"studio\nunsloth\nunsloth_cli\n",
    }
    return build_wheel(folder, "unsloth", "2026.10.9", files)


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_bitsandbytes_keeps_the_cuda_majors_libraries_and_its_cpu_library(tmp_path):
    source = _bitsandbytes(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    dropped = offline_wheels.repack(source, out / source.name, offline_wheels.bitsandbytes_drop(13))
    kept = {name.split("_", 1)[1].removesuffix(".so") for name in _names(out / source.name) if name.endswith(".so")}
    assert kept == {"cuda130", "cuda132", "cpu"}
    assert {row["path"] for row in dropped} == {
        f"bitsandbytes/libbitsandbytes_{lib}.so" for lib in BNB_LIBS if lib not in kept
    }
    offline_wheels.verify(out / source.name)
    twelve = offline_wheels.repack(source, tmp_path / "twelve.whl", offline_wheels.bitsandbytes_drop(12))
    assert len(twelve) == len(BNB_LIBS) - 3  # cuda124 and cuda128 kept, and cpu


def test_unsloth_loses_its_web_app_and_stays_a_wheel_pip_installs(tmp_path):
    source = _unsloth(tmp_path)
    target = tmp_path / "out" / source.name
    target.parent.mkdir()
    dropped = offline_wheels.repack(source, target, offline_wheels.unsloth_drop, offline_wheels.unsloth_edit)
    assert {row["path"] for row in dropped} == {"studio/frontend/dist/app.js", "studio/backend/run.py"}
    assert not any(name.startswith("studio/") for name in _names(target))
    offline_wheels.verify(target)
    with zipfile.ZipFile(target) as archive:
        assert archive.read("unsloth-2026.10.9.dist-info/top_level.txt") == b"unsloth\nunsloth_cli\n"
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert (site / "unsloth" / "__init__.py").exists() and not (site / "studio").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda files: files.pop("pkg/b.py"), "RECORD lists pkg/b.py"),
        (lambda files: files.update({"pkg/a.py": b"changed"}), "hash or size of pkg/a.py"),
        (lambda files: files.update({"pkg/c.py": b"new"}), "pkg/c.py is not in its RECORD"),
    ],
)
def test_verify_finds_a_record_that_does_not_match_the_files(tmp_path, damage, message):
    good = build_wheel(tmp_path, "pkg", "1.0", {"pkg/a.py": b"a", "pkg/b.py": b"b"})
    offline_wheels.verify(good)
    with zipfile.ZipFile(good) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    damage(files)
    bad = tmp_path / "bad" / good.name
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    with pytest.raises(offline_wheels.BundleError, match=message):
        offline_wheels.verify(bad)


def _fake_fetch(tmp_path: Path, extra: dict[str, tuple[str, ...]] | None = None):
    """A stand-in for pip download: a small wheel per pin (bitsandbytes and unsloth with their big parts)."""
    store = tmp_path / "store"
    store.mkdir()
    fetched = []

    def fetch(pin, folder, python, platforms):
        fetched.append((pin.requirement, python, platforms))
        name, version = pin.requirement.split("==")
        if pin.name == "bitsandbytes":
            return _bitsandbytes(store)
        if pin.name == "unsloth":
            return _unsloth(store)
        requires = (extra or {}).get(pin.name, ())
        module = name.replace("-", "_").lower()
        return build_wheel(store, name, version, {f"{module}/__init__.py": b"x" * 1000}, tag=NATIVE, requires=requires)

    return fetch, fetched


def test_build_places_each_wheel_in_its_folder_and_reports_every_size(tmp_path):
    fetch, fetched = _fake_fetch(tmp_path)
    out = tmp_path / ".whl"
    report = offline_wheels.build(out, python="3.12", cuda="13.0", cache=tmp_path / "cache", fetch=fetch)

    assert [call[0] for call in fetched] == [pin.requirement for pin in offline_wheels.PINS]
    assert all(call[1] == "3.12" and "manylinux_2_28_x86_64" in call[2] for call in fetched)
    top = sorted(path.name.split("-")[0] for path in out.glob("*.whl"))
    competitors = sorted(path.name.split("-")[0] for path in (out / "competitors").glob("*.whl"))
    # gpu_check.sh installs every top-level wheel onto one path: one version of each, fastft's.
    assert len(top) == len(set(top)) and {"bitsandbytes", "trl", "datasets", "gguf"} <= set(top)
    assert {"unsloth", "unsloth_zoo", "liger_kernel", "trl", "datasets"} <= set(competitors)
    assert "unsloth" not in top and "trl-1.15.0" not in " ".join(p.name for p in out.glob("*.whl"))

    on_disk = sum(path.stat().st_size for path in out.rglob("*.whl"))
    assert report["total_bytes"] == on_disk and report["limit_bytes"] == 60 * offline_wheels.MIB
    rows = {row["wheel"].split("-")[0]: row for row in report["wheels"]}
    assert (
        rows["bitsandbytes"]["dropped_files"] == 6
        and rows["bitsandbytes"]["bytes"] < rows["bitsandbytes"]["downloaded_bytes"]
    )
    assert rows["unsloth"]["dropped"][0]["path"] in {"studio/frontend/", "studio/backend/"}
    assert rows["gguf"]["dropped_files"] == 0 and rows["gguf"]["bytes"] == rows["gguf"]["downloaded_bytes"]
    for path in out.rglob("*.whl"):
        offline_wheels.verify(path)
    assert "total" in offline_wheels.describe(report)


def test_requirements_are_met_by_a_bundled_wheel_the_image_or_nothing(tmp_path):
    extra = {
        "gguf": (
            "numpy>=1.17",
            "torch>=2.4",
            "transformers<5",
            "not-on-the-image>=1",
            "pywin32; sys_platform == 'win32'",
        ),
        "trl": ("datasets>=4.7",),
    }
    fetch, _ = _fake_fetch(tmp_path, extra)
    report = offline_wheels.build(tmp_path / ".whl", cache=tmp_path / "cache", fetch=fetch)
    fastft = report["requirements"]["fastft"]

    def verdict(text):
        (found,) = [kind for kind, rows in fastft.items() for row in rows if row["requirement"] == text]
        return found

    assert verdict("torch>=2.4") == "stated" and verdict("numpy>=1.17") == "assumed"
    assert verdict("datasets>=4.7") == "bundled"
    # The image's transformers is 5.17: a cap below it is not met by it.
    assert verdict("transformers<5") == "unresolved" and verdict("not-on-the-image>=1") == "unresolved"
    assert not any("pywin32" in row["requirement"] for rows in fastft.values() for row in rows)
    # pyproject's own dependencies are checked too.
    assert any(row["by"] == "fastft (pyproject.toml)" for rows in fastft.values() for row in rows)
    # Each competitor venv's pins resolve against both folders; unsloth's own declared dependencies are not asked
    # (it is installed without them).
    unsloth = report["requirements"]["unsloth"]
    assert any(row["requirement"] == "unsloth==2026.10.9" for row in unsloth["bundled"])
    assert any(row["requirement"] == "bitsandbytes==0.50.2" for row in unsloth["bundled"])
    assert not any(row["by"] == "unsloth" for rows in unsloth.values() for row in rows)
    assert "UNRESOLVED not-on-the-image>=1" in offline_wheels.describe(report)


def test_the_size_limit_fails_the_build_and_names_the_largest_wheels(tmp_path):
    fetch, _ = _fake_fetch(tmp_path)
    with pytest.raises(offline_wheels.BundleError, match=r"over --max-mb 0.01; largest: bitsandbytes-0\.50\.2"):
        offline_wheels.build(tmp_path / ".whl", max_mb=0.01, cache=tmp_path / "cache", fetch=fetch)


def test_a_cuda_major_bitsandbytes_does_not_ship_fails_by_name(tmp_path):
    fetch, _ = _fake_fetch(tmp_path)
    with pytest.raises(offline_wheels.BundleError, match="no native library for CUDA 14"):
        offline_wheels.build(tmp_path / ".whl", cuda="14.0", cache=tmp_path / "cache", fetch=fetch)


def test_the_pins_agree_with_the_competitor_venvs():
    from fastft.bench.systems import VENVS

    pinned = {pin.requirement for pin in offline_wheels.PINS}
    for spec in VENVS.values():
        for text in [*spec["requirements"], *spec["no_deps"]]:
            if "==" in text:
                name, version = text.split("==")
                assert text in pinned or offline_wheels.STATED.get(name) == version, text
    names = [(pin.name, pin.side) for pin in offline_wheels.PINS]
    assert len(names) == len(set(names)), "a package pinned twice on one side"


def test_main_writes_the_report_and_returns_1_when_strict_and_unresolved(tmp_path, monkeypatch, capsys):
    fetch, _ = _fake_fetch(tmp_path, {"gguf": ("not-on-the-image>=1",)})
    monkeypatch.setattr(offline_wheels, "pip_download", fetch)
    out, report = tmp_path / ".whl", tmp_path / "report.json"
    args = ["--out", str(out), "--cache", str(tmp_path / "cache"), "--report", str(report)]
    assert offline_wheels.main(args) == 0
    assert json.loads(report.read_text()) == json.loads((out / "bundle-report.json").read_text())
    assert offline_wheels.main([*args, "--strict"]) == 1
    assert "UNRESOLVED" in capsys.readouterr().out
