"""Registers and spills of the FP8 grouped GEMM's prefill configs, from ptxas (no GPU needed).

Builds each unswapped FP8 config of the GPU search space for sm_90 as a launch builds it (aligned pointers, the
config's warps and stages), as GEMM1 (SwiGLU, FP8 output) and GEMM2 (row scale), and prints what ptxas reports:
registers per thread, spill stores and loads. A config that spills its accumulators runs far below the tensor cores'
rate; ``config_space.fp8_registers_ok`` is the rule that keeps them out of the search.

    PYTHONPATH=$PWD python benchmarks/fp8_registers.py [--all]   # --all: also configs the rule prunes
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions and the GPU search space

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moe_ep.kernels.grouped_gemm import config_space  # noqa: E402
from moe_ep.testing.compile_checks import _fp8_gemms  # noqa: E402

ALIGNED = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "out_ptr", "os_ptr", "rs_ptr", "cnt_ptr", "N", "K")


def _ptxas() -> str:
    import triton.backends.nvidia as nv
    return os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")


def registers(cfg: triton.Config, swiglu: bool) -> tuple[int, int, int]:
    """(registers per thread, spill store bytes, spill load bytes) of cfg built for sm_90a as GEMM1 (swiglu: SwiGLU
    with an FP8 output) or GEMM2."""
    kernel, sig, const = next((k, s, c) for k, s, c in _fp8_gemms()
                              if c["RAGGED"] and c["SWIGLU"] == swiglu and c["FP8_OUT"] == swiglu)
    sig, const = dict(sig), dict(const)
    const.update({k: cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "GROUP_M")}, EVEN_K=True,
                 PERSISTENT=False)
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}
    k = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=True)
    log = r.stdout + r.stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    return regs, st, ld


def prefill_configs(swiglu: bool, pruned_too: bool) -> list[triton.Config]:
    """Unswapped FP8 configs for GEMM1 (swiglu) or GEMM2, without the register rule's prune when pruned_too."""
    out = []
    for c in config_space.grouped_gemm_configs():
        kw = c.kwargs
        if kw["SWAP_AB"] or kw["TMA"] or config_space.fp8_rule_broken(kw, swiglu):
            continue
        if swiglu and kw["BLOCK_M"] * kw["BLOCK_N"] > 128 * 128:
            continue  # the prune's bf16-era SwiGLU rule drops these whatever the format
        if pruned_too or config_space.fp8_registers_ok(config_space.config_dict(c), swiglu):
            out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also the configs the register rule prunes")
    args = ap.parse_args()
    print(f"{'gemm':6} {'BMxBNxBK':12} {'warps':>5} {'stages':>6} {'acc regs':>8} {'rule':>5} {'regs':>5} "
          f"{'spill st':>8} {'spill ld':>8}")
    for swiglu in (True, False):
        for c in prefill_configs(swiglu, args.all):
            kw, d = c.kwargs, config_space.config_dict(c)
            regs, st, ld = registers(c, swiglu)
            print(f"{'GEMM1' if swiglu else 'GEMM2':6} {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']:<5} "
                  f"{c.num_warps:>5} {c.num_stages:>6} {config_space.fp8_accumulator_registers(d, swiglu):>8} "
                  f"{'ok' if config_space.fp8_registers_ok(d, swiglu) else 'prune':>5} {regs:>5} {st:>8} {ld:>8}",
                  flush=True)


if __name__ == "__main__":
    main()
