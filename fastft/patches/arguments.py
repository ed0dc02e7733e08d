"""Reading a replaced forward's arguments by name, as ``inspect.Signature.bind`` would, at a fraction of its cost.

A patched forward takes its upstream signature (whichever transformers is installed) and must accept what upstream
accepts. ``Signature.bind`` does that but builds a ``BoundArguments`` on every call (about 10 µs per attention call,
times layers, times forward and recompute). :class:`ArgumentReader` studies the signature once; per call it only
lays positional arguments over the keyword dict. Anything ``bind`` would refuse (too many positional arguments, a
name given twice, a missing required argument, an unknown keyword where there is no ``**kwargs``) is handed to
``bind`` itself, so the ``TypeError`` is exactly upstream's.
"""

from __future__ import annotations

import inspect
from typing import Any

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class ArgumentReader:
    """The arguments of a method with ``signature`` (``self`` first), by name.

    Args:
        signature: The upstream forward's signature, ``self`` included.
    """

    def __init__(self, signature: inspect.Signature) -> None:
        parameters = list(signature.parameters.values())[1:]
        self.signature = signature
        self.positional = tuple(p.name for p in parameters if p.kind in _POSITIONAL)
        self.named = tuple(p.name for p in parameters if p.kind not in _VARIADIC)
        self.required = frozenset(p.name for p in parameters if p.kind not in _VARIADIC and p.default is p.empty)
        self.defaults = {p.name: p.default for p in parameters if p.kind not in _VARIADIC and p.default is not p.empty}
        self.var_keyword = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def read(self, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(named, extra)``: every named parameter's value (its default when not passed) and what ``**kwargs``
        collected. ``kwargs`` is the call's own dict and is consumed.

        Raises:
            TypeError: Whatever ``Signature.bind`` raises for these arguments.
        """
        if args:
            if len(args) > len(self.positional):
                self.signature.bind(owner, *args, **kwargs)  # raises: too many positional arguments
                raise TypeError(
                    f"fastft: {len(args) - len(self.positional)} extra positional arguments for "
                    f"{self.signature}; the fused forward passes keyword arguments on, not *args."
                )
            given = self.positional[: len(args)]
            if not kwargs.keys().isdisjoint(given) or not self.required <= kwargs.keys() | set(given):
                self.signature.bind(owner, *args, **kwargs)  # raises: a value given twice, or one missing
            kwargs.update(zip(given, args, strict=True))
        elif not self.required <= kwargs.keys():
            self.signature.bind(owner, *args, **kwargs)  # raises: a required argument missing
        named = {name: kwargs.pop(name) if name in kwargs else self.defaults[name] for name in self.named}
        if kwargs and self.var_keyword is None:
            # raises: an unexpected keyword (the named ones are back in place for an exact message)
            self.signature.bind(owner, **named, **kwargs)
        return named, kwargs


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


__all__ = ["ArgumentReader"]
