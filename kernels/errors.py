"""The exception the kernel layer raises for a tensor of the wrong shape; fastft re-exports it."""


class ShapeContractError(ValueError):
    """A tensor or config does not have the shape a module needs.

    Raised before any matmul sees the tensor, with the module's name, the expected and the actual shape, and what
    to change. It is a ``ValueError``, so code that already catches bad input keeps working.
    """
