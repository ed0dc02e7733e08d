"""Fused linear log-probs (and entropy, log Σp², mean logit, is-top-1) against the unfused float64 expression."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error

import fastft.kernels as kernels
from fastft.bench.measure import SavedTensorBytes
from fastft.kernels import dispatch
from fastft.kernels import linear_logprobs as module
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.linear_logprobs import (
    OPTIONAL_OUTPUTS,
    LogProbOutputs,
    default_chunk_size,
    fused_linear_logprobs,
    linear_logprobs_reference,
)

IGNORE = -100
ALL = OPTIONAL_OUTPUTS


def make_inputs(lead, vocab, width, dtype, gen, *, ignore_fraction=0.25, logit_scale=3.0, bias=False):
    """hidden [*lead, H], weight [V, H] (logits of O(logit_scale)), optional bias [V], targets with some ignored.

    A third of the scored targets are the row's argmax (of the fp64 logits), so ``is_top1`` is True often enough to
    be tested; the rest are random.
    """
    hidden = random_tensor((*lead, width), dtype, gen).requires_grad_()
    weight = random_tensor((vocab, width), dtype, gen, scale=logit_scale * width**-0.5).requires_grad_()
    bias_t = random_tensor((vocab,), dtype, gen).requires_grad_() if bias else None
    logits = hidden.detach().double() @ weight.detach().double().t()
    targets = torch.randint(0, vocab, lead, generator=gen).to(KERNEL_DEVICE)
    use_argmax = (torch.rand(lead, generator=gen) < 1 / 3).to(KERNEL_DEVICE)
    targets = torch.where(use_argmax, logits.argmax(-1), targets)
    drop = torch.rand(lead, generator=gen) < ignore_fraction
    drop.view(-1)[0] = False  # at least one scored token
    return hidden, weight, bias_t, targets.masked_fill(drop.to(KERNEL_DEVICE), IGNORE)


def upstream(lead, gen):
    """Random per-token upstream gradients (ones would hide a missing factor), fp32."""
    return tuple((torch.rand(lead, generator=gen) + 0.5).to(KERNEL_DEVICE) * sign for sign in (1.0, -1.0))


def transform64(z, *, temperature=1.0, softcap=None, logit_scale=1.0):
    z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z / temperature


def reference64(hidden, weight, bias, targets, *, ignore_index=IGNORE, grads=None, **transform):
    """Every output from the full float64 softmax of the same (already rounded) inputs, and, given ``grads``
    (g1, g2), the gradients of ``(log_probs * g1).sum() + (entropy * g2).sum()`` by autograd."""
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    raw = h64 @ w64.t()
    if b64 is not None:
        raw = raw + b64
    z = transform64(raw, **transform)
    log_softmax = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    safe = targets.masked_fill(~valid, 0)
    log_probs = log_softmax.gather(-1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0.0)
    entropy = (-(log_softmax.exp() * log_softmax).sum(-1)).masked_fill(~valid, 0.0)
    out = {
        "log_probs": log_probs,
        "entropy": entropy,
        "log_sum_sq_probs": torch.logsumexp(2 * log_softmax, dim=-1).masked_fill(~valid, 0.0),
        "mean_logits": z.mean(-1).masked_fill(~valid, 0.0),
        "is_top1": valid & (z.argmax(-1) == targets),
        "z": z.detach(),
        "valid": valid,
    }
    if grads is not None:
        g1, g2 = grads
        ((log_probs * g1.double()).sum() + (entropy * g2.double()).sum()).backward()
        out["grads"] = (h64.grad, w64.grad, None if b64 is None else b64.grad)
    return out


def check_top1(actual, ref):
    """``is_top1`` equals the float64 one wherever the float64 top two logits are further apart than fp32 rounding."""
    assert actual.dtype == torch.bool and actual.shape == ref["is_top1"].shape
    top2 = ref["z"].topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4 * top2[..., 0].abs().clamp(min=1.0)
    assert torch.equal(actual[clear], ref["is_top1"][clear])
    assert not actual[~ref["valid"]].any()


def check_outputs(out, ref, dtype, outputs=ALL):
    bound = TOLERANCE[dtype]
    assert isinstance(out, LogProbOutputs)
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == ref["log_probs"].shape
    assert relative_error(out.log_probs, ref["log_probs"]) < bound
    for name in ("entropy", "log_sum_sq_probs", "mean_logits"):
        value = getattr(out, name)
        if name not in outputs:
            assert value is None
            continue
        assert value.dtype == torch.float32 and value.shape == ref[name].shape, name
        assert relative_error(value, ref[name]) < bound, name
        assert torch.all(value[~ref["valid"]] == 0), name
    if "is_top1" in outputs:
        check_top1(out.is_top1, ref)
    else:
        assert out.is_top1 is None
    assert torch.all(out.log_probs[~ref["valid"]] == 0)


def check_grads(hidden, weight, bias, ref, dtype):
    ref_dh, ref_dw, ref_db = ref["grads"]
    bound = TOLERANCE[dtype]
    assert hidden.grad.dtype == hidden.dtype and hidden.grad.shape == hidden.shape
    assert relative_error(hidden.grad, ref_dh) < bound
    # Ignored positions get exactly no gradient.
    assert torch.all(hidden.grad[~ref["valid"]] == 0)
    if weight.requires_grad:
        assert weight.grad.dtype == weight.dtype
        assert relative_error(weight.grad, ref_dw) < bound
    else:
        assert weight.grad is None
    if bias is not None:
        assert bias.grad.dtype == bias.dtype
        assert relative_error(bias.grad, ref_db) < bound


def run(hidden, weight, bias, targets, grads, **kwargs):
    out = fused_linear_logprobs(hidden, weight, targets, bias=bias, **kwargs)
    g1, g2 = grads
    loss = (out.log_probs * g1).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * g2).sum()
    loss.backward()
    return out


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("lead", "vocab", "width", "chunk_size"),
    [((37,), 1000, 45, None), ((3, 13), 997, 33, (16, 256))],
    # 997 in tiles of 256 (the last one 229 wide) and 39 tokens in chunks of 16 (the last 7 tall); odd H.
    ids=["37tok-v1000-h45", "3x13-v997-h33-tiles16x256"],
)
def test_matches_float64(kernel_path, gen, lead, vocab, width, chunk_size, dtype):
    hidden, weight, bias, targets = make_inputs(lead, vocab, width, dtype, gen, bias=True)
    if len(lead) == 2:
        targets[1] = IGNORE  # a whole row (sequence) of ignored positions
    grads = upstream(lead, gen)
    out = run(hidden, weight, bias, targets, grads, outputs=ALL, chunk_size=chunk_size)
    ref = reference64(hidden, weight, bias, targets, grads=grads)
    check_outputs(out, ref, dtype)
    check_grads(hidden, weight, bias, ref, dtype)
    assert out.is_top1.any(), "no top-1 target among the scored ones: the test would not see a wrong True"


def test_bfloat16(kernel_path, gen):
    """bf16 runs through the interpreter too: the GEMMs are torch's (in fp32 on the CPU), the kernels have no tl.dot."""
    lead, vocab, width = (21,), 600, 32
    hidden, weight, bias, targets = make_inputs(lead, vocab, width, torch.bfloat16, gen, bias=True)
    grads = upstream(lead, gen)
    out = run(hidden, weight, bias, targets, grads, outputs=ALL, chunk_size=(8, 256))
    ref = reference64(hidden, weight, bias, targets, grads=grads)
    check_outputs(out, ref, torch.float32)  # fp32 arithmetic on the rounded inputs: fp32 accuracy
    check_grads(hidden, weight, bias, ref, torch.bfloat16)


def test_output_name_spellings(gen):
    hidden, weight, _, targets = make_inputs((5,), 100, 8, torch.float32, gen)
    as_string = linear_logprobs_reference(hidden, weight, targets, outputs="is_top1")
    as_generator = linear_logprobs_reference(hidden, weight, targets, outputs=(n for n in ["is_top1"]))
    trl_spelling = linear_logprobs_reference(hidden, weight, targets, outputs=("log_probs", "is_top1"))
    for out in (as_string, as_generator, trl_spelling):
        assert out.entropy is None and out.is_top1 is not None
        assert torch.equal(out.log_probs, as_string.log_probs)


TRANSFORMS = {
    "temperature": dict(temperature=0.7),
    "softcap": dict(softcap=3.0),  # logits of O(8) against a cap of 3: many saturate
    "scale-cap-temperature": dict(logit_scale=0.5, softcap=30.0, temperature=1.3),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS.values()), ids=list(TRANSFORMS))
def test_logit_transforms(kernel_path, gen, transform):
    lead, vocab, width = (29,), 997, 32
    hidden, weight, bias, targets = make_inputs(lead, vocab, width, torch.float32, gen, logit_scale=8.0, bias=True)
    grads = upstream(lead, gen)
    out = run(hidden, weight, bias, targets, grads, outputs=ALL, chunk_size=(8, 300), **transform)
    ref = reference64(hidden, weight, bias, targets, grads=grads, **transform)
    check_outputs(out, ref, torch.float32)
    check_grads(hidden, weight, bias, ref, torch.float32)
    plain = reference64(hidden, weight, bias, targets)
    assert relative_error(out.log_probs, plain["log_probs"]) > 0.01  # the transform matters far beyond tolerance


def test_transform_order_is_trls(gen):
    """Scale, then cap, then temperature: each other order gives other numbers."""
    hidden, weight, bias, targets = make_inputs((9,), 300, 16, torch.float32, gen, logit_scale=8.0, bias=True)
    options = dict(logit_scale=2.0, softcap=5.0, temperature=0.5)
    out = linear_logprobs_reference(hidden, weight, targets, bias=bias, outputs=(), **options)
    raw = hidden.detach().double() @ weight.detach().double().t() + bias.detach().double()
    ours = torch.tanh(raw * 2.0 / 5.0) * 5.0 / 0.5
    other = torch.tanh(raw / 5.0) * 5.0 * 2.0 / 0.5  # scale after the cap
    for z, matches in ((ours, True), (other, False)):
        expected = torch.log_softmax(z, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        expected = expected.masked_fill(targets == IGNORE, 0.0)
        assert (relative_error(out.log_probs, expected) < 1e-5) is matches


def test_tied_head_gets_gradient_from_both_uses(kernel_path, gen):
    """The head is the embedding matrix: it embeds the input ids and scores the targets; both paths feed its grad."""
    vocab, width, lead = 500, 24, (2, 11)
    embedding = random_tensor((vocab, width), torch.float32, gen, scale=2.0 * width**-0.5).requires_grad_()
    mix = random_tensor((width, width), torch.float32, gen, scale=width**-0.5)
    ids = torch.randint(0, vocab, lead, generator=gen).to(KERNEL_DEVICE)
    targets = torch.randint(0, vocab, lead, generator=gen).to(KERNEL_DEVICE)
    targets[0, :3] = IGNORE
    grads = upstream(lead, gen)

    hidden = torch.tanh(embedding[ids] @ mix) * 4.0
    out = run(hidden, embedding, None, targets, grads, chunk_size=(8, 128))

    e64 = embedding.detach().double().requires_grad_()
    h64 = torch.tanh(e64[ids] @ mix.double()) * 4.0
    log_softmax = torch.log_softmax(h64 @ e64.t(), dim=-1)
    valid = targets != IGNORE
    log_probs = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0)
    entropy = (-(log_softmax.exp() * log_softmax).sum(-1)).masked_fill(~valid, 0)
    ((log_probs * grads[0].double()).sum() + (entropy * grads[1].double()).sum()).backward()

    assert relative_error(out.log_probs, log_probs) < TOLERANCE[torch.float32]
    assert relative_error(out.entropy, entropy) < TOLERANCE[torch.float32]
    assert relative_error(embedding.grad, e64.grad) < TOLERANCE[torch.float32]
    # Both uses contribute: the head alone (hidden detached) gives a different gradient.
    head_only = embedding.detach().clone().requires_grad_()
    run(hidden.detach(), head_only, None, targets, grads, chunk_size=(8, 128))
    assert relative_error(head_only.grad, e64.grad) > 0.01


def test_is_top1_ties(kernel_path, gen):
    """Integer logits (exact in fp32, whatever the GEMM's order): column 3 ties with column 1 (same tile) and
    column 200 with column 3 (another tile). Only the first column of a tied maximum counts."""
    vocab, width = 300, 8
    weight = torch.randint(-2, 3, (vocab, width), generator=gen).float()
    hidden = torch.randint(-2, 3, (6, width), generator=gen).float()
    hidden[:, 0] = 1.0
    weight[:, 0] = -20.0  # every other column far below the tied ones
    for column in (1, 3, 200):
        weight[column] = weight[1]
        weight[column, 0] = 20.0
    weight[250, 0] = 10.0  # a clear second
    hidden, weight = hidden.to(KERNEL_DEVICE), weight.to(KERNEL_DEVICE)
    targets = torch.tensor([1, 3, 200, 250, 7, IGNORE], device=KERNEL_DEVICE)
    out = fused_linear_logprobs(hidden, weight, targets, outputs=ALL, chunk_size=(4, 128))
    assert out.is_top1.tolist() == [True, False, False, False, False, False]
    ref = reference64(hidden, weight, None, targets)
    assert ref["is_top1"].tolist() == out.is_top1.tolist()
    check_outputs(out, ref, torch.float32)
    # The ties are real: in every row, columns 1, 3 and 200 hold the maximum, exactly.
    z = ref["z"]
    assert torch.equal(z[:, [1, 3, 200]], z.amax(-1, keepdim=True).expand(6, 3))


def test_entropy_without_gradient_costs_nothing_and_changes_nothing(kernel_path, gen):
    lead, vocab, width = (23,), 997, 32
    hidden, weight, bias, targets = make_inputs(lead, vocab, width, torch.float32, gen, bias=True)
    g1 = upstream(lead, gen)[0]
    results = []
    for outputs in ((), ("entropy",), ALL):
        hidden.grad = weight.grad = bias.grad = None
        out = fused_linear_logprobs(hidden, weight, targets, bias=bias, outputs=outputs, chunk_size=(8, 512))
        (out.log_probs * g1).sum().backward()  # entropy, when computed, only logged
        results.append((out.log_probs.detach(), hidden.grad, weight.grad, bias.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
    ref = reference64(hidden, weight, bias, targets, grads=(g1, torch.zeros_like(g1)))
    check_grads(hidden, weight, bias, ref, torch.float32)


def test_entropy_gradient_alone(kernel_path, gen):
    lead, vocab, width = (17,), 600, 32
    hidden, weight, bias, targets = make_inputs(lead, vocab, width, torch.float32, gen, bias=True)
    g2 = upstream(lead, gen)[1]
    out = fused_linear_logprobs(hidden, weight, targets, bias=bias, chunk_size=(8, 256))
    (out.entropy * g2).sum().backward()
    ref = reference64(hidden, weight, bias, targets, grads=(torch.zeros_like(g2), g2))
    check_grads(hidden, weight, bias, ref, torch.float32)


def test_frozen_head_and_weight_only_gradient(kernel_path, gen):
    lead, vocab, width = (19,), 500, 32
    hidden, weight, bias, targets = make_inputs(lead, vocab, width, torch.float32, gen, bias=True)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    grads = upstream(lead, gen)
    run(hidden, weight, bias, targets, grads)
    assert weight.grad is None and bias.grad is None
    ref = reference64(hidden, weight, bias, targets, grads=grads)
    check_grads(hidden, weight, None, ref, torch.float32)

    hidden.grad = None
    hidden.requires_grad_(False)
    weight.requires_grad_(True)
    run(hidden, weight, bias, targets, grads, chunk_size=(4, 128))
    assert hidden.grad is None and bias.grad is None
    assert relative_error(weight.grad, ref["grads"][1]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("ignore_index", [-1, 10**6], ids=["minus1", "huge"])
def test_ignored_targets_need_no_valid_index(kernel_path, gen, ignore_index):
    """Ignored positions hold ignore_index, not a token: never read, 0 everywhere, no gradient."""
    lead, vocab, width = (12,), 400, 16
    hidden, weight, bias, targets = make_inputs(lead, vocab, width, torch.float32, gen, bias=True)
    targets = targets.masked_fill(targets == IGNORE, ignore_index)
    targets[-1] = ignore_index
    grads = upstream(lead, gen)
    out = run(hidden, weight, bias, targets, grads, outputs=ALL, ignore_index=ignore_index, chunk_size=(5, 128))
    ref = reference64(hidden, weight, bias, targets, ignore_index=ignore_index, grads=grads)
    check_outputs(out, ref, torch.float32)
    check_grads(hidden, weight, bias, ref, torch.float32)


def test_all_ignored_and_zero_tokens(kernel_path, gen):
    hidden, weight, bias, _ = make_inputs((2, 5), 300, 16, torch.float32, gen, bias=True)
    targets = torch.full((2, 5), IGNORE, device=KERNEL_DEVICE)
    grads = upstream((2, 5), gen)
    out = run(hidden, weight, bias, targets, grads, outputs=ALL, chunk_size=(3, 128))
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert torch.equal(getattr(out, name), torch.zeros(2, 5, device=KERNEL_DEVICE)), name
    assert not out.is_top1.any()
    for tensor in (hidden, weight, bias):
        assert torch.equal(tensor.grad, torch.zeros_like(tensor))

    empty = hidden.detach()[:0].requires_grad_()
    weight.grad = None
    out = run(empty, weight, None, targets[:0], (grads[0][:0], grads[1][:0]), outputs=ALL)
    assert out.log_probs.shape == (0, 5) and out.is_top1.shape == (0, 5)
    assert empty.grad.shape == (0, 5, 16) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_no_grad_and_non_contiguous_inputs(kernel_path, gen):
    width, vocab = 32, 700
    hidden = random_tensor((width, 19), torch.float32, gen).t()  # [19, H], strides (1, 19)
    wide = random_tensor((vocab, width + 7), torch.float32, gen, scale=3 * width**-0.5)
    weight = wide[:, 3 : 3 + width]  # row stride H + 7
    targets = torch.randint(0, vocab, (38,), generator=gen).to(KERNEL_DEVICE)[::2]
    targets[[2, 5]] = IGNORE
    with torch.no_grad():
        out = fused_linear_logprobs(hidden, weight, targets, outputs=ALL, chunk_size=(6, 256))
    assert not out.log_probs.requires_grad and not out.entropy.requires_grad
    check_outputs(out, reference64(hidden, weight, None, targets), torch.float32)


def test_reference_function_is_the_torch_path(gen, monkeypatch):
    """linear_logprobs_reference runs the torch twins forward and backward, whatever the dispatch would pick, and
    FASTFT_DISABLE_TRITON=1 sends fused_linear_logprobs there too (bit for bit the same)."""
    calls = []
    for name in ("fold_torch", "grad_torch", "fold_triton", "grad_triton"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    hidden, weight, bias, targets = make_inputs((9,), 300, 16, torch.float32, gen, bias=True)
    grads = upstream((9,), gen)

    def both(function):
        hidden.grad = weight.grad = bias.grad = None
        out = function(hidden, weight, targets, bias=bias, outputs=ALL)
        ((out.log_probs * grads[0]).sum() + (out.entropy * grads[1]).sum()).backward()
        return [*out, hidden.grad, weight.grad, bias.grad]

    reference = both(linear_logprobs_reference)
    assert set(calls) == {"fold_torch", "grad_torch"}
    calls.clear()
    monkeypatch.setenv("FASTFT_DISABLE_TRITON", "1")
    disabled = both(fused_linear_logprobs)
    assert set(calls) == {"fold_torch", "grad_torch"}
    assert all(torch.equal(a, b) for a, b in zip(reference, disabled, strict=True))
    monkeypatch.delenv("FASTFT_DISABLE_TRITON")
    calls.clear()
    both(fused_linear_logprobs)
    expected = {"fold_triton", "grad_triton"} if dispatch.use_triton(hidden) else {"fold_torch", "grad_torch"}
    assert set(calls) == expected


def saved_shapes(fn):
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return shapes, out


@pytest.mark.parametrize("outputs", [("entropy",), ()], ids=["entropy", "log_probs-only"])
def test_saved_for_backward_is_not_the_logits(gen, outputs):
    """Acceptance: at 512 tokens × 32000 vocabulary, the call saves hidden, the targets and one or two fp32 numbers
    per token; nothing of [tokens, vocab] (65.5 MB in fp32), nor of one tile."""
    tokens, vocab, width = 512, 32000, 64
    hidden, weight, bias, targets = make_inputs((tokens,), vocab, width, torch.float32, gen, bias=True)
    logits_bytes = tokens * vocab * 4

    def call():
        return fused_linear_logprobs(hidden, weight, targets, bias=bias, outputs=outputs)

    with dispatch.force_reference():  # the interpreter would take too long at this size
        with SavedTensorBytes(exclude=[weight, bias]) as saved:
            out = call()
        shapes, _ = saved_shapes(call)
    per_token = 4 * width + 8 + 4 * (1 + len(outputs))  # hidden fp32, int64 target, log Z (and the entropy)
    message = (
        f"saved for backward at T={tokens} V={vocab} H={width}: {saved.bytes:,} B ({saved.tensors} tensors), "
        f"[T, V] fp32 logits would be {logits_bytes:,} B"
    )
    print("\n" + message)
    assert saved.bytes == tokens * per_token, message
    assert saved.bytes < 0.01 * logits_bytes, message
    assert saved.excluded == 2  # the weight and the bias, saved by reference
    assert set(shapes) <= {(tokens, width), (vocab, width), (vocab,), (tokens,)}, shapes
    assert torch.isfinite(out.log_probs).all()


def test_saved_tensors_interpreter_path_small(kernel_path, gen):
    lead, vocab, width = (3, 7), 500, 16
    hidden, weight, _, targets = make_inputs(lead, vocab, width, torch.float32, gen)
    with SavedTensorBytes(exclude=[weight]) as saved:
        fused_linear_logprobs(hidden, weight, targets, chunk_size=(4, 128))
    shapes, _ = saved_shapes(lambda: fused_linear_logprobs(hidden, weight, targets, chunk_size=(4, 128)))
    assert set(shapes) <= {(21, width), (vocab, width), (21,)}, shapes
    assert saved.bytes == 21 * (4 * width + 8 + 8)


def test_default_chunk_size():
    # CUDA: 256 MiB tiles of 32768 columns = 2048 tokens; the CPU: 8 MiB = 64 tokens; never more than there is.
    assert default_chunk_size(8192, 128256, "cuda") == (2048, 32768)
    assert default_chunk_size(8192, 49152, "meta") == (2048, 32768)
    assert default_chunk_size(8192, 128256, "cpu") == (64, 32768)
    assert default_chunk_size(67, 1000, "cpu") == (67, 1000)
    assert default_chunk_size(0, 10, "cpu") == (1, 10)


def test_exported_with_docstrings():
    for name in ("fused_linear_logprobs", "linear_logprobs_reference", "LogProbOutputs"):
        assert name in kernels.__all__ and getattr(kernels, name) is getattr(module, name)
    for function in (fused_linear_logprobs, linear_logprobs_reference):
        assert "Args:" in function.__doc__ and "Returns:" in function.__doc__
    assert LogProbOutputs._fields == ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def test_bad_inputs_raise(kernel_path, gen):
    hidden, weight, bias, targets = make_inputs((4,), 50, 8, torch.float32, gen, bias=True)
    name = "fused_linear_logprobs: "
    cases = [
        (
            dict(hidden=hidden[:, :7]),
            ShapeContractError,
            r"hidden must be \[\.\.\., 8\] to match weight \[50, 8\], "
            r"got shape \(4, 7\); pass the final hidden states",
        ),
        (
            dict(targets=targets.view(2, 2)),
            ShapeContractError,
            r"targets must have hidden's leading shape \(4,\), "
            r"got \(2, 2\); give one target token id per hidden row",
        ),
        (
            dict(bias=bias[:49]),
            ShapeContractError,
            r"bias must be \[50\] \(one per row of weight \[50, 8\]\), got "
            r"shape \(49,\); pass lm_head.bias, or None",
        ),
        (dict(weight=weight.reshape(-1)), ShapeContractError, r"weight must be the LM head \[vocab, hidden\]"),
        (
            dict(outputs=("entropy", "perplexity")),
            ValueError,
            r"unknown output name\(s\) \['perplexity'\]; outputs "
            r"must be a subset of \('entropy', 'log_sum_sq_probs', 'mean_logits', 'is_top1'\)",
        ),
        (dict(chunk_size=0), ValueError, r"chunk_size must be a positive int"),
        (dict(chunk_size=(4, 0)), ValueError, r"chunk_size must be a positive int"),
        (dict(logit_scale=float("nan")), ValueError, r"logit_scale must be a finite number, got nan"),
        (dict(softcap=-1.0), ValueError, r"softcap must be a finite number > 0 or None, got -1.0"),
        (dict(weight=weight.detach().half()), TypeError, r"hidden and weight must share one dtype"),
        (dict(targets=targets.float()), TypeError, r"targets must be integer token ids"),
    ]
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1"):
        message = rf"temperature must be a finite number > 0, got {re.escape(repr(bad))}; pass the sampling"
        cases.append((dict(temperature=bad), ValueError, message))
    for wrong in (50, -2):
        out_of_range = targets.clone()
        out_of_range[1] = wrong
        cases.append(
            (dict(targets=out_of_range), ShapeContractError, rf"targets must lie in \[0, 50\).*e\.g\. {wrong}")
        )
    for change, error, message in cases:
        arguments = dict(hidden=hidden, weight=weight, targets=targets, bias=bias) | change
        call = {key: arguments.pop(key) for key in ("hidden", "weight", "targets")}
        with pytest.raises(error, match=re.escape(name) + message):
            fused_linear_logprobs(call["hidden"], call["weight"], call["targets"], **arguments)
    with pytest.raises(ValueError, match=r"^linear_logprobs_reference: temperature must be"):
        linear_logprobs_reference(hidden, weight, targets, temperature=0)
    # Shape errors are ValueErrors too (ShapeContractError subclasses it).
    with pytest.raises(ValueError, match="fused_linear_logprobs: targets must have"):
        fused_linear_logprobs(hidden, weight, targets[:3])
