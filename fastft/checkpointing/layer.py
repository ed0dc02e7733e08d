"""fastft's checkpointer: one autograd node per checkpointed decoder-layer call (the modes:
:mod:`fastft.checkpointing.modes`).

A call runs the layer without a graph and keeps only what the recompute needs: the layer input (on the device,
parked in host memory by :mod:`fastft.checkpointing.offload`, or replayed by :mod:`fastft.checkpointing.replay`),
the RNG and autocast state the forward ran under, and the bound layer function. Its backward runs the layer again on
the same (fused) path and hands the gradients of the input, of keyword tensors that need one and of the layer's
trainable parameters back to autograd. Where the layer's forward offered a rerun of its fused node
(:mod:`fastft.checkpointing.rerun`), the recompute and the ``"sqrt"`` replay call that instead of the forward.

What a call costs on the host is kept to what must be per call. The layer's parameters are walked once and walked
again only when a module or parameter was registered into one of its modules (torch's registration hooks say so) or
one of them was swapped out of its module; ``requires_grad`` is read on every call, so freezing or unfreezing a
parameter takes effect at once. The RNG state is read straight from the generators (no ``torch.random.fork_rng``),
and the recompute enters autocast only where the backward's state differs from the forward's.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fastft.checkpointing.offload import OffloadEngine, ParkedTensor
from fastft.checkpointing.replay import ReplayedInput, Segment
from fastft.checkpointing.rerun import Rerun, listen, stop
from fastft.checkpointing.router_logits import layer_routers, recording_router_logits
from fastft.kernels.custom_ops import direct_apply

_Path = tuple[str, "int | None"]
_module = torch.nn.modules.module
_WALK_ATTR = "_fastft_layer_parameters"


# ---------------------------------------------------------------------------------------------------------------------
# The layer's parameters, cached.


class _Registrations:
    """Which cached parameter walks a module belongs to, and the hooks that mark them stale on a registration."""

    owners: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[LayerParameters]] = weakref.WeakKeyDictionary()
    watching = False

    @classmethod
    def registered(cls, module: torch.nn.Module, *_: Any) -> None:
        # Called for every registration in the process (transformers slices its ModuleList of layers on every
        # forward), so only a registration into a module some walk went through costs more than one lookup.
        # Returning None leaves the registered module or parameter as it was.
        owners = cls.owners.get(module)
        if owners:
            for owner in owners:
                owner.stale = True

    @classmethod
    def watch(cls, walk: LayerParameters, modules: list[torch.nn.Module]) -> None:
        """Mark ``walk`` stale when a module or parameter is registered into one of ``modules``."""
        if not cls.watching:
            torch.nn.modules.module.register_module_parameter_registration_hook(cls.registered)
            torch.nn.modules.module.register_module_module_registration_hook(cls.registered)
            cls.watching = True
        for module in modules:
            owners = cls.owners.get(module)
            if owners is None:
                owners = cls.owners[module] = weakref.WeakSet()
            owners.add(walk)


class LayerParameters:
    """A decoder layer's parameters, walked once and walked again only when they may have changed.

    The walk is stale when a module or parameter was registered into one of the layer's modules since it was made (a
    new adapter, a parametrization: torch's registration hooks say so) or when a module's entry no longer holds the
    parameter the walk found (a write straight into ``Module._parameters``, which no hook sees). Which of them train
    is read on every call, so ``requires_grad_`` takes effect at the next call.

    Args:
        layer: The decoder layer.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.walks = 0
        self.stale = True
        self._entries: list[tuple[dict[str, Any], str, torch.nn.Parameter]] = []

    def trainable(self) -> list[torch.nn.Parameter]:
        """The layer's parameters that require a gradient now, each once, in ``layer.parameters()`` order."""
        if not self.stale:
            found = []
            for entries, name, parameter in self._entries:
                if entries.get(name) is not parameter:
                    break
                if parameter.requires_grad:
                    found.append(parameter)
            else:
                return found
        self._walk()
        return [parameter for _, _, parameter in self._entries if parameter.requires_grad]

    def __getstate__(self) -> dict[str, Any]:
        # A copy (copy.deepcopy of the model) walks its own layer again and is watched for its own modules.
        return {"layer": self.layer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layer"])

    def _walk(self) -> None:
        self.stale = False
        self.walks += 1
        seen: set[int] = set()
        self._entries = []
        modules = list(self.layer.modules())
        for module in modules:
            for name, parameter in module._parameters.items():
                if parameter is not None and id(parameter) not in seen:
                    seen.add(id(parameter))
                    self._entries.append((module._parameters, name, parameter))
        _Registrations.watch(self, modules)


# ---------------------------------------------------------------------------------------------------------------------
# The forward's RNG and autocast state.

_CPU_GENERATOR = torch.default_generator


def _cuda_generator(index: int) -> torch.Generator:
    generators = torch.cuda.default_generators
    if index >= len(generators):
        # A CUDA tensor exists, so CUDA is usable; its generators appear at lazy initialisation.
        torch.cuda.init()
        generators = torch.cuda.default_generators
    return generators[index]


def _autocast_state(device_types: Sequence[str]) -> tuple[tuple[str, bool, torch.dtype, bool], ...]:
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), cache)
        for device_type in device_types
    )


class ForwardState:
    """The RNG and autocast state a layer call ran under, so its recompute draws the same dropout masks.

    Reading the CPU generator's state costs about a microsecond, so it is read on every call rather than proving
    that nothing random runs in the layer.

    Args:
        tensors: The call's tensor inputs: their devices say which CUDA generators and autocast types to keep.
    """

    __slots__ = ("autocast", "cpu_rng", "cuda_rng", "device_types")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        cuda = sorted({tensor.device.index or 0 for tensor in tensors if tensor.device.type == "cuda"})
        self.cpu_rng = _CPU_GENERATOR.get_state()
        self.cuda_rng = [(_cuda_generator(index), _cuda_generator(index).get_state()) for index in cuda]
        self.device_types = ("cpu", "cuda") if cuda else ("cpu",)
        self.autocast = _autocast_state(self.device_types)

    def replayed(self) -> _Replayed:
        """A context that runs its body under this state and then puts the caller's RNG state back."""
        return _Replayed(self)


class _Replayed:
    __slots__ = ("_autocast", "_cpu", "_cuda", "_state")

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        self._autocast: list[torch.autocast] = []

    def __enter__(self) -> None:
        state = self._state
        self._cpu = _CPU_GENERATOR.get_state()
        self._cuda = [(generator, generator.get_state()) for generator, _ in state.cuda_rng]
        try:
            _CPU_GENERATOR.set_state(state.cpu_rng)
            for generator, saved in state.cuda_rng:
                generator.set_state(saved)
            if _autocast_state(state.device_types) != state.autocast:
                for device_type, enabled, dtype, cache in state.autocast:
                    context = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
                    context.__enter__()
                    self._autocast.append(context)
        except BaseException as error:
            # The with-body never runs, so __exit__ would not either: give the caller its state back, then raise.
            self.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        while self._autocast:
            self._autocast.pop().__exit__(kind, error, traceback)
        _CPU_GENERATOR.set_state(self._cpu)
        for generator, saved in self._cuda:
            generator.set_state(saved)


# ---------------------------------------------------------------------------------------------------------------------
# Arguments and outputs.


def _first(flat: Sequence[torch.Tensor]) -> torch.Tensor:
    return flat[0]


def _flatten(outputs: Any, owner: str) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], Any]]:
    """The tensors of a layer's output, and how to put outputs of the same structure back together."""
    if isinstance(outputs, torch.Tensor):
        return [outputs], _first
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
        f"fastft checkpointing: {owner} returned a {type(outputs).__name__}; it checkpoints layers that return a "
        "tensor or a tuple. Train it with use_gradient_checkpointing=False, or load it with "
        "FastModel.from_pretrained(..., patch=False) to checkpoint it with transformers' own."
    )


def _tensors_of(outputs: Any, owner: str) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return _flatten(outputs, owner)[0]


def _grad_keyword_paths(function: Callable[..., Any]) -> list[_Path]:
    """Where the keyword arguments bound into ``function`` hold tensors that need a gradient."""
    keywords = function.keywords if isinstance(function, functools.partial) else {}
    paths: list[_Path] = []
    for key, value in keywords.items():
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
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


# ---------------------------------------------------------------------------------------------------------------------
# One call, its autograd node, and the per-layer entry point.


class _LayerCall:
    """One checkpointed call of one layer: what its backward needs to run the layer again."""

    def __init__(
        self,
        owner: str,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        tensors: list[torch.Tensor],
        slot: int,
        engine: OffloadEngine,
        offload: bool,
        parameters: list[torch.nn.Parameter],
        keyword_paths: list[_Path],
    ) -> None:
        self.owner, self.function, self.slot, self.engine = owner, function, slot, engine
        self.parameters, self.keyword_paths = parameters, keyword_paths
        if len(tensors) == len(args):
            # Every argument is a tensor (transformers passes the hidden states alone): nothing to rebuild.
            self.positions: list[int] | None = None
            self.template: list[Any] = []
        else:
            self.positions = [index for index, item in enumerate(args) if isinstance(item, torch.Tensor)]
            # The argument list without its tensors: the tensors are saved (or parked) by the autograd node.
            self.template = [None if isinstance(item, torch.Tensor) else item for item in args]
        self.count = len(tensors)
        self.needs_grad = [tensor.requires_grad for tensor in tensors]
        self.offload = offload and bool(tensors) and all(engine.parks(tensor) for tensor in tensors)
        self.parked: list[weakref.ref] = []
        self.pending: list[ParkedTensor] = []
        self.previous: weakref.ref | None = None
        self.segment: weakref.ref | None = None
        self.rebuild: Callable[[Sequence[torch.Tensor]], Any] = _first
        # The layer's own shortcut for running this call again (fastft.checkpointing.rerun), heard in the forward.
        self.listens = self.count == 1 and self.positions is None and not keyword_paths
        self.rerun: Rerun | None = None
        # The same for the backward's recompute, which reads only the output's grad_fn (fastft.checkpointing.rerun).
        self.backward_rerun: Rerun | None = None
        # Taken before the forward runs, so the recompute draws the same dropout masks. A layer called without a
        # positional tensor still runs where its parameters are.
        self.state = ForwardState(tensors if tensors else parameters[:1])

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

    def kept(self) -> torch.Tensor | ParkedTensor | None:
        """The parked copy of this call's only input (``None`` when it parked nothing)."""
        return self.parked[0]() if len(self.parked) == 1 else None

    def prefetch(self) -> None:
        """Start bringing back what this call's backward reads: its parked inputs, or its segment's kept one."""
        for reference in self.parked:
            parked = reference()
            if parked is not None:
                parked.prefetch()
        segment = self.segment() if self.segment is not None else None
        if segment is not None:
            segment.prefetch()

    def arguments(self, tensors: Sequence[torch.Tensor]) -> Sequence[Any]:
        if self.positions is None:
            return tensors
        items = list(self.template)
        for position, tensor in zip(self.positions, tensors, strict=True):
            items[position] = tensor
        return items

    def replay(self, tensor: torch.Tensor) -> torch.Tensor:
        """The layer's first output from ``tensor`` as its only positional input, as the forward computed it."""
        with torch.no_grad(), self.state.replayed():
            if self.rerun is not None:
                return self.rerun(tensor)
            outputs = self.function(*self.arguments([tensor]))
        return _tensors_of(outputs, self.owner)[0]


class _CheckpointedLayer(torch.autograd.Function):
    """Runs a layer without keeping its activations; the backward recomputes it from the saved (or parked) input.

    The inputs after ``call`` are the layer's positional tensors, the keyword tensors that need a gradient, and the
    layer's trainable parameters, so their gradients return through autograd as for any other op (and reach
    ``AccumulateGrad`` and any hooks on it once).
    """

    @staticmethod
    def forward(ctx: Any, call: _LayerCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        inputs = tensors[: call.count]
        if call.offload:
            # Queued before the layer's kernels, so the copy to host overlaps them.
            call.pending = [call.engine.park(call.slot, tensor) for tensor in inputs]
        slot = listen() if call.listens else None
        try:
            outputs = call.function(*call.arguments(inputs))
        finally:
            if slot is not None:
                stop(slot)
        flat, call.rebuild = _flatten(outputs, call.owner)
        if slot is not None and len(flat) == 1:
            taken = slot.taken_for(inputs[0])
            if taken is not None:
                call.rerun, call.backward_rerun = taken
        call.previous = call.engine.follow(call.slot, call)
        # Packed by the caller's hooks, or parked in host memory by call.park (LayerCheckpoint.__call__).
        ctx.save_for_backward(*inputs)
        if not all(tensor.is_floating_point() for tensor in flat):
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
        with torch.enable_grad(), call.state.replayed():
            if call.backward_rerun is not None:
                # Its output's values are not computed: nothing below reads them, only its grad_fn.
                flat = [call.backward_rerun(leaves[0])]
            else:
                function = _with_keywords(call.function, keyword_leaves)
                fed = leaves
                if _module._global_forward_pre_hooks or _module._global_forward_hooks:
                    # A global module hook (torch's ModuleTracker, which FlopCounterMode uses) registers multi-grad
                    # hooks on the layer's inputs, which ask the engine about the inputs' nodes; asked about a leaf
                    # inside torch.autograd.grad below, the engine raises. A view is no leaf.
                    fed = [leaf.view_as(leaf) if leaf.requires_grad else leaf for leaf in leaves]
                flat = _tensors_of(function(*call.arguments(fed)), call.owner)
        pairs = [(out, grad) for out, grad in zip(flat, grads, strict=True) if grad is not None and out.requires_grad]
        targets = [leaf for leaf in leaves if leaf.requires_grad] + list(keyword_leaves.values()) + call.parameters
        found: Sequence[torch.Tensor | None] = [None] * len(targets)
        if pairs and targets:
            found = _one_node_grads(pairs, targets)
            if found is None:
                found = torch.autograd.grad(
                    [out for out, _ in pairs], targets, [grad for _, grad in pairs], allow_unused=True
                )
        remaining = iter(found)
        input_grads = [next(remaining) if needs else None for needs in call.needs_grad]
        return (None, *input_grads, *remaining)


def _one_node_grads(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], targets: list[torch.Tensor]
) -> list[torch.Tensor | None] | None:
    """The targets' gradients when the recomputed layer is one node straight over them (a fused decoder layer:
    :mod:`fastft.kernels.lora_decoder_layer`), by calling that node; None for any other graph.

    A pass of the autograd engine per layer (its graph task, and the gradients it may compute only for what that pass
    asked for) costs more than the node's own host work; one node over leaves needs none of it.
    """
    if len(pairs) != 1:
        return None
    out, grad = pairs[0]
    node = out.grad_fn
    if node is None or out.output_nr != 0:
        return None
    index = {id(target): position for position, target in enumerate(targets)}
    positions = []
    for function, _ in node.next_functions:
        if function is None:
            positions.append(None)
            continue
        variable = getattr(function, "variable", None)
        position = None if variable is None else index.get(id(variable))
        if position is None or targets[position] is not variable:
            return None
        positions.append(position)
    mask = getattr(node, "tensor_inputs", None)
    if mask is None:
        # A Python Function's node returns a value for every forward argument, tensor or not; only one that says
        # which were tensors (the fused layer's does) can be lined up with its edges.
        return None
    values = [value for value, is_tensor in zip(node.apply(grad), mask, strict=True) if is_tensor]
    found: list[torch.Tensor | None] = [None] * len(targets)
    for position, value in zip(positions, values, strict=True):
        if position is not None and value is not None:
            found[position] = value if found[position] is None else found[position] + value
    return found


def _replayed_pack(expected: torch.Tensor, segment: Segment, index: int) -> Callable[[torch.Tensor], Any]:
    # autograd keeps the pack hook as long as the saved value: it must not hold the input it stands in for.
    address, shape = expected.data_ptr(), expected.shape

    def pack(tensor: torch.Tensor) -> Any:
        # The node saves only the layer's input; anything else would be kept as it is.
        if tensor.data_ptr() == address and tensor.shape == shape:
            return ReplayedInput(segment, index, tensor)
        return tensor

    return pack


_apply_checkpointed = direct_apply(_CheckpointedLayer)


class LayerCheckpoint:
    """fastft's ``_gradient_checkpointing_func`` for one decoder layer (see :mod:`fastft.checkpointing.modes`).

    transformers calls it as ``func(layer_call, *args)``, where ``layer_call`` runs the layer with its keyword
    arguments bound.

    Args:
        layer: The decoder layer; its trainable parameters get their gradients through the checkpoint.
        slot: The layer's position among the checkpointed layers.
        engine: The model's :class:`~fastft.checkpointing.offload.OffloadEngine`.
        keep_on_device: Keep the input on its device instead of parking it in host memory.
        segment: Layers per replay segment (``"sqrt"``, ``"sqrt-offload"``: :mod:`fastft.checkpointing.replay`);
            0 keeps every input.
    """

    def __init__(
        self, layer: torch.nn.Module, slot: int, engine: OffloadEngine, keep_on_device: bool, segment: int = 0
    ) -> None:
        self.layer, self.slot, self.engine, self.keep_on_device = layer, slot, engine, keep_on_device
        self.segment = segment
        # Kept on the layer, so a checkpointer installed again (trl re-enables checkpointing around every reference
        # forward) reuses the walk instead of starting over.
        walk = layer.__dict__.get(_WALK_ATTR)
        if not isinstance(walk, LayerParameters) or walk.layer is not layer:
            walk = LayerParameters(layer)
            setattr(layer, _WALK_ATTR, walk)
        self.layer_parameters: LayerParameters = walk
        self._owner = f"{type(layer).__name__} {slot}"
        self._routers = layer_routers(layer)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            function = functools.partial(function, **kwargs)
        if not torch.is_grad_enabled() or _PLAIN[0] or recording_router_logits(self._routers):
            return function(*args)
        parameters = self.layer_parameters.trainable()
        tensors = [item for item in args if isinstance(item, torch.Tensor)]
        keyword_paths = _grad_keyword_paths(function)
        if not (parameters or keyword_paths or any(tensor.requires_grad for tensor in tensors)):
            return function(*args)
        engine = self.engine
        call = _LayerCall(
            self._owner, function, args, tensors, self.slot, engine, not self.keep_on_device, parameters, keyword_paths
        )
        keyword_tensors = [_keyword(function, path) for path in keyword_paths]
        joined = engine.chain.join(tensors[0], call, self.segment) if self.segment and len(tensors) == 1 else None
        if joined is not None:
            # Replayed in backward from the segment's kept input: nothing of this input is kept or moved.
            call.offload = False
            call.segment = weakref.ref(joined[0])
            pack = _replayed_pack(tensors[0], *joined)
            hooks: Any = torch.autograd.graph.saved_tensors_hooks(pack, ReplayedInput.take)
        elif call.offload:
            hooks = torch.autograd.graph.saved_tensors_hooks(call.park, ParkedTensor.take)
        else:
            hooks = None
        if hooks is None:
            flat = _apply_checkpointed(call, *tensors, *keyword_tensors, *parameters)
        else:
            with hooks:
                flat = _apply_checkpointed(call, *tensors, *keyword_tensors, *parameters)
        if self.segment:
            kept = (call.kept() if call.offload else tensors[0]) if len(tensors) == 1 and flat else None
            if kept is None:
                engine.chain.clear()
            else:
                engine.chain.follow(kept, call, flat[0], None if joined is None else joined[0])
        return call.rebuild(flat)

    def __repr__(self) -> str:
        return f"LayerCheckpoint(slot={self.slot}, keep_on_device={self.keep_on_device}, segment={self.segment})"


# Open plain_layers() blocks: while any is open, every checkpointed layer runs as plain autograd.
_PLAIN = [0]


@contextlib.contextmanager
def plain_layers() -> Iterator[None]:
    """Run every checkpointed layer without checkpointing inside the block (autograd keeps its activations).

    For a forward whose side outputs need their gradient: an MoE model's router logits, which transformers collects
    with hooks while the layer runs, reach the auxiliary loss detached if the layer runs without grad first.
    """
    _PLAIN[0] += 1
    try:
        yield
    finally:
        _PLAIN[0] -= 1


__all__ = ["ForwardState", "LayerCheckpoint", "LayerParameters", "plain_layers"]
