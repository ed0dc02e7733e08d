"""Shape contracts: what each projection expects, checked early, with errors that name the module."""


class ShapeContractError(ValueError):
    """A tensor or config does not have the shape a module needs.

    Raised before any forward runs, with the module's name, the expected and the actual shape, and what to
    change. It is a ``ValueError``, so code that already catches bad input keeps working.
    """
