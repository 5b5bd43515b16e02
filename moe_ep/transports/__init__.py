"""Transports: dispatch tokens to the ranks owning their experts and combine results back."""

from .base import DispatchResult, Transport

__all__ = ["DispatchResult", "Transport"]
