"""Fused linear cross-entropy against float64 F.cross_entropy, transformers' ForCausalLMLoss, and its memory claim."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, OpRecorder, random_tensor, relative_error

from fastft.kernels import dispatch
from fastft.kernels.cross_entropy import (
    FusedLinearCrossEntropyFunction,
    default_chunk_size,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.head_inputs import TargetRangeCheck

IGNORE = -100


def make_inputs(lead, vocab, width, dtype, gen, *, ignore_fraction=0.25, weight_grad=True, logit_scale=1.0):
    """hidden [*lead, H], weight [V, H] (scaled so logits are O(logit_scale), O(1) as in a trained head), labels with
    some ignored."""
    hidden = random_tensor((*lead, width), dtype, gen).requires_grad_()
    weight = random_tensor((vocab, width), dtype, gen, scale=logit_scale * width**-0.5).requires_grad_(weight_grad)
    labels = torch.randint(0, vocab, lead, generator=gen)
    drop = torch.rand(lead, generator=gen) < ignore_fraction
    drop.view(-1)[0] = False  # at least one counted token
    labels = labels.masked_fill(drop, IGNORE).to(KERNEL_DEVICE)
    return hidden, weight, labels


def upstream(gen) -> torch.Tensor:
    """A random scalar upstream gradient (ones would hide a missing grad_output factor)."""
    return (0.5 + torch.rand((), generator=gen)).to(KERNEL_DEVICE)


def reference64(hidden, weight, labels, grad, *, ignore_index=IGNORE, num_items_in_batch=None, softcap=None):
    """Loss and gradients from F.cross_entropy on float64 logits of the same (already rounded) inputs."""
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    logits = h64.reshape(-1, h64.shape[-1]) @ w64.t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    flat = labels.reshape(-1)
    if num_items_in_batch is None:
        loss = F.cross_entropy(logits, flat, ignore_index=ignore_index)
    else:
        loss = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
    loss.backward(grad.double())
    return loss.detach(), h64.grad, w64.grad


def check_against_float64(loss, hidden, weight, ref, dtype):
    ref_loss, ref_dh, ref_dw = ref
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert relative_error(loss, ref_loss) < TOLERANCE[dtype]
    assert hidden.grad.dtype == hidden.dtype and hidden.grad.shape == hidden.shape
    assert relative_error(hidden.grad, ref_dh) < TOLERANCE[dtype]
    if weight.requires_grad:
        assert weight.grad.dtype == weight.dtype
        assert relative_error(weight.grad, ref_dw) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("lead", "vocab", "width"),
    [((1,), 1000, 32), ((67,), 1000, 123), ((2, 33), 1000, 32), ((3,), 32003, 32), ((5,), 32003, 123)],
    ids=["1tok-v1000-h32", "67tok-v1000-h123", "2x33-v1000-h32", "3tok-v32003-h32", "5tok-v32003-h123"],
)
def test_matches_float64(kernel_path, gen, lead, vocab, width, dtype):
    hidden, weight, labels = make_inputs(lead, vocab, width, dtype, gen)
    grad = upstream(gen)
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward(grad)
    check_against_float64(loss, hidden, weight, reference64(hidden, weight, labels, grad), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("chunk_size", [1, 16, 64, 67, 1000])
def test_chunk_sizes_that_do_not_divide_tokens(kernel_path, gen, chunk_size, dtype):
    hidden, weight, labels = make_inputs((67,), 1000, 123, dtype, gen)
    grad = upstream(gen)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    loss.backward(grad)
    check_against_float64(loss, hidden, weight, reference64(hidden, weight, labels, grad), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_num_items_in_batch_matches_transformers(kernel_path, gen, dtype, as_tensor):
    """ForCausalLMLoss shifts labels itself: give it one extra position and labels shifted right by one."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    batch, seq, vocab, width = 2, 9, 1000, 32
    hidden, weight, labels = make_inputs((batch, seq), vocab, width, dtype, gen)
    grad = upstream(gen)
    num_items = int((labels != IGNORE).sum()) + 11  # as if other micro-batches held 11 more tokens
    num_items_arg = torch.tensor(num_items) if as_tensor else num_items

    loss = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=num_items_arg, chunk_size=5)
    loss.backward(grad)

    # transformers: logits for seq + 1 positions; label at position t + 1 is the target of position t, and the
    # last position's target (padding added by ForCausalLMLoss) is ignored, so the extra row never counts.
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    extra = random_tensor((batch, 1, width), dtype, gen).double()
    logits = torch.cat([h64, extra], dim=1) @ w64.t()
    shifted = torch.cat([torch.full((batch, 1), IGNORE, device=labels.device), labels], dim=1)
    hf_loss = ForCausalLMLoss(logits, shifted, vocab_size=vocab, num_items_in_batch=num_items_arg)
    hf_loss.backward(grad.double())

    # transformers computes in fp32 (logits.float()): compare at fp32 tolerance, or the input dtype's if looser.
    bound = max(TOLERANCE[dtype], TOLERANCE[torch.float32])
    assert relative_error(loss, hf_loss) < bound
    assert relative_error(hidden.grad, h64.grad) < bound
    assert relative_error(weight.grad, w64.grad) < bound
    check_against_float64(
        loss, hidden, weight, reference64(hidden, weight, labels, grad, num_items_in_batch=num_items), dtype
    )


def test_mean_matches_transformers_without_num_items(gen):
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, labels = make_inputs((3, 7), 1000, 32, torch.float32, gen)
    logits = torch.cat([hidden, hidden[:, :1]], dim=1).detach() @ weight.detach().t()
    shifted = torch.cat([torch.full((3, 1), IGNORE, device=labels.device), labels], dim=1)
    expected = ForCausalLMLoss(logits, shifted, vocab_size=1000)
    assert relative_error(fused_linear_cross_entropy(hidden, weight, labels), expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_gradient_accumulation_equals_one_big_batch(kernel_path, gen, dtype):
    hidden, weight, labels = make_inputs((41,), 1000, 32, dtype, gen, ignore_fraction=0.4)
    grad = upstream(gen)
    total = int((labels != IGNORE).sum())

    parts = [slice(0, 23), slice(23, 41)]  # unequal micro-batches with unequal ignored counts
    accumulated = torch.zeros((), dtype=torch.float32, device=KERNEL_DEVICE)
    for part in parts:
        micro = fused_linear_cross_entropy(
            hidden[part], weight, labels[part], num_items_in_batch=torch.tensor(total), chunk_size=8
        )
        micro.backward(grad)
        accumulated += micro.detach()
    accumulated_dh, accumulated_dw = hidden.grad.clone(), weight.grad.clone()

    hidden.grad = weight.grad = None
    big = fused_linear_cross_entropy(hidden, weight, labels)
    big.backward(grad)

    assert relative_error(accumulated, big) < TOLERANCE[dtype]
    assert relative_error(accumulated_dh, hidden.grad) < TOLERANCE[dtype]
    assert relative_error(accumulated_dw, weight.grad) < TOLERANCE[dtype]
    check_against_float64(big, hidden, weight, reference64(hidden, weight, labels, grad), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("num_items", [None, 5])
def test_all_ignored_gives_zero_loss_and_zero_grads(kernel_path, gen, dtype, num_items):
    hidden, weight, _ = make_inputs((2, 5), 1000, 32, dtype, gen)
    labels = torch.full((2, 5), IGNORE, device=KERNEL_DEVICE)
    # The deliberate difference: torch's mean over zero tokens is NaN.
    assert torch.isnan(
        F.cross_entropy(hidden.detach().float().reshape(10, 32) @ weight.detach().float().t(), labels.view(-1))
    )

    loss = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=num_items, chunk_size=3)
    loss.backward(upstream(gen))
    assert loss.dtype == torch.float32 and loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    reference = linear_cross_entropy_reference(hidden, weight, labels, num_items_in_batch=num_items)
    assert reference.item() == 0.0


def saved_tensors_during(fn):
    """Every distinct tensor autograd saves while ``fn`` runs, and the output of ``fn``."""
    saved = {}

    def pack(tensor):
        saved[id(tensor)] = tensor  # holding it keeps ids unique
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return list(saved.values()), out


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_frozen_weight_skips_dw(kernel_path, gen, dtype):
    hidden, weight, labels = make_inputs((67,), 1000, 123, dtype, gen, weight_grad=False)
    grad = upstream(gen)
    saved, loss = saved_tensors_during(lambda: fused_linear_cross_entropy(hidden, weight, labels, chunk_size=16))
    loss.backward(grad)
    assert weight.grad is None
    # Only d hidden and the 0-dim denominator are kept: no [V, H] gradient was built for a frozen head.
    assert sorted(tuple(t.shape) for t in saved) == [(), (67, 123)]
    check_against_float64(loss, hidden, weight, reference64(hidden, weight, labels, grad), dtype)


def test_weight_only_gradient(kernel_path, gen):
    hidden, weight, labels = make_inputs((13,), 1000, 32, torch.float32, gen)
    hidden.requires_grad_(False)
    grad = upstream(gen)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    loss.backward(grad)
    assert hidden.grad is None
    assert relative_error(weight.grad, reference64(hidden, weight, labels, grad)[2]) < TOLERANCE[torch.float32]


def test_no_grad_forward_matches(kernel_path, gen):
    hidden, weight, labels = make_inputs((2, 11), 1000, 32, torch.float32, gen)
    with torch.no_grad():
        evaluated = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=7)
    assert not evaluated.requires_grad
    ref_loss = reference64(hidden, weight, labels, torch.tensor(1.0))[0]
    assert relative_error(evaluated, ref_loss) < TOLERANCE[torch.float32]


def test_non_contiguous_inputs_and_custom_ignore_index(kernel_path, gen):
    width, vocab = 32, 1000
    hidden = random_tensor((width, 19), torch.float32, gen).t().requires_grad_()  # [19, H], strides (1, 19)
    wide = random_tensor((vocab, width + 7), torch.float32, gen, scale=width**-0.5)
    weight = wide[:, 3 : 3 + width].requires_grad_()  # row stride H + 7
    labels = torch.randint(0, vocab, (38,), generator=gen).to(KERNEL_DEVICE)[::2]
    labels[[2, 5]] = 0  # ignore_index 0: token 0 acts as padding
    grad = upstream(gen)
    loss = fused_linear_cross_entropy(hidden, weight, labels, ignore_index=0, chunk_size=6)
    loss.backward(grad)
    check_against_float64(
        loss, hidden, weight, reference64(hidden, weight, labels, grad, ignore_index=0), torch.float32
    )


def test_function_apply_directly(kernel_path, gen):
    hidden, weight, labels = make_inputs((9,), 1000, 32, torch.float32, gen)
    grad = upstream(gen)
    loss = FusedLinearCrossEntropyFunction.apply(hidden, weight, labels, IGNORE, None, 4)
    loss.backward(grad)
    check_against_float64(loss, hidden, weight, reference64(hidden, weight, labels, grad), torch.float32)


def test_reference_matches_float64(gen):
    hidden, weight, labels = make_inputs((2, 6), 1000, 32, torch.float32, gen)
    grad = upstream(gen)
    loss = linear_cross_entropy_reference(hidden, weight, labels)
    loss.backward(grad)
    check_against_float64(loss, hidden, weight, reference64(hidden, weight, labels, grad), torch.float32)


def test_default_chunk_size():
    # 256 MiB of fp32 logits: 1024 rows at SmolLM's 49152, 512 at Llama 3's 128256, never more than the tokens.
    assert default_chunk_size(4096, 49152) == 1024
    assert default_chunk_size(16384, 128256) == 512
    assert default_chunk_size(67, 1000) == 67
    assert default_chunk_size(1, 10**9) == 1


def test_bad_inputs_raise(kernel_path, gen):
    hidden, weight, labels = make_inputs((4,), 50, 8, torch.float32, gen)
    with pytest.raises(ShapeContractError, match=r"hidden must be \[\.\.\., 8\].*got shape \(4, 7\)"):
        fused_linear_cross_entropy(hidden[:, :7], weight, labels)
    with pytest.raises(ShapeContractError, match=r"labels must have hidden's leading shape \(4,\), got \(2, 2\)"):
        fused_linear_cross_entropy(hidden, weight, labels.view(2, 2))
    with pytest.raises(ShapeContractError, match=r"weight must be the LM head \[vocab, hidden\], got shape \(400,\)"):
        fused_linear_cross_entropy(hidden, weight.reshape(-1), labels)
    for bad in (50, -1):
        wrong = labels.clone()
        wrong[1] = bad
        with pytest.raises(ShapeContractError, match=rf"labels must lie in \[0, 50\).*e\.g\. {bad}"):
            fused_linear_cross_entropy(hidden, weight, wrong)
    with pytest.raises(TypeError, match="share one dtype"):
        fused_linear_cross_entropy(hidden, weight.detach().half(), labels)
    with pytest.raises(TypeError, match="integer token ids"):
        fused_linear_cross_entropy(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        fused_linear_cross_entropy(hidden, weight, labels, chunk_size=0)


def test_a_label_check_started_earlier_gives_the_same_loss_errors_and_no_read_in_the_loss(kernel_path, gen):
    hidden, weight, labels = make_inputs((2, 6), 50, 8, torch.float32, gen)

    def loss_and_grads(check):
        hidden.grad = weight.grad = None
        loss = fused_linear_cross_entropy(hidden, weight, labels, labels_check=check)
        loss.backward()
        return loss.detach(), hidden.grad.clone(), weight.grad.clone()

    checked_here = loss_and_grads(None)
    started = TargetRangeCheck(labels, 50, -100)
    with OpRecorder() as recorder:
        checked_before = loss_and_grads(started)
    for before, here in zip(checked_before, checked_here, strict=True):
        torch.testing.assert_close(before, here, rtol=0, atol=0)
    # The verdict was taken when the check started: the loss reads no tensor value (on a GPU, no queue drain).
    assert "_local_scalar_dense" not in recorder.ops and "any" not in recorder.ops
    for bad in (50, -1):
        wrong = labels.clone()
        wrong[1, 2] = bad
        with pytest.raises(ShapeContractError, match=rf"labels must lie in \[0, 50\).*found 1 outside, e\.g\. {bad}"):
            fused_linear_cross_entropy(hidden, weight, wrong, labels_check=TargetRangeCheck(wrong, 50, -100))
    for vocab, ignore_index, targets in ((49, -100, labels), (50, 0, labels), (50, -100, labels[:, :5])):
        with pytest.raises(ValueError, match="the started target check covers .* but the head has 12 targets"):
            fused_linear_cross_entropy(
                hidden, weight, labels, labels_check=TargetRangeCheck(targets, vocab, ignore_index)
            )


def test_saved_bytes_meta_figure_equals_real(gen):
    """The naive figure below is taken on the meta device; at a small size it equals the real CPU one."""
    hidden, weight, labels = make_inputs((256,), 3000, 64, torch.float32, gen)
    real, _ = saved_tensors_during(lambda: F.cross_entropy(hidden @ weight.t(), labels))
    meta, _ = saved_tensors_during(
        lambda: F.cross_entropy(hidden.to("meta") @ weight.to("meta").t(), labels.to("meta"))
    )
    assert nbytes(real) == nbytes(meta) > 256 * 3000 * 4


def test_saved_bytes_for_backward_are_not_the_logits(gen):
    """Acceptance: 4096 tokens × 49152 vocab, the fused call saves O(T·H + V·H), never the [T, V] logits."""
    tokens, vocab, width = 4096, 49152, 64
    hidden, weight, labels = make_inputs((tokens,), vocab, width, torch.float32, gen)
    chunk = default_chunk_size(tokens, vocab)

    # The naive graph on meta tensors: same saved shapes, without allocating 1.6 GB of logits and log-probs.
    naive_saved, _ = saved_tensors_during(
        lambda: F.cross_entropy(hidden.to("meta") @ weight.to("meta").t(), labels.to("meta"))
    )
    with dispatch.force_reference():  # the interpreter would take far too long at this size
        fused_saved, loss = saved_tensors_during(lambda: fused_linear_cross_entropy(hidden, weight, labels))
    naive_bytes, fused_bytes = nbytes(naive_saved), nbytes(fused_saved)
    bound = 4 * (tokens * width + vocab * width + chunk * vocab)
    message = (
        f"saved for backward at T={tokens} V={vocab} H={width} (chunk {chunk}): fused {fused_bytes:,} B "
        f"({fused_bytes / 2**20:.1f} MiB), naive F.cross_entropy(hidden @ W.T) {naive_bytes:,} B "
        f"({naive_bytes / 2**20:.1f} MiB), ratio {fused_bytes / naive_bytes:.2%}, bound {bound:,} B"
    )
    print("\n" + message)
    assert torch.isfinite(loss)
    assert fused_bytes < 0.10 * naive_bytes, message
    assert fused_bytes < bound, message
    # Tighter: exactly d hidden [T, H] + d weight [V, H] (fp32) + the 0-dim denominator, no chunk × vocab at all.
    assert fused_bytes == 4 * (tokens * width + vocab * width + 1), message
    assert naive_bytes >= 4 * tokens * vocab, message


def test_zero_tokens(kernel_path, gen):
    hidden, weight, _ = make_inputs((3,), 1000, 32, torch.float32, gen)
    empty_hidden = hidden.detach()[:0].requires_grad_()
    loss = fused_linear_cross_entropy(empty_hidden, weight, torch.zeros(0, dtype=torch.int64, device=KERNEL_DEVICE))
    loss.backward(upstream(gen))
    assert loss.item() == 0.0 and empty_hidden.grad.shape == (0, 32)
    assert torch.equal(weight.grad, torch.zeros_like(weight))


# Soft-capped logits (Gemma 2/3's final_logit_softcapping). Logits of O(8): a cap of 30 bends them a little, a cap of
# 3 saturates many; both are far from the uncapped loss, so a kernel that skipped the cap (or its derivative) fails.
SOFTCAPS = [30.0, 3.0]


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("lead", "vocab", "width", "chunk_size"),
    [((67,), 1000, 123, 16), ((2, 5), 5003, 32, 3), ((1,), 1000, 32, None)],
    # 5003: two 4096-column blocks per row, the second mostly masked; chunks of 16 and 3 leave a short last chunk.
    ids=["67tok-v1000-h123-chunk16", "2x5-v5003-h32-chunk3", "1tok-v1000-h32"],
)
def test_softcap_matches_float64(kernel_path, gen, lead, vocab, width, chunk_size, dtype, softcap):
    hidden, weight, labels = make_inputs(lead, vocab, width, dtype, gen, logit_scale=8.0)
    grad = upstream(gen)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, softcap=softcap)
    loss.backward(grad)
    check_against_float64(loss, hidden, weight, reference64(hidden, weight, labels, grad, softcap=softcap), dtype)

    # The unfused fp32 computation a user would write: F.cross_entropy(tanh((h @ W.T) / c) * c, labels).
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    unfused = linear_cross_entropy_reference(h32, w32, labels, softcap=softcap)
    unfused.backward(grad)
    bound = max(TOLERANCE[dtype], TOLERANCE[torch.float32])
    assert relative_error(loss, unfused) < bound
    assert relative_error(hidden.grad, h32.grad) < bound
    assert relative_error(weight.grad, w32.grad) < bound
    uncapped = reference64(hidden, weight, labels, grad)[0]
    assert relative_error(loss, uncapped) > 0.01  # the cap changes the loss far beyond the tolerance


@pytest.mark.parametrize("num_items", [None, 50])
def test_softcap_num_items_frozen_head_and_no_grad(kernel_path, gen, num_items):
    hidden, weight, labels = make_inputs((2, 9), 1000, 32, torch.float32, gen, logit_scale=8.0, weight_grad=False)
    grad = upstream(gen)
    ref = reference64(hidden, weight, labels, grad, num_items_in_batch=num_items, softcap=3.0)
    loss = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=num_items, chunk_size=4, softcap=3.0)
    loss.backward(grad)
    check_against_float64(loss, hidden, weight, ref, torch.float32)
    with torch.no_grad():
        evaluated = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=num_items, softcap=3.0)
    assert relative_error(evaluated, ref[0]) < TOLERANCE[torch.float32]


def test_softcap_saturated_logits_stay_finite(kernel_path, gen):
    """Logits of O(1000) against a cap of 30: tanh saturates, the cap's derivative underflows, nothing overflows."""
    hidden, weight, labels = make_inputs((9,), 1000, 32, torch.float32, gen, logit_scale=1000.0)
    grad = upstream(gen)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=4, softcap=30.0)
    loss.backward(grad)
    ref_loss = reference64(hidden, weight, labels, grad, softcap=30.0)[0]
    assert relative_error(loss, ref_loss) < TOLERANCE[torch.float32]
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_softcap_none_is_the_uncapped_loss_bit_for_bit(kernel_path, gen):
    hidden, weight, labels = make_inputs((19,), 1000, 32, torch.float32, gen)
    results = []
    for call in (
        lambda: fused_linear_cross_entropy(hidden, weight, labels, chunk_size=8),
        lambda: fused_linear_cross_entropy(hidden, weight, labels, chunk_size=8, softcap=None),
        lambda: FusedLinearCrossEntropyFunction.apply(hidden, weight, labels, IGNORE, None, 8),  # old signature
    ):
        hidden.grad = weight.grad = None
        loss = call()
        loss.backward()
        results.append((loss, hidden.grad, weight.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
    assert torch.equal(
        linear_cross_entropy_reference(hidden, weight, labels, softcap=None),
        linear_cross_entropy_reference(hidden, weight, labels),
    )


@pytest.mark.parametrize("bad", [0.0, -30.0, float("inf"), float("nan"), True, "30"], ids=repr)
def test_bad_softcap_raises(kernel_path, gen, bad):
    hidden, weight, labels = make_inputs((4,), 50, 8, torch.float32, gen)
    message = rf"fused_linear_cross_entropy: softcap must be a finite number > 0 or None, got {re.escape(repr(bad))}"
    message += r".*final_logit_softcapping"
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(hidden, weight, labels, softcap=bad)
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(hidden, weight, labels, softcap=bad)
    with pytest.raises(ValueError, match="linear_cross_entropy_reference: softcap must be"):
        linear_cross_entropy_reference(hidden, weight, labels, softcap=bad)
