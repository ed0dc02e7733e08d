"""peft methods other than plain LoRA on a patched model: equal to the same method on the stock model."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error, trl_logprobs_status
from peft import IA3Config, PrefixTuningConfig, PromptTuningConfig
from peft import get_peft_model as peft_get_peft_model

from fastft import FastModel, patch_report

pytestmark = pytest.mark.lane


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(3, vocab, (2, 9), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _perturb_trainables(model) -> None:
    """Move every trainable tensor off its initial value (IA3 starts at ones, DoRA's B at zeros), identically on
    both sides, so the comparison sees every path."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_equal(patched, stock) -> None:
    batch = _batch(patched.config.vocab_size if hasattr(patched, "config") else stock.config.vocab_size)
    loss, grads = _loss_and_grads(patched, batch)
    stock_loss, stock_grads = _loss_and_grads(stock, batch)
    assert torch.isfinite(loss) and relative_error(loss, stock_loss) <= 1e-5
    assert grads and grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, stock_grads[name]) <= 1e-4, name


def _base(folder, patch: bool):
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=64, patch=patch)
    statuses = {row["name"]: row["status"] for row in patch_report(model)}
    # trl's row depends on the installed trl (not applicable before it had a fused LM head), not on the model.
    trl_row = statuses.pop("trl.fused_logprobs")
    assert trl_row == (trl_logprobs_status() if patch else "disabled")
    assert set(statuses.values()) == ({"applied"} if patch else {"disabled"})
    return model


def _peft_pair(folder, make_config):
    pair = []
    for patch in (True, False):
        torch.manual_seed(0)
        model = peft_get_peft_model(_base(folder, patch), make_config())
        _perturb_trainables(model)
        pair.append(model)
    return pair


def test_prefix_tuning_on_a_patched_model_equals_stock(tiny_llama_dir):
    patched, stock = _peft_pair(tiny_llama_dir, lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    _assert_equal(patched, stock)


def test_prompt_tuning_on_a_patched_model_equals_stock(tiny_llama_dir):
    patched, stock = _peft_pair(tiny_llama_dir, lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    _assert_equal(patched, stock)


def test_ia3_on_a_patched_model_equals_stock(tiny_llama_dir):
    patched, stock = _peft_pair(
        tiny_llama_dir,
        lambda: IA3Config(
            task_type="CAUSAL_LM",
            target_modules=["k_proj", "v_proj", "down_proj"],
            feedforward_modules=["down_proj"],
        ),
    )
    _assert_equal(patched, stock)


def test_dora_through_fastft_equals_stock(tiny_llama_dir):
    pair = []
    for patch in (True, False):
        model = FastModel.get_peft_model(_base(tiny_llama_dir, patch), r=4, lora_alpha=8, use_dora=True)
        _perturb_trainables(model)
        pair.append(model)
    assert any("lora_magnitude_vector" in name for name, _ in pair[0].named_parameters())
    _assert_equal(*pair)
