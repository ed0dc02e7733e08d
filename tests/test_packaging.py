"""The installed package: fastft.kernels exists, a top-level `kernels` module does not."""

import subprocess
import sys

import fastft


def test_version_is_exposed():
    assert isinstance(fastft.__version__, str) and fastft.__version__[0].isdigit()


def test_kernels_ship_only_as_fastft_kernels(tmp_path):
    # Run outside the repository, so the checkout's kernels/ folder is not on sys.path.
    probe = (
        "import importlib.util, sys\n"
        "import fastft.kernels\n"
        "assert fastft.kernels.__file__.endswith('kernels/__init__.py'), fastft.kernels.__file__\n"
        "try:\n"
        "    import kernels\n"
        "except ModuleNotFoundError:\n"
        "    print('no top-level kernels')\n"
        "else:\n"
        "    import importlib.metadata as md\n"
        "    try:\n"
        "        md.distribution('kernels')\n"
        "        print('kernels is the PyPI package')\n"  # installed on purpose by the user: not ours
        "    except md.PackageNotFoundError:\n"
        "        sys.exit('top-level kernels importable from ' + str(kernels.__file__))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "no top-level kernels" in result.stdout or "kernels is the PyPI package" in result.stdout


def test_public_api_names():
    from fastft import FastModel, ShapeContractError, patch_report

    assert issubclass(ShapeContractError, ValueError)
    for name in ("from_pretrained", "get_peft_model", "for_inference", "for_training", "save_merged"):
        assert callable(getattr(FastModel, name))
    assert callable(patch_report)


def test_every_subpackage_is_listed_for_the_wheel():
    # An editable install finds subpackages on disk; a wheel ships only what pyproject lists.
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(root).parts) for init in (root / "fastft").rglob("__init__.py")} | {
        "fastft.kernels"
    }
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages in pyproject.toml"
