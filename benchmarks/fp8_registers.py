"""Registers and spills of the FP8 grouped GEMM's prefill configs, from ptxas (no GPU needed).

Builds each unswapped FP8 config of the GPU search space (pointer loads and TMA) for sm_90a as a launch builds it,
as GEMM1 (SwiGLU, FP8 output) and GEMM2 (row scale), and prints ptxas's registers per thread and spill bytes next
to the accumulator registers ``config_space.fp8_registers_ok`` prunes by (a config that spills its accumulators
runs far below the tensor cores' rate).

    PYTHONPATH=$PWD python benchmarks/fp8_registers.py [--all]   # --all: also the configs the rule prunes
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions and the GPU search space

from moe_ep.kernels.grouped_gemm import config_space  # noqa: E402
from moe_ep.testing.compile_checks import fp8_gemm_registers, fp8_prefill_configs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also the configs the register rule prunes")
    args = ap.parse_args()
    print(f"{'gemm':6} {'BMxBNxBK':12} {'warps':>5} {'stages':>6} {'acc regs':>8} {'rule':>5} {'regs':>5} "
          f"{'spill st':>8} {'spill ld':>8}")
    for swiglu in (True, False):
        for c in fp8_prefill_configs(swiglu):
            kw, d = c.kwargs, config_space.config_dict(c)
            ok = config_space.fp8_registers_ok(d, swiglu)
            if not (ok or args.all):
                continue
            regs, st, ld = fp8_gemm_registers(c, swiglu)
            tile = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}{' tma' if kw['TMA'] else ''}"
            print(f"{'GEMM1' if swiglu else 'GEMM2':6} {tile:12} {c.num_warps:>5} {c.num_stages:>6} "
                  f"{config_space.fp8_accumulator_registers(d, swiglu):>8} {'ok' if ok else 'prune':>5} {regs:>5} "
                  f"{st:>8} {ld:>8}", flush=True)


if __name__ == "__main__":
    main()
