"""A grouped-GEMM call's decisions as one value, :class:`GemmPlan`: operand formats, the decoded copies, the tile
config and where it came from, TMA, the grid, and the call's part in the expert MLP's GEMM1 -> GEMM2 chain.

:func:`decide` makes it from the call's sizes and formats (no tensor is read: no host sync); the launcher launches
exactly what it says. Before an autotuned launch its ``config`` is None (the autotuner picks at launch);
:func:`autotuned` fills in the pick after it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from ... import device_facts, options
from . import config_space, schedule, sm100_fp4, tuned_files
from .config_space import DECODE_MAX_M, m_bucket

CONFIG_SOURCES = ("tuned-file", "first-config", "autotune", "forced", "no-launch", "variant")
CHAIN_ROLES = ("none", "counts", "waits")
PATHS = ("tl", "sm100-fp4", "gluon-fp8", "gluon-nvfp4")


@dataclass(frozen=True)
class GemmPlan:
    """Every decision of one :func:`~moe_ep.kernels.grouped_gemm` call.

    - ``layout``: "masked" or "ragged"; ``sizes``: ``(G, N, K, M_max, S)`` (N: output columns; M_max 0 when ragged;
      S: rows of x, ``G * M_max`` when masked); ``m_bucket``: the tokens-per-expert bucket configs are keyed on.
    - ``x_format``, ``w_format``: "bf16", "nvfp4" or "fp8" (FP8 goes with FP8 only); ``x_decoded``, ``w_decoded``:
      whether that NVFP4 operand is decoded to a transient bf16 copy before the GEMM (``decoded`` is the pair);
      ``out_format``: "fp8" where the epilogue quantizes (GEMM1 of an FP8 expert MLP), else the output tensor's
      dtype, "bf16" or (for tests of the fp32 epilogue) "fp32".
    - ``swiglu``, ``row_scale``: the epilogues.
    - ``config``: the tile config launched (``BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, GROUP_M, TMA, num_warps,
      num_stages``), None before an autotuned launch and when nothing is launched; ``config_source``: "tuned-file"
      (``config_file`` names it), "first-config" (``MOE_EP_AUTOTUNE=off``, untimed), "autotune", "forced" (the
      caller's ``config=``) or "no-launch" (no rows).
    - ``tma_possible``: TMA tiles may run here (ragged, bf16 tiles, a prefill bucket, Hopper or newer); ``tma``:
      the launched config loads by TMA (None until an autotuned launch); ``persistent``: the grid walks the tiles
      (TMA configs, or a masked layout with a large row capacity); ``grid``: the programs launched.
    - ``chain``: "none", "counts" (GEMM1 of a chained expert MLP: counts its finished tiles per expert) or "waits"
      (GEMM2: waits per expert); ``pdl``: launched as / allowing a programmatic dependent launch.
    - ``path``: the kernel that runs (:data:`PATHS`): "tl" (``kernels.py``), "sm100-fp4" (``sm100_fp4.py``: NVFP4 x
      and w on the block-scaled FP4 tensor cores of a compute capability 10.x GPU, where ``sm100_fp4.available``; no
      decoded copies, its own config space and tuned-file keys: ``config_source`` "forced", "tuned-file" or
      "first-config", and a forced ``config`` must be one of ``sm100_fp4.configs_for``, MoEEpConfigError otherwise)
      or "gluon-fp8" (``gluon_fp8.py``: a ragged FP8 call from ``MOE_EP_GLUON_FP8_MIN_M`` tokens per expert on, on an
      sm_90 GPU where ``gluon_fp8.dispatchable``, without a forced config; GEMM2's form with a bf16 output, or GEMM1's
      with SwiGLU and an FP8 output; at most ``gluon_fp8.MAX_EXPERTS`` experts. ``config`` is ``{"VARIANT": name,
      "BLOCK_M": .., "BLOCK_N": ..}`` of the kernel's default variant, ``config_source`` "variant", ``grid`` the
      persistent programs, one per SM; ``tma`` and ``persistent`` True), or "gluon-nvfp4" (``gluon_nvfp4_prefill.py``:
      a call of NVFP4 weights with a bf16 output from ``MOE_EP_GLUON_NVFP4_MIN_M`` tokens per expert on, where
      ``gluon_nvfp4_prefill.dispatchable`` (of its layout: ragged, or masked) and ``takes`` the sizes, without a
      forced config; both forms; the weights never decoded to a copy, NVFP4 x decoded as for the tl kernel.
      ``config`` is ``{"BLOCK_T": .., "BLOCK_N": ..}``, the token tile of the bucket and the tile's output columns;
      the rest as for "gluon-fp8").
    """
    layout: str
    sizes: tuple
    m_bucket: int
    x_format: str
    w_format: str
    x_decoded: bool
    w_decoded: bool
    swiglu: bool
    row_scale: bool
    config: dict | None
    config_source: str
    config_file: str | None
    tma_possible: bool
    tma: bool | None
    persistent: bool | None
    grid: int | None
    chain: str = "none"
    pdl: bool = False
    out_format: str = "bf16"
    path: str = "tl"

    @property
    def decoded(self) -> tuple[bool, bool]:
        return self.x_decoded, self.w_decoded

    @property
    def ragged(self) -> bool:
        return self.layout == "ragged"


def environment() -> tuple:
    """What a plan depends on besides the call: (the options, the tuned files' versions, the device's
    ``device_facts.plan_key``). One value for several calls made together (the expert MLP's two GEMMs)."""
    return options.current(), tuned_files.file_versions(), device_facts.plan_key()


def decide(*, ragged: bool, x_fp4: bool, w_fp4: bool, swiglu: bool, row_scale: bool, G: int, N: int, K: int,
           M_max: int, S: int, m: int, chain: str = "none", pdl: bool = False, config: dict | None = None,
           fp8: bool = False, fp8_out: bool = False, out_fp32: bool = False, env: tuple | None = None) -> GemmPlan:
    """The plan of a call with these sizes and formats (``m``: tokens per expert the config is chosen for).
    ``config``: a forced tile config (checked against the tuned-file schema, the FP8 rules where ``fp8`` / ``fp8_out``
    and this GPU's shared memory; on the sm_100 W4A4 path, NVFP4 x and w where ``sm100_fp4.available()``, it must be
    an sm100_fp4 config instead: ``tuned_files.validate_sm100``, MoEEpConfigError otherwise). ``fp8``: x and w are
    FP8; ``fp8_out``: the epilogue quantizes to FP8; ``out_fp32``: the output tensor is float32.

    Plans without a forced config are cached, keyed by every input: these arguments, the options, the tuned
    files' versions and the device (a plan is a pure function of them; the cache is bounded). ``env``:
    :func:`environment`, when the caller has it already."""
    fmt = ("fp8" if fp8 else "nvfp4" if x_fp4 else "bf16", "fp8" if fp8 else "nvfp4" if w_fp4 else "bf16",
           "fp8" if fp8_out else "fp32" if out_fp32 else "bf16")
    if config is not None:
        return _decide(ragged, fmt, swiglu, row_scale, G, N, K, M_max, S, m, chain, pdl, config, options.current())
    opts, versions, device = env if env is not None else environment()
    return _cached_decide(ragged, fmt, swiglu, row_scale, G, N, K, M_max, S, m, chain, pdl, opts, versions, device)


def clear_cache() -> None:
    """Forget the cached plans and the tuned files' last stat (for tests that change the rules a plan is made by, or
    rewrite a tuned file)."""
    _cached_decide.cache_clear()
    tuned_files.invalidate()


@lru_cache(maxsize=4096)
def _cached_decide(ragged, fmt, swiglu, row_scale, G, N, K, M_max, S, m, chain, pdl, opts, versions, device):
    return _decide(ragged, fmt, swiglu, row_scale, G, N, K, M_max, S, m, chain, pdl, None, opts)


def _decide(ragged, fmt, swiglu, row_scale, G, N, K, M_max, S, m, chain, pdl, config, opts) -> GemmPlan:
    """``fmt``: (x, w, out) formats."""
    x_format, w_format, out_format = fmt
    x_fp4, w_fp4 = x_format == "nvfp4", w_format == "nvfp4"
    fp8, fp8_out = w_format == "fp8", out_format == "fp8"
    bucket = m_bucket(m)
    x_dec = x_fp4  # NVFP4 x: always decoded once (it is small, and every column tile reads it)
    w_dec = w_fp4 and bucket >= (opts.decoded_min_m or float("inf"))
    w_tiles_fp4 = w_fp4 and not w_dec
    # TMA: ragged prefill shapes with bf16 or FP8 tiles, on a GPU with the tensor memory accelerator (the masked
    # layout's boxes would read an expert's padding rows, which that layout never touches)
    tma_possible = ragged and not w_tiles_fp4 and bucket > DECODE_MAX_M and device_facts.tma_supported()
    base = dict(layout="ragged" if ragged else "masked", sizes=(G, N, K, M_max, S), m_bucket=bucket,
                x_format=x_format, w_format=w_format, x_decoded=x_dec, w_decoded=w_dec, swiglu=swiglu,
                row_scale=row_scale, tma_possible=tma_possible, chain=chain, pdl=pdl, out_format=out_format)
    if S == 0:
        return GemmPlan(**dict(base, chain="none", pdl=False), config=None, config_source="no-launch",
                        config_file=None, tma=False, persistent=False, grid=0)
    if config is None and fp8 and ragged and out_format != "fp32" and swiglu == fp8_out and \
            gluon_fp8_takes(bucket, G, opts):
        return _gluon_fp8_plan(base)
    if config is None and w_fp4 and out_format == "bf16" and \
            gluon_nvfp4_takes(bucket, G, N, K, swiglu, opts, masked=not ragged):
        return _gluon_nvfp4_plan(base)
    if x_fp4 and w_fp4 and sm100_fp4.available():  # W4A4 on Blackwell: native FP4 MMAs
        cfg, source, path = _sm100_config(N, K, m, swiglu, config)
        grid = schedule.tile_slots(ragged, G, M_max, S, N, cfg["BLOCK_M"], cfg["BLOCK_N"])
        return GemmPlan(**dict(base, x_decoded=False, w_decoded=False, tma_possible=False), config=cfg,
                        config_source=source, config_file=path, tma=False, persistent=False, grid=grid,
                        path="sm100-fp4")
    if config is not None:
        cfg, source, path = tuned_files.validate(config, "config", swiglu, w_tiles_fp4, device_facts.smem_limit(),
                                                 fp8=fp8, fp8_out=fp8_out), "forced", None
    else:
        cfg, source, path = _choose_config(N, K, bucket, G, w_tiles_fp4, swiglu, fp8, fp8_out, opts,
                                           tuned_files.file_versions(), device_facts.smem_limit(),
                                           device_facts.sm_count())
    if cfg is None:  # the autotuner picks at launch; a chained GEMM2 follows a searched GEMM1 by a plain launch
        return GemmPlan(**dict(base, pdl=False), config=None, config_source="autotune", config_file=None, tma=None,
                        persistent=None, grid=None)
    cfg = dict(cfg)
    if cfg["TMA"] and (not tma_possible or cfg["SWAP_AB"]):  # a TMA config where TMA cannot run: the same tiles
        cfg["TMA"] = False  # through pointer loads
    return _with_config(GemmPlan(**base, config=None, config_source=source, config_file=path, tma=None,
                                 persistent=None, grid=None), cfg)


def gluon_fp8_takes(bucket: int, G: int, opts: options.Options | None = None) -> bool:
    """Whether a ragged FP8 call of ``bucket`` tokens per expert (``config_space.m_bucket``) over ``G`` experts, in a
    form the Gluon kernels have (GEMM2's with a bf16 out, GEMM1's with SwiGLU and an FP8 out) and with no forced
    config, runs them here: from ``MOE_EP_GLUON_FP8_MIN_M`` on (``opts``: the options, None: the current ones),
    where ``gluon_fp8.dispatchable()``, for at most ``gluon_fp8.MAX_EXPERTS`` experts. ``moe-ep tune`` asks it too:
    the tl kernel's configs for such a bucket would never be read."""
    if bucket < ((opts or options.current()).gluon_fp8_min_m or float("inf")):
        return False
    from . import gluon_fp8  # (here: Gluon is imported only where a call may take it)
    return G <= gluon_fp8.MAX_EXPERTS and gluon_fp8.dispatchable()


def _gluon_fp8_plan(base: dict) -> GemmPlan:
    """The plan of a ragged FP8 prefill call on the Gluon kernels (``gluon_fp8.py``: the default variant of the call's
    form), where :func:`gluon_fp8_takes`."""
    from . import gluon_fp8
    swiglu = base["swiglu"]
    variant = gluon_fp8.DEFAULT_SWIGLU_VARIANT if swiglu else gluon_fp8.DEFAULT_VARIANT
    spec = gluon_fp8.variant_spec(variant, swiglu)
    cfg = {"VARIANT": variant, "BLOCK_M": spec.block_m, "BLOCK_N": spec.block_n}
    return GemmPlan(**dict(base, tma_possible=True), config=cfg, config_source="variant", config_file=None, tma=True,
                    persistent=True, grid=device_facts.sm_count(), path="gluon-fp8")


def gluon_nvfp4_takes(bucket: int, G: int, N: int, K: int, swiglu: bool, opts: options.Options | None = None,
                      masked: bool = False) -> bool:
    """Whether a call of NVFP4 weights (bf16 or NVFP4 x) of ``bucket`` tokens per expert and these sizes (N: GEMM1's
    I), bf16 out, no forced config, ragged or ``masked``, runs the Gluon prefill GEMM here: from
    ``MOE_EP_GLUON_NVFP4_MIN_M`` on, where ``gluon_nvfp4_prefill.dispatchable(masked)`` and the kernels take the sizes
    (``gluon_nvfp4_prefill.takes``)."""
    if bucket < ((opts or options.current()).gluon_nvfp4_min_m or float("inf")):
        return False
    from . import gluon_nvfp4_prefill  # (here: Gluon is imported only where a call may take it)
    return gluon_nvfp4_prefill.takes(G, N, K, swiglu) and gluon_nvfp4_prefill.dispatchable(masked)


def _gluon_nvfp4_plan(base: dict) -> GemmPlan:
    """The plan of an NVFP4-weight prefill call on the Gluon kernel (``gluon_nvfp4_prefill.py``), where
    :func:`gluon_nvfp4_takes`: the token tile of its bucket, the weights read as they are (no decoded copy); NVFP4
    x decoded once, as for the tl kernel (``x_decoded``)."""
    from . import gluon_nvfp4_prefill
    block_t = gluon_nvfp4_prefill.token_tile(base["m_bucket"])
    cfg = {"BLOCK_T": block_t, "BLOCK_N": 2 * gluon_nvfp4_prefill.wg_columns(base["swiglu"])}
    return GemmPlan(**dict(base, w_decoded=False, tma_possible=True), config=cfg, config_source="variant",
                    config_file=None, tma=True, persistent=True, grid=device_facts.sm_count(), path="gluon-nvfp4")


def _sm100_config(n: int, k: int, m: int, swiglu: bool, config: dict | None) -> tuple:
    """(config, source, file) of an sm_100 W4A4 call, in order: the forced ``config`` (it must be an sm100_fp4
    config: ``tuned_files.validate_sm100``, MoEEpConfigError otherwise), the tuned file's
    ``n{N}_k{K}_xnvfp4_wnvfp4[_swiglu]`` entry, else ``sm100_fp4.default_config`` ("first-config"; no autotuner
    runs on this path: ``moe-ep tune`` times its space)."""
    if config is not None:
        return tuned_files.validate_sm100(config, "config", swiglu), "forced", None
    found = tuned_files.tuned_gemm_config(n, k, m, True, swiglu, sm100=True)
    if found is not None:
        return found[0], "tuned-file", found[1]
    return sm100_fp4.default_config(m, swiglu), "first-config", None


def autotuned(plan: GemmPlan, best: dict | None) -> GemmPlan:
    """The plan of an autotuned launch once the autotuner has picked ``best`` (``config_space.config_dict`` form)."""
    return plan if best is None else _with_config(plan, best)


def _with_config(plan: GemmPlan, cfg: dict) -> GemmPlan:
    G, N, K, M_max, S = plan.sizes
    fp8 = plan.w_format == "fp8"  # (the grids' shared-memory estimate: e4m3 tiles, as the launch's flags say)
    args = dict(cfg, RAGGED=plan.ragged, G=G, M_MAX=M_max, S=S, N=N, SWIGLU=plan.swiglu, FP8=fp8)
    persistent = bool(cfg["TMA"]) or schedule.persistent_grid(args)
    grid = schedule.grid_size(dict(cfg, PERSISTENT=persistent, FP8=fp8), plan.ragged, G, M_max, S, N, plan.swiglu)
    return dataclasses.replace(plan, config=cfg, tma=bool(cfg["TMA"]), persistent=persistent, grid=grid)


@lru_cache(maxsize=1024)
def _choose_config(n, k, bucket, groups, w_fp4, swiglu, fp8, fp8_out, opts, versions, smem_limit, sm_count):
    """(config, source, file) for a shape class: the tuned file's, else under ``MOE_EP_AUTOTUNE=off`` the first
    config that suits it, else (None, "autotune", None). Keyed by everything it reads: the shape class, the options,
    the tuned files' versions (path, mtime) and the GPU's limits (bounded: one entry per shape class met)."""
    found = tuned_files.tuned_gemm_config(n, k, bucket, w_fp4, swiglu, versions, fp8=fp8, fp8_out=fp8_out)
    if found is not None:
        return found[0], "tuned-file", found[1]
    if not opts.autotune:
        return config_space.first_gemm_config(n, k, bucket, groups, w_fp4, swiglu, fp8=fp8, fp8_out=fp8_out), \
            "first-config", None
    return None, "autotune", None
