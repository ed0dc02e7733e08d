"""bench/layer_bound.py: fastft's fused decoder-layer node against the same operators as straight-line code."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("forward", "forward_backward")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fastft_bench_layer_bound", ROOT / "bench" / "layer_bound.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_record(record: dict) -> None:
    # The straight-line layer is only a bound on the node's Python if it computes what the node computes: the same
    # operators in the same order give the same bits, output and every gradient.
    assert record["largest_difference"] == {"output": 0.0, "x_grad": 0.0, "lora_grads": 0.0}
    for name in ("fastft_node", "straight_line"):
        ops = record["ops_per_call"][name]
        assert 0 < ops["forward"] < ops["forward_backward"], name
        for kind in KINDS:
            assert record["median_s"][name][kind] > 0, (name, kind)
            assert len(record["rounds_s"][name][kind]) == record["settings"]["rounds"], (name, kind)
    # Both dispatch about the same operators (the straight line skips only the attention graph's views).
    node, straight = record["ops_per_call"]["fastft_node"], record["ops_per_call"]["straight_line"]
    assert abs(node["forward_backward"] - straight["forward_backward"]) <= 0.1 * node["forward_backward"]
    for kind in KINDS:
        rounds = zip(record["rounds_s"]["straight_line"][kind], record["rounds_s"]["fastft_node"][kind], strict=True)
        ratio = statistics.median(s / n for s, n in rounds)
        assert record["straight_over_node"][kind] == pytest.approx(ratio)
        assert record["node_python_share"][kind] == pytest.approx(1.0 - ratio)


def test_quick_run_matches_the_node_bit_for_bit(bench, tmp_path, capsys):
    output = tmp_path / "bound.json"
    threads = torch.get_num_threads()
    assert bench.main(["--quick", "--out", str(output)]) == 0
    assert torch.get_num_threads() == threads
    record = json.loads(output.read_text())
    _check_record(record)
    assert record["settings"]["calls"] == 3 and record["versions"]["fastft"]
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {output}"


def test_committed_record_is_a_full_run_on_the_cpu():
    record = json.loads((ROOT / "bench" / "results" / "layer-bound-cpu.json").read_text())
    _check_record(record)
    assert record["device"].startswith("cpu")
    assert (record["settings"]["rounds"], record["settings"]["calls"], record["settings"]["threads"]) == (30, 100, 1)
    # The straight line is the faster of the two: otherwise it bounds nothing.
    assert (
        record["median_s"]["straight_line"]["forward_backward"] < record["median_s"]["fastft_node"]["forward_backward"]
    )
