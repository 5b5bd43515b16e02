"""Autotune spaces for the kernels, and which of them the interpreter gets.

On a GPU each kernel autotunes over its space (keyed on its shape class). Through the interpreter
(no GPU) a program costs Python time per launch, so it gets a couple of large-block configs: enough
to keep the autotuner itself exercised, few enough to stay quick.
"""

from __future__ import annotations

import json
import math
import os
import re
from functools import lru_cache

import torch
import triton

from ..errors import MoEEpConfigError
from ..triton_runtime import INTERPRETER


def size_bucket(n: int, lo: int = 256) -> int:
    """Power-of-two class of a size (at least ``lo``): autotune keys on it, so a new size in the same
    class reuses the tuned config instead of re-tuning."""
    return max(lo, 1 << max(n - 1, 0).bit_length())


def nvfp4_configs() -> list[triton.Config]:
    """Quantize/dequantize tiles: memory bound, so wide K blocks and enough rows in flight."""
    if INTERPRETER:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_K": 256}), triton.Config({"BLOCK_M": 32, "BLOCK_K": 512})]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=1)
        for bm, bk, w in [(8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 8), (4, 1024, 4), (8, 1024, 8),
                          (32, 128, 4), (64, 128, 8)]
    ]


# ---------------------------------------------------------------------------------------------------
# Grouped GEMM: autotune space, shape classes, tuned-config files.
# ---------------------------------------------------------------------------------------------------

GEMM_PARAMS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "GROUP_M")
CONFIG_DIR_ENV = "MOE_EP_CONFIG_DIR"
QUICK_ENV = "MOE_EP_AUTOTUNE_QUICK"  # set: search at most 3 configs per shape class
SEARCH_ENV = "MOE_EP_AUTOTUNE"  # "off": no config search, first configs untimed (fuzzing: see launch())
DECODE_MAX_M = 32  # tokens per expert up to this are "decode": weight-streaming tiles (see prune_grouped_gemm_configs)
PERSISTENT_ROUNDS = 8  # persistent pointer-load grids (masked layouts): this many times the programs that fit at once
DECODED_MIN_M = 512  # from this bucket on NVFP4 weights are decoded to bf16 copies once, then bf16 tiles (x: always)
DECODED_ENV = "MOE_EP_DECODED_MIN_M"  # overrides DECODED_MIN_M: tokens per expert, or "off"
FP4_SWAP_MAX_M = 128  # NVFP4 weights may stay swapped up to here: decoded straight into wgmma's register operand


def m_bucket(m: int) -> int:
    """Tokens-per-expert bucket (a power of two >= 8): the M part of the autotune key and shape class."""
    return max(8, triton.next_power_of_2(max(int(m), 1)))


def _gemm(bm, bn, bk, swap, stages, warps, group_m=8, tma=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SWAP_AB": swap, "GROUP_M": group_m,
                          "TMA": tma}, num_warps=warps, num_stages=stages, pre_hook=set_tma_blocks if tma else None)


def set_tma_blocks(nargs) -> None:
    """Give the grouped GEMM's TMA descriptors the tile shapes of the config about to run (x: BLOCK_M x BLOCK_K,
    w: BLOCK_N x BLOCK_K); a config's pre-hook."""
    nargs["x_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


@lru_cache(maxsize=None)
def _props(index: int):
    """CUDA device ``index``'s properties, read once: reading them costs ~25 us, too much per kernel call."""
    return torch.cuda.get_device_properties(index)


def _current_props():
    """The current CUDA device's properties (None without CUDA)."""
    return _props(torch.cuda.current_device()) if torch.cuda.is_available() else None


def hopper_or_newer() -> bool:
    """Whether the current CUDA device is Hopper (compute capability 9.0) or newer; False without CUDA."""
    props = _current_props()
    return props is not None and props.major >= 9


def tma_supported() -> bool:
    """Whether the grouped GEMM can load bf16 tiles by TMA here: Hopper or newer (or the interpreter, which runs
    the same tensor-descriptor code)."""
    return INTERPRETER or hopper_or_newer()


def persistent_programs(meta: dict, swiglu: bool) -> int:
    """Grid of a persistent pointer-load launch: PERSISTENT_ROUNDS times the programs that fit at once, so that one
    program's last tile still overlaps the next program's first."""
    return PERSISTENT_ROUNDS * resident_programs(meta, swiglu)


def resident_programs(meta: dict, swiglu: bool) -> int:
    """How many programs of a config run at once on this GPU, estimated by shared memory (the pipeline's bf16 x
    and weight tiles per stage): the grid of a persistent TMA launch."""
    props = _current_props()
    smem = props.shared_memory_per_multiprocessor if props is not None else 1
    return sm_count() * max(1, smem // smem_bytes(meta, swiglu, False))


SMEM_SLACK = 1024  # bytes past the pipeline's tiles (TMA barriers and the like)


def smem_bytes(meta: dict, swiglu: bool, w_fp4: bool) -> int:
    """Shared memory one program of a grouped-GEMM config takes, estimated: ``num_stages`` x and weight tiles
    (NVFP4 weights: the packed codes; unswapped, also one bf16 tile of decoded weights on its way to the MMA). In
    Triton 3.6's sm_90 and sm_100 builds it is exact for bf16 weights and 0-30% over for NVFP4 (tests/test_compile.py;
    on the H200 it told exactly which configs of the space fail to launch, docs/PERF.md)."""
    bm, bk = meta["BLOCK_M"], meta["BLOCK_K"]
    rows = (2 if swiglu else 1) * meta["BLOCK_N"]
    total = meta.get("num_stages", 3) * (bm * bk * 2 + (rows * bk // 2 if w_fp4 else rows * bk * 2))
    if w_fp4 and not meta.get("SWAP_AB"):
        total += rows * bk * 2
    return total + SMEM_SLACK


def smem_limit() -> int | None:
    """Shared memory one program may use on the current GPU (the opt-in maximum, which Triton checks a compiled kernel
    against: 227 KB on H100/H200/B200, 99 KB on sm_89/sm_120 cards); None without one (the interpreter has none)."""
    props = _current_props()
    return None if INTERPRETER or props is None else props.shared_memory_per_block_optin


def grouped_gemm_configs() -> list[triton.Config]:
    """The whole search space; :func:`prune_grouped_gemm_configs` keeps the part fit for a shape class.

    Decode (few tokens per expert) is bound by reading weights: BLOCK_M 16-64 (mostly with swapped operands, so
    the tokens sit in the MMA's N slot), many N tiles so every SM streams weights, deep pipelines. Prefill is bound
    by the tensor cores: large tiles.
    """
    if INTERPRETER:  # one decode-style (swapped), one prefill-style config and its TMA form, blocks as large as
        return [_gemm(16, 64, 64, True, 1, 4), _gemm(32, 64, 64, False, 1, 4),  # tests allow
                _gemm(32, 64, 64, False, 1, 4, tma=True)]
    space = []
    for bm in (16, 32):  # decode, swap AB
        for bn, bk in ((64, 128), (64, 256), (128, 128), (128, 256)):
            for stages in (3, 4, 5):
                if bn * bk <= 128 * 128 or stages <= 4:
                    space.append(_gemm(bm, bn, bk, True, stages, 4))
        space.append(_gemm(bm, 64, 64, True, 3, 4))  # bf16 SwiGLU within 99 KB of shared memory (sm_89, sm_120)
        space.append(_gemm(bm, 128, 128, True, 4, 8))  # more warps to decode NVFP4 weights
    for bn, warps in ((64, 4), (128, 4), (128, 8)):  # NVFP4 weights, 33-128 tokens
        space.append(_gemm(64, bn, 128, True, 3 if bn == 128 else 4, warps))
    for bm, bn, bk, stages, warps in ((64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 3, 4),
                                      (128, 64, 64, 4, 4), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4),
                                      (128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (64, 256, 64, 4, 8)):
        space.append(_gemm(bm, bn, bk, False, stages, warps))
    for bn, stages in ((128, 4), (128, 3), (256, 3), (256, 4)):  # prefill, bf16: TMA loads, persistent grid
        space.append(_gemm(128, bn, 64, False, stages, 8, tma=True))
    return space


def sm_count() -> int:
    """Streaming multiprocessors of the current device (1 without CUDA)."""
    props = _current_props()
    return props.multi_processor_count if props is not None else 1


def prune_grouped_gemm_configs(configs, named_args, **kwargs):
    """Keep configs that suit the shape class: tiles that fit this GPU's shared memory (:func:`smem_bytes`); row
    tiles of up to twice the bucket's rows (either operand order at decode buckets, not swapped above them but for
    NVFP4 weights); tiles no wider than the problem; enough programs to fill the SMs when that is possible.

    Why twice: routed tokens spread over the experts (a mean of m per expert reaches about m + 3 sqrt(m)), and a
    row tile short of an expert's count makes a second pass over that expert's weights. On the H200, DeepSeek-V3 at
    32 routed tokens per expert: 976 us with 16-row tiles, 703 with 64-row ones (docs/PERF.md)."""
    m = int(named_args["M_BUCKET"])
    n, k = int(named_args["N"]), int(named_args["K"])
    groups = int(named_args["G"])
    decode = m <= DECODE_MAX_M
    swiglu = bool(kwargs.get("SWIGLU", named_args.get("SWIGLU", False)))
    w_fp4 = bool(kwargs.get("W_FP4", named_args.get("W_FP4", False)))
    right_kind = []  # operand order fit for the shape, before the size filters
    keep = []
    tma_ok = named_args.get("x_desc") is not None or bool(named_args.get("TMA_OK"))
    limit = smem_limit()
    for c in configs:
        kw = c.kwargs
        if kw.get("TMA") and not tma_ok:
            continue
        if limit is not None and smem_bytes(config_dict(c), swiglu, w_fp4) > limit:
            continue  # would not build here: the first-config fallback (MOE_EP_AUTOTUNE=off) must always run
        bm = kw["BLOCK_M"]
        if kw["SWAP_AB"] and not decode:
            fits = w_fp4 and m <= FP4_SWAP_MAX_M and bm == 64
        else:
            fits = bm <= max(2 * m, 16)
        if not fits:
            continue
        right_kind.append(c)
        if swiglu and not kw["SWAP_AB"] and kw["BLOCK_M"] * kw["BLOCK_N"] > 128 * 128 and not INTERPRETER:
            continue  # gate and up accumulators: twice the registers
        too_wide = kw["BLOCK_N"] > max(triton.next_power_of_2(n), 16) or kw["BLOCK_K"] > max(
            triton.next_power_of_2(k), 32)
        if too_wide and not INTERPRETER:
            continue
        keep.append(c)
    if not keep:  # every tile too wide for a tiny shape: the smallest one of the right operand order
        keep = sorted(right_kind, key=lambda c: (c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"], c.kwargs["BLOCK_M"]))[:1]
    if os.environ.get(QUICK_ENV) and len(keep) > 3:  # bounded search (benchmarks' --quick)
        keep = keep[:2] + keep[-1:]
    if not INTERPRETER and len(keep) > 1:
        full = [c for c in keep if groups * triton.cdiv(m, c.kwargs["BLOCK_M"]) * triton.cdiv(n, c.kwargs["BLOCK_N"])
                >= sm_count()]
        keep = full or keep
    if not keep:  # nothing of the right order fits: the space is broken (or the GPU tiny), not the shape
        raise MoEEpConfigError(f"no grouped-GEMM config for m={m} n={n} k={k} (decode {decode}) fits {limit} bytes "
                               "of shared memory; allowed: a space with both operand orders and tiles that fit")
    return keep


def search_off() -> bool:
    """True when ``MOE_EP_AUTOTUNE=off``: autotuned kernels run their first config (:func:`launch`), and GEMM
    shapes without a tuned config :func:`first_gemm_config`."""
    return os.environ.get(SEARCH_ENV, "").lower() == "off"


def decoded_min_m() -> float:
    """Tokens per expert from which the grouped GEMM decodes NVFP4 weights into bf16 copies before multiplying:
    ``$MOE_EP_DECODED_MIN_M`` (a positive integer, or "off": never, for a tight memory budget, since the copies are
    as large as bf16 weights), else :data:`DECODED_MIN_M`. (NVFP4 x is decoded at every size: it is small.)"""
    text = os.environ.get(DECODED_ENV, "").strip().lower()
    if not text:
        return DECODED_MIN_M
    if text == "off":
        return math.inf
    if not text.isdigit() or int(text) < 1:
        raise MoEEpConfigError(f"{DECODED_ENV} = {text!r}; allowed: a positive integer (tokens per expert) or off")
    return int(text)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` for a ``triton.autotune`` kernel; under ``MOE_EP_AUTOTUNE=off`` its first
    config instead, untimed (a fuzz run meets hundreds of new keys; timing every config of each dominated it)."""
    if not search_off():
        return kernel[grid](*args, **kwargs)
    cfg = kernel.configs[0]
    return kernel.fn[grid(cfg.kwargs) if callable(grid) else grid](*args, **kwargs, **cfg.all_kwargs())


def config_dict(cfg: triton.Config) -> dict:
    """A grouped-GEMM ``triton.Config`` as the tuned-config file stores it."""
    kw = cfg.kwargs
    return {"BLOCK_M": int(kw["BLOCK_M"]), "BLOCK_N": int(kw["BLOCK_N"]), "BLOCK_K": int(kw["BLOCK_K"]),
            "SWAP_AB": bool(kw["SWAP_AB"]), "GROUP_M": int(kw.get("GROUP_M", 8)), "TMA": bool(kw.get("TMA", False)),
            "num_warps": int(cfg.num_warps), "num_stages": int(cfg.num_stages)}


@lru_cache(maxsize=None)
def first_gemm_config(n: int, k: int, m: int, groups: int, w_fp4: bool, swiglu: bool) -> dict:
    """The first config of the space that suits the shape, unbenchmarked: a fuzz run meets thousands of shapes,
    and timing every config of each would cost far more than the checks themselves."""
    return config_dict(prune_grouped_gemm_configs(grouped_gemm_configs(), {"M_BUCKET": m_bucket(m), "N": n, "K": k,
                                                                         "G": groups}, SWIGLU=swiglu, W_FP4=w_fp4)[0])


def shape_class(n: int, k: int, w_fp4: bool, swiglu: bool) -> str:
    """The tuned-config file key of a GEMM shape (tokens-per-expert bucket is the inner key). x is always bf16 in the
    GEMM (NVFP4 x is decoded to a bf16 copy first); the key still names it, as the files always have."""
    return f"n{n}_k{k}_xbf16_w{'nvfp4' if w_fp4 else 'bf16'}{'_swiglu' if swiglu else ''}"


def device_name() -> str:
    """File-name form of the current device's name, e.g. ``NVIDIA_H200`` (``cpu`` without CUDA)."""
    props = _current_props()
    return _file_name(props.name if props is not None else "cpu")


@lru_cache(maxsize=None)
def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip())


def config_dirs() -> list[str]:
    """Folders searched for tuned configs: ``$MOE_EP_CONFIG_DIR`` first, then the shipped ``configs/``."""
    dirs = []
    if os.environ.get(CONFIG_DIR_ENV):
        dirs.append(os.environ[CONFIG_DIR_ENV])
    dirs.append(os.path.join(os.path.dirname(__file__), "configs"))
    return dirs


def load_config_file(path: str) -> dict:
    """A tuned-config file as a dict ({} when absent); a malformed one raises MoEEpConfigError."""
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


@lru_cache(maxsize=None)
def _load_file(path: str, mtime: float) -> dict:
    return load_config_file(path)  # cached per modification time: re-read when tune rewrites it


def _validate(cfg, where: str) -> dict:
    need = set(GEMM_PARAMS) | {"num_warps", "num_stages"}
    if not isinstance(cfg, dict) or not need <= set(cfg):
        raise MoEEpConfigError(f"{where} = {cfg!r}; allowed: an object with keys {sorted(need)}")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if not (isinstance(v, int) and v >= 16 and v & (v - 1) == 0):
            raise MoEEpConfigError(f"{where}.{key} = {v!r}; allowed: a power of two >= 16")
    if cfg["BLOCK_K"] < 32:
        raise MoEEpConfigError(f"{where}.BLOCK_K = {cfg['BLOCK_K']}; allowed: >= 32")
    if not isinstance(cfg.get("TMA", False), bool):
        raise MoEEpConfigError(f"{where}.TMA = {cfg['TMA']!r}; allowed: true or false (optional)")
    return {**{k: cfg[k] for k in GEMM_PARAMS}, "SWAP_AB": bool(cfg["SWAP_AB"]), "TMA": cfg.get("TMA", False),
            "num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}


def tuned_gemm_config(n: int, k: int, m: int, w_fp4: bool, swiglu: bool) -> dict | None:
    """The tuned config for this shape from ``<dir>/<device_name>.json``, or None (then autotune).

    File format (vLLM style): ``{shape_class: {"<tokens-per-expert bucket>": {BLOCK_M, BLOCK_N, BLOCK_K,
    SWAP_AB, GROUP_M, num_warps, num_stages[, TMA]}}}``; the nearest bucket present is used, nearest by ratio
    (with buckets 16 and 1024, 256 tokens per expert take the 1024 config, not the 16-token decode one).
    TMA (optional, default false): bf16 tiles loaded by tensor descriptors on a persistent grid; where TMA cannot
    run (NVFP4 weights, the masked layout, decode buckets, a GPU older than Hopper) the same tiles go through
    pointer loads.
    """
    key, want = shape_class(n, k, w_fp4, swiglu), m_bucket(m)
    for d in config_dirs():
        path = os.path.join(d, device_name() + ".json")
        try:
            mtime = os.stat(path).st_mtime  # one stat per call: an edited file (moe-ep tune) is picked up
        except OSError:
            continue
        cfg = _lookup(path, mtime, key, want)
        if cfg is not None:
            return cfg
    return None


@lru_cache(maxsize=4096)
def _lookup(path: str, mtime: float, key: str, want: int) -> dict | None:
    """The validated config of ``key`` nearest to bucket ``want`` in one file version (callers copy it)."""
    by_m = _load_file(path, mtime).get(key)
    if not by_m:
        return None
    if not isinstance(by_m, dict):
        raise MoEEpConfigError(f"{path}[{key!r}] = {by_m!r}; allowed: {{bucket: config}}")
    try:
        buckets = {int(b): c for b, c in by_m.items()}
    except ValueError as e:
        raise MoEEpConfigError(f"{path}[{key!r}] keys = {list(by_m)}; allowed: integers") from e
    best = min(buckets, key=lambda b: (abs(math.log2(max(b, 1) / want)), b))
    return _validate(buckets[best], f"{path}[{key!r}][{best}]")
