"""The notebooks in colab/: their shape, and a CPU run of each one end to end through a Jupyter kernel.

Each notebook is run the way papermill runs one: its parameters cell stays, and a cell injected right after it
overrides the GPU defaults with the embedded SmolLM2-135M, the shipped demo data, a few steps and short sequences.
The install cell becomes a no-op (CI has no network, and fastft is already installed from the checkout).
"""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
INSTALL_LINE = '%pip install "fastft[cuda]"'
# The notebooks as Colab opens them from the repository (github.com/fastft/fastft, branch main).
COLAB_URL = "https://colab.research.google.com/github/fastft/fastft/blob/main/colab/"
BADGE = "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"

# What CI puts in place of each notebook's GPU defaults.
CPU_RUN = {
    "MODEL_NAME": "smollm2-135m",
    "DATASET_NAME": "demo",
    "MAX_SEQ_LENGTH": 192,
    "DTYPE": "float32",
    "LORA_RANK": 8,
    "MAX_STEPS": 3,
    "BATCH_SIZE": 2,
    "GRAD_ACCUM": 1,
}
OVERRIDES = {
    "qlora_sft.ipynb": {**CPU_RUN, "LOAD_IN_4BIT": True, "MAX_NEW_TOKENS": 24},
    "chat_response_only.ipynb": {
        **CPU_RUN,
        "LOAD_IN_4BIT": False,
        "DATASET_SPLIT": "train",
        "MAX_ROWS": 40,
        "MAX_NEW_TOKENS": 24,
    },
    "export.ipynb": {**CPU_RUN, "LOAD_IN_4BIT": False, "GGUF_QUANTIZATION": "q8_0"},
    # The demo preference split (pairs of at most 58 tokens). This run checks that the notebook trains, saves and
    # plots end to end; that DPO on the embedded model raises the reward margin is asserted by tests/test_cli.py
    # (test_dpo_on_the_embedded_model_raises_the_reward_margin), so a few short steps do here.
    "dpo.ipynb": {**CPU_RUN, "LOAD_IN_4BIT": False, "LEARNING_RATE": 5e-4},
    # MODEL_NAME is replaced by a tiny random Qwen2.5-VL that the test saves (BUILT_MODELS); the shapes demo.
    "vision_sft.ipynb": {**CPU_RUN, "LOAD_IN_4BIT": False, "MAX_ROWS": 40, "MAX_NEW_TOKENS": 8},
}
# Files each run must leave in its working directory (relative to the notebook's OUTPUT_DIR).
ARTIFACTS = {
    "qlora_sft.ipynb": ["adapter/adapter_model.safetensors", "adapter/adapter_config.json"],
    "chat_response_only.ipynb": ["adapter/adapter_model.safetensors", "adapter/adapter_config.json"],
    "export.ipynb": ["merged/model.safetensors", "merged/config.json", "model-q8_0.gguf"],
    "dpo.ipynb": ["adapter/adapter_model.safetensors", "adapter/adapter_config.json"],
    "vision_sft.ipynb": ["adapter/adapter_model.safetensors", "adapter/adapter_config.json"],
}


def _tiny_vlm(folder: Path) -> str:
    from vlm_chat import save_chat_vlm

    return str(save_chat_vlm(folder))


# Notebooks whose CPU model no package ships: the test saves a tiny random one and passes its folder as MODEL_NAME.
BUILT_MODELS = {"vision_sft.ipynb": _tiny_vlm}
CELL_TIMEOUT_S = 300


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _parameters_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]


def _parameters(cell: nbformat.NotebookNode) -> dict:
    """The names the parameters cell assigns and their values; papermill needs plain `NAME = literal` lines."""
    values = {}
    for statement in ast.parse(cell.source).body:
        assert isinstance(statement, ast.Assign) and len(statement.targets) == 1, ast.unparse(statement)
        target = statement.targets[0]
        assert isinstance(target, ast.Name), ast.unparse(statement)
        values[target.id] = ast.literal_eval(statement.value)
    return values


def _output_text(notebook: nbformat.NotebookNode) -> str:
    chunks = []
    for cell in _code_cells(notebook):
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                chunks.append(output.text)
            elif output.output_type in ("execute_result", "display_data"):
                chunks.append(output.data.get("text/plain", ""))
    return "".join(chunks)


def test_ci_covers_each_notebook_in_colab():
    assert {path.name for path in NOTEBOOKS} == set(OVERRIDES) == set(ARTIFACTS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_shape(path):
    notebook = _read(path)
    nbformat.validate(notebook)
    first = notebook.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "open with a markdown title"
    assert "Colab" in first.source and "Kaggle" in first.source and "GPU" in first.source
    code = _code_cells(notebook)
    assert code[0].source.strip() == INSTALL_LINE
    # The install cell is the only one that reaches the network or changes the environment.
    assert not any(re.search(r"^\s*[%!]\s*(pip|conda|uv)\b", cell.source, re.M) for cell in code[1:])
    parameters = _parameters_cells(notebook)
    assert len(parameters) == 1 and parameters[0] is code[1], "one parameters cell, right after the install cell"
    defaults = _parameters(parameters[0])
    # The defaults name real hub repositories for a GPU run; CI's overrides must all land on a parameter.
    assert "/" in defaults["MODEL_NAME"] and "/" in defaults["DATASET_NAME"], defaults
    assert set(OVERRIDES[path.name]) <= set(defaults), set(OVERRIDES[path.name]) - set(defaults)
    assert "OUTPUT_DIR" in defaults
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, "commit notebooks with outputs cleared"


def test_colab_readme_opens_each_notebook_in_colab():
    text = (COLAB / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"{BADGE}({COLAB_URL}{path.name})" in text, path.name


def test_main_readme_links_each_notebook_with_a_colab_badge():
    text = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"{BADGE}({COLAB_URL}{path.name})" in text, path.name


def _prepared(path: Path, built: dict | None = None) -> nbformat.NotebookNode:
    notebook = copy.deepcopy(_read(path))
    code = _code_cells(notebook)
    code[0].source = "# The install line is skipped here: fastft is installed from the checkout, offline."
    overrides = {**OVERRIDES[path.name], **(built or {})}
    injected = nbformat.v4.new_code_cell(
        "# Parameters injected by tests/test_notebooks.py\n"
        + "".join(f"{name} = {value!r}\n" for name, value in overrides.items()),
        metadata={"tags": ["injected-parameters"]},
    )
    position = notebook.cells.index(_parameters_cells(notebook)[0]) + 1
    notebook.cells.insert(position, injected)
    return notebook


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_on_cpu(path, tmp_path, monkeypatch):
    # The kernel inherits this environment. The notebooks run as a CPU user runs them: the kernels' torch path,
    # not the Triton interpreter that conftest turns on for the kernel tests (far too slow for a 135M model).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # One torch thread: on a 2-core machine shared with other jobs, two OpenMP threads spin-wait on each other and a
    # training step measured 3-10x slower than on one thread; alone on 2 cores, one thread costs seconds in all.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    built = {"MODEL_NAME": BUILT_MODELS[path.name](tmp_path / "model")} if path.name in BUILT_MODELS else {}
    notebook = _prepared(path, built)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    try:
        client.execute()
    finally:
        # Left beside the outputs for a look after a failure.
        nbformat.write(notebook, tmp_path / f"executed-{path.name}")
    output = _output_text(notebook)
    steps = OVERRIDES[path.name]["MAX_STEPS"]
    assert f"trained {steps} steps" in output, output[-2000:]
    output_dir = tmp_path / _parameters(_parameters_cells(_read(path))[0])["OUTPUT_DIR"]
    for artifact in ARTIFACTS[path.name]:
        assert (output_dir / artifact).is_file(), f"{path.name} left no {artifact} in {output_dir}"
