"""The old path of :mod:`fastft.checkpointing.modes`, kept for the code and documents that import it."""

import sys

from fastft.checkpointing import modes as _module

# One module object under both names, so what is set on either (monkeypatch, configuration) holds for both.
sys.modules[__name__] = _module
