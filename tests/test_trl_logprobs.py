"""fastft.patches.trl_logprobs: trl's fused LM head on a fastft model answered by fastft's fused log-prob kernel,
equal to trl's own head on the stock model (every output, the loss and the LoRA gradients)."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from conftest import relative_error
from parity import lora_model, save_family

from fastft import patch_report, registry
from fastft.patches import trl_logprobs

trl_utils = pytest.importorskip("trl.trainer.utils")
if not hasattr(trl_utils, "add_fused_lm_head"):
    pytest.skip("this trl has no fused LM head hook (add_fused_lm_head, trl >= 1.15)", allow_module_level=True)

EXTRAS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smol_tokenizer) -> str:
    return save_family(tmp_path_factory.mktemp("trl-logprobs"), "llama", smol_tokenizer)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad for name, p in model.named_parameters() if "lora_" in name}
    assert grads and all(grad is not None for grad in grads.values()), "every LoRA weight gets a gradient"
    return {name: grad.clone() for name, grad in grads.items()}


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, vocab, (2, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    # A prompt (not scored) then a completion, as trl's preference trainers label them.
    labels = input_ids.masked_fill(torch.arange(10) < 5, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _with_trl_head(folder: str, patch: bool, **head_kwargs):
    model = lora_model(folder, patch=patch, checkpointing=False)
    trl_utils.add_fused_lm_head(model.get_base_model(), **head_kwargs)
    return model


@pytest.mark.parametrize(
    "head_kwargs",
    [dict(outputs=EXTRAS), dict(temperature=0.7, outputs=("log_probs", "entropy"))],
    ids=["every-output", "temperature"],
)
def test_fused_head_matches_trl_head_on_stock(folder, head_kwargs):
    patched, stock = _with_trl_head(folder, True, **head_kwargs), _with_trl_head(folder, False, **head_kwargs)
    assert {row["name"]: row["status"] for row in patch_report(patched)}["trl.fused_logprobs"] == "applied"
    base = patched.get_base_model()
    calls = base.fastft_fused_logprob_calls
    batch = _batch(patched.config.vocab_size)
    results = []
    for model in (patched, stock):
        model.zero_grad(set_to_none=True)
        out = model(**batch, fused_lm_head=True)
        # What DPO does with them: sums of the completion's log-probs, and the entropy for a bonus term.
        (out.loss + 0.1 * out.entropy.sum()).backward()
        results.append((out, _lora_grads(model)))
    (out, grads), (stock_out, stock_grads) = results
    assert base.fastft_fused_logprob_calls == calls + 1
    assert not hasattr(stock.get_base_model(), "fastft_fused_logprob_calls")
    assert relative_error(out.loss, stock_out.loss) <= 1e-5
    for name in head_kwargs["outputs"]:
        ours, theirs = getattr(out, name), getattr(stock_out, name)
        assert ours.shape == theirs.shape == (2, 9), name
        if name == "is_top1":
            assert torch.equal(ours, theirs)
        else:
            assert relative_error(ours, theirs) <= 1e-5, name
    assert torch.equal(out.label_mask, stock_out.label_mask)
    # Prompt positions score nothing.
    assert torch.all(out.log_probs[:, :4] == 0)
    assert grads.keys() == stock_grads.keys()
    assert any(grad.norm() > 0 for grad in grads.values())
    for name, grad in grads.items():
        assert relative_error(grad, stock_grads[name]) <= 1e-4, name


def test_without_fused_lm_head_trl_keeps_the_models_own_forward(folder):
    patched = _with_trl_head(folder, True)
    base = patched.get_base_model()
    calls, losses = base.fastft_fused_logprob_calls, base.fastft_fused_loss_calls
    batch = _batch(patched.config.vocab_size)
    out = patched(**batch)
    assert out.loss.requires_grad and base.fastft_fused_loss_calls == losses + 1
    assert base.fastft_fused_logprob_calls == calls
    patched.eval()
    with torch.no_grad():
        generated = patched.generate(input_ids=batch["input_ids"][:1, 3:], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 10)


def test_an_all_ignored_batch_gives_a_zero_gradient_not_an_error(folder):
    patched = _with_trl_head(folder, True)
    batch = _batch(patched.config.vocab_size)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    out = patched(**batch, fused_lm_head=True)
    assert out.loss.item() == 0 and torch.all(out.log_probs == 0)
    out.loss.backward()
    assert all(torch.all(grad == 0) for grad in _lora_grads(patched).values())


def test_a_changed_trl_head_keeps_trls_own_with_one_warning(folder, monkeypatch):
    patched = lora_model(folder, patch=True, checkpointing=False)
    # As if the installed trl's head had changed after the model was loaded.
    monkeypatch.setattr(trl_logprobs, "_CLOSURE", trl_logprobs._CLOSURE | {"a_new_setting"})
    monkeypatch.setattr(trl_logprobs, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trl_utils.add_fused_lm_head(patched.get_base_model())
    messages = [str(w.message) for w in caught if "trl.fused_logprobs" in str(w.message)]
    assert len(messages) == 1 and "a_new_setting" in messages[0]
    calls = patched.get_base_model().fastft_fused_logprob_calls
    out = patched(**_batch(patched.config.vocab_size), fused_lm_head=True)
    assert torch.isfinite(out.loss) and patched.get_base_model().fastft_fused_logprob_calls == calls


def test_labels_that_do_not_fit_name_both_shapes(folder):
    patched = _with_trl_head(folder, True)
    batch = _batch(patched.config.vocab_size)
    batch["labels"] = batch["labels"][:, :6]
    with pytest.raises(ValueError, match=r"trl.fused_logprobs: labels of shape \[2, 5\].*\[2, 9\]"):
        patched(**batch, fused_lm_head=True)


def test_an_untested_trl_version_keeps_trls_head_with_one_warning(folder, monkeypatch):
    monkeypatch.setattr(importlib.import_module("trl"), "__version__", "1.17.0")
    monkeypatch.setattr(registry, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = lora_model(folder, patch=True, checkpointing=False)
    row = {row["name"]: row for row in patch_report(patched)}["trl.fused_logprobs"]
    assert row["status"] == "skipped" and "trl 1.17.0" in row["reason"], row
    assert sum("trl.fused_logprobs" in str(w.message) for w in caught) == 1
    trl_utils.add_fused_lm_head(patched.get_base_model())
    out = patched(**_batch(patched.config.vocab_size), fused_lm_head=True)
    assert torch.isfinite(out.loss) and patched.get_base_model().fastft_fused_logprob_calls == 0
