"""fastft's kernels as torch custom ops, and the two ways a call reaches them.

Every kernel registers two custom ops over its implementations (Triton or the torch reference, by
:mod:`fastft.kernels.dispatch`): ``fastft::<kernel>`` (forward) and ``fastft::<kernel>_backward``, each with a fake
implementation that gives only shapes and dtypes. Autograd is registered on the forward op: a ``setup_context`` that
keeps what backward needs, and a ``backward`` that calls the backward op. ``torch.compile`` then sees each kernel as
one opaque node of known output shape (no graph break, nothing traced inside a Triton launch), and AOTAutograd traces
the registered backward into the backward op.

Eager calls do not go through the dispatcher. A custom op's Python dispatch costs about 12 µs per forward + backward
on a CPU (torch 2.13) against about 4 µs for an ``autograd.Function``, and host time is what the hot path is judged
by. So the public function applies an ``autograd.Function`` (through :func:`direct_apply`) whose forward and backward
call the *same* implementations the ops wrap; inside a registered backward, :func:`pick` hands out the backward op
while compiling and its implementation otherwise. One implementation, two entry points, the same numbers.

A kernel file therefore looks like::

    def _forward(x, w, eps):                       # the implementation (dispatch picks Triton or torch)
        ...
    _op = define("rms_norm", _forward, fake=lambda x, w, eps: ...)
    _backward_op = define("rms_norm_backward", _backward, fake=...)

    def _setup(ctx, inputs, output): ...
    def _grad(ctx, dy, drstd):
        return pick(_backward_op, _backward)(dy, ...)

    register_autograd(_op, _setup, _grad)

    class RMSNormFunction(torch.autograd.Function):  # forward / backward call _forward / _backward
        ...

    _apply = direct_apply(RMSNormFunction)

    def rms_norm(x, w, eps):
        if compiling():
            return _op(x, w, eps)[0]
        return _apply(x, w, eps)

Custom-op rules that shape the implementations: arguments are tensors, optional tensors, lists of them, and
int / float / bool / str scalars or lists (no Python objects); an output never aliases an input; a mutated input is
named in ``mutates_args``. A backward that writes gradients over its saved inputs in eager (SwiGLU, GeGLU, LoRA-MLP)
does so only when not compiling; its backward op allocates, and the compiler plans the memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

NAMESPACE = "fastft"

_MODES = torch._C._TorchDispatchModeKey
_active_mode = torch._C._get_dispatch_mode


def compiling() -> bool:
    """Whether the caller is being traced rather than run: by ``torch.compile`` (dynamo, and AOTAutograd tracing a
    registered backward), or by AOTAutograd / ``make_fx`` called directly (``torch.library.opcheck``, export), which
    run under a fake or proxy dispatch mode. About 0.2 µs in eager."""
    return (
        torch.compiler.is_compiling() or _active_mode(_MODES.FAKE) is not None or _active_mode(_MODES.PROXY) is not None
    )


def define(
    name: str,
    implementation: Callable[..., Any],
    *,
    fake: Callable[..., Any],
    mutates_args: Iterable[str] = (),
) -> Any:
    """Register ``implementation`` as the custom op ``fastft::<name>`` with its fake implementation.

    Args:
        name: The op's name inside the ``fastft`` namespace (``"rms_norm"``, ``"rms_norm_backward"``).
        implementation: The function that computes it; its type hints give the op's schema.
        fake: Computes outputs of the right shape, dtype and device without reading any data (``torch.compile``'s
            fake tensors, ``meta`` tensors).
        mutates_args: Names of the arguments the implementation writes into.

    Returns:
        The op (a ``torch._library.custom_ops.CustomOpDef``), callable like the function.
    """
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", implementation, mutates_args=tuple(mutates_args))
    op.register_fake(fake)
    return op


def register_autograd(op: Any, setup_context: Callable[..., None], backward: Callable[..., Any]) -> None:
    """Register ``backward`` (with ``setup_context``) as the gradient formula of the forward op ``op``."""
    op.register_autograd(backward, setup_context=setup_context)


def pick(op: Any, implementation: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` while compiling (so the tracer records one node), ``implementation`` otherwise (no dispatch cost)."""
    return op if compiling() else implementation


def direct_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` without the Python layer ``autograd.Function.apply`` wraps around torch's C++ one.

    That layer walks every argument for functorch wrappers (and, for ``setup_context``-style Functions, binds their
    default arguments through ``inspect``): about 2 µs per call of an eight-argument Function, on every call of every
    layer. Under functorch transforms (vmap, grad) the full ``apply`` still runs. With grad mode off the forward runs
    directly, on a context that keeps nothing: about 2.5 µs less per call again. For classic ``forward(ctx, ...)``
    Functions, called with every argument.

    Called while ``torch.compile`` traces (a plan built inside a compiled region, which never runs this wrapper:
    traced code takes the custom ops), it returns ``function.apply``: torch 2.15's dynamo cannot evaluate the
    ``super()`` lookup below (``AsPythonConstantNotImplementedError: AutogradFunctionVariable() is not a constant``).
    """
    if compiling():
        return function.apply
    fast = super(torch.autograd.Function, function).apply
    full = function.apply
    transforms_active = torch._C._are_functorch_transforms_active
    grad_enabled = torch.is_grad_enabled

    def apply(*args: Any) -> Any:
        if transforms_active():
            return full(*args)
        if not grad_enabled():
            # Nothing will be recorded (checkpointing's forward, trl's reference pass, generation): the forward runs
            # on a context that keeps nothing, without the node torch would build and drop.
            return function.forward(_Unrecorded(len(args)), *args)
        return fast(*args)

    apply.__doc__ = f"``{function.__name__}.apply`` (:func:`fastft.kernels.custom_ops.direct_apply`)."
    return apply


class _Unrecorded:
    """The ``ctx`` of a Function's forward that runs with grad mode off: what a forward may call on it does what
    torch's would there (a dirty tensor's version is bumped), and nothing is kept for a backward that cannot come."""

    def __init__(self, count: int) -> None:
        self.needs_input_grad = (False,) * count

    def save_for_backward(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            torch.autograd.graph.increment_version(tensor)


def below_autograd() -> Any:
    """A context in which torch ops skip the autograd and ADInplaceOrView dispatch keys: for the straight-line math
    inside a Function's forward and backward, which records nothing.

    Even with grad mode off, every op passes through those two keys (checks, version-counter bumps, view
    bookkeeping) on its way to the kernel; on the small tensors of a host-bound step that is measurable (about 110 µs
    of the 700 µs backward of a fused decoder layer, on this repository's host benchmark). What that skips, and what
    the caller must therefore keep outside: anything autograd should record (an ``attend`` graph, a hand-called
    node's fallback to ``torch.autograd.grad``), and views of tensors that outlive the block and are checked by
    version (a view made inside gets a version counter of its own, so a saved view of an *input* must be made
    outside). Autocast and Python dispatch modes still apply.
    """
    return _NOTHING if _BELOW is None else _BELOW()


# torch's guard is private API: a torch without it runs the same math through every key, only slower.
_BELOW = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
_NOTHING = contextlib.nullcontext()


def math_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``once_differentiable`` for a Function ``backward`` that is straight-line math (no autograd inside): its body
    runs in :func:`below_autograd`."""

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        # Unpacked before the block: under torch.utils.checkpoint (non-reentrant) the unpack recomputes the
        # checkpointed forward, which must record autograd as it did the first time.
        unpacked = _Unpacked(ctx)
        with below_autograd():
            return backward(unpacked, *grads)

    wrapper = once_differentiable(run)
    wrapper.below_autograd = True  # what tests find on every kernel Function's backward
    return wrapper


class _Unpacked:
    """A backward's ``ctx`` with its saved tensors already unpacked (once, as torch's checkpoint requires); every
    other attribute is the real context's."""

    __slots__ = ("_ctx", "saved_tensors")

    def __init__(self, ctx: Any) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", ctx.saved_tensors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ctx, name, value)


_BACKENDS = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}
_composite: dict[tuple[Any, str], bool] = {}


def expand_composite(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """For a ``TorchDispatchMode`` that counts or records operators: ``func`` run as its decomposition, under
    ``mode``, where its backend would run it as one (a CompositeImplicitAutograd operator with no kernel of the
    backend's own: ``linear``, ``reshape``, ``to``); ``NotImplemented`` otherwise, for the mode to run it itself.

    Such an operator normally decomposes at the autograd key, so a mode only ever sees its parts. Inside
    :func:`below_autograd` it reaches the mode whole, and then decomposes in the backend, into the same parts. Expanded
    here, a mode sees the operators that run either way (``torch.utils.flop_counter`` does the same). An operator with
    a backend kernel as well (``silu_backward``) runs that kernel, and stays one operator.
    """
    device = next((arg.device.type for arg in args if isinstance(arg, torch.Tensor)), "cpu")
    key = (func, _BACKENDS.get(device, "CPU"))
    composite = _composite.get(key)
    if composite is None:
        name = func.name()
        composite = _composite[key] = torch._C._dispatch_has_kernel_for_dispatch_key(
            name, "CompositeImplicitAutograd"
        ) and not torch._C._dispatch_has_kernel_for_dispatch_key(name, key[1])
    if not composite:
        return NotImplemented
    with mode:
        return func.decompose(*args, **kwargs)


def registered_ops() -> list[str]:
    """Every fastft custom op registered in this process (``"fastft::rms_norm"``, ...), sorted."""
    namespace = getattr(torch.ops, NAMESPACE)
    return sorted(f"{NAMESPACE}::{name}" for name in dir(namespace) if not name.startswith("_") and name != "name")


__all__ = [
    "NAMESPACE",
    "below_autograd",
    "compiling",
    "define",
    "direct_apply",
    "expand_composite",
    "math_backward",
    "pick",
    "register_autograd",
    "registered_ops",
]
