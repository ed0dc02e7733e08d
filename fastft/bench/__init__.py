"""``fastft bench``: fastft against transformers + peft, Liger-Kernel and Unsloth, each in its own process and
environment, on the same model, data and seed (see ``bench/README.md``)."""

from fastft.bench.harness import BenchError, Options, run, write

__all__ = ["BenchError", "Options", "run", "write"]
