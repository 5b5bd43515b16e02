"""Integer helpers for host code on the launch path. ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr
functions (callable in kernels too), which costs microseconds per call from plain Python; launchers call these
dozens of times per forward."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ints (``b`` > 0)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
