"""moe-ep: an expert-parallel Mixture-of-Experts layer with Triton expert compute.

Importing moe_ep first decides how kernels run (compiled on a GPU, Triton's interpreter without one):
see :mod:`moe_ep.triton_runtime`.
"""

from . import triton_runtime  # noqa: F401  (must precede any triton import)
from .checkpoints import NvFp4Projection, nvfp4_activation_global_scale, nvfp4_experts_from_state_dict
from .config import Algorithm, EpConfig, Format, Layout
from .errors import (MoEEpBackendUnavailable, MoEEpConcurrentUseError, MoEEpConfigError, MoEEpError, MoEEpInputError,
                     MoEEpPeerError)
from .fused import fused_moe
from .layer import MoEEpLayer
from .transports.discovery import available_transports
from .weights import ExpertWeights

__version__ = "0.1.0"

__all__ = ["fused_moe", "MoEEpLayer", "EpConfig", "Algorithm", "Layout", "Format", "ExpertWeights",
           "MoEEpError", "MoEEpConfigError", "MoEEpInputError", "MoEEpBackendUnavailable", "MoEEpPeerError",
           "MoEEpConcurrentUseError",
           "NvFp4Projection", "nvfp4_experts_from_state_dict", "nvfp4_activation_global_scale",
           "available_transports", "__version__"]
