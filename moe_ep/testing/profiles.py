"""The hypothesis profiles of moe-ep's property tests and ``moe-ep fuzz``, registered in this one place.

``ci`` (the default of ``tests/``): few examples, derandomized (the same examples on every run and machine), no
deadline (a case through the Triton interpreter takes seconds). ``fuzz``: thousands of random examples, for GPU
runs (``moe-ep fuzz``, or ``HYPOTHESIS_PROFILE=fuzz pytest``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

CI, FUZZ = "ci", "fuzz"

# the kernels' cases are slow to run and large to draw by design; filtering happens in fuzz's time limit (assume)
_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def register_profiles() -> None:
    """Register the ``ci`` and ``fuzz`` profiles (again is harmless: the same settings)."""
    settings.register_profile(CI, max_examples=12, derandomize=True, deadline=None, suppress_health_check=_SUPPRESSED)
    settings.register_profile(FUZZ, max_examples=2000, deadline=None, suppress_health_check=_SUPPRESSED)
