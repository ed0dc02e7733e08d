"""Gradient checkpointing for fastft models: the modes, and fastft's offloaded checkpointer.

``use_gradient_checkpointing`` takes ``False`` (off), ``True`` (transformers' own recompute checkpointing),
``"offload"`` (alias ``"unsloth"``) or ``"sqrt"``. In ``"offload"`` each decoder layer runs its forward without
keeping its activations; its input is parked in pinned host memory (:mod:`fastft.offload`), except the last
layer's, which the backward needs first. The backward brings the input back (the input of the layer before is
already on its way while this one recomputes), recomputes the layer under the RNG and autocast state of its forward,
so dropout draws the same masks, and passes the gradients on. On CPU the input stays where it is: plain recompute
checkpointing, the same API and the same gradients. In ``"sqrt"`` the same checkpointer keeps the input of one layer
in every ``ceil(sqrt(L))`` and replays the others from it in backward (:mod:`fastft.replay`): about ``2 sqrt(L)``
layer inputs instead of ``L``, on the device, for one more forward of the decoder.

The checkpointer plugs into transformers' own entry point: every ``GradientCheckpointingLayer`` calls
``self._gradient_checkpointing_func(layer_call, *args)`` when checkpointing is on, and that attribute is set per
module instance, so nothing outside the model changes. The registry record ``checkpoint.offload`` holds the
transformers versions this was tested on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fastft.offload import OffloadEngine, ParkedTensor
from fastft.registry import PatchRecord, patch_report, register
from fastft.replay import ReplayedInput, Segment, segment_length

logger = logging.getLogger(__name__)

_MODE_ATTR = "_fastft_checkpointing"
_ORIGINAL_ATTR = "_fastft_checkpointing_original"
_ENGINE_ATTR = "_fastft_offload_engine"
_WARNED_ATTR = "_fastft_offload_warned"
_ALIASES = {False: None, None: None, True: "recompute", "offload": "offload", "unsloth": "offload", "sqrt": "sqrt"}
PATCH_NAME = "checkpoint.offload"


def resolve_mode(value: bool | str | None) -> str | None:
    """Normalise a ``use_gradient_checkpointing`` value.

    Args:
        value: ``False``/``None`` (off), ``True`` (recompute), ``"offload"`` or its alias ``"unsloth"``, or
            ``"sqrt"``.

    Returns:
        ``None``, ``"recompute"``, ``"offload"`` or ``"sqrt"``.

    Raises:
        ValueError: Any other value.
    """
    key = value.lower() if isinstance(value, str) else value
    if isinstance(key, (bool, str, type(None))) and key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(
        f"fastft.get_peft_model: use_gradient_checkpointing={value!r} is not a mode; "
        "use False, True, 'offload' or 'unsloth' (an alias of 'offload'), or 'sqrt'."
    )


def _enable_method_name(model: torch.nn.Module) -> str:
    # transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    return (
        "activation_checkpointing_enable"
        if hasattr(model, "activation_checkpointing_enable")
        else "gradient_checkpointing_enable"
    )


def _disable(model: torch.nn.Module) -> None:
    name = (
        "activation_checkpointing_disable"
        if hasattr(model, "activation_checkpointing_disable")
        else "gradient_checkpointing_disable"
    )
    getattr(model, name)()


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether checkpointing is on in ``model`` (any transformers version)."""
    # transformers 5.23 deprecates is_gradient_checkpointing in favour of is_activation_checkpointing.
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def set_mode(model: torch.nn.Module, mode: str | None) -> None:
    """Turn checkpointing on or off on a transformers model and keep that choice under a Trainer.

    ``transformers.Trainer`` (and so trl's ``SFTTrainer``, whose config defaults to checkpointing on) calls the
    model's checkpointing entry point at start-up. That call is routed here so the mode chosen in
    ``get_peft_model`` stays in force; a request to turn on what the user turned off is logged as a warning.

    Args:
        model: The ``PreTrainedModel`` (not the peft wrapper).
        mode: A value from :func:`resolve_mode`.
    """
    name = _enable_method_name(model)
    if not hasattr(model, _ORIGINAL_ATTR):
        setattr(model, _ORIGINAL_ATTR, getattr(model, name))

        told: set[str | None] = set()

        def _guarded_enable(*args, **kwargs) -> None:
            chosen = getattr(model, _MODE_ATTR)
            # trl's preference trainers re-enable checkpointing around every reference forward: say it once per mode.
            if chosen not in told:
                told.add(chosen)
                log = logger.warning if chosen is None else logger.info
                log(
                    "fastft keeps gradient checkpointing mode %r chosen in "
                    "get_peft_model(use_gradient_checkpointing=...) over this request to enable it (%s %s).",
                    chosen,
                    args,
                    kwargs,
                )
            _apply(model, chosen)

        setattr(model, name, _guarded_enable)
    setattr(model, _MODE_ATTR, mode)
    _apply(model, mode)


def _apply(model: torch.nn.Module, mode: str | None) -> None:
    if mode is None:
        suspend(model)
        return
    # Non-reentrant checkpointing needs no requires_grad on the (frozen) embedding output.
    getattr(model, _ORIGINAL_ATTR)({"use_reentrant": False})
    if mode == "recompute":
        return
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is None:
        if not getattr(model, _WARNED_ATTR, False):
            setattr(model, _WARNED_ATTR, True)
            logger.warning(
                "fastft: use_gradient_checkpointing=%r runs transformers' recompute checkpointing on this "
                "model, which keeps every layer input on the device, because %s.",
                mode,
                _why_not_hooked(model),
            )
        return
    install(model, engine, replay=mode == "sqrt")


def _why_not_hooked(model: torch.nn.Module) -> str:
    try:
        row = next(row for row in patch_report(model) if row["name"] == PATCH_NAME)
    except ValueError:
        return "the model was not loaded through FastModel.from_pretrained"
    return f"patch {PATCH_NAME} is {row['status']} ({row['reason']}; fastft.patch_report(model) lists every patch)"


def get_mode(model: torch.nn.Module) -> str | None:
    """The checkpointing mode fastft set on ``model`` (``None`` when off or never set)."""
    return getattr(model, _MODE_ATTR, None)


def suspend(model: torch.nn.Module) -> None:
    """Turn checkpointing off for inference, keeping the chosen mode for :func:`resume`; free the host buffers."""
    if is_enabled(model):
        _disable(model)
    release_buffers(model)


def release_buffers(model: torch.nn.Module) -> None:
    """Free the pinned host buffers the offloaded checkpointer keeps between steps (they return on the next step)."""
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is not None:
        engine.release()


def resume(model: torch.nn.Module) -> None:
    """Turn the mode chosen in ``get_peft_model`` back on after :func:`suspend`."""
    if hasattr(model, _ORIGINAL_ATTR):
        _apply(model, get_mode(model))


# ---------------------------------------------------------------------------------------------------------------------
# The offloaded checkpointer.

_Path = tuple[str, "int | None"]


def _flatten(outputs: Any, owner: str) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], Any]]:
    """The tensors of a layer's output, and how to put outputs of the same structure back together."""
    if isinstance(outputs, torch.Tensor):
        return [outputs], lambda flat: flat[0]
    if isinstance(outputs, tuple):
        positions = [index for index, item in enumerate(outputs) if isinstance(item, torch.Tensor)]
        # The template keeps the non-tensor items only, so holding it keeps no activation alive.
        template = [None if isinstance(item, torch.Tensor) else item for item in outputs]

        def rebuild(flat: Sequence[torch.Tensor]) -> tuple[Any, ...]:
            items = list(template)
            for position, tensor in zip(positions, flat, strict=True):
                items[position] = tensor
            return tuple(items)

        return [outputs[index] for index in positions], rebuild
    raise TypeError(
        f"fastft offloaded checkpointing: {owner} returned a {type(outputs).__name__}; it checkpoints layers that "
        "return a tensor or a tuple. Use use_gradient_checkpointing=True for this model."
    )


def _grad_keyword_paths(function: Callable[..., Any]) -> list[_Path]:
    """Where the keyword arguments bound into ``function`` hold tensors that need a gradient."""
    keywords = function.keywords if isinstance(function, functools.partial) else {}
    paths: list[_Path] = []
    for key, value in keywords.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            paths.append((key, None))
        elif isinstance(value, (tuple, list)):
            paths += [
                (key, index)
                for index, item in enumerate(value)
                if isinstance(item, torch.Tensor) and item.requires_grad
            ]
    return paths


def _keyword(function: functools.partial, path: _Path) -> torch.Tensor:
    key, index = path
    value = function.keywords[key]
    return value if index is None else value[index]


def _with_keywords(function: Callable[..., Any], replacements: dict[_Path, torch.Tensor]) -> Callable[..., Any]:
    if not replacements:
        return function
    keywords = dict(function.keywords)
    for (key, index), tensor in replacements.items():
        if index is None:
            keywords[key] = tensor
        else:
            items = list(keywords[key])
            items[index] = tensor
            keywords[key] = type(keywords[key])(items)
    return functools.partial(function.func, *function.args, **keywords)


class _LayerCall:
    """One checkpointed call of one layer: what its backward needs to run the layer again."""

    def __init__(
        self,
        owner: str,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        slot: int,
        engine: OffloadEngine,
        offload: bool,
        parameters: list[torch.nn.Parameter],
        keyword_paths: list[_Path],
    ) -> None:
        self.owner, self.function, self.slot, self.engine = owner, function, slot, engine
        self.parameters, self.keyword_paths = parameters, keyword_paths
        self.positions = [index for index, item in enumerate(args) if isinstance(item, torch.Tensor)]
        tensors = [args[index] for index in self.positions]
        # The argument list without its tensors: the tensors are saved (or parked) by the autograd node.
        self.template = [None if isinstance(item, torch.Tensor) else item for item in args]
        self.needs_grad = [tensor.requires_grad for tensor in tensors]
        self.offload = offload and bool(tensors) and all(engine.parks(tensor) for tensor in tensors)
        self.parked: list[weakref.ref] = []
        self.pending: list[ParkedTensor] = []
        self.previous: Any = None
        self.rebuild: Callable[[Sequence[torch.Tensor]], Any] | None = None
        # Captured before the forward runs, so the recompute draws the same dropout masks.
        self.cpu_rng = torch.get_rng_state()
        cuda_devices = sorted({tensor.device.index or 0 for tensor in tensors if tensor.device.type == "cuda"})
        self.cuda_rng = {index: torch.cuda.get_rng_state(index) for index in cuda_devices}
        device_types = {"cpu"} | {tensor.device.type for tensor in tensors}
        self.autocast = [
            {
                "device_type": device_type,
                "enabled": torch.is_autocast_enabled(device_type),
                "dtype": torch.get_autocast_dtype(device_type),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            }
            for device_type in sorted(device_types)
        ]

    def park(self, tensor: torch.Tensor) -> ParkedTensor:
        """Pack hook for the inputs the node saves: their host copies, started before the layer ran.

        Autograd holds what this returns as the saved value and drops it when the graph is freed or, without
        ``retain_graph``, right after the node's backward; the host buffer goes back to the pool then.
        """
        parked = self.pending.pop(0) if self.pending else None
        if parked is None or (parked.shape, parked.dtype, parked.device) != (tensor.shape, tensor.dtype, tensor.device):
            parked = self.engine.park(self.slot, tensor)
        self.parked.append(weakref.ref(parked))
        return parked

    def prefetch(self) -> None:
        """Start bringing this call's parked inputs back (its backward runs soon)."""
        for reference in self.parked:
            parked = reference()
            if parked is not None:
                parked.prefetch()

    def arguments(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        items = list(self.template)
        for position, tensor in zip(self.positions, tensors, strict=True):
            items[position] = tensor
        return items

    def replay(self, tensor: torch.Tensor) -> torch.Tensor:
        """The layer's first output from ``tensor`` as its only positional input, as the forward computed it."""
        with torch.no_grad(), self.replayed_state():
            outputs = self.function(*self.arguments([tensor]))
        return _flatten(outputs, self.owner)[0][0]

    @contextlib.contextmanager
    def replayed_state(self) -> Iterator[None]:
        """The RNG and autocast state of the forward, for the recompute; the caller's RNG is left as it was."""
        with torch.random.fork_rng(devices=list(self.cuda_rng)), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            for index, state in self.cuda_rng.items():
                torch.cuda.set_rng_state(state, index)
            for settings in self.autocast:
                stack.enter_context(torch.autocast(**settings))
            yield


class _CheckpointedLayer(torch.autograd.Function):
    """Runs a layer without keeping its activations; the backward recomputes it from the saved (or parked) input.

    The inputs after ``call`` are the layer's positional tensors, the keyword tensors that need a gradient, and the
    layer's trainable parameters, so their gradients return through autograd as for any other op (and reach
    ``AccumulateGrad`` and any hooks on it once).
    """

    @staticmethod
    def forward(ctx: Any, call: _LayerCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        inputs = tensors[: len(call.positions)]
        if call.offload:
            # Queued before the layer's kernels, so the copy to host overlaps them.
            call.pending = [call.engine.park(call.slot, tensor) for tensor in inputs]
        outputs = call.function(*call.arguments(inputs))
        flat, call.rebuild = _flatten(outputs, call.owner)
        call.previous = call.engine.follow(call.slot, call)
        # Packed by the caller's hooks, or parked in host memory by call.park (LayerCheckpoint.__call__).
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[tensor for tensor in flat if not tensor.is_floating_point()])
        return tuple(flat)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _LayerCall = ctx.call
        inputs = ctx.saved_tensors
        previous = call.previous() if call.previous is not None else None
        if previous is not None:
            # The layer before runs its backward next; its input copies in while this one recomputes.
            previous.prefetch()
        leaves = [tensor.detach().requires_grad_(needs) for tensor, needs in zip(inputs, call.needs_grad, strict=True)]
        keyword_leaves = {
            path: _keyword(call.function, path).detach().requires_grad_(True) for path in call.keyword_paths
        }
        function = _with_keywords(call.function, keyword_leaves)
        with torch.enable_grad(), call.replayed_state():
            outputs = function(*call.arguments(leaves))
        flat, _ = _flatten(outputs, call.owner)
        pairs = [(out, grad) for out, grad in zip(flat, grads, strict=True) if grad is not None and out.requires_grad]
        targets = [leaf for leaf in leaves if leaf.requires_grad] + list(keyword_leaves.values()) + call.parameters
        found: Sequence[torch.Tensor | None] = [None] * len(targets)
        if pairs and targets:
            found = torch.autograd.grad(
                [out for out, _ in pairs], targets, [grad for _, grad in pairs], allow_unused=True
            )
        remaining = iter(found)
        input_grads = [next(remaining) if needs else None for needs in call.needs_grad]
        return (None, *input_grads, *remaining)


class LayerCheckpoint:
    """fastft's ``_gradient_checkpointing_func`` for one decoder layer (see the module docstring).

    transformers calls it as ``func(layer_call, *args)``, where ``layer_call`` runs the layer with its keyword
    arguments bound.

    Args:
        layer: The decoder layer; its trainable parameters get their gradients through the checkpoint.
        slot: The layer's position among the checkpointed layers.
        engine: The model's :class:`~fastft.offload.OffloadEngine`.
        keep_on_device: Keep the input on its device (the last layer: its backward comes first).
        segment: Layers per replay segment (``"sqrt"``: :mod:`fastft.replay`); 0 keeps every input.
    """

    def __init__(
        self, layer: torch.nn.Module, slot: int, engine: OffloadEngine, keep_on_device: bool, segment: int = 0
    ) -> None:
        self.layer, self.slot, self.engine, self.keep_on_device = layer, slot, engine, keep_on_device
        self.segment = segment

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            function = functools.partial(function, **kwargs)
        parameters = [parameter for parameter in self.layer.parameters() if parameter.requires_grad]
        tensors = [item for item in args if isinstance(item, torch.Tensor)]
        keyword_paths = _grad_keyword_paths(function)
        needs_graph = parameters or keyword_paths or any(tensor.requires_grad for tensor in tensors)
        if not (torch.is_grad_enabled() and needs_graph):
            return function(*args)
        owner = f"{type(self.layer).__name__} {self.slot}"
        call = _LayerCall(
            owner, function, args, self.slot, self.engine, not self.keep_on_device, parameters, keyword_paths
        )
        keyword_tensors = [_keyword(function, path) for path in keyword_paths]
        joined = self.engine.chain.join(tensors[0], call, self.segment) if self.segment and len(tensors) == 1 else None
        if joined is not None:
            hooks = torch.autograd.graph.saved_tensors_hooks(_replayed_pack(tensors[0], *joined), ReplayedInput.take)
        elif call.offload:
            hooks = torch.autograd.graph.saved_tensors_hooks(call.park, ParkedTensor.take)
        else:
            hooks = contextlib.nullcontext()
        with hooks:
            flat = _CheckpointedLayer.apply(call, *tensors, *keyword_tensors, *parameters)
        if self.segment:
            if len(tensors) == 1 and flat:
                self.engine.chain.follow(tensors[0], call, flat[0], None if joined is None else joined[0])
            else:
                self.engine.chain.clear()
        return call.rebuild(flat)

    def __repr__(self) -> str:
        return f"LayerCheckpoint(slot={self.slot}, keep_on_device={self.keep_on_device}, segment={self.segment})"


def _replayed_pack(expected: torch.Tensor, segment: Segment, index: int) -> Callable[[torch.Tensor], Any]:
    # autograd keeps the pack hook as long as the saved value: it must not hold the input it stands in for.
    address, shape = expected.data_ptr(), expected.shape

    def pack(tensor: torch.Tensor) -> Any:
        # The node saves only the layer's input; anything else would be kept as it is.
        if tensor.data_ptr() == address and tensor.shape == shape:
            return ReplayedInput(segment, index, tensor)
        return tensor

    return pack


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def install(model: torch.nn.Module, engine: OffloadEngine, replay: bool = False) -> int:
    """Give every checkpointed decoder layer of ``model`` its :class:`LayerCheckpoint`; returns how many.

    Called after transformers' own enable call, which set the stock function on each layer.

    Args:
        model: The transformers model.
        engine: Its offload engine.
        replay: ``"sqrt"``: keep the inputs on the device, one per segment, and replay the rest (no offload).
    """
    layers = [layer for layer in _checkpointed_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    last = len(layers) - 1
    segment = segment_length(len(layers)) if replay else 0
    engine.chain.clear()
    for slot, layer in enumerate(layers):
        layer._gradient_checkpointing_func = LayerCheckpoint(
            layer, slot, engine, keep_on_device=replay or slot == last, segment=segment
        )
    return len(layers)


def engine_of(model: torch.nn.Module) -> OffloadEngine | None:
    """The model's offload engine (``None`` when the ``checkpoint.offload`` patch did not apply)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, _ENGINE_ATTR, None)


def _has_checkpointed_layers(model: torch.nn.Module) -> str | None:
    if not _checkpointed_layers(model):
        return f"{type(model).__name__} has no GradientCheckpointingLayer (transformers' checkpointed decoder layer)"
    return None


def _attach_engine(model: torch.nn.Module) -> int:
    setattr(model, _ENGINE_ATTR, OffloadEngine())
    return len(_checkpointed_layers(model))


# transformers gives each checkpointed layer its function through _set_gradient_checkpointing; the layer calls it as
# func(layer_call, *args) in every tested range (from __call__ up to 5.22, from a wrapped forward from 5.23).
_TARGET = "transformers.modeling_utils.PreTrainedModel._set_gradient_checkpointing"
_FINGERPRINT = "(self, enable=True, gradient_checkpointing_func=torch.utils.checkpoint.checkpoint)"
for _versions, _fingerprint in (
    (">=4.53.3,<4.58", _FINGERPRINT),
    (">=5.5.4,<5.16", _FINGERPRINT),
    (">=5.16,<5.25", _FINGERPRINT[:-1] + ", every_n_layers=1)"),
):
    register(
        PatchRecord(
            name=PATCH_NAME,
            target=_TARGET,
            versions={"transformers": _versions},
            fingerprint=_fingerprint,
            applies_to=_has_checkpointed_layers,
            apply=_attach_engine,
            replacement=LayerCheckpoint,
        )
    )
