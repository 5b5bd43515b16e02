"""``moe-ep tune``: time every grouped-GEMM config for a preset's shapes and write the best per token bucket.

Shapes per preset (L local experts, hidden H, intermediate I): GEMM1 ``[*, H] x [L, 2I, H]`` with the SwiGLU
epilogue and GEMM2 ``[*, I] x [L, H, I]``, for each weight format (``--formats``); x is bf16 (NVFP4 x is decoded
to a bf16 copy before the GEMM, so it runs the same tiles), and FP8 with FP8 weights (GEMM1 with its FP8 output, as
the FP8 expert MLP runs it; keys of their own: ``config_space.shape_class``). Token buckets are tokens per expert (``--buckets``): the
tuned-config file's inner key (``moe_ep.kernels.grouped_gemm.config_space.m_bucket``). The rows of a bucket of m
tokens per expert are spread over the experts as routing spreads them (``--counts routed``, the default: each row's expert drawn at
random, so counts vary around m), not exactly m each (``--counts uniform``): the best tile height depends on that
spread.

The candidates are exactly the kernels' own space, ``config_space.grouped_gemm_configs()`` pruned by
``config_space.prune_grouped_gemm_configs`` for the shape class, the same list ``triton.autotune`` would try.
Each is timed as it launches (a TMA config where TMA cannot run, e.g. at a decode bucket, runs the same tiles through
pointer loads: that is the config timed and written; candidates that launch the same kernel are timed once), with
``grouped_gemm(..., config=)``, not through ``triton.autotune``; a config that fails to compile or run is skipped.
The best is written to
``<dir>/<device name>.json`` in the loader's format (``{shape_class: {bucket: config}}``), after each shape,
atomically, so an interrupted run loses nothing and a rerun skips what is already there (``--force`` redoes
it). ``<dir>``: ``--out-dir``, else ``$MOE_EP_CONFIG_DIR``, else the user's ``$XDG_CONFIG_HOME/moe-ep/configs``
(``~/.config/moe-ep/configs``), which the kernels search before the package's shipped files.
Where the sm_100 W4A4 kernel runs (``sm100_fp4.available()``: a B200), NVFP4 weights are also tuned with NVFP4 x
by the same loop (buckets, routed counts, device name, file): its candidates are ``sm100_fp4.tune_candidates``
(its space pruned for the shape and sm_100's shared and tensor memory), written under
``n{N}_k{K}_xnvfp4_wnvfp4[_swiglu]``.
FP8 buckets that the Gluon FP8 kernels take on this GPU (``grouped_gemm.plan.gluon_fp8_takes``: an H100 / H200, from
``MOE_EP_GLUON_FP8_MIN_M`` tokens per expert on), and NVFP4-weight buckets of bf16 x that the Gluon prefill GEMM
takes (``gluon_nvfp4_takes``, from ``MOE_EP_GLUON_NVFP4_MIN_M`` on, where it is verified), are not tuned: no tl
config of theirs would be read.
Nothing here assumes an architecture: the device name and the config space come from the kernels' package.
"""

from __future__ import annotations

import os
import time

import torch

from .. import device_facts, options
from ..errors import MoEEpConfigError
from ..kernels.grouped_gemm import config_space, grouped_gemm, plan_grouped_gemm, sm100_fp4, tuned_files
from ..kernels.grouped_gemm.plan import gluon_fp8_takes, gluon_nvfp4_takes
from ..triton_runtime import INTERPRETER, device
from .common import (PRESETS, add_shape_arguments, int_list, name_list, preset_from_args, print_table, progress,
                     routed_offsets, uniform_offsets, write_json)
from .timing import sync, time_call

FORMATS = ("bf16", "nvfp4", "fp8")
GEMMS = ("gemm1", "gemm2")
COUNTS = ("routed", "uniform")
CONFIG_KEYS = config_space.CONFIG_KEYS


def add_arguments(parser) -> None:
    add_shape_arguments(parser)
    parser.add_argument("--presets", default=None, help="comma-separated presets (default: --preset)")
    parser.add_argument("--buckets", default=None,
                        help="tokens-per-expert buckets (default 8,16,...,2048 on a GPU; 8 on the CPU)")
    parser.add_argument("--formats", default="bf16,nvfp4", help="weight formats: bf16,nvfp4,fp8 (default bf16,nvfp4)")
    parser.add_argument("--counts", choices=COUNTS, default="routed",
                        help="rows per expert: routed (drawn at random around the bucket) or uniform (exactly it)")
    parser.add_argument("--gemms", default="gemm1,gemm2", help="which GEMMs: gemm1 (SwiGLU), gemm2")
    parser.add_argument("--out-dir", default=None, help="folder for <device>.json (default: $MOE_EP_CONFIG_DIR, "
                        "else ~/.config/moe-ep/configs, or under $XDG_CONFIG_HOME)")
    parser.add_argument("--max-seconds-per-shape", type=float, default=60.0,
                        help="stop trying configs for a shape after this long (at least one is tried)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop starting new shapes after this long (rerun to resume)")
    parser.add_argument("--rep-ms", type=float, default=25.0, help="measuring time per config (GPU)")
    parser.add_argument("--force", action="store_true", help="re-tune shapes already in the output file")
    parser.add_argument("--report", default=None, help="also write every timing to this JSON file")


def out_dir(args) -> str:
    """``--out-dir``, else ``$MOE_EP_CONFIG_DIR``, else the user's folder: each one the kernels search before the
    package's shipped files (which a tune run never rewrites unless ``--out-dir`` names them)."""
    return args.out_dir or options.current().config_dir or tuned_files.user_config_dir()


def shapes(preset, gemms, formats, buckets, sm100: bool = False) -> list[dict]:
    """Every (GEMM, formats, bucket) to tune for ``preset``; ``sm100`` (``sm100_fp4.available()``): NVFP4 weights
    also with NVFP4 x, the W4A4 kernel of sm_100 GPUs (its own keys and space)."""
    H, I = preset.hidden, preset.intermediate
    out = []
    for g in gemms:
        n, k, swiglu = (I, H, True) if g == "gemm1" else (H, I, False)
        for wf in formats:
            for x_fp4 in ((False, True) if sm100 and wf == "nvfp4" else (False,)):
                for m in buckets:
                    out.append(dict(preset=preset.name, gemm=g, N=n, K=k, swiglu=swiglu, w_fp4=wf == "nvfp4",
                                    fp8=wf == "fp8", sm100=x_fp4, bucket=m, G=preset.local_experts))
    return out


def shape_key(s: dict) -> str:
    """The tuned-file key shape ``s`` is written under (``config_space.shape_class``)."""
    return config_space.shape_class(s["N"], s["K"], s["w_fp4"], s["swiglu"], s["fp8"], s["fp8"] and s["swiglu"],
                                    sm100_fp4=s.get("sm100", False))


def _gluon_taker(s: dict) -> tuple[str, str, str] | None:
    """The Gluon fast path that takes shape ``s``'s bucket on this GPU, as (what takes it, its MIN_M option's field,
    a short name), or None: then the tl kernel runs it and its configs are worth tuning."""
    bucket = config_space.m_bucket(s["bucket"])
    if s["fp8"] and gluon_fp8_takes(bucket, s["G"]):
        return "the Gluon FP8 kernels take", "gluon_fp8_min_m", "Gluon FP8"
    if s["w_fp4"] and not s.get("sm100") and gluon_nvfp4_takes(bucket, s["G"], s["N"], s["K"], s["swiglu"]):
        return "the Gluon NVFP4 prefill GEMM takes", "gluon_nvfp4_min_m", "Gluon NVFP4"
    return None


def _operands(s, dev, counts: str):
    """Ragged x (``bucket`` rows per expert: exactly, or on average as routed), weights and offsets for shape ``s``."""
    from ..kernels.fp8 import FP8_BLOCK, quantize_fp8
    from ..kernels.nvfp4 import nvfp4_global_scale, quantize_nvfp4
    G, N, K, m = s["G"], s["N"], s["K"], s["bucket"]
    gen = torch.Generator(device=dev).manual_seed(0)  # generated on the device: weights can be GBs
    w = (torch.randn(G, 2 * N if s["swiglu"] else N, K, generator=gen, device=dev) * K ** -0.5).to(torch.bfloat16)
    x = torch.randn(G * m, K, generator=gen, device=dev).to(torch.bfloat16)
    if s["w_fp4"]:
        w = quantize_nvfp4(w, nvfp4_global_scale(w, per_slice=True))
    if s.get("sm100"):  # W4A4: NVFP4 x, one global scale
        x = quantize_nvfp4(x, nvfp4_global_scale(x))
    if s.get("fp8"):
        x, w = quantize_fp8(x, 1), quantize_fp8(w, FP8_BLOCK, gate_up=s["swiglu"])
    return x, w, (routed_offsets if counts == "routed" else uniform_offsets)(G, m, dev)


def tune_shape(s: dict, budget_s: float, rep_ms: float, dev, counts: str = "routed") -> dict:
    """Time each candidate config of shape ``s`` until ``budget_s``; the best and every timing."""
    fp8 = bool(s.get("fp8"))
    if s.get("sm100"):  # the sm_100 W4A4 kernel's own space, pruned for the shape and sm_100's memories
        cands = sm100_fp4.tune_candidates(config_space.m_bucket(s["bucket"]), s["N"], s["K"], s["swiglu"],
                                          options.current().autotune_quick)
        keys = sm100_fp4.CONFIG_KEYS
    else:
        cands = [config_space.config_dict(c) for c in config_space.prune_grouped_gemm_configs(
            config_space.grouped_gemm_configs(), {"M_BUCKET": config_space.m_bucket(s["bucket"]), "N": s["N"],
                                                  "K": s["K"], "G": s["G"], "SWIGLU": s["swiglu"],
                                                  "TMA_OK": not s["w_fp4"] and device_facts.tma_supported()},
            SWIGLU=s["swiglu"], W_FP4=s["w_fp4"], FP8=fp8, FP8_OUT=fp8 and s["swiglu"])]
        keys = CONFIG_KEYS
    x, w, offsets = _operands(s, dev, counts)
    gemm = dict(offsets=offsets, swiglu=s["swiglu"], m_hint=s["bucket"], quantize_out=fp8 and s["swiglu"])
    t_start, timings, seen, best = time.perf_counter(), [], set(), None
    for asked in cands:
        if best is not None and time.perf_counter() - t_start > budget_s:
            break
        try:  # what the launch would run: a TMA config where TMA cannot run becomes the same tiles by pointer loads
            cfg = {k: plan_grouped_gemm(x, w, config=asked, **gemm).config[k] for k in keys}
        except MoEEpConfigError as e:  # (does not fit here, e.g. in shared memory)
            timings.append(dict(config=asked, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            continue
        if tuple(cfg.items()) in seen:  # an earlier candidate launches the same kernel: timed already
            continue
        seen.add(tuple(cfg.items()))
        fn = lambda cfg=cfg: grouped_gemm(x, w, config=cfg, return_plan=True, **gemm)  # noqa: E731
        try:
            t0 = time.perf_counter()
            _, plan = fn()  # compiles
            sync()
            cfg = {k: plan.config[k] for k in keys}  # what ran is what is timed and written
            # the interpreter has nothing to compile and its time means little: its first call is the timing
            t = time.perf_counter() - t0 if INTERPRETER else time_call(fn, rep_ms=rep_ms, warmup_ms=5.0)
        except Exception as e:  # noqa: BLE001  (a config that cannot compile or run here is skipped)
            timings.append(dict(config=cfg, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            continue
        timings.append(dict(config=cfg, us=t * 1e6))
        if best is None or t < best[0]:
            best = (t, cfg)
    return dict(best=best[1] if best else None, best_us=best[0] * 1e6 if best else None,
                tried=sum("us" in t for t in timings), distinct=len(seen), candidates=len(cands), timings=timings,
                seconds=time.perf_counter() - t_start)


def run(args) -> int:
    names = name_list(args.presets or args.preset, "--presets", PRESETS)
    presets = [preset_from_args(args, n) for n in names]
    buckets = int_list(args.buckets or ("8" if INTERPRETER else "8,16,32,64,128,256,512,1024,2048"), "--buckets")
    todo = [s for p in presets for s in shapes(p, name_list(args.gemms, "--gemms", GEMMS),
                                               name_list(args.formats, "--formats", FORMATS), buckets,
                                               sm100_fp4.available())]
    folder = out_dir(args)
    path = os.path.join(folder, device_facts.device_name() + ".json")
    dev = device()
    print(f"tuning {len(todo)} shape(s) on {device_facts.device_name()} into {path}")
    if INTERPRETER:
        print("note: Triton interpreter (no GPU): timings are Python time, so the configs written only show that "
              "each one runs; tune on the GPU the configs are for")
    if os.path.abspath(folder) not in [os.path.abspath(d) for d in tuned_files.config_dirs()]:
        print(f"note: the kernels do not search {folder}; run them with MOE_EP_CONFIG_DIR={folder}")
    t0, rows, report, stopped = time.perf_counter(), [], [], False
    with progress("tune", len(todo)) as advance:
        for s in todo:
            key = shape_key(s)
            label = f"{s['preset']} {s['gemm']} {key} m={s['bucket']}"
            table = tuned_files.load_config_file(path)  # re-read: another process may have added shapes
            if not args.force and str(s["bucket"]) in table.get(key, {}):
                rows.append([s["preset"], key, s["bucket"], "skipped (already tuned)", "", ""])
                advance(label + " (skip)")
                continue
            gluon = _gluon_taker(s)
            if gluon is not None:
                what, field, short = gluon
                rows.append([s["preset"], key, s["bucket"], f"not tuned: {what} this bucket here "
                             f"({options.ENV[field]}=off for the tl kernel's)", "", ""])
                advance(label + f" ({short})")
                continue
            if args.max_seconds is not None and time.perf_counter() - t0 > args.max_seconds:
                stopped = True
                rows.append([s["preset"], key, s["bucket"], "not tuned (--max-seconds)", "", ""])
                advance(label + " (time budget spent)")
                continue
            r = tune_shape(s, args.max_seconds_per_shape, args.rep_ms, dev, args.counts)
            report.append(dict(shape=s, shape_class=key, **r))
            if r["best"] is not None:
                table = tuned_files.load_config_file(path)
                table.setdefault(key, {})[str(s["bucket"])] = r["best"]
                write_json(path, table)
                tuned_files.invalidate()  # the kernels of this process take the new config at once
            best = r["best"]
            rows.append([s["preset"], key, s["bucket"],
                         "none ran: " + next((t["error"] for t in r["timings"] if "error" in t), "") if best is None else
                         f"{best['BLOCK_M']}x{best['BLOCK_N']}x{best['BLOCK_K']} swap={int(best['SWAP_AB'])} "
                         f"tma={int(best.get('TMA', False))} w{best['num_warps']} s{best['num_stages']}",
                         "-" if r["best_us"] is None else f"{r['best_us']:.1f}", f"{r['tried']}/{r['distinct']}"])
            advance(label)
    print_table(f"tuned configs -> {path}", ["preset", "shape class", "bucket", "best config", "us", "timed/distinct"], rows)
    written = sum(r["best"] is not None for r in report)
    if written:
        print(f"wrote {written} config(s) to {path}")
    if args.report:
        write_json(args.report, dict(device=device_facts.device_name(), file=path, shapes=report))
    if stopped:
        print("time budget spent: rerun the same command to tune the remaining shapes")
    failed = [r for r in report if r["best"] is None]
    if failed:
        print(f"{len(failed)} shape(s) had no config that ran")
    return 1 if failed else 0
