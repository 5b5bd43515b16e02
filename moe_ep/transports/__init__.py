"""Transports: dispatch tokens to the ranks owning their experts and combine results back."""

from __future__ import annotations

from ..config import EpConfig
from ..errors import MoEEpConfigError
from .base import DispatchResult, Transport

TRANSPORTS = ("torch", "nccl_ep", "nixl_ep", "auto")
"""Names :func:`make_transport` accepts ("auto": the best available, see ``available_transports()``)."""


def make_transport(name: str, config: EpConfig, group=None, *, device=None) -> Transport:
    """Build the transport ``name`` for ``config`` over ``group`` (None: the default group, or world size 1
    when torch.distributed is not initialized). Unknown names raise :class:`MoEEpConfigError`; a known
    transport that cannot run here raises :class:`moe_ep.MoEEpBackendUnavailable` with the reason and
    the install command."""
    if name not in TRANSPORTS:
        raise MoEEpConfigError(f"transport = {name!r}; allowed: {', '.join(repr(t) for t in TRANSPORTS)}")
    from .discovery import require_transport
    name = require_transport(name)
    if name == "nccl_ep":
        from .nccl_ep import NcclEpTransport
        return NcclEpTransport(config, group, device=device)
    if name == "nixl_ep":
        from .nixl_ep import NixlEpTransport
        return NixlEpTransport(config, group, device=device)
    if name == "torch":
        from .torch_dist import TorchDistTransport
        return TorchDistTransport(config, group, device=device)
    raise MoEEpConfigError(f"transport = {name!r}; allowed: {', '.join(repr(t) for t in TRANSPORTS)}")


__all__ = ["DispatchResult", "Transport", "make_transport", "TRANSPORTS"]
