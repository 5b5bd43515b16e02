"""Tuned-config files: ``<dir>/<device name>.json`` (``moe-ep tune`` writes them), their schema, and the lookup of
a shape's config.

File format (vLLM style): ``{shape_class: {"<tokens-per-expert bucket>": config}}``, a config being
``{BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, GROUP_M, num_warps, num_stages[, TMA]}`` (:data:`SCHEMA`). A lookup uses the
nearest bucket present, nearest by ratio (with buckets 16 and 1024, 256 tokens per expert take the 1024 config, not
the 16-token decode one). TMA (optional, default false): bf16 or FP8 tiles loaded by tensor descriptors on a persistent
grid; where TMA cannot run (NVFP4 weights, the masked layout, decode buckets, a GPU older than Hopper) the same tiles
go through pointer loads.

Keys ``n{N}_k{K}_xnvfp4_wnvfp4[_swiglu]`` hold configs of the sm_100 W4A4 kernel (``sm100_fp4.py``: no TMA key),
checked by :func:`validate_sm100`; only that kernel's plans look them up.

Every config read is checked against the schema and against this GPU's shared memory (a config too large would not
launch); a file that breaks either raises MoEEpConfigError naming the file, the key, the value and what is allowed.
"""

from __future__ import annotations

import json
import math
import os
import time
from functools import lru_cache

from ... import device_facts, options
from ...errors import MoEEpConfigError
from . import sm100_fp4
from .config_space import CONFIG_KEYS, fp8_rule_broken, m_bucket, shape_class, smem_bytes

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "configs")


def _power_of_two(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi and v & (v - 1) == 0


SCHEMA = {  # key: (allowed, check); every key but TMA is required
    "BLOCK_M": ("an int, a power of two in [16, 512]", lambda v: _power_of_two(v, 16, 512)),
    "BLOCK_N": ("an int, a power of two in [16, 512]", lambda v: _power_of_two(v, 16, 512)),
    "BLOCK_K": ("an int, a power of two in [32, 512]", lambda v: _power_of_two(v, 32, 512)),
    "SWAP_AB": ("true or false", lambda v: type(v) is bool),
    "GROUP_M": ("an int in [1, 64]", lambda v: type(v) is int and 1 <= v <= 64),
    "TMA": ("true or false (optional, default false)", lambda v: type(v) is bool),
    "num_warps": ("an int, a power of two in [1, 32]", lambda v: _power_of_two(v, 1, 32)),
    "num_stages": ("an int in [1, 8]", lambda v: type(v) is int and 1 <= v <= 8),
}


def validate(cfg, where: str, swiglu: bool = False, w_fp4: bool = False, smem_limit: int | None = None, *,
             fp8: bool = False, fp8_out: bool = False) -> dict:
    """A config checked against :data:`SCHEMA`, the FP8 rules for an FP8 shape (``fp8``, ``fp8_out``:
    ``config_space.fp8_rule_broken``) and, given ``smem_limit``, against shared memory for a shape of ``swiglu`` /
    ``w_fp4`` / ``fp8``: the config with every key, or MoEEpConfigError naming ``where``, the key and value."""
    if not isinstance(cfg, dict):
        raise MoEEpConfigError(f"{where} = {cfg!r}; allowed: an object with keys {list(SCHEMA)}")
    unknown = sorted(set(cfg) - set(SCHEMA), key=str)
    if unknown:
        raise MoEEpConfigError(f"{where}: keys {unknown}; allowed: only {list(SCHEMA)}")
    for key, (allowed, ok) in SCHEMA.items():
        if key not in cfg:
            if key == "TMA":
                continue
            raise MoEEpConfigError(f"{where}.{key} = missing; allowed: {allowed}")
        if not ok(cfg[key]):
            raise MoEEpConfigError(f"{where}.{key} = {cfg[key]!r}; allowed: {allowed}")
    out = {k: cfg.get(k, False) for k in CONFIG_KEYS}
    if fp8:
        broken = fp8_rule_broken(out, fp8_out)
        if broken:
            raise MoEEpConfigError(f"{where}.{broken}")
    if smem_limit is not None:
        need = smem_bytes(out, swiglu, w_fp4, fp8)
        if need > smem_limit:
            raise MoEEpConfigError(f"{where} = {cfg!r}: {need} bytes of shared memory; allowed: at most {smem_limit} "
                                   "on this GPU (smaller blocks or fewer num_stages)")
    return out


def validate_sm100(cfg, where: str, swiglu: bool) -> dict:
    """A config of the sm_100 W4A4 kernel (a ``..._xnvfp4_wnvfp4`` entry, or a forced config on that path) checked:
    an object of exactly ``sm100_fp4.CONFIG_KEYS`` with values as :data:`SCHEMA` allows, and one of
    ``sm100_fp4.configs_for(swiglu)`` (it builds the FP4 MMA within sm_100's shared and tensor memory). The config
    with every key, or MoEEpConfigError naming ``where``, the key and value."""
    out = sm100_fp4.check_keys(cfg, where)
    for key, value in out.items():
        allowed, ok = SCHEMA[key]
        if not ok(value):
            raise MoEEpConfigError(f"{where}.{key} = {value!r}; allowed: {allowed}")
    return sm100_fp4.check_config(out, where, swiglu)


def user_config_dir() -> str:
    """The user's folder of tuned configs, where ``moe-ep tune`` writes by default: ``$XDG_CONFIG_HOME/moe-ep/configs``,
    else ``~/.config/moe-ep/configs`` (outside the package, so an install's shipped files stay as shipped); read
    with the options (``options.current().user_config_dir``), not on every lookup."""
    return options.current().user_config_dir


def config_dirs() -> list[str]:
    """Folders searched for tuned configs, in order: the ``config_dir`` option (``$MOE_EP_CONFIG_DIR``), the user's
    folder (:func:`user_config_dir`), then the shipped ``configs/``."""
    extra = options.current().config_dir
    return ([extra] if extra else []) + [user_config_dir(), SHIPPED_DIR]


def load_config_file(path: str) -> dict:
    """A tuned-config file as a dict ({} when absent); one that is not a JSON object raises MoEEpConfigError (its
    configs are checked when looked up)."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise MoEEpConfigError(f"tuned-config file {path}: {e}; allowed: a JSON object (fix or remove it)") from e
    if not isinstance(table, dict):
        raise MoEEpConfigError(f"tuned-config file {path} = {type(table).__name__}; allowed: a JSON object")
    return table


@lru_cache(maxsize=16)
def _load_file(path: str, mtime: float) -> dict:
    return load_config_file(path)  # per modification time: re-read when tune rewrites it (bounded: old versions go)


RESTAT_S = 1.0  # how long a stat of the tuned files is trusted (a forward takes them on every call)
_versions = None  # (options, device index, trusted until (time.monotonic), versions) of the last stat


def file_versions() -> tuple:
    """(path, mtime) of this device's tuned-config file in each searched folder that has one; caches of looked-up
    configs key on it. One stat per folder at most every :data:`RESTAT_S` seconds per options and device (an edited
    file is seen within that), at once after :func:`invalidate` (``moe-ep tune`` calls it when it writes a file)."""
    global _versions
    opts, dev, now = options.current(), device_facts.device_index(), time.monotonic()
    v = _versions
    if v is not None and v[0] is opts and v[1] == dev and now < v[2]:
        return v[3]
    found = []
    name = device_facts.device_name() + ".json"
    for d in config_dirs():
        path = os.path.join(d, name)
        try:
            found.append((path, os.stat(path).st_mtime))
        except OSError:
            continue
    _versions = (opts, dev, now + RESTAT_S, tuple(found))
    return _versions[3]


def invalidate() -> None:
    """Forget the last stat of the tuned files: the next :func:`file_versions` reads them again (after a write)."""
    global _versions
    _versions = None


def tuned_gemm_config(n: int, k: int, m: int, w_fp4: bool, swiglu: bool, versions: tuple | None = None, *,
                      fp8: bool = False, fp8_out: bool = False, sm100: bool = False):
    """``(config, file path)`` of the tuned config for this shape (FP8 shapes have keys of their own; ``sm100``: the
    sm_100 W4A4 kernel's, :func:`validate_sm100`), or None (then the first config or autotune). ``versions``:
    :func:`file_versions`, when the caller has them already."""
    key, want = shape_class(n, k, w_fp4, swiglu, fp8, fp8_out, sm100_fp4=sm100), m_bucket(m)
    limit = device_facts.sm100_smem_limit() if sm100 else device_facts.smem_limit()
    for path, mtime in (file_versions() if versions is None else versions):
        cfg = _lookup(path, mtime, key, want, swiglu, w_fp4, fp8, fp8_out, limit, sm100)
        if cfg is not None:
            return dict(cfg), path
    return None


@lru_cache(maxsize=4096)
def _lookup(path: str, mtime: float, key: str, want: int, swiglu: bool, w_fp4: bool, fp8: bool, fp8_out: bool,
            limit, sm100: bool = False) -> dict | None:
    """The checked config of ``key`` nearest to bucket ``want`` in one file version (callers copy it)."""
    by_m = _load_file(path, mtime).get(key)
    if not by_m:
        return None
    if not isinstance(by_m, dict):
        raise MoEEpConfigError(f"{path}[{key!r}] = {by_m!r}; allowed: {{bucket: config}}")
    buckets = {}
    for b, c in by_m.items():
        if not (isinstance(b, str) and b.isascii() and b.isdigit() and int(b) >= 1):
            raise MoEEpConfigError(f"{path}[{key!r}] key {b!r}; allowed: a positive integer (tokens per expert)")
        buckets[int(b)] = c
    if sm100:  # (limit: what the space was pruned by; the key is part of the cache's key)
        checked = {b: validate_sm100(c, f"{path}[{key!r}][{b}]", swiglu) for b, c in buckets.items()}
    else:
        checked = {b: validate(c, f"{path}[{key!r}][{b}]", swiglu, w_fp4, limit, fp8=fp8, fp8_out=fp8_out)
                   for b, c in buckets.items()}
    return checked[min(checked, key=lambda b: (abs(math.log2(b / want)), b))]
