"""The causal-LM loss through the fused linear cross-entropy: no [tokens, vocab] logits in training.

:func:`causal_lm_forward` builds the forward of a family's ``...ForCausalLM`` subclass; it takes the upstream
signature (of whichever transformers is installed). With labels in training mode, autograd on, it runs the
backbone, shifts the labels like transformers' ``ForCausalLMLoss`` and computes the loss with
:func:`fastft.kernels.fused_linear_cross_entropy`, which never materialises the logits; everything else (eval,
generation, no labels, an LM head that is not a plain ``nn.Linear``) is the upstream forward.

Logits in training: transformers returns them beside the loss, and trl before 1.15 reads them for its token
accuracy / entropy metrics. There, the logits are computed once more without gradient (nothing is saved for
backward); with trl >= 1.15, or without trl, training returns ``logits=None``. ``model.fastft_return_logits`` (True /
False) overrides the choice.

trl >= 1.15 ``SFTTrainer`` does not call this forward: it installs its own fused LM head on the model instance and
calls the backbone directly. That head also never builds the full logits (it scores chunks of tokens) and computes
the metrics trl logs; with trl 1.16 :mod:`fastft.patches.trl_logprobs` answers it with fastft's fused log-prob
kernel, through :meth:`FusedLossState.__setattr__`. ``tests/test_fused_lora_model.py`` proves which head ran.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version
from transformers.modeling_outputs import CausalLMOutputWithPast

from fastft.kernels import fused_linear_cross_entropy
from fastft.kernels.head_inputs import TargetRangeCheck
from fastft.patches.arguments import ArgumentReader

_IGNORE_INDEX = -100
# transformers 5.24 renamed the output's past_key_values to cache.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@functools.cache
def _trl_reads_logits() -> bool:
    """Whether the installed trl's SFTTrainer computes its metrics from ``outputs.logits`` (trl < 1.15).

    Cached: the training forward asks on every step, and reading package metadata touches the disk."""
    try:
        return Version(importlib.metadata.version("trl")) < Version("1.15")
    except importlib.metadata.PackageNotFoundError:
        return False


def head_reason(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot serve this model's LM head, or None when it can."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"lm_head is {type(head).__name__} (a LoRA or modules_to_save wrapper?), not nn.Linear"
    if head.bias is not None:
        return "lm_head has a bias"
    if head.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"lm_head weight is {head.weight.dtype}"
    return None


def unpatched_class(cls: type) -> type:
    """The class a fastft-patched class stands in for: the first in its MRO that is not fastft's (transformers' own,
    or a remote-code model's); ``cls`` itself when it is not patched."""
    return next(base for base in cls.__mro__ if not base.__module__.startswith("fastft."))


class FusedLossState:
    """The per-instance switches of a fused-loss model; a family's ``...ForCausalLM`` subclass lists it first."""

    # Class default; an instance attribute of the same name overrides it.
    fastft_return_logits: bool | None = None
    # How many losses the fused path computed on this instance: what tests read to know which head ran.
    fastft_fused_loss_calls: int = 0
    # How many trl fused-head calls fastft's log-prob kernel answered (fastft.patches.trl_logprobs).
    fastft_fused_logprob_calls: int = 0
    # Set per instance by a patch that takes over what others assign to ``forward`` (trl's fused LM head).
    fastft_forward_wrapper: Callable[[torch.nn.Module, Any], Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # trl >= 1.15 installs its fused LM head by assigning model.forward on the instance; this is the one place a
        # per-instance patch can see that happen.
        if name == "forward" and self.fastft_forward_wrapper is not None:
            value = self.fastft_forward_wrapper(self, value)
        super().__setattr__(name, value)

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """``save_pretrained`` of the upstream class, run as that class.

        transformers writes ``type(self).__name__`` into the saved config's ``architectures``; vLLM, TGI and the
        hub read that field and know ``LlamaForCausalLM``, not fastft's ``FastLlamaForCausalLM``.
        """
        fast_class = type(self)
        upstream = unpatched_class(fast_class)
        self.__class__ = upstream
        try:
            return upstream.save_pretrained(self, *args, **kwargs)
        finally:
            self.__class__ = fast_class


def causal_lm_forward(
    upstream_class: type, backbone: str = "model", output_class: type | None = None
) -> Callable[..., Any]:
    """The forward of ``upstream_class`` (a ``...ForCausalLM``) with its training loss through the fused linear
    cross-entropy; shows the upstream signature, which generate() and Trainer read (logits_to_keep, **kwargs).
    ``backbone`` names the attribute holding the decoder stack (``model``; GPT-NeoX's ``gpt_neox``).
    ``output_class``: the output upstream returns when it is not ``CausalLMOutputWithPast`` (a vision-language
    model's, with its ``rope_deltas`` or image outputs); its fields other than the loss and logits are read from the
    backbone's output by name."""
    signature = inspect.signature(upstream_class.forward)
    upstream_forward = upstream_class.forward
    output_fields = tuple(output_class.__dataclass_fields__) if output_class is not None else ()
    reader = ArgumentReader(signature)
    # Gemma 3 names its catch-all **loss_kwargs; every other family **kwargs.
    var_keyword = reader.var_keyword
    # Trainers call model(**batch): keywords alone, which split between the named parameters and the catch-all
    # as Signature.bind would split them, without binding on every step. Only what was passed goes on to the
    # backbone (ArgumentReader.read would fill in every default).
    named = frozenset(reader.named)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args or var_keyword is None:
            arguments = dict(signature.bind(self, *args, **kwargs).arguments)
            arguments.pop("self")
            extra = dict(arguments.pop(var_keyword, {}))
        else:
            arguments, extra = {}, {}
            for name, value in kwargs.items():
                (arguments if name in named else extra)[name] = value
        labels = arguments.get("labels")
        # Evaluation (eval mode, or no autograd) keeps the stock forward: it wants the logits anyway.
        if labels is None or not (self.training and torch.is_grad_enabled()) or head_reason(self) is not None:
            return upstream_forward(self, *args, **kwargs)

        arguments.pop("labels")
        logits_to_keep = arguments.pop("logits_to_keep", 0)
        return_dict = extra.pop("return_dict", None)
        shift_labels = extra.pop("shift_labels", None)
        num_items_in_batch = extra.get("num_items_in_batch")
        if shift_labels is None:
            # Position t predicts token t + 1; the last position predicts nothing (transformers' ForCausalLMLoss).
            # Padding the slice, not slicing the padded labels: a contiguous result, which the check and the loss
            # flatten without a copy each.
            shift_labels = F.pad(labels[..., 1:], (0, 1), value=_IGNORE_INDEX)
        head = self.get_output_embeddings()
        # Started before the backbone: the loss then reads a verdict the GPU reached long ago, instead of draining
        # the whole forward from the queue before the backward can be launched.
        labels_check = TargetRangeCheck(shift_labels, head.weight.shape[0], _IGNORE_INDEX)
        outputs = getattr(self, backbone)(**arguments, **extra)
        hidden_states = outputs[0]
        # Gemma 2 / 3 cap the logits (tanh(z / c) · c) before the loss; the fused loss caps each chunk it scores.
        softcap = getattr(self.config, "final_logit_softcapping", None)
        loss = fused_linear_cross_entropy(
            hidden_states,
            head.weight,
            shift_labels.to(hidden_states.device),
            ignore_index=_IGNORE_INDEX,
            num_items_in_batch=num_items_in_batch,
            softcap=softcap,
            labels_check=labels_check,
        )
        # Straight into the instance dict: nn.Module.__setattr__ (and the class's own) cost more than the count.
        self.__dict__["fastft_fused_loss_calls"] = self.fastft_fused_loss_calls + 1

        logits = None
        wants_logits = self.fastft_return_logits
        if wants_logits is None:
            wants_logits = _trl_reads_logits()
        if wants_logits:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            with torch.no_grad():
                logits = head(hidden_states[:, keep, :])
                if softcap is not None:
                    logits = torch.tanh(logits / softcap) * softcap
        if output_class is None:
            result = CausalLMOutputWithPast(
                loss=loss,
                logits=logits,
                **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD, None)},
                hidden_states=getattr(outputs, "hidden_states", None),
                attentions=getattr(outputs, "attentions", None),
            )
        else:
            passed = {name: getattr(outputs, name, None) for name in output_fields if name not in ("loss", "logits")}
            result = output_class(loss=loss, logits=logits, **passed)
        if return_dict is False:
            return result.to_tuple()
        return result

    forward.__signature__ = signature
    forward.__doc__ = f"``{upstream_class.__name__}.forward`` with the training loss through the fused cross-entropy."
    return forward


__all__ = ["FusedLossState", "causal_lm_forward", "head_reason"]
