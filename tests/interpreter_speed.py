"""Triton's CPU interpreter re-patches ``triton.language`` at every ``@triton.jit`` call inside a kernel; do it once.

A kernel launch under ``TRITON_INTERPRET=1`` swaps the builtins of the ``triton.language`` modules its function sees
for interpreted ones (``_patch_lang``) and restores them when the launch ends. A device function called from the
kernel, ``tl.sum`` included (it is a ``@triton.jit`` function of ``triton.language.standard``), runs ``_patch_lang``
again on every call, once per program of the grid. Inside one launch every later call finds the same modules already
patched and sets the same attributes again: ``inspect.getmembers`` over each module for nothing. It was a quarter of
the interpreter's time in a family parity test (tl.sum in every RMSNorm row program), and the interpreter is most of
the version lanes' time.

``install()`` keeps the first ``_patch_lang`` of each set of modules in a launch (the kernel's own, which the launch
restores, and a device function's first, which Triton never restores either) and skips the repeats until the launch
ends. Nothing the kernels compute changes: the parity and kernel tests compare the same numbers as before. Where the
interpreter's internals differ from what this expects, ``install()`` leaves the interpreter as it is and says why
(the tests run, only slower).
"""

from __future__ import annotations

import inspect
import warnings


def install() -> bool:
    """Make repeated ``_patch_lang`` calls within one interpreted launch no-ops; returns whether it was installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no triton: nothing is interpreted
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None:
        warnings.warn(
            "tests/interpreter_speed.py: this triton's interpreter lacks GridExecutor, _patch_lang or _LangPatchScope; "
            "the interpreted tests run without the once-per-launch patching (slower, same results)",
            stacklevel=2,
        )
        return False
    if getattr(patch_lang, "_fastft_once", False):  # installed already
        return True
    if list(inspect.signature(patch_lang).parameters) != ["fn"]:
        warnings.warn(
            f"tests/interpreter_speed.py: triton's _patch_lang takes {inspect.signature(patch_lang)}, expected (fn); "
            "the interpreted tests run without the once-per-launch patching (slower, same results)",
            stacklevel=2,
        )
        return False

    patched_in_launch: set[tuple[int, ...]] = set()

    def once_per_launch(fn):
        # The modules _patch_lang patches are those of fn's globals that are triton.language or its core.
        key = tuple(sorted(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core))
        if key in patched_in_launch:
            return scope_type()
        scope = patch_lang(fn)
        patched_in_launch.add(key)
        return scope

    once_per_launch._fastft_once = True
    launch = executor.__call__

    def launch_forgetting_patches(self, *args, **kwargs):
        # The launch restores what its kernel patched: the next launch must patch again.
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched_in_launch.clear()

    interpreter._patch_lang = once_per_launch
    executor.__call__ = launch_forgetting_patches
    return True
