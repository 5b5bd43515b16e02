"""Triton stood in for below the launch cache (``moe_ep.kernels.launch_cache``), so that the cache's own path (key,
lookup, argument and grid work up to ``compiled.run``) runs and can be measured or tested on any machine: no
interpreter, no compile, no GPU. Used by ``benchmarks/bench_host_path.py`` (its ``+launch`` columns) and the tests
of the launch cache and the launch path.

While :func:`stand_in_triton` is entered, the launch cache sees no interpreter, a driver whose current device and
stream are 0, an empty kernel cache, and a caller's ``through_triton(info, kernel, grid, args, kwargs) -> (config,
compiled)`` in place of Triton's launch (a first call of a key): ``compiled`` is what it keeps, typically a
:class:`StandInCompiled`, whose ``run`` is the kept kernel's launch.
"""

from __future__ import annotations

import contextlib

from ..kernels import launch_cache


class StandInDriver:
    """Triton's active driver as the launch cache asks it: device 0, stream 0."""

    @staticmethod
    def get_current_device():
        return 0

    @staticmethod
    def get_current_stream(device):
        return 0


class StandInCompiled(launch_cache.CompiledKernel):
    """A compiled kernel with nothing loaded: ``run`` (what the launch cache calls for a kept kernel, Triton's C
    launcher's call) hands the grid's x and the launch's values (the positional arguments, then those past them)
    to ``on_run(gx, values)``."""

    def __init__(self, on_run, function=None, packed_metadata=None):  # (none of CompiledKernel's own state)
        self.on_run, self.function, self.packed_metadata = on_run, function, packed_metadata

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *values):
        self.on_run(gx, values)


@contextlib.contextmanager
def stand_in_triton(through_triton):
    """The launch cache on the stand-in (module doc) for the ``with`` block; its interpreter flag, driver, Triton
    call and kept kernels are put back after it (also on an exception)."""
    saved = (launch_cache.INTERPRETER, launch_cache._driver, launch_cache._through_triton, launch_cache._KERNELS)
    launch_cache.INTERPRETER, launch_cache._driver = False, lambda: StandInDriver
    launch_cache._through_triton, launch_cache._KERNELS = through_triton, {}
    try:
        yield
    finally:
        launch_cache.INTERPRETER, launch_cache._driver, launch_cache._through_triton, launch_cache._KERNELS = saved
