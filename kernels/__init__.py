"""Triton kernels with a plain-torch reference for each (installed as ``fastft.kernels``).

This layer knows tensors only: it never imports transformers or peft. See :mod:`fastft.kernels.dispatch` for
which implementation a call takes.
"""
