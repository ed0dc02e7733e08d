"""transformers 4.x's per-expert MoE modules (Qwen3-MoE's ``Qwen3MoeMLP``, Mixtral's ``MixtralBlockSparseTop2MLP``)
on the fused grouped-expert path (fastft/patches/moe_experts_4x.py): that it runs (patch report and calls), parity
with stock transformers + peft through the Triton kernels (the interpreter) and the torch reference, routing as
upstream's (top-k renormalisation, Mixtral's jitter), exact zeros for unrouted experts, every fallback named, and
address tables that never go stale (storage swapped, ``.half()``, ``.to(float64)``).

transformers 5.x has no per-expert modules (its experts are 3-D parameters, tests/test_moe_lora.py): skipped there."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import lane_cases, randomize_lora_b, relative_error
from parity import assert_moe_step_matches, stock_like
from test_moe_lora import HIDDEN, VOCAB, _expert_grads, _layout, _model, _route_to_first_two

from fastft import FastModel
from fastft.contracts.moe import moe_blocks
from fastft.patches import moe_experts_4x
from fastft.registry import patch_report

pytestmark = [
    pytest.mark.lane,
    pytest.mark.skipif(_layout() != "per-expert", reason="transformers 5.x keeps no per-expert modules"),
]

FAMILIES = ["qwen3_moe", "mixtral"]


def _save(folder, family: str, word_tokenizer, **overrides) -> str:
    _model(family, **overrides).save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory, word_tokenizer):
    return _save(tmp_path_factory.mktemp(request.param), request.param, word_tokenizer)


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times a 4.x block ran its experts on the fused path."""
    calls = []
    original = moe_experts_4x._Fused.__call__
    monkeypatch.setattr(moe_experts_4x._Fused, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    return calls


def _lora(folder: str, checkpointing: bool | str = False, **kwargs) -> torch.nn.Module:
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=checkpointing, **kwargs)
    randomize_lora_b(model)
    return model


def _experts_row(model: torch.nn.Module) -> dict:
    return next(r for r in patch_report(model) if r["name"] == f"{model.config.model_type}.experts")


def _ids(seed: int, length: int = 12) -> torch.Tensor:
    return torch.randint(4, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("checkpointing", lane_cases([True, False]))
def test_per_expert_modules_take_the_fused_path_and_match_stock(moe_dir, kernel_path, fused_calls, checkpointing):
    model = _lora(moe_dir, checkpointing)
    row = _experts_row(model)
    assert row["status"] == "applied" and not row.get("fallbacks"), row
    ids = _ids(1)
    assert_moe_step_matches(model, stock_like(model, moe_dir), input_ids=ids, labels=ids)
    # Two sparse blocks, once each (checkpointing runs a block again in backward).
    assert len(fused_calls) == (4 if checkpointing else 2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_block_routes_exactly_as_upstream(tmp_path, word_tokenizer, fused_calls, family, norm_topk_prob):
    # The patched block against upstream's own forward on the same module: the same router logits, the same output
    # and the same LoRA gradients. Mixtral always renormalises and draws its router jitter in training (the same
    # draws, from the same seed); Qwen3-MoE renormalises only when norm_topk_prob says so.
    overrides = {"norm_topk_prob": norm_topk_prob} if family == "qwen3_moe" else {"router_jitter_noise": 0.1}
    if family == "mixtral" and not norm_topk_prob:
        pytest.skip("Mixtral has no norm_topk_prob")
    model = _lora(_save(tmp_path, family, word_tokenizer, **overrides))
    model.train()
    block = next(moe_blocks(model)).block
    upstream = type(block).__mro__[1].forward
    leaves = [p for n, p in block.named_parameters() if p.requires_grad]
    hidden = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(3))
    results = []
    for forward in (type(block).forward, upstream):
        torch.manual_seed(11)
        out, logits = forward(block, hidden.clone())
        grads = torch.autograd.grad(out.square().sum() + logits.square().sum(), leaves)
        results.append((out, logits, *grads))
    assert len(fused_calls) == 1
    for ours, theirs in zip(*results, strict=True):
        assert relative_error(ours, theirs) <= 1e-5


def test_unrouted_experts_get_exactly_zero_lora_gradients(moe_dir, fused_calls):
    model = _lora(moe_dir)
    _route_to_first_two(model)
    ids = _ids(0)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(fused_calls) == 2
    totals = _expert_grads(model)
    assert totals[0] > 0 and totals[1] > 0
    assert totals[2] == 0.0 and totals[3] == 0.0


def _expert(model: torch.nn.Module, index: int = 1) -> torch.nn.Module:
    return next(moe_blocks(model)).experts[index]


def _projection(expert: torch.nn.Module, role: int) -> torch.nn.Module:
    return getattr(expert, moe_experts_4x.roles_of(type(expert))[role])


def _hook(model):
    _expert(model).register_forward_hook(lambda *args: None)


def _trainable_base(model):
    _projection(_expert(model), 2).base_layer.weight.requires_grad_(True)


def _column_major(model):
    # Same shape, other strides: the table reads every expert with one stride.
    weight = _projection(_expert(model, 2), 0).base_layer.weight
    weight.data = weight.data.t().contiguous().t()


def _two_adapters(model):
    from peft import LoraConfig

    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "w1"]))
    model.base_model.set_adapter(["default", "other"])


FALLBACKS = {
    "hook": (_hook, {}, r"experts\.1 has forward hooks"),
    "trainable base weight": (
        _trainable_base,
        {},
        r"experts\.1\.(down_proj|w2)\.base_layer's base weight is trainable",
    ),
    "strides": (_column_major, {}, r"expert 2's weight \(part 0\) is .* expected .* strides"),
    "lora dropout": (None, {"lora_dropout": 0.1}, r"lora_dropout p=0\.1"),
    "dora": (None, {"use_dora": True}, r"DoRA"),
    "two adapters": (_two_adapters, {}, r"2 active adapters"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_what_the_kernels_cannot_serve_runs_upstream_and_is_named(moe_dir, fused_calls, case):
    change, kwargs, reason = FALLBACKS[case]
    model = _lora(moe_dir, **kwargs)
    model.train()
    if change is not None:
        change(model)
    row = _experts_row(model)
    assert row["status"] == "applied"
    blocks = [block.name for block in moe_blocks(model)]
    fallbacks = row.get("fallbacks") or {}
    first = f"{blocks[0]}.experts"
    assert first in fallbacks and re.search(reason, fallbacks[first]), fallbacks
    ids = _ids(2)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    # A change made to one block leaves the other one fused; the options (dropout, DoRA, two adapters) reach both.
    assert len(fused_calls) == (1 if change not in (None, _two_adapters) else 0)


def test_a_non_silu_activation_runs_upstream_and_is_named(tmp_path, word_tokenizer, fused_calls):
    model = _lora(_save(tmp_path, "mixtral", word_tokenizer, hidden_act="gelu"))
    fallbacks = _experts_row(model).get("fallbacks") or {}
    assert fallbacks and all(
        "activation GELUActivation has no fused grouped-expert kernel" in r for r in fallbacks.values()
    )
    ids = _ids(2)
    model(input_ids=ids, labels=ids).loss.backward()
    assert not fused_calls


def test_4bit_experts_run_upstream_and_are_named(moe_dir, fused_calls):
    model, _ = FastModel.from_pretrained(moe_dir, max_seq_length=64, load_in_4bit=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    fallbacks = _experts_row(model).get("fallbacks") or {}
    assert len(fallbacks) == 2 and all("Linear4bit) expert" in r for r in fallbacks.values()), fallbacks
    ids = _ids(2)
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    assert not fused_calls


def test_expert_storage_swapped_after_a_step_is_read_where_it_is_now(moe_dir, fused_calls):
    # param.data = ... keeps every Parameter (and so every id the plan compares) but moves its storage: the next step
    # must build new address tables, and read the new values (a stale table would read the old, freed memory).
    model = _lora(moe_dir)
    stock = stock_like(model, moe_dir)
    ids = _ids(4)
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad()
    for side in (model, stock):
        for block in moe_blocks(side):
            for expert in block.experts:
                for role in range(3):
                    weight = _projection(expert, role).base_layer.weight
                    weight.data = weight.data * 1.5
    assert_moe_step_matches(model, stock, input_ids=ids, labels=ids)
    assert len(fused_calls) == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_a_block_cast_after_patching_matches_upstream_or_is_refused(moe_dir, fused_calls, dtype):
    # .half() / .to(float64) after the first call: fp16 gets new tables; float64 (which the kernels do not take) runs
    # upstream's loop, and the patch report names the dtype. The block then equals upstream's own forward, or (where
    # the loop itself runs fastft's fused dense MLP on each expert: Qwen3-MoE) is refused by name, never a stale read.
    model = _lora(moe_dir)
    block = next(moe_blocks(model)).block
    hidden = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        block(hidden)
        assert len(fused_calls) == 1
        block.to(dtype)
        if dtype == torch.float64 and model.config.model_type == "qwen3_moe":
            with pytest.raises(TypeError, match=r"float32 / float16 / bfloat16 .*got torch\.float64"):
                block(hidden.to(dtype))
            ours = theirs = None
        else:
            ours, _ = block(hidden.to(dtype))
            theirs, _ = type(block).__mro__[1].forward(block, hidden.to(dtype))
    if ours is not None:
        assert ours.dtype == dtype
        assert relative_error(ours, theirs) <= (2e-3 if dtype == torch.float16 else 1e-12)
    fallbacks = _experts_row(model).get("fallbacks") or {}
    if dtype == torch.float16:
        assert len(fused_calls) == 2 and not fallbacks
    else:
        assert len(fused_calls) == 1
        name = f"{next(moe_blocks(model)).name}.experts"
        assert "torch.float64" in fallbacks[name] and "float32 / float16 / bfloat16" in fallbacks[name]


def test_autocast_to_another_dtype_runs_upstream(moe_dir, fused_calls):
    # The grouped GEMMs take one dtype: under autocast to bf16 an fp32 model's experts run upstream's loop, where
    # autocast casts each expert's matmul, instead of failing on the dtype.
    model = _lora(moe_dir)
    block = next(moe_blocks(model)).block
    hidden = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = block(hidden)
        theirs, _ = type(block).__mro__[1].forward(block, hidden)
    assert not fused_calls
    assert torch.equal(ours, theirs)
    with torch.no_grad():
        block(hidden)
    assert len(fused_calls) == 1


NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
# Up alone (gate's rows of the gate | up B are zero), gate and down without up, and gate with another rank than up
# (the block-diagonal B is [E, 2I, 2 + 4]; alpha keeps the scales equal). Roles as (gate, up, down) indices.
ADAPTER_LAYOUTS = {"up only": ((1,), False), "gate and down": ((0, 2), False), "ranks differ": ((0, 1, 2), True)}


@pytest.mark.parametrize("layout", list(ADAPTER_LAYOUTS))
def test_adapters_on_some_roles_or_of_other_ranks_match_stock(moe_dir, fused_calls, layout):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    names = NAMES[AutoConfig.from_pretrained(moe_dir).model_type]
    roles, other_rank = ADAPTER_LAYOUTS[layout]
    options: dict = {"target_modules": [names[role] for role in roles]}
    if other_rank:
        options.update(rank_pattern={names[0]: 2}, alpha_pattern={names[0]: 4})
    model = _lora(moe_dir, **options)
    assert not _experts_row(model).get("fallbacks")
    stock = get_peft_model(AutoModelForCausalLM.from_pretrained(moe_dir), LoraConfig(r=4, lora_alpha=8, **options))
    stock.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    ids = _ids(5)
    assert_moe_step_matches(model, stock, input_ids=ids, labels=ids)
    assert len(fused_calls) == 2
