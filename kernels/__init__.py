"""Triton kernels with a plain-torch reference for each (installed as ``fastft.kernels``).

This layer knows tensors only: it never imports transformers or peft. The kernels themselves land with the
kernels issue; until then every model runs the stock transformers + peft path.
"""
