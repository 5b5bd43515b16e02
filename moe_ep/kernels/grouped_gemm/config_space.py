"""The grouped GEMM's tile configs: the search space, its prune per shape class, the shared-memory estimate a config
is pruned (and a tuned file checked) by, and the shape classes configs are keyed on."""

from __future__ import annotations

from functools import lru_cache

import triton

from ... import device_facts, options
from ...errors import MoEEpConfigError
from ...triton_runtime import INTERPRETER
from .. import host_math, launch_cache

GEMM_PARAMS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "GROUP_M")
CONFIG_KEYS = (*GEMM_PARAMS, "TMA", "num_warps", "num_stages")  # a config as the tuned-config file stores it
DECODE_MAX_M = 32  # tokens per expert up to this are "decode": weight-streaming tiles (see prune_grouped_gemm_configs)
PERSISTENT_ROUNDS = 8  # persistent pointer-load grids (masked layouts): this many times the programs that fit at once
DECODED_MIN_M = options.DEFAULT_DECODED_MIN_M  # from this bucket on NVFP4 weights are decoded to bf16 copies first
FP4_SWAP_MAX_M = 128  # NVFP4 weights may stay swapped up to here: decoded straight into wgmma's register operand
SMEM_SLACK = 1024  # bytes past the pipeline's tiles (TMA barriers and the like)


def m_bucket(m: int) -> int:
    """Tokens-per-expert bucket (a power of two >= 8): the M part of the autotune key and shape class."""
    return max(8, host_math.next_power_of_2(max(int(m), 1)))


def shape_class(n: int, k: int, w_fp4: bool, swiglu: bool, fp8: bool = False, fp8_out: bool = False,
                sm100_fp4: bool = False) -> str:
    """The tuned-config file key of a GEMM shape (tokens-per-expert bucket is the inner key). x is bf16 in the GEMM
    but for FP8 (NVFP4 x is decoded to a bf16 copy first); the key still names it, as the files always have. FP8
    (both operands) and an FP8 output have keys of their own: their tiles are not bf16's. ``sm100_fp4``: the W4A4
    kernel of sm_100 GPUs (``sm100_fp4.py``, NVFP4 x and w on the FP4 MMA), ``n{N}_k{K}_xnvfp4_wnvfp4[_swiglu]``,
    whose entries are that kernel's configs (``sm100_fp4.CONFIG_KEYS``)."""
    if sm100_fp4:
        return f"n{n}_k{k}_xnvfp4_wnvfp4{'_swiglu' if swiglu else ''}"
    if fp8:
        return f"n{n}_k{k}_xfp8_wfp8{'_swiglu' if swiglu else ''}{'_outfp8' if fp8_out else ''}"
    return f"n{n}_k{k}_xbf16_w{'nvfp4' if w_fp4 else 'bf16'}{'_swiglu' if swiglu else ''}"


FP8_BLOCK_K = (32, 64, 128)  # FP8: a K step lies in one 128-wide scale block; e4m3 wgmma takes K >= 32


def fp8_rule_broken(cfg: dict, fp8_out: bool) -> str | None:
    """What an FP8 GEMM's config breaks (None: nothing): BLOCK_K in :data:`FP8_BLOCK_K`; with an FP8 output, BLOCK_N
    a multiple of 128 (a tile quantizes whole 128-column blocks)."""
    if cfg["BLOCK_K"] not in FP8_BLOCK_K:
        return f"BLOCK_K = {cfg['BLOCK_K']}; allowed with FP8 operands: {', '.join(map(str, FP8_BLOCK_K))}"
    if fp8_out and cfg["BLOCK_N"] % 128:
        return f"BLOCK_N = {cfg['BLOCK_N']}; allowed with an FP8 output: a multiple of 128"
    return None


FP8_ACC_REGISTERS = 128  # most fp32 registers per thread an FP8 config's two accumulators may take (see below)


def fp8_accumulator_registers(cfg: dict, swiglu: bool) -> int:
    """fp32 registers per thread of an FP8 tile's accumulators: the running sum and the K step's product it is
    promoted from (both ``BLOCK_M x R``, R = 2 * BLOCK_N with SwiGLU's gate and up rows; half that for tiles computed
    in two halves, :func:`fp8_split_halves`)."""
    rows = (2 if swiglu else 1) * cfg["BLOCK_N"] // (2 if fp8_split_halves(cfg, swiglu) else 1)
    return 2 * cfg["BLOCK_M"] * rows // (32 * cfg["num_warps"])


def fp8_registers_ok(cfg: dict, swiglu: bool) -> bool:
    """Whether an FP8 config's accumulators leave ptxas room (255 registers a thread) for the pipeline's addresses,
    scales and epilogue: past :data:`FP8_ACC_REGISTERS` they spill (benchmarks/fp8_registers.py prints them)."""
    return fp8_accumulator_registers(cfg, swiglu) <= FP8_ACC_REGISTERS


def decoded_min_m() -> float:
    """Tokens per expert from which NVFP4 weights are decoded into bf16 copies before multiplying (the
    ``decoded_min_m`` option; inf when off, for a tight memory budget: the copies are as large as bf16 weights).
    NVFP4 x is decoded at every size: it is small."""
    m = options.current().decoded_min_m
    return float("inf") if m is None else m


def _gemm(bm, bn, bk, swap, stages, warps, group_m=8, tma=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SWAP_AB": swap, "GROUP_M": group_m,
                          "TMA": tma}, num_warps=warps, num_stages=stages, pre_hook=set_tma_blocks if tma else None)


def fp8_split_halves(meta: dict, swiglu: bool) -> bool:
    """Whether an FP8 config computes its tile's columns as two halves one after the other: SwiGLU TMA tiles of 128
    rows (gate, up and one product of a half live at a time: what a 64-row tile holds; kernels.py)."""
    return bool(meta.get("TMA")) and swiglu and meta["BLOCK_M"] == 128


def tma_blocks(cfg: dict, fp8: bool, swiglu: bool) -> tuple:
    """The TMA boxes of a config's tiles: x ``(BLOCK_M, BLOCK_K)``, w ``(BLOCK_N, BLOCK_K)``, w's half that for
    FP8's split tiles (:func:`fp8_split_halves`)."""
    half = fp8 and fp8_split_halves(cfg, swiglu)
    return (cfg["BLOCK_M"], cfg["BLOCK_K"]), (cfg["BLOCK_N"] // (2 if half else 1), cfg["BLOCK_K"])


@launch_cache.sets_descriptor_boxes
def set_tma_blocks(nargs) -> None:
    """Give the grouped GEMM's TMA descriptors the boxes of the config about to run (:func:`tma_blocks`); a config's
    pre-hook (nargs: the launch's arguments, its flags among them)."""
    x_box, w_box = tma_blocks(nargs, bool(nargs.get("FP8")), bool(nargs.get("SWIGLU")))
    nargs["x_desc"].block_shape, nargs["w_desc"].block_shape = list(x_box), list(w_box)


def config_dict(cfg: triton.Config) -> dict:
    """A grouped-GEMM ``triton.Config`` as the tuned-config file stores it."""
    kw = cfg.kwargs
    return {"BLOCK_M": int(kw["BLOCK_M"]), "BLOCK_N": int(kw["BLOCK_N"]), "BLOCK_K": int(kw["BLOCK_K"]),
            "SWAP_AB": bool(kw["SWAP_AB"]), "GROUP_M": int(kw.get("GROUP_M", 8)), "TMA": bool(kw.get("TMA", False)),
            "num_warps": int(cfg.num_warps), "num_stages": int(cfg.num_stages)}


def smem_bytes(meta: dict, swiglu: bool, w_fp4: bool, fp8: bool = False) -> int:
    """Shared memory one program of a grouped-GEMM config takes, estimated: ``num_stages`` x and weight tiles
    (NVFP4 weights: the packed codes; unswapped, also one bf16 tile of decoded weights on its way to the MMA; FP8:
    one byte an element). For bf16 weights it matches Triton's sm_90 and sm_100 builds exactly and for NVFP4 it is a
    little over (tests/test_compile.py holds it between the two; how it did on a GPU: docs/PERF.md)."""
    bm, bk = meta["BLOCK_M"], meta["BLOCK_K"]
    rows = (2 if swiglu else 1) * meta["BLOCK_N"]
    if fp8:  # e4m3 tiles (a half's gate and up rows where computed in halves); wide tiles' epilogue layout
        # conversions (and sm_100's barriers) take up to two slacks more
        rows = meta["BLOCK_N"] if fp8_split_halves(meta, swiglu) else rows
        return meta.get("num_stages", 3) * (bm + rows) * bk + 3 * SMEM_SLACK
    total = meta.get("num_stages", 3) * (bm * bk * 2 + (rows * bk // 2 if w_fp4 else rows * bk * 2))
    if w_fp4 and not meta.get("SWAP_AB"):
        total += rows * bk * 2
    return total + SMEM_SLACK


def resident_programs(meta: dict, swiglu: bool) -> int:
    """How many programs of a config run at once on this GPU, estimated by shared memory (the pipeline's x and
    weight tiles per stage: bf16, or e4m3 where ``meta["FP8"]``): the grid of a persistent TMA launch."""
    return device_facts.sm_count() * max(1, device_facts.smem_per_sm() // smem_bytes(meta, swiglu, False,
                                                                                    bool(meta.get("FP8"))))


def persistent_programs(meta: dict, swiglu: bool) -> int:
    """Grid of a persistent pointer-load launch: PERSISTENT_ROUNDS times the programs that fit at once, so that one
    program's last tile still overlaps the next program's first."""
    return PERSISTENT_ROUNDS * resident_programs(meta, swiglu)


def grouped_gemm_configs() -> list[triton.Config]:
    """The whole search space; :func:`prune_grouped_gemm_configs` keeps the part fit for a shape class.

    Decode (few tokens per expert) is bound by reading weights: BLOCK_M 16-64 (mostly with swapped operands, so
    the tokens sit in the MMA's N slot), many N tiles so every SM streams weights, deep pipelines. Prefill is bound
    by the tensor cores: large tiles.
    """
    if INTERPRETER:  # one decode-style (swapped), one prefill-style config and its TMA form, blocks as large as
        return [_gemm(16, 64, 64, True, 1, 4), _gemm(32, 64, 64, False, 1, 4),  # tests allow; then FP8's
                _gemm(32, 64, 64, False, 1, 4, tma=True)] + fp8_only_configs()
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
    return space + fp8_only_configs()


def fp8_only_configs() -> list[triton.Config]:
    """Configs for FP8 shape classes only (the prune keeps them from the others, whose searches and first configs stay
    as they were): one byte an element leaves room for deeper pipelines at BLOCK_K 128, and an FP8-output GEMM1 needs
    whole 128-column blocks. FP8 also takes the shared space's configs that obey :func:`fp8_rule_broken`."""
    if INTERPRETER:  # swapped with whole blocks (decode, FP8 out); unswapped K steps of 32 (4 per scale block)
        return [_gemm(16, 128, 64, True, 1, 4), _gemm(32, 128, 32, False, 1, 4)]
    space = [_gemm(bm, 128, 128, True, stages, 4) for bm in (16, 32) for stages in (5, 6)]  # decode, swap AB
    space += [_gemm(64, 128, 128, True, 4, 4)]  # 33-128 tokens, FP8 out
    for bm, bn, stages, warps in ((64, 128, 4, 4), (128, 128, 5, 8), (128, 128, 6, 8), (128, 256, 3, 8)):  # prefill
        space.append(_gemm(bm, bn, 128, False, stages, warps))
    space.append(_gemm(128, 128, 128, False, 5, 8, tma=True))
    # prefill within fp8_registers_ok, last (the bounded search times an FP8 prefill class's last three): GEMM1's
    # 64 x (gate + up 256) over two warpgroups side by side (pointer loads, and TMA: both operands from shared
    # memory); GEMM2's 64 x 256 the same way, and its 128 x 128 over two warpgroups one above the other (64 rows
    # each: one's promotion overlaps the other's MMA, and a weight tile serves 128 rows), by pointers and by TMA
    # (GEMM1 takes the TMA one too, in two halves of 64 columns: fp8_split_halves)
    space += [_gemm(64, 128, 128, False, stages, 8) for stages in (4, 5)] + [_gemm(64, 128, 128, False, 4, 8, tma=True)]
    space += [_gemm(64, 256, 128, False, 4, 8), _gemm(128, 128, 128, False, 4, 8),
              _gemm(128, 128, 128, False, 4, 8, tma=True)]
    return space


def _config_key(c: triton.Config) -> tuple:
    return tuple(sorted(config_dict(c).items()))


@lru_cache(maxsize=1)
def _fp8_only_keys(interpreter: bool) -> frozenset:
    return frozenset(_config_key(c) for c in fp8_only_configs())


def prune_grouped_gemm_configs(configs, named_args, **kwargs):
    """Keep configs that suit the shape class: tiles that fit this GPU's shared memory (:func:`smem_bytes`); row
    tiles of up to twice the bucket's rows (either operand order at decode buckets, not swapped above them but for
    NVFP4 weights); tiles no wider than the problem; enough programs to fill the SMs when that is possible.

    Why twice: routed tokens spread over the experts (a mean of m per expert reaches about m + 3 sqrt(m)), and a
    row tile short of an expert's count makes a second pass over that expert's weights (measured: docs/PERF.md)."""
    m = int(named_args["M_BUCKET"])
    n, k = int(named_args["N"]), int(named_args["K"])
    groups = int(named_args["G"])
    decode = m <= DECODE_MAX_M
    swiglu = bool(kwargs.get("SWIGLU", named_args.get("SWIGLU", False)))
    w_fp4 = bool(kwargs.get("W_FP4", named_args.get("W_FP4", False)))
    fp8 = bool(kwargs.get("FP8", named_args.get("FP8", False)))
    fp8_out = bool(kwargs.get("FP8_OUT", named_args.get("FP8_OUT", False)))
    fp8_only = _fp8_only_keys(INTERPRETER)
    right_kind = []  # operand order fit for the shape, before the size filters
    keep = []
    tma_ok = named_args.get("x_desc") is not None or bool(named_args.get("TMA_OK"))
    limit = device_facts.smem_limit()
    for c in configs:
        kw = c.kwargs
        if kw.get("TMA") and not tma_ok:
            continue
        if fp8 and fp8_rule_broken(kw, fp8_out) or not fp8 and _config_key(c) in fp8_only:
            continue
        if limit is not None and smem_bytes(config_dict(c), swiglu, w_fp4, fp8) > limit:
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
        if fp8 and not fp8_registers_ok(config_dict(c), swiglu):
            continue  # the promoted K step's product: a second accumulator, and ptxas spills both
        too_wide = kw["BLOCK_N"] > max(host_math.next_power_of_2(n), 16) or kw["BLOCK_K"] > max(
            host_math.next_power_of_2(k), 32)
        if too_wide and not INTERPRETER:
            continue
        keep.append(c)
    if not keep:  # every tile too wide for a tiny shape: the smallest one of the right operand order
        keep = sorted(right_kind, key=lambda c: (c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"], c.kwargs["BLOCK_M"]))[:1]
    if options.current().autotune_quick and len(keep) > 3:  # bounded search (benchmarks' --quick); FP8 prefill:
        keep = keep[-3:] if fp8 and not decode else keep[:2] + keep[-1:]  # its own configs, the space's last
    if not INTERPRETER and len(keep) > 1:
        full = [c for c in keep
                if groups * host_math.cdiv(m, c.kwargs["BLOCK_M"]) * host_math.cdiv(n, c.kwargs["BLOCK_N"])
                >= device_facts.sm_count()]
        keep = full or keep
    if not keep:  # nothing of the right order fits: the space is broken (or the GPU tiny), not the shape
        raise MoEEpConfigError(f"no grouped-GEMM config for m={m} n={n} k={k} (decode {decode}) fits {limit} bytes "
                               "of shared memory; allowed: a space with both operand orders and tiles that fit")
    return keep


def first_gemm_config(n: int, k: int, m: int, groups: int, w_fp4: bool, swiglu: bool, fp8: bool = False,
                      fp8_out: bool = False) -> dict:
    """The first config of the space that suits the shape, unbenchmarked: a fuzz run meets thousands of shapes,
    and timing every config of each would cost far more than the checks themselves. (A copy: callers may edit it.)"""
    return dict(_first_gemm_config(n, k, m_bucket(m), groups, w_fp4, swiglu, fp8, fp8_out,
                                   options.current().autotune_quick, device_facts.smem_limit(),
                                   device_facts.sm_count(), INTERPRETER))


@lru_cache(maxsize=1024)
def _first_gemm_config(n, k, bucket, groups, w_fp4, swiglu, fp8, fp8_out, quick, smem_limit, sm_count,
                       interpreter) -> dict:
    """Keyed by everything the prune reads (the bucket, not the raw m: bounded by the shape classes met)."""
    return config_dict(prune_grouped_gemm_configs(grouped_gemm_configs(), {"M_BUCKET": bucket, "N": n, "K": k,
                                                                         "G": groups}, SWIGLU=swiglu, W_FP4=w_fp4,
                                                  FP8=fp8, FP8_OUT=fp8_out)[0])
