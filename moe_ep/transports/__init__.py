"""Transports: dispatch tokens to the ranks owning their experts and combine results back."""

from __future__ import annotations

from ..config import EpConfig
from ..layout_contract import DispatchResult
from .base import Transport
from .discovery import PREFERENCE, require_transport

TRANSPORTS = ("auto", *PREFERENCE)
"""Names :func:`make_transport` accepts ("auto": the best available, see ``available_transports()``)."""


def make_transport(name: str, config: EpConfig, group=None, *, device=None) -> Transport:
    """Build the transport ``name`` for ``config`` over ``group`` (None: the default group, or world size 1
    when torch.distributed is not initialized). Unknown names raise :class:`MoEEpConfigError`; a known
    transport that cannot run here raises :class:`moe_ep.MoEEpBackendUnavailable` with the reason and
    the install command (both from :func:`~moe_ep.transports.discovery.require_transport`)."""
    name = require_transport(name)
    if name == "nccl_ep":
        from .nccl_ep import NcclEpTransport as T
    elif name == "nixl_ep":
        from .nixl_ep import NixlEpTransport as T
    else:
        from .torch_dist import TorchDistTransport as T
    return T(config, group, device=device)


__all__ = ["DispatchResult", "Transport", "make_transport", "TRANSPORTS"]
