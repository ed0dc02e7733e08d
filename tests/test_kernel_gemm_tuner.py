"""Where the fused LoRA groups run their base GEMM: cuBLAS or Triton, by compute capability, FASTFT_GEMM and the
on-device tuner (its cache included). CUDA targets are simulated: the launch code runs on meta tensors and every
Triton launch is recorded instead of run."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import KERNEL_DEVICE, TOLERANCE, relative_error
from test_kernel_lora import HIDDEN, NO_BIAS, QWEN2_BIAS, qkv_projections

from fastft.bench.operators import OperatorMode
from fastft.kernels import LoRAWeights, compile_cases, compile_check, dispatch, gemm_tuner, lora_math, lora_qkv, targets
from fastft.kernels.gemm_configs import GemmConfig, candidates
from fastft.kernels.gemm_tuner import CUBLAS, CUBLAS_ACCUMULATE, Candidate, force, tune
from fastft.kernels.lora_group import LoRAGroup

MODEL = compile_check.Model(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch, tmp_path):
    monkeypatch.delenv(gemm_tuner.GEMM_ENV, raising=False)
    monkeypatch.delenv(gemm_tuner.NF4_DEQUANT_ENV, raising=False)
    monkeypatch.setenv(gemm_tuner.CACHE_ENV, str(tmp_path / "cache"))
    gemm_tuner.reset()
    yield
    gemm_tuner.reset()


def _launched_gemms(capability: int, dtype: torch.dtype, nf4: bool = False) -> list[str]:
    """The Triton GEMM kernels the three groups launch on a simulated target (forward and backward)."""
    launches: list[compile_check.Launch] = []
    with targets.simulate(capability), compile_check.recording(launches, {}):
        for _, run in compile_cases.groups(MODEL, 8, dtype, nf4):
            run()
    return [launch.kernel for launch in launches if launch.kernel in compile_check.GEMM_KERNELS]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_compute_capability_7_5_never_selects_the_triton_gemm(dtype, nf4):
    assert candidates(75, dtype) == () and candidates(75, dtype, "nf4") == ()
    assert _launched_gemms(75, dtype, nf4) == []
    chosen = gemm_tuner.choices()
    assert {c["group"] for c in chosen} == {"qkv", "o", "gate_up", "down"}
    for choice in chosen:
        assert choice["path"] == "cublas", choice
        assert "compute capability 7.5 < 8.0" in choice["reason"] and "tensor cores" in choice["reason"]
        # Every group here has LoRA, so its two cuBLAS orders would be timed on a real T4; a simulated one cannot.
        assert choice["reason"].startswith("simulated target: nothing to time"), choice
    assert not (gemm_tuner.cache_file()).exists(), "nothing timed, nothing cached"


def test_both_cublas_orders_are_candidates_only_where_there_is_a_low_rank_term():
    assert gemm_tuner.cublas_candidates((16, 8, 0)) == [CUBLAS, CUBLAS_ACCUMULATE]
    assert gemm_tuner.cublas_candidates((0, 0)) == [CUBLAS]


class _Calls(OperatorMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("nf4", ["dense", "params4bit-nested"])
@pytest.mark.parametrize("biases", [NO_BIAS, QWEN2_BIAS], ids=["no-bias", "bias"])
def test_the_accumulate_order_computes_the_plain_order_s_outputs_and_writes_each_output_once(nf4, biases):
    gen = torch.Generator().manual_seed(11)
    # q and v with LoRA (two scales), k without: both kinds of segment in one group.
    projections = qkv_projections(torch.float32, gen, [(4, 0.25), None, (2, 3.0)], nf4=(nf4,) * 3, biases=biases)
    group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
    spec, count = group._spec, group._lora_count
    x = torch.randn(7, HIDDEN, generator=gen).to(KERNEL_DEVICE)
    with torch.no_grad():
        xa, lora_b = lora_math.forward_xa(spec, x, group._adapters[:count], group._adapters[count:])
        inputs = (spec, x, group._weights, group._quant_states, xa, lora_b, group._biases)
        plain = lora_math.run(CUBLAS, *inputs)
        with _Calls() as mode:
            accumulated = lora_math.run(CUBLAS_ACCUMULATE, *inputs)
    for got, expected in zip(accumulated, plain, strict=True):
        assert got.shape == expected.shape and got.is_contiguous()
        assert relative_error(got, expected) < TOLERANCE[torch.float32]
    # The only in-place GEMMs are the base GEMMs (K = hidden) accumulating onto the low-rank terms; the plain order's
    # are the rank-r adds onto the base GEMMs' outputs.
    in_place = [args[1].shape[1] for name, args in mode.calls if name == "aten.addmm_.default"]
    assert in_place == [HIDDEN, HIDDEN], mode.calls


@pytest.mark.parametrize(
    "loras",
    [[(4, 2.0)] * 3, [(4, 0.25), None, (2, 3.0)]],
    ids=["one-scale", "mixed"],
)
def test_a_node_whose_forward_accumulated_sums_its_dx_the_same_way_round(monkeypatch, loras):
    # One scale: the grouped backward (one dY B buffer); mixed scales and a segment without LoRA: one term each.
    gen = torch.Generator().manual_seed(5)
    projections = qkv_projections(torch.float32, gen, loras, nf4=("dense",) * 3, biases=NO_BIAS)
    x = torch.randn(2, 5, HIDDEN, generator=gen).to(KERNEL_DEVICE)
    upstream = [torch.randn(2, 5, p.weight.shape[0], generator=gen).to(KERNEL_DEVICE) for p in projections]
    leaves = [t for p in projections if p.lora_a is not None for t in (p.lora_a, p.lora_b)]
    results = {}
    for candidate in (CUBLAS, CUBLAS_ACCUMULATE):
        monkeypatch.setattr(lora_math, "plan", lambda *args, candidate=candidate: candidate)
        inputs = x.clone().requires_grad_()
        outputs = lora_qkv(inputs, *projections)
        with _Calls() as mode:
            grads = torch.autograd.grad(outputs, [inputs, *leaves], upstream)
        in_place = [args[1].shape[1] for name, args in mode.calls if name == "aten.addmm_.default"]
        results[candidate.path] = outputs, grads, in_place
    plain, accumulated = results["cublas"], results["cublas-accumulate"]
    for got, expected in zip((*accumulated[0], *accumulated[1]), (*plain[0], *plain[1]), strict=True):
        assert relative_error(got, expected) < TOLERANCE[torch.float32]
    widths = {p.weight.shape[0] for p in projections}

    def kinds(in_place):
        return ["base" if k in widths else "rank" for k in in_place]

    # Plain: dX starts as the first base GEMM (not in place), the rank-r terms come last, onto the base sum.
    # Accumulated: dX starts as a rank-r term, and all three base GEMMs accumulate onto the low-rank sum after it.
    plain_kinds, accumulated_kinds = kinds(plain[2]), kinds(accumulated[2])
    assert plain_kinds.count("base") == 2 and plain_kinds[-1] == "rank", plain[2]
    assert accumulated_kinds.count("base") == 3, accumulated[2]
    assert "rank" not in accumulated_kinds[accumulated_kinds.index("base") :], accumulated[2]


def test_forcing_triton_below_8_0_still_runs_cublas_and_says_so_once(monkeypatch):
    monkeypatch.setenv(gemm_tuner.GEMM_ENV, "triton")
    with pytest.warns(UserWarning, match=r"FASTFT_GEMM=triton ignored .* sm_75.*running cuBLAS") as caught:
        assert _launched_gemms(75, torch.float16) == []
        assert _launched_gemms(75, torch.float16) == []
    assert len([w for w in caught if "FASTFT_GEMM=triton" in str(w.message)]) == 1


def test_fp32_operands_run_cublas_on_every_target():
    assert all(candidates(cc, torch.float32) == () for cc in targets.TARGETS)
    assert _launched_gemms(90, torch.float32) == []
    assert {c["path"] for c in gemm_tuner.choices()} == {"cublas"}


@pytest.mark.parametrize("capability", [80, 86, 89, 90])
def test_forced_triton_from_8_0_launches_the_fused_gemm(monkeypatch, capability):
    monkeypatch.setenv(gemm_tuner.GEMM_ENV, "triton")
    # qkv, o, gate_up, down, the biased qkv and attention's qkv + RoPE node: one launch each in forward; backward
    # runs torch's matmul.
    assert _launched_gemms(capability, torch.bfloat16) == ["_lora_gemm_kernel"] * 6
    assert {c["path"] for c in gemm_tuner.choices()} == {"triton"}


def test_auto_keeps_cublas_where_nothing_was_measured():
    # A simulated target cannot time anything: Triton runs only where a tuner measured it faster.
    assert _launched_gemms(90, torch.bfloat16) == []
    assert {c["reason"] for c in gemm_tuner.choices()} == {"simulated target: nothing to time"}


def test_forced_cublas_launches_no_triton_gemm(monkeypatch):
    monkeypatch.setenv(gemm_tuner.GEMM_ENV, "cublas")
    assert _launched_gemms(90, torch.bfloat16) == []
    assert {c["reason"] for c in gemm_tuner.choices()} == {"FASTFT_GEMM=cublas"}


def test_nf4_in_kernel_decode_is_a_candidate_not_the_default(monkeypatch):
    options = gemm_tuner.triton_candidates(80, torch.float16, packed=True)
    assert {o.path for o in options} == {"triton", "triton-nf4"} and options[0].path == "triton"
    monkeypatch.setenv(gemm_tuner.NF4_DEQUANT_ENV, "kernel")
    assert {o.path for o in gemm_tuner.triton_candidates(80, torch.float16, packed=True)} == {"triton-nf4"}
    monkeypatch.setenv(gemm_tuner.GEMM_ENV, "triton")
    assert set(_launched_gemms(80, torch.float16, nf4=True)) == {"_lora_gemm_nf4_kernel"}


def test_an_unknown_gemm_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(gemm_tuner.GEMM_ENV, "cutlass")
    with pytest.raises(ValueError, match=r"FASTFT_GEMM must be one of auto, cublas, triton, got 'cutlass'"):
        gemm_tuner.mode()


def _triton_device() -> str:
    """Where this run's tensors take Triton: the GPU, compiled, else the CPU through the interpreter, which conftest
    turns on (TRITON_INTERPRET=1) unless the run turns it off, as the compiled GPU runs do."""
    if KERNEL_DEVICE == "cpu" and not dispatch.INTERPRETED:
        pytest.fail(
            "test_kernel_gemm_tuner: without a GPU only the Triton interpreter runs the Triton GEMM; keep "
            "TRITON_INTERPRET=1 (conftest's default) for this run"
        )
    return KERNEL_DEVICE


def test_the_triton_gemm_runs_where_triton_runs_unless_cublas_is_forced():
    # On the CPU the interpreter runs Triton, and "auto" takes the Triton GEMM there (checking it is the point). A GPU
    # compiles it, and "auto" would time it against cuBLAS first, so Triton is forced there: the first configuration
    # of the device's list runs, or cuBLAS with the reason where there is none (below compute capability 8.0). fp16 on
    # the GPU: fp32 operands never take a Triton GEMM.
    device = _triton_device()
    dtype = torch.float16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    x = randn(5, 24)
    projections = [LoRAWeights(randn(w, 24), randn(4, 24) / 5, randn(w, 4) / 2, 0.5) for w in (16, 8, 8)]
    if device == "cpu":
        fused = lora_qkv(x, *projections)
        expected = "triton:32x32x32/w1/s1 (Triton interpreter)"
    else:
        capability = targets.capability(x.device)
        options = gemm_tuner.triton_candidates(capability, dtype, packed=False)
        with force("triton"):
            fused = lora_qkv(x, *projections)
        reason = "FASTFT_GEMM=triton" if options else gemm_tuner.no_triton_reason(capability, dtype)
        expected = f"{options[0].label if options else 'cublas'} ({reason})"
    assert gemm_tuner.by_group()["qkv"] == expected
    with force("cublas"):
        plain = lora_qkv(x, *projections)
    # On the CPU the cuBLAS path is torch's CPU matmul.
    cublas = "torch matmul" if device == "cpu" else "cublas"
    assert gemm_tuner.by_group()["qkv"] == f"{cublas} (FASTFT_GEMM=cublas)"
    for a, b in zip(fused, plain, strict=True):
        assert relative_error(a, b) < TOLERANCE[dtype]


def test_the_plan_key_changes_with_everything_choose_reads(monkeypatch):
    # On a device that takes Triton; on CPU tensors without the interpreter the key is shorter (the next test).
    device = _triton_device()
    x = torch.empty(5, 24, device=device)
    key = gemm_tuner.plan_key(x)
    assert gemm_tuner.plan_key(torch.empty(8, 24, device=device)) == key  # one bucket: M <= 8
    assert gemm_tuner.rows_bucket(5) == 8 and gemm_tuner.rows_bucket(0) == gemm_tuner.rows_bucket(1) == 1
    changed = [gemm_tuner.plan_key(torch.empty(9, 24, device=device)), gemm_tuner.plan_key(x.half())]
    with force("cublas"):
        changed.append(gemm_tuner.plan_key(x))
    with dispatch.force_reference():
        changed.append(gemm_tuner.plan_key(x))
    with targets.simulate(80):
        changed.append(gemm_tuner.plan_key(x))
    monkeypatch.setenv(gemm_tuner.GEMM_ENV, "cublas")
    changed.append(gemm_tuner.plan_key(x))
    monkeypatch.delenv(gemm_tuner.GEMM_ENV)
    monkeypatch.setenv(gemm_tuner.NF4_DEQUANT_ENV, "kernel")
    changed.append(gemm_tuner.plan_key(x))
    monkeypatch.delenv(gemm_tuner.NF4_DEQUANT_ENV)
    assert gemm_tuner.plan_key(x) == key
    gemm_tuner.reset()
    changed.append(gemm_tuner.plan_key(x))
    assert key not in changed and len(set(changed)) == len(changed)


def test_without_the_interpreter_a_cpu_key_holds_only_what_can_change_the_choice(monkeypatch):
    # Outside the tests' interpreter only the torch reference runs on CPU tensors (choose's first answer), so the
    # key a group memoises under is the bucket, the dtype and reset's generation; no switch is read per call.
    monkeypatch.setattr(dispatch, "INTERPRETED", False)
    x = torch.empty(5, 24)
    key = gemm_tuner.plan_key(x)
    with force("triton"):
        assert gemm_tuner.plan_key(x) == key
        choice = gemm_tuner.choose("qkv", x, (8,), (2,), False, run=None, check=None)
    assert choice.candidate == gemm_tuner.CUBLAS
    assert gemm_tuner.plan_key(torch.empty(9, 24)) != key and gemm_tuner.plan_key(x.half()) != key
    gemm_tuner.reset()
    assert gemm_tuner.plan_key(x) != key


# The tuner proper, with an injected timer and static check.
OPTIONS = [
    CUBLAS,
    Candidate("triton", GemmConfig(128, 128, 64, 8, 3)),
    Candidate("triton", GemmConfig(64, 128, 64, 4, 4)),
]


class Bench:
    """Stand-in candidates: ``run`` counts calls, the timer reports fixed seconds per candidate."""

    def __init__(self, seconds: dict[str, float], problems: dict[str, list[str]] | None = None) -> None:
        self.seconds, self.problems, self.runs, self.current = seconds, problems or {}, [], None

    def run(self, candidate: Candidate) -> str:
        self.runs.append(candidate.label)
        self.current = candidate.label
        if self.seconds.get(candidate.label) is None:
            raise RuntimeError("out of resources: shared memory")
        return candidate.label

    def check(self, candidate: Candidate) -> list[str]:
        return self.problems.get(candidate.label, [])

    def timer(self, call) -> float:
        call()
        return self.seconds[self.current]


def _tune(bench: Bench, path, key="H100|sm_90|bfloat16|qkv|dense K=2048"):
    return tune(key, OPTIONS, bench.run, check=bench.check, timer=bench.timer, path=path)


def test_the_tuner_keeps_the_fastest_candidate_and_caches_it(tmp_path):
    path = tmp_path / "gemm-tuning.json"
    labels = [o.label for o in OPTIONS]
    bench = Bench({labels[0]: 2e-3, labels[1]: 1e-3, labels[2]: 1.5e-3})
    choice = _tune(bench, path)
    assert choice.candidate == OPTIONS[1]
    assert choice.timings_ms == {labels[0]: 2.0, labels[1]: 1.0, labels[2]: 1.5}
    document = json.loads(path.read_text())
    assert document["versions"] == gemm_tuner.cache_versions()
    assert document["choices"]["H100|sm_90|bfloat16|qkv|dense K=2048"]["config"] == OPTIONS[1].config.as_dict()

    again = Bench({label: 1.0 for label in labels})  # would pick cuBLAS if it measured
    reused = _tune(again, path)
    assert reused.candidate == OPTIONS[1] and reused.reason.startswith("cached: tuned")
    assert again.runs == [], "a cached bucket is not timed again"

    other_key = "H100|sm_90|bfloat16|o|x"
    other = _tune(Bench({labels[0]: 1e-3, labels[1]: 3e-3, labels[2]: 3e-3}), path, key=other_key)
    assert other.candidate == CUBLAS
    assert set(json.loads(path.read_text())["choices"]) == {
        "H100|sm_90|bfloat16|qkv|dense K=2048",
        "H100|sm_90|bfloat16|o|x",
    }


def test_cublas_wins_when_it_is_fastest_and_failing_candidates_are_excluded(tmp_path):
    labels = [o.label for o in OPTIONS]
    bench = Bench({labels[0]: 1.2e-3, labels[1]: None, labels[2]: 1e-3}, problems={labels[2]: ["spills 88 bytes"]})
    choice = _tune(bench, tmp_path / "cache.json")
    assert choice.candidate == CUBLAS
    assert f"{labels[1]} (RuntimeError: out of resources" in choice.reason
    assert f"{labels[2]} (spills 88 bytes)" in choice.reason
    assert list(choice.timings_ms) == [labels[0]], "an excluded candidate is never timed"


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"format": 1, "choices": {"k": {"path": 3}}}'])
def test_a_corrupt_cache_is_tuned_again_and_rewritten(tmp_path, caplog, content):
    path = tmp_path / "gemm-tuning.json"
    path.write_text(content)
    labels = [o.label for o in OPTIONS]
    bench = Bench({labels[0]: 3e-3, labels[1]: 2e-3, labels[2]: 1e-3})
    with caplog.at_level(logging.WARNING, logger="fastft.kernels.gemm_tuner"):
        choice = _tune(bench, path, key="k")
    assert choice.candidate == OPTIONS[2] and bench.runs, "tuned, not read from the broken file"
    assert json.loads(path.read_text())["choices"]["k"]["path"] == "triton"
    if content.startswith("{not"):
        assert "cannot be read" in caplog.text


def test_a_cache_from_other_versions_is_not_trusted(tmp_path):
    path = tmp_path / "gemm-tuning.json"
    stale = {"path": "triton", "config": OPTIONS[1].config.as_dict(), "reason": "tuned", "timings_ms": {}}
    versions = {**gemm_tuner.cache_versions(), "triton": "0.0.1"}
    path.write_text(json.dumps({"format": 1, "versions": versions, "choices": {"k": stale}}))
    labels = [o.label for o in OPTIONS]
    bench = Bench({labels[0]: 1e-3, labels[1]: 2e-3, labels[2]: 2e-3})
    assert _tune(bench, path, key="k").candidate == CUBLAS
    assert bench.runs


def test_an_unwritable_cache_keeps_the_choice_for_the_run(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    labels = [o.label for o in OPTIONS]
    bench = Bench({labels[0]: 1e-3, labels[1]: 2e-3, labels[2]: 2e-3})
    with caplog.at_level(logging.WARNING, logger="fastft.kernels.gemm_tuner"):
        choice = _tune(bench, blocker / "sub" / "gemm-tuning.json", key="k")
    assert choice.candidate == CUBLAS
    assert "cannot write the GEMM tuning cache" in caplog.text
