"""The version-pinned patch registry: record selection, signature fingerprints, skips, warnings and strict mode."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import randomize_lora_b, relative_error, trl_logprobs_status
from packaging.version import Version
from transformers.models.llama import modeling_llama as upstream

from fastft import FastModel, patch_report, registry
from fastft.registry import PatchRecord, PatchSkippedError, records, signature_fingerprint

pytestmark = pytest.mark.lane

LANES = Path(__file__).resolve().parents[1] / ".ci" / "lanes"
PATCH_NAMES = {
    "llama.rms_norm",
    "llama.attention",
    "llama.mlp",
    "llama.causal_lm_loss",
    "llama.decoder_layer",
    "checkpoint.offload",
}
TRL_PATCH = "trl.fused_logprobs"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts with no skip warned yet (the registry warns once per process for the same skip)."""
    monkeypatch.setattr(registry, "_WARNED", set())
    monkeypatch.delenv(registry.STRICT_ENV, raising=False)


def _pretend_transformers(monkeypatch, version: str) -> None:
    # Importing a transformers submodule for the first time can replace the package object in sys.modules, so a
    # module-level `import transformers` may hold a stale object: patch the one the registry will import.
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", version)


def _fastft_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "fastft" in str(w.message)]


def _load(folder, patch: bool = True):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = FastModel.from_pretrained(str(folder), max_seq_length=64, patch=patch)
    return model, _fastft_warnings(caught)


def _loss_and_grads(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    randomize_lora_b(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def _assert_equal_to_stock(model, folder, loss_tolerance: float = 1e-6, grad_tolerance: float = 1e-6) -> None:
    stock, _ = _load(folder, patch=False)
    loss, grads = _loss_and_grads(model)
    stock_loss, stock_grads = _loss_and_grads(stock)
    assert relative_error(loss, stock_loss) <= loss_tolerance
    errors = [relative_error(a, b) for a, b in zip(grads, stock_grads, strict=True)]
    assert max(errors) <= grad_tolerance, max(errors)


def _stock_types(model) -> bool:
    layer = model.model.layers[0]
    return (
        type(layer.self_attn) is upstream.LlamaAttention
        and type(layer.mlp) is upstream.LlamaMLP
        and type(layer.input_layernorm) is upstream.LlamaRMSNorm
    )


def test_unknown_transformers_version_skips_every_patch_with_one_warning(tiny_llama_dir, monkeypatch):
    _pretend_transformers(monkeypatch, "99.0")
    model, caught = _load(tiny_llama_dir)
    assert len(caught) == 1, caught
    for name in PATCH_NAMES:
        assert name in caught[0]
    assert "transformers 99.0" in caught[0] and ">=5.24,<5.25" in caught[0]
    rows = {row["name"]: row for row in patch_report(model)}
    assert set(rows) == PATCH_NAMES | {TRL_PATCH}
    for name in PATCH_NAMES:
        assert rows[name]["status"] == "skipped" and "transformers 99.0" in rows[name]["reason"], rows[name]
        assert ">=4.53.3" in rows[name]["tested"]
    # trl's row is about trl, not transformers; with the stock head it has no fastft model class to serve.
    if rows[TRL_PATCH]["status"] == "applied":
        assert rows[TRL_PATCH]["modules"] == 0 and "did not apply" in rows[TRL_PATCH]["fallbacks"]["lm_head"]
    assert _stock_types(model)
    _assert_equal_to_stock(model, tiny_llama_dir)


def test_a_skip_warns_once_per_process(tiny_llama_dir, monkeypatch):
    _pretend_transformers(monkeypatch, "99.0")
    assert len(_load(tiny_llama_dir)[1]) == 1
    assert _load(tiny_llama_dir)[1] == []


def test_changed_upstream_signature_skips_that_patch_only(tiny_llama_dir, monkeypatch):
    original = upstream.LlamaAttention.forward

    def forward_with_a_new_argument(self, hidden_states, *args, sliding_window=None, **kwargs):
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(upstream.LlamaAttention, "forward", forward_with_a_new_argument)
    model, caught = _load(tiny_llama_dir)
    assert len(caught) == 1 and "llama.attention" in caught[0] and "changed its signature" in caught[0]
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows["llama.attention"]["status"] == "skipped"
    assert "sliding_window=None" in rows["llama.attention"]["reason"]
    assert rows["llama.rms_norm"]["status"] == rows["llama.mlp"]["status"] == "applied"
    assert type(model.model.layers[0].self_attn) is upstream.LlamaAttention
    # The norm, MLP and loss still run fused: equal to stock within the parity tolerances, not bit for bit.
    _assert_equal_to_stock(model, tiny_llama_dir, loss_tolerance=1e-5, grad_tolerance=1e-4)


def test_strict_mode_raises_before_changing_the_model(tiny_llama_dir, monkeypatch):
    _pretend_transformers(monkeypatch, "99.0")
    monkeypatch.setenv(registry.STRICT_ENV, "1")
    model, _ = _load(tiny_llama_dir, patch=False)
    with pytest.raises(PatchSkippedError, match=r"llama\.rms_norm .*transformers 99\.0.*FASTFT_STRICT=1"):
        registry.apply_patches(model)
    assert _stock_types(model)
    with pytest.raises(PatchSkippedError):
        FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)


def test_strict_mode_accepts_a_tested_version(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(registry.STRICT_ENV, "1")
    model, caught = _load(tiny_llama_dir)
    statuses = {row["name"]: row["status"] for row in patch_report(model)}
    assert caught == [] and statuses.pop(TRL_PATCH) == trl_logprobs_status()
    assert set(statuses.values()) == {"applied"}


def test_a_new_transformers_range_is_a_new_record(tiny_llama_dir, monkeypatch):
    _pretend_transformers(monkeypatch, "99.0")
    monkeypatch.setattr(registry, "_RECORDS", {name: list(group) for name, group in records().items()})
    current = records()["llama.rms_norm"][-1]
    registry.register(
        PatchRecord(
            name="llama.rms_norm",
            target=current.target,
            versions={"transformers": ">=99.0,<99.1"},
            fingerprint=current.fingerprint,
            applies_to=current.applies_to,
            apply=current.apply,
            replacement=current.replacement,
        )
    )
    model, caught = _load(tiny_llama_dir)
    rows = {row["name"]: row for row in patch_report(model)}
    assert (
        rows["llama.rms_norm"]["status"] == "applied"
        and rows["llama.rms_norm"]["tested"] == "transformers >=99.0,<99.1"
    )
    assert rows["llama.mlp"]["status"] == "skipped"
    assert len(caught) == 1 and "llama.rms_norm" not in caught[0]


def test_overlapping_records_are_refused(monkeypatch):
    monkeypatch.setattr(registry, "_RECORDS", {name: list(group) for name, group in records().items()})
    current = records()["llama.mlp"][-1]
    clash = PatchRecord(
        name=current.name,
        target=current.target,
        versions={"transformers": ">=5.20"},
        fingerprint=current.fingerprint,
        applies_to=current.applies_to,
        apply=current.apply,
    )
    with pytest.raises(ValueError, match="overlapping versions"):
        registry.register(clash)


def test_signature_fingerprint_sees_names_kinds_and_defaults_not_annotations():
    def a(self, x: int, y: float | None = None, *rest, z="s", **kwargs) -> int: ...

    def b(self, x, y=None, *rest, z="s", **kwargs): ...

    def c(self, x, y=None, *rest, z="t", **kwargs): ...

    assert signature_fingerprint(a) == signature_fingerprint(b) == "(self, x, y=None, *rest, kw:z='s', **kwargs)"
    assert signature_fingerprint(c) != signature_fingerprint(b)


def _lane_pins() -> dict[str, dict[str, str]]:
    lanes = {}
    for path in sorted(LANES.glob("*.txt")):
        pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", path.read_text(), flags=re.M))
        if "transformers" in pins:
            lanes[path.stem] = pins
    return lanes


# transformers releases that added a family fastft patches (lanes older than these have no record of it).
FAMILY_INTRODUCED = {"gpt_oss": Version("4.55"), "qwen3_vl": Version("4.57")}


def test_every_lane_is_covered_by_exactly_one_record_of_every_patch():
    lanes = _lane_pins()
    assert len(lanes) >= 4, f"expected the version lanes in {LANES}"
    for lane, pins in lanes.items():
        for name, group in records().items():
            matching = [
                record
                for record in group
                if all(Version(pins[lib]) in spec for lib, spec in record.specifiers.items() if lib in pins)
            ]
            # trl.fused_logprobs plugs into the fused LM head trl added in 1.15: an older trl has nothing to patch;
            # a family transformers added later has nothing to patch before it (gpt-oss: 4.55, Qwen3-VL: 4.57).
            expected = 0 if name == TRL_PATCH and Version(pins["trl"]) < Version("1.15") else 1
            introduced = FAMILY_INTRODUCED.get(name.split(".")[0])
            if introduced is not None and Version(pins["transformers"]) < introduced:
                expected = 0
            assert len(matching) == expected, (
                f"lane {lane} ({pins['transformers']}, trl {pins['trl']}): {name} has {len(matching)} records"
            )


def test_every_record_is_run_by_some_lane():
    """A record no lane installs would be code no test has ever run against its upstream."""
    lanes = _lane_pins()
    for name, group in records().items():
        for record in group:
            covered = [
                lane
                for lane, pins in lanes.items()
                if all(Version(pins[lib]) in spec for lib, spec in record.specifiers.items() if lib in pins)
            ]
            assert covered, f"{name} [{record.tested()}] is run by no lane in {LANES}"


def test_doctor_reports_skips_under_strict_mode_instead_of_raising(monkeypatch):
    from fastft.doctor import report

    _pretend_transformers(monkeypatch, "99.0")
    monkeypatch.setenv(registry.STRICT_ENV, "1")
    text = report()
    assert "llama.rms_norm         skipped" in text and "transformers 99.0" in text
    assert "FASTFT_STRICT=1: a skipped patch is an error; loading a Llama here raises PatchSkippedError" in text
