"""Parity with stock transformers + peft, shared by the per-architecture patch tests: tiny random models of each
fused family, a LoRA model loaded through FastModel (patched or stock), a padded batch, and the loss / gradient
comparison."""

from __future__ import annotations

import importlib

import torch
from conftest import randomize_lora_b, relative_error, tiny_llama_config

from fastft import FastModel

LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
ZERO_GRAD_SCALE = 1e-5

FAMILY_VOCAB = 4096

# Per family: (transformers config class, causal-LM class, settings on top of the tiny Llama's). Head counts follow
# the real models' GQA ratios, scaled down.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # Mistral 7B's 32 / 8 heads, scaled to 8 / 2; a window shorter than the test rows, so it really masks.
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=8),
    ),
    # Qwen2.5-0.5B's wide GQA (14 / 2 heads there, 16 / 2 here: head_dim 8); the second layer slides over 8 tokens.
    # Every in_features is a multiple of 64, bitsandbytes' blocksize: where it is a multiple of 16 but not of 64
    # (112 with 14 heads), bitsandbytes 0.50's AVX-512 CPU dequantiser scales by the wrong block, and the stock side
    # of the 4-bit parity test would be the wrong one (kernels/nf4.py).
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=128,
            num_attention_heads=16,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
    ),
    # Qwen3's explicit head_dim (wider than hidden / heads) and its per-head q / k norms.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # Phi-3 / Phi-4-mini: packed qkv_proj and gate_up_proj, kv_heads < heads, and Phi-4-mini's partial rotary (the
    # last quarter of each head is not rotated).
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75),
    ),
    # Gemma 3: explicit head_dim, query_pre_attn_scalar (so the scale is not head_dim ** -0.5), a sliding layer with
    # a window shorter than the test rows beside a full one, and a logit soft-cap. Its sandwich norms keep the
    # residual stream bounded, so a wider init is safe; it makes the logits large enough that the cap changes the
    # loss by a few percent (at 0.02 it would change it by ~1e-6).
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=4.0,
            initializer_range=0.2,
        ),
    ),
}

# RMSNorm modules per decoder layer where a family has more than Llama's two (input, post-attention): Qwen3's
# per-head q / k norms; Gemma 3's pre- / post-feedforward norms and its q / k norms.
NORMS_PER_LAYER = {"qwen3": 4, "gemma3": 6}


# The autograd node a family's q / k / v run through: one launch for the three, or for Phi-3's packed projection.
QKV_NODES = {"phi3": "LoRAPackedQKV"}


def qkv_node(family: str) -> str:
    """The name fragment of the fused q / k / v autograd node of ``family``."""
    return QKV_NODES.get(family, "LoRAQKV")


def norms_per_layer(family: str) -> int:
    """How many RMSNorm modules one decoder layer of ``family`` has (the final norm is one more per model)."""
    return NORMS_PER_LAYER.get(family, 2)


def family_config(family: str, tokenizer, **overrides):
    """A two-layer random config of ``family`` with SmolLM2's vocabulary."""
    config_name, _, settings = FAMILIES[family]
    base = tiny_llama_config(tokenizer).to_dict()
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "initializer_range",
    )
    values = {key: base[key] for key in keep}
    # A smaller vocabulary than SmolLM2's 49,152: the interpreter's fused loss scans every column, and what the
    # families differ in is before the head. Token ids stay below it (make_batch), and the special tokens fit.
    values["vocab_size"] = FAMILY_VOCAB if family != "llama" else values["vocab_size"]
    values.update(settings)
    values.update(overrides)
    return getattr(importlib.import_module("transformers"), config_name)(**values)


def save_family(folder, family: str, tokenizer, **overrides) -> str:
    """Save a tiny random ``family`` model and the tokenizer into ``folder``."""
    _, model_name, _ = FAMILIES[family]
    torch.manual_seed(0)
    model_class = getattr(importlib.import_module("transformers"), model_name)
    model = model_class(family_config(family, tokenizer, **overrides))
    with torch.no_grad():
        # Norm weights start at one (Llama) or zero (Gemma's 1 + w): perturb them so a wrong offset, scale or
        # per-head norm shows in the loss.
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def lora_model(folder: str, patch: bool, checkpointing: bool | str = "offload", **load_kwargs):
    """``FastModel.from_pretrained`` + ``get_peft_model`` (r=8, LoRA B made non-zero)."""
    model, _ = FastModel.from_pretrained(folder, max_seq_length=128, patch=patch, **load_kwargs)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=checkpointing)
    randomize_lora_b(model)
    return model


def make_batch(vocab: int, batch: int, seq: int, pad: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens with the first ``pad`` positions of row 0 left-padded, random targets (no shift) so a
    single-token sequence has a loss too, and labels (shifted by the model) for the causal-LM loss."""
    generator = torch.Generator().manual_seed(seq * 31 + batch)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :pad] = 0
    targets = torch.randint(3, vocab, (batch, seq), generator=generator).masked_fill(mask == 0, -100)
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "targets": targets, "labels": labels}


def loss_and_grads(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's own causal-LM loss (the fused one on a patched model) plus a loss on every position's logits
    (a single-token row has no causal-LM target), so both heads and the attention at every position are checked."""
    model.zero_grad(set_to_none=True)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logits = model(**inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
    if batch["input_ids"].shape[1] > 1:
        loss = loss + model(**inputs, labels=batch["labels"]).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_parity(patched, stock, batch) -> None:
    """Loss within 1e-5 relative, every LoRA gradient within 1e-4 of stock."""
    loss, grads = loss_and_grads(patched, batch)
    stock_loss, stock_grads = loss_and_grads(stock, batch)
    assert torch.isfinite(loss)
    assert relative_error(loss, stock_loss) <= LOSS_TOLERANCE, (loss.item(), stock_loss.item())
    assert grads.keys() == stock_grads.keys() and any("lora_A" in name for name in grads)
    # With one key per query, softmax has zero derivative and q / k gradients are rounding noise on both sides:
    # gradients that small are compared on the scale of the largest one instead of their own.
    floor = ZERO_GRAD_SCALE * max(grad.norm().item() for grad in stock_grads.values())
    for name, grad in grads.items():
        expected = stock_grads[name]
        if expected.norm().item() < floor:
            assert grad.norm().item() < floor, f"{name}: {grad.norm().item():.2e} where stock is ~0"
            continue
        error = relative_error(grad, expected)
        assert error <= GRAD_TOLERANCE, f"{name}: relative error {error:.2e}"


def greedy_tokens(folder: str, patch: bool) -> torch.Tensor:
    """Eight greedy tokens after a left-padded prompt, with the KV cache."""
    model, _ = FastModel.from_pretrained(folder, max_seq_length=128, patch=patch)
    FastModel.for_inference(model)
    batch = make_batch(model.config.vocab_size, batch=2, seq=6, pad=2)
    with torch.no_grad():
        return model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=8,
            do_sample=False,
            use_cache=True,
            pad_token_id=model.config.pad_token_id,
        )


def graph_nodes(loss: torch.Tensor) -> list[str]:
    """The type names of every autograd node behind ``loss``."""
    names, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


FUSED_LAYER = "LoRADecoderLayerFunction"
# What one fused decoder-layer node runs inside it, by node-name fragment (each other fused part once).
_PER_LAYER = {"RMSNormFunction": 2}


def served(names: list[str], fragment: str) -> int:
    """How many times the fused part ``fragment`` ran: as its own node, or inside a fused decoder-layer node (which
    runs one q / k / v group, one o, one MLP and two RMSNorms)."""
    return count(names, fragment) + _PER_LAYER.get(fragment, 1) * count(names, FUSED_LAYER)


def count(names: list[str], fragment: str) -> int:
    """How many node names contain ``fragment``."""
    return sum(fragment in name for name in names)


def stock_like(model, folder, auto=None):
    """transformers + peft on ``folder`` with ``model``'s LoRA targets (``target_parameters`` too) and LoRA values;
    ``auto``: the auto class that loads it (default ``AutoModelForCausalLM``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = model.peft_config["default"]
    targets = config.target_modules
    # A vision-language model's targets are one pattern string, which list() would split into characters.
    options = dict(
        r=config.r, lora_alpha=config.lora_alpha, target_modules=targets if isinstance(targets, str) else list(targets)
    )
    if getattr(config, "target_parameters", None):
        options["target_parameters"] = list(config.target_parameters)
    stock = get_peft_model((auto or AutoModelForCausalLM).from_pretrained(str(folder)), LoraConfig(**options))
    stock.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    return stock


def assert_lora_step_matches(model, stock, required: str, **inputs) -> None:
    """One forward + backward of both: a finite loss within 1e-5, every LoRA gradient within 1e-4 and non-zero, and
    some trainable parameter's name containing ``required`` (so the part under test did train)."""
    ours, theirs = model(**inputs).loss, stock(**inputs).loss
    ours.backward()
    theirs.backward()
    assert torch.isfinite(ours)
    assert relative_error(ours, theirs) <= LOSS_TOLERANCE, (ours.item(), theirs.item())
    expected = {n: p.grad for n, p in stock.named_parameters() if p.requires_grad}
    actual = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert expected.keys() == actual.keys() and any(required in name for name in actual)
    for name, grad in actual.items():
        assert expected[name].norm() > 0, name
        assert relative_error(grad, expected[name]) <= GRAD_TOLERANCE, name


def vlm_lora(folder, checkpointing=False, **switches):
    """fastft's tiny vision-language model from ``folder`` (fp32, max_seq_length 128) with r = 4 adapters chosen by
    the ``finetune_*`` ``switches``, their B's random so every adapter reaches the loss."""
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=128, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=checkpointing, **switches)
    randomize_lora_b(model, std=0.1)
    return model


def stock_vlm(model, folder):
    """:func:`stock_like` for a vision-language model: transformers' image-text-to-text auto class."""
    from fastft.loading.vision import vision_model_class

    return stock_like(model, folder, vision_model_class())


def assert_vlm_step_matches(model, stock, batch, required: str = "lora_A") -> None:
    """Both in train mode, then :func:`assert_lora_step_matches` on ``batch``."""
    model.train()
    stock.train()
    assert_lora_step_matches(model, stock, required, **batch)


def assert_vlm_adapter_loads_in_peft(model, folder, batch, tmp_path) -> None:
    """``model``'s adapter saved and loaded by plain peft on the stock model gives the same logits (1e-5)."""
    from peft import PeftModel

    from fastft.loading.vision import vision_model_class

    model.save_pretrained(tmp_path / "adapter")
    plain = PeftModel.from_pretrained(vision_model_class().from_pretrained(str(folder)), str(tmp_path / "adapter"))
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert relative_error(model(**batch).logits, plain(**batch).logits) <= 1e-5


def assert_vlm_generation_matches(model, stock, batch, pad_token_id: int, new_tokens: int = 6) -> None:
    """Greedy generation with the batch's images: fastft's tokens equal stock's, ``new_tokens`` of them."""
    FastModel.for_inference(model)
    stock.eval()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    outputs = []
    for candidate in (model, stock):
        with torch.no_grad():
            outputs.append(
                candidate.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
            )
    assert outputs[0].shape[1] == inputs["input_ids"].shape[1] + new_tokens
    assert torch.equal(outputs[0], outputs[1])


def assert_moe_step_matches(model, stock, **inputs) -> None:
    """:func:`assert_lora_step_matches` with the experts' adapters among the trained parameters."""
    assert_lora_step_matches(model, stock, ".experts.", **inputs)


def assert_backbone_router_logits_match(folder, checkpointing, vocab: int) -> None:
    """The backbone called with ``output_router_logits`` (as trl >= 1.15 does for its load-balancing loss) under
    ``checkpointing``: the router logits carry the gradient they carry without checkpointing."""
    ids = torch.randint(4, vocab, (2, 12), generator=torch.Generator().manual_seed(6))
    grads = []
    for mode in (False, checkpointing):
        model, _ = FastModel.from_pretrained(str(folder), max_seq_length=64, dtype=torch.float32)
        model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=mode)
        randomize_lora_b(model)
        out = model.get_base_model().model(input_ids=ids, output_router_logits=True)
        logits = out.router_logits
        assert logits and all(t.requires_grad for t in logits)
        sum((t.float() ** 2).sum() for t in logits).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert any(".self_attn." in n and grad.norm() > 0 for n, grad in plain.items())
    # A parameter the router logits do not depend on (the last layer's experts) has no gradient without
    # checkpointing; a checkpointed layer's node may give it zeros instead (transformers 4.x returns the logits from
    # the layer): the same gradient.
    for name in plain.keys() | checkpointed.keys():
        expected = plain.get(name, torch.zeros_like(checkpointed.get(name, torch.zeros(0))))
        actual = checkpointed.get(name, torch.zeros_like(expected))
        if expected.norm() == 0:
            assert actual.norm() == 0, name
        else:
            assert relative_error(actual, expected) <= 1e-6, name
