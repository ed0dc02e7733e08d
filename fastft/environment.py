"""The old path of :mod:`fastft.bench.environment`, kept for the code and documents that import it."""

import sys

from fastft.bench import environment as _module

# One module object under both names, so what is set on either (monkeypatch, configuration) holds for both.
sys.modules[__name__] = _module
