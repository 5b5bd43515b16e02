"""``moe-ep info``: the device, library versions, which transports can run here (and why not), which of the grouped
GEMM's GPU-only fast paths are taken here (and why not), and the tuned-config files the grouped GEMM would load."""

from __future__ import annotations

import glob
import json
import os

from .common import print_table, versions, write_json


def add_arguments(parser) -> None:
    parser.add_argument("--json", dest="json_out", default=None, metavar="PATH",
                        help="also write everything shown as JSON to PATH")


def transports() -> list[dict]:
    """``moe_ep.available_transports()`` as dicts (name, available, reason, install)."""
    try:
        from ..transports.discovery import available_transports
    except ImportError as e:  # a build without the discovery module: the portable transport only
        return [dict(name="torch", available=True, reason=f"(discovery unavailable: {e})", install="")]
    out = []
    for t in available_transports():
        out.append({k: getattr(t, k) for k in ("name", "available", "reason", "install") if hasattr(t, k)})
    return out


def tuned_configs() -> dict:
    """Tuned-config folders searched (in order), the file for this device and what each file covers."""
    try:
        from ..device_facts import device_name
        from ..kernels.grouped_gemm.tuned_files import config_dirs
        dirs, dev_name = config_dirs(), device_name()
    except (ImportError, AttributeError) as e:
        return dict(device_name=None, dirs=[], files=[], note=f"no tuned-config loader in this build ({e})")
    files = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            entry = dict(path=path, this_device=os.path.basename(path) == dev_name + ".json")
            try:
                with open(path) as f:
                    table = json.load(f)
                entry["shape_classes"] = len(table)
                entry["buckets"] = sum(len(v) for v in table.values() if isinstance(v, dict))
            except (OSError, ValueError) as e:
                entry["error"] = str(e)
            files.append(entry)
    return dict(device_name=dev_name, dirs=dirs, files=files)


def fast_paths() -> list[dict]:
    """The GPU-only grouped-GEMM paths the dispatcher may take instead of the tl kernel (``GemmPlan.path``): name,
    the calls it takes, whether it is taken here, and why not (or from when)."""
    from .. import options
    from ..kernels.grouped_gemm import gluon_fp8, gluon_nvfp4_prefill, sm100_fp4

    def gluon(name, module, field, default, calls):
        min_m, var = getattr(options.current(), field), options.ENV[field]
        why = module.not_dispatchable_reason()
        if why is None:
            why = (f"from {min_m} tokens per expert ({var})" if min_m is not None else
                   f"{var} is off: unset it (default {default}) to take this path")
        return dict(name=name, calls=calls, taken=module.dispatchable() and min_m is not None, reason=why)

    return [gluon("gluon-fp8", gluon_fp8, "gluon_fp8_min_m", options.DEFAULT_GLUON_FP8_MIN_M,
                  "ragged FP8 GEMMs at prefill sizes (Hopper, sm_90)"),
            gluon("gluon-nvfp4", gluon_nvfp4_prefill, "gluon_nvfp4_min_m", options.DEFAULT_GLUON_NVFP4_MIN_M,
                  "ragged GEMMs of NVFP4 weights at prefill sizes (Hopper, sm_90)"),
            dict(name="sm100-fp4", calls="W4A4: NVFP4 x and weights (Blackwell, capability 10.x)",
                 taken=sm100_fp4.available(), reason=sm100_fp4.unavailable_reason() or "every W4A4 call")]


def collect() -> dict:
    return dict(versions=versions(), transports=transports(), fast_paths=fast_paths(), tuned_configs=tuned_configs())


def run(args) -> int:
    info = collect()
    v = info["versions"]
    print_table("moe-ep info", ["", ""], [[k, v[k]] for k in v])
    print_table("transports", ["name", "available", "why / what", "install"],
                [[t.get("name"), "yes" if t.get("available") else "no", t.get("reason", ""), t.get("install", "")]
                 for t in info["transports"]])
    print_table("grouped GEMM fast paths (otherwise the tl kernel runs)", ["path", "calls", "taken here", "why / when"],
                [[f["name"], f["calls"], "yes" if f["taken"] else "no", f["reason"]] for f in info["fast_paths"]])
    tc = info["tuned_configs"]
    rows = [[f["path"], "yes" if f["this_device"] else "", f.get("shape_classes", "-"), f.get("buckets", "-"),
             f.get("error", "")] for f in tc["files"]]
    print_table(f"tuned configs (device file name: {tc['device_name']}.json; searched: {', '.join(tc['dirs'])})",
                ["file", "this device", "shape classes", "buckets", "error"], rows or [["(none)", "", "", "", ""]])
    if not any(f["this_device"] for f in tc["files"]):
        print("no tuned configs for this device: the grouped GEMM autotunes on first use "
              "(run `moe-ep tune` to write them)")
    if args.json_out:
        write_json(args.json_out, info)
    return 0
