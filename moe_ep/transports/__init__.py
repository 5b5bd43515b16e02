"""Transports: dispatch tokens to the ranks owning their experts and combine results back."""

from __future__ import annotations

from ..config import EpConfig
from ..errors import MoEEpConfigError
from .base import DispatchResult, Transport

TRANSPORTS = ("torch",)
"""Names :func:`make_transport` accepts."""


def make_transport(name: str, config: EpConfig, group=None, *, device=None) -> Transport:
    """Build the transport ``name`` for ``config`` over ``group`` (None: the default group, or world size 1
    when torch.distributed is not initialized). Unknown names raise :class:`MoEEpConfigError`."""
    if name == "torch":
        from .torch_dist import TorchDistTransport
        return TorchDistTransport(config, group, device=device)
    raise MoEEpConfigError(f"transport = {name!r}; allowed: {', '.join(repr(t) for t in TRANSPORTS)}")


__all__ = ["DispatchResult", "Transport", "make_transport", "TRANSPORTS"]
