"""Watching the aten operators a step runs: the base of every operator-counting dispatch mode of the tests and the
benchmarks."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from fastft.kernels.custom_ops import expand_composite


class OperatorMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose subclass's ``__torch_dispatch__`` sees the operators that run.

    fastft's nodes run their math inside :func:`fastft.kernels.custom_ops.below_autograd`, where a
    CompositeImplicitAutograd operator (``linear``, ``reshape``, ``to``) reaches a dispatch mode whole and decomposes
    only in the backend. A subclass of this class gets such an operator as its parts (``t`` and ``addmm``, ``view``,
    ``_to_copy``), exactly what it would see of the same call outside the block, so counts stay comparable between
    fastft and stock code, and between fastft versions.

    Example::

        class Count(OperatorMode):
            def __init__(self):
                super().__init__()
                self.n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.n += 1
                return func(*args, **(kwargs or {}))
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is None:
            return

        def __torch_dispatch__(
            self: Any, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            out = expand_composite(self, func, args, kwargs or {})
            if out is not NotImplemented:
                return out
            return handler(self, func, types, args, kwargs)

        __torch_dispatch__.__doc__ = handler.__doc__
        cls.__torch_dispatch__ = __torch_dispatch__


__all__ = ["OperatorMode"]
