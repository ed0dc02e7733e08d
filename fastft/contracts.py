"""Shape contracts: what each projection expects, checked early, with errors that name the module."""

# The class lives in the kernel layer, which sits above this one and raises it too (a packed 4-bit weight
# without its quant_state); defining it there keeps one class for both layers.
from fastft.kernels.errors import ShapeContractError

__all__ = ["ShapeContractError"]
