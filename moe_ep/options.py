"""The ``MOE_EP_*`` environment options, parsed once per process by one rule.

Every option moe-ep reads from the environment is a field of :class:`Options`:

============================  ======================  =================================================================
variable                      field                   values
============================  ======================  =================================================================
``MOE_EP_AUTOTUNE``           ``autotune``            on/off (bool): off = no config search, first configs untimed;
                                                      default on, off under Triton's interpreter (its timings are
                                                      Python time: a search only costs time there)
``MOE_EP_AUTOTUNE_QUICK``     ``autotune_quick``      bool: search at most 3 grouped-GEMM configs per shape class
``MOE_EP_DECODED_MIN_M``      ``decoded_min_m``       a positive int (tokens per expert), or off (``None``: never)
``MOE_EP_GEMM_CHAIN``         ``gemm_chain``          bool: the expert MLP chains GEMM2 onto GEMM1 at decode shapes
``MOE_EP_GLUON_FP8_MIN_M``    ``gluon_fp8_min_m``     a positive int (tokens per expert), or off (``None``: never): from
                                                      this bucket on, ragged FP8 GEMMs run the Gluon fast path where it
                                                      is verified (``grouped_gemm/gluon_fp8.py``)
``MOE_EP_GLUON_NVFP4_MIN_M``  ``gluon_nvfp4_min_m``   a positive int (tokens per expert), or off: from this bucket on,
                                                      ragged GEMMs of NVFP4 weights run the Gluon prefill GEMM where
                                                      it is verified (``grouped_gemm/gluon_nvfp4_prefill.py``)
``MOE_EP_CONFIG_DIR``         ``config_dir``          a folder searched for tuned configs first (``None``: unset)
``MOE_EP_FORWARD_PLAN``       ``forward_plan``        bool: a layer at world size 1 over the portable transport replays
                                                      its eager forward's recorded launches (``forward_plan.py``);
                                                      on by default
============================  ======================  =================================================================

One field comes from the environment without a ``MOE_EP_`` variable of its own: ``user_config_dir``, the user's
folder of tuned configs, ``$XDG_CONFIG_HOME/moe-ep/configs`` (``~/.config/moe-ep/configs`` when unset), read at the
same time as the others.

The rule: whitespace is stripped and case ignored; an unset or empty variable takes the default; booleans accept
``1/0/on/off/true/false/yes/no``; anything else raises :class:`~moe_ep.errors.MoEEpConfigError` naming the variable,
its value and what is allowed.

The environment is read once, at the first :func:`current` (kernels read options on every call, so that must be
cheap). A process that changes ``os.environ`` afterwards calls :func:`reload`; code (tools, benchmarks, tests) sets
options for a block with :func:`override` instead of editing ``os.environ``::

    with options.override(autotune="off"):
        ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from dataclasses import dataclass

from .errors import MoEEpConfigError

DEFAULT_DECODED_MIN_M = 512  # from this many tokens per expert on, NVFP4 weights are decoded to bf16 copies first
DEFAULT_GLUON_FP8_MIN_M = 128  # the bucket from which the FP8 expert MLP is faster through the Gluon kernels (PERF.md)
# the bucket from which the NVFP4-weight expert MLP is faster through the Gluon prefill GEMM (PERF.md; at 64 tokens
# per expert it is as fast as the tl path or slower)
DEFAULT_GLUON_NVFP4_MIN_M = 128

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")
BOOL_VALUES = "1/0/on/off/true/false/yes/no"


@dataclass(frozen=True)
class Options:
    """The parsed options (immutable and hashable: caches may key on it)."""
    autotune: bool = True
    autotune_quick: bool = False
    decoded_min_m: int | None = DEFAULT_DECODED_MIN_M
    gemm_chain: bool = True
    gluon_fp8_min_m: int | None = DEFAULT_GLUON_FP8_MIN_M
    gluon_nvfp4_min_m: int | None = DEFAULT_GLUON_NVFP4_MIN_M
    config_dir: str | None = None
    forward_plan: bool = True
    user_config_dir: str | None = None  # set by parse(); not overridable (it is no MOE_EP_ option)


ENV = {"autotune": "MOE_EP_AUTOTUNE", "autotune_quick": "MOE_EP_AUTOTUNE_QUICK",
       "decoded_min_m": "MOE_EP_DECODED_MIN_M", "gemm_chain": "MOE_EP_GEMM_CHAIN",
       "gluon_fp8_min_m": "MOE_EP_GLUON_FP8_MIN_M", "gluon_nvfp4_min_m": "MOE_EP_GLUON_NVFP4_MIN_M",
       "config_dir": "MOE_EP_CONFIG_DIR",
       "forward_plan": "MOE_EP_FORWARD_PLAN"}
"""Field name -> environment variable."""


def _bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise MoEEpConfigError(f"{name} = {value!r}; allowed: {BOOL_VALUES}")


def _min_m(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip().lower()
    else:
        text = None
    if text == "off":
        return None
    if text is None or not re.fullmatch(r"[0-9]+", text) or int(text) < 1:  # ASCII digits only ("²" is a digit too)
        raise MoEEpConfigError(f"{name} = {value!r}; allowed: a positive integer (tokens per expert) or off")
    return int(text)


def _path(name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise MoEEpConfigError(f"{name} = {value!r}; allowed: a folder path")
    text = os.fspath(value).strip()
    return text or None


_PARSE = {"autotune": _bool, "autotune_quick": _bool, "decoded_min_m": _min_m, "gemm_chain": _bool,
          "gluon_fp8_min_m": _min_m, "gluon_nvfp4_min_m": _min_m, "config_dir": _path, "forward_plan": _bool}


def parse(env=None) -> Options:
    """Options from ``env`` (default ``os.environ``); raises MoEEpConfigError for a value that means nothing."""
    env = os.environ if env is None else env
    values = {}
    for field, var in ENV.items():
        raw = env.get(var)
        if raw is None or not raw.strip():
            continue
        values[field] = _PARSE[field](var, raw)
    if "autotune" not in values:
        values["autotune"] = autotune_default()
    config_home = (env.get("XDG_CONFIG_HOME") or "").strip() or os.path.join(os.path.expanduser("~"), ".config")
    return Options(**values, user_config_dir=os.path.join(config_home, "moe-ep", "configs"))


def autotune_default() -> bool:
    """``autotune`` when ``MOE_EP_AUTOTUNE`` is unset: on, except under Triton's interpreter, whose timings measure
    Python, not the kernel (a search there would only multiply the first calls' time)."""
    from . import triton_runtime  # (here: it imports torch, which this module does not need otherwise)
    return not triton_runtime.INTERPRETER


_current: Options | None = None
_explicit: frozenset = frozenset()


def current() -> Options:
    """The options in force: the environment as read once per process (:func:`reload`), or an :func:`override`."""
    return _current if _current is not None else reload()


def reload() -> Options:
    """Re-read the environment (after ``os.environ`` changed) and return the new options."""
    global _current, _explicit
    _current = parse()
    _explicit = frozenset(f for f, var in ENV.items() if os.environ.get(var, "").strip())
    return _current


def explicit() -> frozenset:
    """Field names whose variable is set (non-empty) in the environment, so a tool can leave the user's choice
    alone (``moe-ep fuzz`` turns the search off unless ``MOE_EP_AUTOTUNE`` is set)."""
    current()
    return _explicit


@contextlib.contextmanager
def override(**values):
    """Options changed for the ``with`` block (the previous ones come back after it, also on an exception).
    Values are parsed as the variables are (``autotune="off"``, ``decoded_min_m=64``) or given typed
    (``autotune=False``, ``decoded_min_m=None``); an unknown name or a value that means nothing raises
    MoEEpConfigError."""
    global _current
    changes = {}
    for field, value in values.items():
        if field not in ENV:
            raise MoEEpConfigError(f"options.override({field}=...) = {value!r}; allowed: {sorted(ENV)}")
        changes[field] = _PARSE[field](field, value)
    before = current()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
