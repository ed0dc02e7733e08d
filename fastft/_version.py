"""fastft's version, in a module that imports nothing, so the kernels can record it without importing fastft."""

__version__ = "0.1.0.dev0"
