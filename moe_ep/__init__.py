"""moe-ep: an expert-parallel Mixture-of-Experts layer with Triton expert compute.

``import moe_ep`` is cheap: it imports neither torch nor triton (``moe-ep --help`` answers at once). The public
names below are imported from their modules on first use (PEP 562), and so is any submodule named as an attribute
(``moe_ep.options``). Importing moe_ep first still decides how kernels run (compiled on a GPU, Triton's interpreter
without one) before triton is imported: see :mod:`moe_ep.kernel_mode`.
"""

import importlib
import importlib.util

from .kernel_mode import decide_before_triton

decide_before_triton()

__version__ = "0.1.0"

_HOME = {  # public name -> the module defining it
    "fused_moe": "fused", "MoEEpLayer": "layer", "EpConfig": "config", "Algorithm": "config", "Layout": "config",
    "Format": "config", "ExpertWeights": "weights", "MoEEpError": "errors", "MoEEpConfigError": "errors",
    "MoEEpInputError": "errors", "MoEEpBackendUnavailable": "errors", "MoEEpPeerError": "errors",
    "MoEEpConcurrentUseError": "errors", "NvFp4Projection": "checkpoints",
    "nvfp4_experts_from_state_dict": "checkpoints", "nvfp4_activation_global_scale": "checkpoints",
    "available_transports": "transports.discovery",
}

__all__ = ["fused_moe", "MoEEpLayer", "EpConfig", "Algorithm", "Layout", "Format", "ExpertWeights",
           "MoEEpError", "MoEEpConfigError", "MoEEpInputError", "MoEEpBackendUnavailable", "MoEEpPeerError",
           "MoEEpConcurrentUseError",
           "NvFp4Projection", "nvfp4_experts_from_state_dict", "nvfp4_activation_global_scale",
           "available_transports", "__version__"]


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
