"""Packing and padding-free batches on fastft models: the packed row equals the padded batch, examples never see
each other, boundary labels are masked, and trl's SFTTrainer with packing=True / padding_free=True keeps that.

Loss normalisation everywhere here: a token-level mean, the sum of the cross-entropies of every target token in the
batch divided by the number of target tokens (not a mean of per-example means). That is what transformers'
causal-LM loss, fastft's fused loss and trl's SFT loss compute without ``num_items_in_batch``; a packed row and the
padded batch of the same examples have the same targets, so their losses must agree.
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize_lora_b, relative_error
from datasets import Dataset
from trl import SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from fastft import FastModel
from fastft.training.packing import PaddingFreeCollator, pack_dataset, pack_examples, packed_position_ids
from fastft.training.trl import sft_config

# Measured (torch 2.13 CPU, fp32): loss within 2e-7, LoRA gradients within 1.3e-6; a leak across one boundary moves
# the loss by about 2e-3 (relative), and an unmasked boundary label by about 1e-3.
LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-5
LOGIT_TOLERANCE = 1e-5
LEAK_FLOOR = 1e-4
LENGTHS = (6, 11, 4, 9)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns a short sentence quickly.",
    "Seven blue birds sat on the old wooden fence.",
    "Fine-tuning with LoRA trains only the low-rank adapters, nothing else.",
    "Rain.",
    "Packing puts several short examples in one row.",
]


def _lora(folder, attn_implementation: str = "sdpa", checkpointing: bool | str = False):
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=64, attn_implementation=attn_implementation)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=checkpointing)
    assert model.config._attn_implementation == attn_implementation
    randomize_lora_b(model)
    return model


def _examples(vocab: int, lengths=LENGTHS, seed: int = 3) -> list[dict[str, list[int]]]:
    """Random token rows; the first two tokens of every other example are a loss-free "prompt"."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for index, length in enumerate(lengths):
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        labels = [-100, -100, *ids[2:]] if index % 2 else list(ids)
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def _padded(examples, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """The unpacked reference: one example per row, right-padded, with an attention mask."""
    longest = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.full((len(examples), longest), pad_token_id)
    labels = torch.full((len(examples), longest), -100)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        input_ids[row, :length] = torch.tensor(example["input_ids"])
        labels[row, :length] = torch.tensor(example.get("labels", example["input_ids"]))
        mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "use_cache": False}


def _targets(labels: torch.Tensor) -> int:
    """Tokens the causal-LM loss predicts: labels after the shift that are not -100."""
    return int((labels[..., 1:] != -100).sum())


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same_loss_and_grads(model, packed, padded) -> float:
    """Compare, and return the packed loss."""
    loss, grads = _loss_and_grads(model, packed)
    padded_loss, padded_grads = _loss_and_grads(model, padded)
    assert torch.isfinite(loss)
    assert relative_error(loss, padded_loss) <= LOSS_TOLERANCE, (loss.item(), padded_loss.item())
    assert grads.keys() == padded_grads.keys() and sum("lora_A" in name for name in grads) >= 14
    for name, grad in grads.items():
        assert grad.norm() > 0, name
        error = relative_error(grad, padded_grads[name])
        assert error <= GRAD_TOLERANCE, f"{name}: relative error {error:.2e}"
    return loss


def _segment_logits(model, batch) -> list[torch.Tensor]:
    """Logits of each example of a packed row, split at the position restarts."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    bounds = [*starts, logits.shape[0]]
    return [logits[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _alone_logits(model, example) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([example["input_ids"]]), use_cache=False).logits[0]


# --- the packed row against the padded batch, on the model ---------------------------------------------------------


@pytest.mark.lane
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_row_loss_and_lora_grads_equal_the_padded_batch(attn_implementation, tiny_llama_dir):
    model = _lora(tiny_llama_dir, attn_implementation)
    examples = _examples(model.config.vocab_size)
    packed, padded = PaddingFreeCollator()(examples), _padded(examples)
    assert packed["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in packed
    # Same targets on both sides: the boundary masks only labels that the padded batch never predicts either.
    # Every token but each example's first, less the second token of the two examples with a two-token prompt.
    assert _targets(packed["labels"]) == _targets(padded["labels"]) == sum(LENGTHS) - len(LENGTHS) - 2
    loss = _assert_same_loss_and_grads(model, packed, padded)
    # The comparison can fail: the same row with a full attention mask (examples see each other) ...
    leaky, _ = _loss_and_grads(model, {**packed, "attention_mask": torch.ones_like(packed["input_ids"])})
    assert relative_error(leaky, loss) > LEAK_FLOOR
    # ... or with the boundary labels left in (the last token of one example predicting the next one's first).
    unmasked = packed["labels"].clone()
    starts = (packed["position_ids"][0] == 0).nonzero().flatten()
    unmasked[0, starts] = packed["input_ids"][0, starts]
    crossing, _ = _loss_and_grads(model, {**packed, "labels": unmasked})
    assert relative_error(crossing, loss) > LEAK_FLOOR


@pytest.mark.lane
@pytest.mark.parametrize("kernel_path", ["triton"], indirect=True)
def test_packed_parity_through_the_triton_kernels(kernel_path, tiny_llama_dir):
    # The fused LoRA, RoPE, RMSNorm, SwiGLU and cross-entropy kernels (interpreted on CPU) on a packed row; the
    # attention implementation is upstream's either way, so sdpa alone here.
    model = _lora(tiny_llama_dir, "sdpa")
    examples = _examples(model.config.vocab_size, lengths=(5, 7, 3), seed=6)
    _assert_same_loss_and_grads(model, PaddingFreeCollator()(examples), _padded(examples))


@pytest.mark.lane
def test_packed_parity_holds_under_offloaded_checkpointing(tiny_llama_dir):
    model = _lora(tiny_llama_dir, "sdpa", checkpointing="offload")
    examples = _examples(model.config.vocab_size, seed=4)
    _assert_same_loss_and_grads(model, PaddingFreeCollator()(examples), _padded(examples))


@pytest.mark.lane
def test_packed_parity_holds_for_rows_from_pack_dataset(tiny_llama_dir):
    model = _lora(tiny_llama_dir)
    examples = _examples(model.config.vocab_size, lengths=(6, 11, 4, 9, 3, 7), seed=5)
    rows = pack_dataset(Dataset.from_list(examples), max_length=16)
    assert len(rows) == 3 and all(len(row["input_ids"]) <= 16 for row in rows)
    # Three packed rows (of two examples each) collated into one padding-free row, its 40 tokens padded to 48: the
    # tail is a loss-free sequence of its own and must not change anything either.
    packed = PaddingFreeCollator(pad_to_multiple_of=16)(list(rows))
    assert packed["input_ids"].shape == (1, 48) and packed["position_ids"][0, 40:].tolist() == list(range(8))
    _assert_same_loss_and_grads(model, packed, _padded(examples))


# --- no attention across examples -----------------------------------------------------------------------------------


@pytest.mark.lane
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_changing_one_example_leaves_the_others_logits_unchanged(attn_implementation, tiny_llama_dir):
    model = _lora(tiny_llama_dir, attn_implementation)
    first, second, third = _examples(model.config.vocab_size, lengths=(6, 9, 5))
    changed = _examples(model.config.vocab_size, lengths=(8,), seed=11)[0]
    collate = PaddingFreeCollator()
    before = _segment_logits(model, collate([first, second, third]))
    after = _segment_logits(model, collate([changed, second, third]))
    # The changed example's own logits do change (so the comparison below could fail) ...
    assert (after[0][:6] - before[0]).abs().max() > 1e-2
    # ... and the other examples', at other offsets in the row now, are those each gives alone.
    for index, example in ((1, second), (2, third)):
        alone = _alone_logits(model, example)
        assert (before[index] - alone).abs().max() <= LOGIT_TOLERANCE * alone.abs().max()
        assert (after[index] - alone).abs().max() <= LOGIT_TOLERANCE * alone.abs().max()


@pytest.mark.lane
def test_the_collator_turns_the_cache_off_because_a_cache_hides_the_boundaries(tiny_llama_dir):
    model = _lora(tiny_llama_dir)
    model.config.use_cache = True  # e.g. after FastModel.for_inference, or a model that never went through peft
    model.train()
    first, second = _examples(model.config.vocab_size, lengths=(6, 9))
    batch = PaddingFreeCollator()([first, second])
    assert batch["use_cache"] is False
    alone = _alone_logits(model, second)
    kept = _segment_logits(model, batch)[1]
    assert (kept - alone).abs().max() <= LOGIT_TOLERANCE * alone.abs().max()
    # Why: with a cache object transformers skips its packed-sequence detection (masking_utils) and builds a plain
    # causal mask, so the second example attends to the first. If this starts failing, upstream has changed.
    leaked = _segment_logits(model, {k: v for k, v in batch.items() if k != "use_cache"})[1]
    assert (leaked - alone).abs().max() > 1e-2 * alone.abs().max()


# --- boundary labels and the packers --------------------------------------------------------------------------------


def test_boundary_labels_are_masked_and_positions_restart():
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, -100]}, {"input_ids": [4, 3, 2, 1]}]
    batch = PaddingFreeCollator()(examples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 3, 2, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # The first token of each example is never a target: no example predicts the next one's first token.
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100, -100, 3, 2, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 4
    padded = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=4)(examples)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 3, 2, 1, 0, 0, 0]]
    # The pad tail is a sequence of its own, with no loss.
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert padded["labels"][0, 9:].tolist() == [-100] * 3 and padded["cu_seq_lens_k"].tolist() == [0, 3, 5, 9, 12]
    plain = PaddingFreeCollator(flash_kwargs=False, disable_cache=False)(examples)
    assert set(plain) == {"input_ids", "labels", "position_ids"}
    assert packed_position_ids([2, 1, 3]).tolist() == [0, 1, 0, 0, 1, 2]


def test_the_collator_drops_padding_and_refuses_bad_examples():
    batch = PaddingFreeCollator()(
        [
            {"input_ids": [0, 0, 5, 6], "attention_mask": [0, 0, 1, 1]},
            {"input_ids": [7, 8, 0], "attention_mask": [1, 1, 0]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8]] and batch["position_ids"].tolist() == [[0, 1, 0, 1]]
    with pytest.raises(ValueError, match="PaddingFreeCollator: example 1 has 2 input_ids but 3 labels"):
        PaddingFreeCollator()([{"input_ids": [1]}, {"input_ids": [1, 2], "labels": [1, 2, 3]}])
    with pytest.raises(ValueError, match="example 0 has no 'input_ids'"):
        PaddingFreeCollator()([{"text": "not tokenized"}])
    with pytest.raises(ValueError, match="holds no tokens"):
        PaddingFreeCollator()([{"input_ids": []}])
    with pytest.raises(ValueError, match=r"seq_lengths \[2, 2\] \(sum 4\) for 3 tokens"):
        PaddingFreeCollator()([{"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}])


def _lengths_and_members(rows, examples):
    unpacked = []
    for row in rows:
        start = 0
        for length in row["seq_lengths"]:
            unpacked.append(tuple(row["input_ids"][start : start + length]))
            start += length
        assert start == len(row["input_ids"]) == len(row["labels"])
    assert sorted(unpacked) == sorted(tuple(example["input_ids"]) for example in examples)
    return [row["seq_lengths"] for row in rows]


def test_pack_examples_fills_rows_with_whole_examples():
    examples = [{"input_ids": list(range(10, 10 + n))} for n in (7, 5, 3, 3, 2)]
    bfd = pack_examples(examples, max_length=10)
    # Best-fit decreasing: 7 + 3 and 5 + 3 + 2, two full rows (examples keep their dataset order inside a row).
    assert _lengths_and_members(bfd, examples) == [[7, 3], [5, 3, 2]]
    ordered = pack_examples(examples, max_length=10, strategy="ordered")
    assert _lengths_and_members(ordered, examples) == [[7], [5, 3], [3, 2]]
    for row in bfd + ordered:
        starts = [0, *torch.tensor(row["seq_lengths"]).cumsum(0)[:-1].tolist()]
        assert all(row["labels"][start] == -100 for start in starts)
        assert sum(label != -100 for label in row["labels"]) == len(row["labels"]) - len(starts)


def test_pack_examples_truncates_or_refuses_long_examples():
    examples = [{"input_ids": list(range(15)), "labels": list(range(15))}, {"input_ids": [1, 2]}]
    rows = pack_examples(examples, max_length=10)
    assert [row["seq_lengths"] for row in rows] == [[10], [2]] and rows[0]["input_ids"] == list(range(10))
    with pytest.raises(ValueError, match="example 0 has 15 tokens, more than max_length=10"):
        pack_examples(examples, max_length=10, truncate=False)
    with pytest.raises(ValueError, match="strategy must be one of"):
        pack_examples(examples, max_length=10, strategy="wrapped")
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        pack_examples(examples, max_length=0)


def test_pack_dataset_rows_collate_the_same_with_trl_padding_free_collator():
    examples = [{"input_ids": list(range(1, 1 + n)), "labels": [-100] + list(range(2, 1 + n))} for n in (4, 6, 3, 5)]
    dataset = Dataset.from_list([{**example, "text": "extra column"} for example in examples])
    packed = pack_dataset(dataset, max_length=9)
    assert packed.column_names == ["input_ids", "labels", "seq_lengths"]
    ours = PaddingFreeCollator()(list(packed))
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(list(packed))
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"):
        assert ours[key].tolist() == theirs[key].tolist(), key
    with pytest.raises(ValueError, match="pack_dataset: expected a tokenized dataset with an 'input_ids' column"):
        pack_dataset(Dataset.from_dict({"text": ["a"]}), max_length=8)


# --- trl's SFTTrainer ---------------------------------------------------------------------------------------------


def _split_row(batch) -> list[dict[str, list[int]]]:
    """The examples of a padding-free row, cut at its position restarts."""
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    bounds = [*starts, batch["input_ids"].shape[1]]
    return [
        {"input_ids": batch["input_ids"][0, a:b].tolist(), "labels": batch["labels"][0, a:b].tolist()}
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def _trainer(tiny_llama_dir, tmp_path, dataset, **config):
    model, tokenizer = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, random_state=5)
    randomize_lora_b(model)
    args = sft_config(str(tmp_path / "out"), torch.float32, save_strategy="no", seed=5, learning_rate=3e-2, **config)
    return SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)


def _assert_trainer_batch_is_packed_and_exact(trainer) -> int:
    model = trainer.model
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    examples = _split_row(batch)
    assert len(examples) >= 3
    assert all(example["labels"][0] == -100 for example in examples)
    padded = _padded(examples, pad_token_id=trainer.processing_class.pad_token_id)
    assert _targets(batch["labels"]) == _targets(padded["labels"])
    # trl's loss (its fused LM head, on the padding-free row) against fastft's on the padded batch.
    model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    padded_loss, padded_grads = _loss_and_grads(model, padded)
    assert relative_error(loss.detach(), padded_loss) <= LOSS_TOLERANCE, (loss.item(), padded_loss.item())
    for name, grad in grads.items():
        assert relative_error(grad, padded_grads[name]) <= GRAD_TOLERANCE, name
    # A row whose examples see each other (an all-ones attention mask) would not pass the comparison above.
    with torch.no_grad():
        leaky = trainer.compute_loss(model, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    assert relative_error(leaky, loss.detach()) > LEAK_FLOOR
    return len(examples)


def test_sft_trainer_packing_keeps_attention_inside_examples(tiny_llama_dir, tmp_path):
    dataset = Dataset.from_dict({"text": SENTENCES * 2})
    trainer = _trainer(
        tiny_llama_dir, tmp_path, dataset, max_length=48, packing=True, max_steps=2, per_device_train_batch_size=2
    )
    assert trainer.padding_free  # trl's "bfd" packing implies padding-free batches
    _assert_trainer_batch_is_packed_and_exact(trainer)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_sft_trainer_padding_free_keeps_attention_inside_examples(tiny_llama_dir, tmp_path):
    dataset = Dataset.from_dict({"text": SENTENCES})
    # trl refuses padding_free without packing while max_length is set (it would not be enforced).
    trainer = _trainer(
        tiny_llama_dir,
        tmp_path,
        dataset,
        max_length=None,
        padding_free=True,
        max_steps=2,
        per_device_train_batch_size=4,
    )
    assert _assert_trainer_batch_is_packed_and_exact(trainer) == 4
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
