"""The exceptions moe-ep raises. All subclass :class:`MoEEpError`; catch that to catch them all."""


class MoEEpError(Exception):
    """Base class of every error moe-ep raises on purpose."""


class MoEEpConfigError(MoEEpError, ValueError):
    """A configuration (EpConfig, tuned-config file, transport setting) is invalid."""


class MoEEpInputError(MoEEpError, ValueError):
    """A tensor or argument passed to a moe-ep function is invalid (shape, dtype, device, values)."""


def check(cond: bool, what: str, value, allowed: str, exc: type = MoEEpInputError) -> None:
    """Raise ``exc`` saying that ``what`` was ``value`` and what is allowed, unless ``cond``."""
    if not cond:
        fail(what, value, allowed, exc)


def fail(what: str, value, allowed: str, exc: type = MoEEpInputError):
    """Raise ``exc`` saying that ``what`` was ``value`` and what is allowed. Per-step hot paths write
    ``if not cond: fail(...)`` so the message (f-strings, shape tuples: ~1 us each) is built only on failure."""
    raise exc(f"{what} = {value!r}; allowed: {allowed}")


class MoEEpBackendUnavailable(MoEEpError, RuntimeError):
    """A transport was asked for that cannot run here; the message says why and how to install it."""


class MoEEpPeerError(MoEEpError, RuntimeError):
    """Another rank of the layer's group failed (the message names the rank and its error), or not every rank
    answered a collective of the layer within its ``timeout``. This rank's call did nothing."""


class MoEEpConcurrentUseError(MoEEpError, RuntimeError):
    """Two threads called one layer's forward at once: a layer owns buffers and collectives that one forward
    at a time may use (give each thread its own layer, or serialize the calls)."""
