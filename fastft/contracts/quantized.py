"""bitsandbytes 4-bit layers: the quant_state checked at load and on every forward, and no nn.DataParallel."""

from __future__ import annotations

import sys

import torch

from fastft.contracts._layers import _base_model
from fastft.kernels.errors import ShapeContractError

_DDP_FIX = (
    "Use DistributedDataParallel, one process per GPU, which keeps each process's quantised weights intact: "
    "`torchrun --nproc_per_node=N train.py` or `accelerate launch train.py` (fastft picks each process's GPU "
    "from LOCAL_RANK)."
)


def _linear4bit_class() -> type | None:
    # No bnb import means no bnb module can exist in the model, so don't pay for importing it.
    if "bitsandbytes" not in sys.modules:
        return None
    from bitsandbytes.nn import Linear4bit

    return Linear4bit


def _linear4bit_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    linear4bit = _linear4bit_class()
    if linear4bit is None:
        return []
    return [(name, module) for name, module in _base_model(model).named_modules() if isinstance(module, linear4bit)]


def _lost_quant_state_message(name: str, module: torch.nn.Module) -> str:
    weight = module.weight
    return (
        f"{name}: expected a 4-bit weight for [out, in] = [{module.out_features}, {module.in_features}] carrying its "
        f"bitsandbytes quant_state, got a {type(weight).__name__} of packed {weight.dtype} bytes "
        f"{list(weight.shape)} with no quant_state, which cannot be used as a weight. Rebuilding the parameter "
        "(module.weight = torch.nn.Parameter(module.weight.data), p.detach(), nn.DataParallel replication, FSDP "
        "sharding) drops it: keep the original Params4bit, reload with FastModel.from_pretrained(..., "
        "load_in_4bit=True); FSDP needs a 16-bit base (load_in_4bit=False), and for a 4-bit base on several GPUs: "
        f"{_DDP_FIX}"
    )


def check_quant_states(model: torch.nn.Module) -> int:
    """Check that every bitsandbytes ``Linear4bit`` weight carries a quant_state of the layer's shape.

    Args:
        model: A transformers model or a ``PeftModel``.

    Returns:
        The number of 4-bit layers checked.

    Raises:
        ShapeContractError: A packed weight without quant_state, or one whose quant_state is for another shape.
    """
    modules = _linear4bit_modules(model)
    for name, module in modules:
        state = getattr(module.weight, "quant_state", None)
        if state is None:
            raise ShapeContractError(_lost_quant_state_message(name, module))
        expected = (module.out_features, module.in_features)
        actual = tuple(getattr(state, "shape", None) or ())
        if actual != expected:
            raise ShapeContractError(
                f"{name}: expected the 4-bit weight's quant_state.shape [out, in] = {list(expected)}, got "
                f"{list(actual)}: the packed bytes and their quantisation statistics belong to different layers. "
                "Reload the model with FastModel.from_pretrained(..., load_in_4bit=True)."
            )
    return len(modules)


class _QuantStateGuard:
    """Forward pre-hook of one ``Linear4bit``: refuse to run without a quant_state.

    bitsandbytes' own forward would try ``fix_4bit_weight_quant_state_from_module`` (every version from 0.46 to
    0.50): it silently re-attaches ``module.quant_state`` when the module still has one, and otherwise warns
    ("FP4 quantization state not initialized") and fails in an assert or in ``matmul_4bit`` without naming the
    layer. A re-attached state is only right if nothing else changed, so fastft refuses instead. A module-level
    class rather than a closure, so the model still pickles and deep-copies.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            raise ShapeContractError(_lost_quant_state_message(self.name, module))


class _RefuseReplication:
    """Stands in for ``Module._replicate_for_data_parallel`` on a 4-bit module (an instance attribute).

    ``torch.nn.parallel.replicate`` (what ``nn.DataParallel`` runs on every forward with several GPUs) broadcasts
    the parameters as plain tensors, which drops Params4bit's quant_state, and then calls this on every submodule;
    raising here stops it before any replica computes with packed bytes.
    """

    def __init__(self, name: str, shape: tuple[int, int]) -> None:
        self.name = name
        self.shape = shape

    def __call__(self) -> torch.nn.Module:
        raise ShapeContractError(
            f"{self.name}: nn.DataParallel cannot replicate a 4-bit layer: its replicas would get the packed bytes "
            f"without the quant_state that makes them a [{self.shape[0]}, {self.shape[1]}] weight. {_DDP_FIX}"
        )


def guard_4bit(model: torch.nn.Module) -> int:
    """Keep every bitsandbytes ``Linear4bit`` from computing without its quant_state.

    Registers a forward pre-hook per 4-bit layer that raises :class:`ShapeContractError` naming the layer when its
    weight has lost the quant_state (hooks are copied into ``nn.DataParallel`` replicas too), and makes
    ``nn.DataParallel`` replication of the layer raise, pointing to DDP. Calling it again on the same model adds
    nothing.

    Args:
        model: A transformers model or a ``PeftModel``.

    Returns:
        The number of 4-bit layers guarded.
    """
    modules = _linear4bit_modules(model)
    for name, module in modules:
        if isinstance(module.__dict__.get("_replicate_for_data_parallel"), _RefuseReplication):
            continue
        module.register_forward_pre_hook(_QuantStateGuard(name))
        module._replicate_for_data_parallel = _RefuseReplication(name, (module.out_features, module.in_features))
    return len(modules)
