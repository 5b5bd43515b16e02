"""Every kernel compiles for sm_90 (H100/H200) and sm_100 (B200) — checked without a GPU.

Runs in a subprocess with the interpreter off, so the kernels are real JIT functions; Triton ships
ptxas, so ``triton.compile`` builds cubins here. A kernel that would not build on H200 or B200 fails.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from moe_ep.testing.compile_checks import SM90_ONLY

# moe_ep.testing.compile_checks.TABLES
KERNEL_MODULES = ["nvfp4", "fp8", "grouped_gemm", "fp4_decode", "bridge", "gluon_nvfp4", "gluon_nvfp4_prefill",
                  "gluon_fp8"]

# The builds are split into three groups per target, each one process (importing torch and triton once for the
# group): the grouped GEMM's variants and the smem estimate's configs are most of the work, so as separate tests
# pytest-xdist can run them on different workers. Every check of a group runs even when one fails, and each says how
# it ended (a JSON line). Each group builds all its items, or its shard's half (--compile-shard, tests/conftest.py).
GROUPS = {"grouped_gemm": ["grouped_gemm"], "smem": ["smem"],
          "others": [m for m in KERNEL_MODULES if m != "grouped_gemm"]}

SCRIPT = r"""
import json
import sys
import traceback

import moe_ep  # TRITON_INTERPRET=0 is set, so kernels stay compiled JIT functions
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from moe_ep.kernels.grouped_gemm import config_space
from moe_ep.testing.compile_checks import SM90_ONLY, TABLES, fp8_tma_descriptors

cc, shard, wanted = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
target = GPUTarget("cuda", cc, 32)


# whether this shard builds item i for this target: all, or every other one, the shards' parities swapped between
# the targets (so each shard builds every item once, and the two shards together build each one for both targets)
def mine(i):
    return shard == "all" or (i + (cc == 100)) % 2 == int(shard)


def kernel_module(name):
    checks = TABLES[name]()
    assert checks, "no compile checks listed"
    if name in SM90_ONLY and cc != 90:
        return f"sm_90 only: none of {len(checks)} variants built for sm_{cc}"
    built = 0
    for i, (fn, sig, constexprs, *options) in enumerate(checks):  # options: a launch's num_warps, maxnreg
        if mine(i):
            source = GluonASTSource if fn.is_gluon() else ASTSource
            k = triton.compile(source(fn, sig, constexprs), target=target, options=options[0] if options else None)
            assert k.asm["cubin"], (fn.__name__, cc)
            built += 1
    return f"{built} of {len(checks)} variants compiled for sm_{cc}"


# Every config of the grouped GEMM's GPU space, built as a launch builds it (16-byte aligned pointers and strides:
# that is what lets Triton pipeline the loads through shared memory), against config_space.smem_bytes, the estimate
# the autotune prune drops configs by. Formats and epilogues rotate over the configs; the FP8-only configs are built
# as FP8.
def smem_estimate():
    kernel, base_sig, base_const = TABLES["grouped_gemm"]()[0]
    aligned = ["x_ptr", "xgs_ptr", "xs_ptr", "w_ptr", "ws_ptr", "wgs_ptr", "out_ptr", "os_ptr", "rs_ptr", "cnt_ptr",
               "ready_ptr", "N", "K", "KQ", "K16"]
    fp8_only = {config_space._config_key(c) for c in config_space.fp8_only_configs()}
    worst = 0.0
    configs = config_space.grouped_gemm_configs()
    for i, c in enumerate(configs):
        if not mine(i):
            continue
        kw = c.kwargs
        fp8 = config_space._config_key(c) in fp8_only
        w_fp4, swiglu = (False, i % 2 == 0) if kw["TMA"] or fp8 else (i % 4 >= 2, i % 2 == 0)
        sig, const = dict(base_sig), dict(base_const)
        sig["w_ptr"] = "*u8" if w_fp4 else "*bf16"
        if fp8:  # e4m3 tensors, as the launcher passes them
            sig.update(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", ws_ptr="*fp32")
        const.update(RAGGED=True, W_FP4=w_fp4, SWIGLU=swiglu, HAS_RS=not swiglu, X_DECODED=False, W_DECODED=False,
                     FP8=fp8, FP8_OUT=False, EVEN_K=True, PERSISTENT=False, SIGNAL=False, WAIT=False, PDL=False,
                     **{k: kw[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "GROUP_M", "TMA")})
        for name in ("x_desc", "w_desc"):
            const.pop(name, None)
        if kw["TMA"] and fp8:
            sig.update(fp8_tma_descriptors(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], swiglu))
        elif kw["TMA"]:
            sig["x_desc"] = f"tensordesc<bf16[{kw['BLOCK_M']}, {kw['BLOCK_K']}]>"
            sig["w_desc"] = f"tensordesc<bf16[{kw['BLOCK_N']}, {kw['BLOCK_K']}]>"
        else:
            const.update(x_desc=None, w_desc=None)
        sig.update({name: "constexpr" for name in const})
        attrs = {(kernel.arg_names.index(a), ): [["tt.divisibility", 16]] for a in aligned}
        k = triton.compile(ASTSource(kernel, sig, const, attrs), target=target,
                           options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
        est, real = config_space.smem_bytes(config_space.config_dict(c), swiglu, w_fp4, fp8), k.metadata.shared
        assert real <= est <= 1.35 * real + config_space.SMEM_SLACK, (kw, c.num_stages, w_fp4, fp8, swiglu, real, est)
        worst = max(worst, est / real)
    built = sum(map(mine, range(len(configs))))
    return f"smem estimate: {built} of {len(configs)} configs within it, at most {worst:.2f}x the compiled size"


results = {}
for name, check in [*((m, lambda m=m: kernel_module(m)) for m in TABLES), ("smem", smem_estimate)]:
    if name not in wanted:
        continue
    try:
        results[name] = {"ok": True, "said": check()}
    except Exception:
        results[name] = {"ok": False, "said": traceback.format_exc()}
print(json.dumps(results))
"""


def _run(script: str, *argv: str) -> str:
    """``script`` in a fresh process with the interpreter off (real JIT functions); its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _build(cc: int, shard: str, names: list[str]) -> dict:
    return json.loads(_run(SCRIPT, str(cc), shard, ",".join(names)).strip().splitlines()[-1])


def test_the_build_groups_cover_every_kernel_module_once():
    """The groups below build every compile table of moe_ep.testing.compile_checks and the smem estimate, each once."""
    from moe_ep.testing.compile_checks import TABLES
    named = [n for names in GROUPS.values() for n in names]
    assert sorted(named) == sorted([*TABLES, "smem"]) and sorted(KERNEL_MODULES) == sorted(TABLES), (named, TABLES)


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("cc", [90, 100], ids=["sm_90", "sm_100"])
def test_kernels_compile_for_sm90_and_sm100_within_the_smem_estimate(cc, group, request):
    """Every variant of every kernel module builds a cubin for the target. And config_space.smem_bytes is at
    least what each config of the grouped GEMM's space takes there (so a pruned list only holds configs that
    fit) and not far above it (so the prune does not drop configs that would fit). ``--compile-shard 0`` / ``1``
    (CI: one per Triton) build every other variant and config for each target, the two shards all of them."""
    shard = request.config.getoption("compile_shard")
    names = GROUPS[group]
    results = _build(cc, shard, names)
    assert set(results) == set(names), sorted(results)
    failed = {name: r["said"] for name, r in results.items() if not r["ok"]}
    assert not failed, "\n".join(f"{name} for sm_{cc}:\n{said}" for name, said in failed.items())
    assert all("compiled" in results[m]["said"] for m in names if m != "smem" and not (m in SM90_ONLY and cc != 90)), \
        results
    if "smem" in names:
        assert "within it" in results["smem"]["said"], results["smem"]
    for name, r in results.items():  # what was built is the shard: all, or every other one
        if name in SM90_ONLY and cc != 90:
            assert r["said"].startswith("sm_90 only"), (name, r["said"])
            continue
        built, listed = map(int, re.search(r"(\d+) of (\d+)", r["said"]).groups())
        want = listed if shard == "all" else sum((i + (cc == 100)) % 2 == int(shard) for i in range(listed))
        assert built == want and listed, (name, shard, r["said"])


def test_no_kernel_module_holds_a_nan_global():
    """A compiled kernel checks at every launch that the globals it read are unchanged, comparing them with ``!=``:
    a NaN global (NaN != NaN) fails every launch after the first on a GPU, which the interpreter never shows."""
    import math
    import pkgutil

    import triton.language as tl

    import moe_ep.kernels as kernels
    nan_globals = []
    for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        mod = __import__(info.name, fromlist=["_"])
        for name, v in vars(mod).items():
            v = v.value if isinstance(v, tl.constexpr) else v
            if isinstance(v, float) and math.isnan(v):
                nan_globals.append(f"{info.name}.{name}")
    assert nan_globals == [], nan_globals


SPILL_SCRIPT = r"""
import moe_ep
from moe_ep.kernels.grouped_gemm import config_space
from moe_ep.testing.compile_checks import fp8_gemm_registers, fp8_prefill_configs
kept = pruned = 0
for swiglu in (True, False):
    for c in fp8_prefill_configs(swiglu):
        ok = config_space.fp8_registers_ok(config_space.config_dict(c), swiglu)
        regs, stores, loads = fp8_gemm_registers(c, swiglu)
        # kept: no more than a few spilled registers (outside the K loop); pruned: the accumulators spill
        assert (stores <= 64) if ok else (stores >= 128), (c.kwargs, c.num_warps, c.num_stages, swiglu, regs, stores)
        kept, pruned = kept + ok, pruned + (not ok)
assert kept and pruned
print(f"fp8 registers: {kept} configs kept within them, {pruned} pruned configs spill")
"""


def test_fp8_register_rule_matches_ptxas_spills():
    """config_space.fp8_registers_ok, the FP8 prune's register budget, agrees with ptxas on sm_90a: the unswapped FP8
    configs it keeps (GEMM1 and GEMM2 builds, pointer loads and TMA) spill at most a few registers, those it prunes
    spill their accumulators (benchmarks/fp8_registers.py prints the table)."""
    assert "within them" in _run(SPILL_SCRIPT)


GLUON_SPILL_SCRIPT = r"""
import sys
import moe_ep
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moe_ep.testing.compile_checks import TABLES, sm90_ptxas_log, sm90_ptxas_usage
checks = TABLES[sys.argv[1]]()
for fn, sig, const, opts in checks:
    k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)
    log = sm90_ptxas_log(k.asm["ptx"])
    regs, stores, loads = sm90_ptxas_usage(log)
    warps = k.metadata.num_warps  # every partition's warps (the consumer's 4 and the producer's, padded)
    # a thread's registers: the launch's maxnreg, else what 64K registers split over the CTA's threads allow
    limit = min(opts.get("maxnreg") or 255, 255, 65536 // (32 * warps) // 8 * 8)
    assert stores == loads == 0 and regs <= limit, (const, opts, warps, regs, limit, stores, loads)
    # shared memory: at most the 227 KB an sm_90 block may use (more fails at launch, on the GPU only)
    assert k.metadata.shared <= 232448, (const, opts, k.metadata.shared)
    # ptxas serializes wgmma (waits after each) where it cannot prove the async accumulators untouched, and says so
    assert "wgmma" not in log, (const, log)
print(f"gluon registers: {len(checks)} variants within their register and shared-memory limits, no spills")
"""


def test_gluon_nvfp4_variants_build_for_sm90a_without_spills():
    """Every Gluon NVFP4 GEMM variant of the compile table, built for sm_90a at its launch's warps and registers:
    ptxas -v reports no spill bytes and at most the registers a thread may hold (maxnreg, or 64K over the CTA's
    threads): a variant that spills its accumulators or decode registers would be slow on the H200, not wrong. And
    the kernel takes at most the shared memory an sm_90 block may use."""
    assert "no spills" in _run(GLUON_SPILL_SCRIPT, "gluon_nvfp4")


def test_gluon_fp8_variants_build_for_sm90a_without_spills():
    """Every Gluon FP8 GEMM variant (and with / without the row scale), built for sm_90a as a launch builds it: no
    spill bytes, at most the registers a thread may hold, at most the shared memory a block may use (227 KB: the
    ring's depth is chosen against it), and no wgmma serialization warning from ptxas (an MMA that could not run
    asynchronously would leave the tensor core idle through each promotion, the thing this kernel is for)."""
    assert "no spills" in _run(GLUON_SPILL_SCRIPT, "gluon_fp8")


def test_gluon_nvfp4_prefill_variants_build_for_sm90a_without_spills():
    """Every variant of the Gluon NVFP4-weight prefill GEMM, built for sm_90a as a launch builds it: no spill bytes
    (its 256-token tile holds 128 accumulator registers a thread beside the decode's), at most the registers and
    shared memory a block may use, and no wgmma serialization warning (the decoded A registers of an MMA in flight
    left untouched, so that the two math warpgroups' MMAs and decodes overlap)."""
    assert "no spills" in _run(GLUON_SPILL_SCRIPT, "gluon_nvfp4_prefill")


SLOT_BYTES_SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moe_ep.kernels.grouped_gemm import gluon_nvfp4_prefill as gp
from moe_ep.testing.compile_checks import gluon_nvfp4_prefill
for fn, sig, const, opts in gluon_nvfp4_prefill():
    k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)
    block_t = int(re.search(r"bf16\[(\d+), 64\]", sig["x_desc"]).group(1))
    want = block_t * gp.BLOCK_K * 2 + gp.BLOCK_N * gp.BLOCK_K // 2  # the x tile and 128 rows' code words
    got = {int(n) for n in re.findall(r"expect_tx\.shared(?:::cta)?\.b64 _, \[%r\d+\], (\d+);", k.asm["ptx"])}
    assert got == {want}, (const, got, want)
print("slot bytes ok")
"""


def test_gluon_nvfp4_prefill_slots_expect_the_bytes_their_boxes_bring():
    """The producer's ``mbarrier.expect`` of every Gluon NVFP4 prefill variant (both forms, both token tiles) is the
    bytes its TMA loads bring a slot: the x tile and 128 rows of code words (GEMM1's two boxes of 64 included), read
    from the sm_90a PTX. A short count lets the consumers read a slot before its second box lands; a long one never
    completes."""
    assert "slot bytes ok" in _run(SLOT_BYTES_SCRIPT)


ABLATION_SCRIPT = r"""
import os
import sys
import tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "benchmarks"))
import ablate_gluon_fp8
from moe_ep.kernels.grouped_gemm import gluon_fp8

def code(module, variant, swiglu):
    sig, const, opts = module.compile_signature(variant, swiglu=swiglu)
    k = triton.compile(GluonASTSource(module._gluon_fp8_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    # the PTX before its debug sections (they name the source file), without comments and line markers
    return [line for line in k.asm["ptx"].split(".section\t.debug")[0].splitlines()
            if not line.strip().startswith(("//", ".loc", ".file"))]

with tempfile.TemporaryDirectory() as d:
    ablated = ablate_gluon_fp8.ablated_module(os.path.join(d, "gluon_fp8_ablated.py"), 0)
    defaults = {("coop", True), (gluon_fp8.DEFAULT_SWIGLU_VARIANT, True), (gluon_fp8.DEFAULT_VARIANT, False)}
    for variant, swiglu in defaults:
        assert code(ablated, variant, swiglu) == code(gluon_fp8, variant, swiglu), (variant, swiglu)
print("ablation baseline: the production kernel's PTX")
"""


def test_the_ablation_tool_with_nothing_switched_off_builds_the_production_kernel():
    """``benchmarks/ablate_gluon_fp8.py`` patches a copy of the Gluon FP8 kernel: its patches still apply to the kernel
    as it is, and with no switch set (``ABLATE`` 0) the copy builds for sm_90a to the kernel's own PTX, GEMM1's
    ``coop`` and default variants and GEMM2's default, so that an ablation's baseline row is the kernel users run."""
    assert "production kernel's PTX" in _run(ABLATION_SCRIPT)
