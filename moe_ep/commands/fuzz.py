"""``moe-ep fuzz``: differential fuzzing of every kernel and the world-size-1 layer against the references.

Targets (``--targets``): the properties of :mod:`moe_ep.testing.properties` (the checks the tests make, each with
its tolerance): NVFP4 ``quantize`` / ``dequantize`` / ``gather_quantize`` (bit-exact), ``grouped_gemm`` and
``expert_mlp`` (relative error vs the fp32 reference), the bridge's ``route`` and ``permute`` (exact) and
``unpermute_reduce``, ``gluon_nvfp4_grouped_gemm`` and ``gluon_nvfp4_prefill_grouped_gemm`` (the Gluon sm_90a
NVFP4-weight GEMMs, decode and prefill, vs the reference and the tl kernel), and ``layer`` (MoEEpLayer at world size
1 vs the dense MoE). Cases come from :mod:`moe_ep.testing.strategies`, sized by ``--sizes`` (``tiny`` for the
interpreter, ``gpu`` on a device).

Runs under the ``fuzz`` hypothesis profile with a persistent example database (``--database``, default
``~/.cache/moe-ep/hypothesis``): a failure found once is replayed first on every later run. Stops after
``--examples`` examples per target or ``--seconds`` in all (split evenly over the targets). On a mismatch it
prints the shrunk counterexample and a command that reproduces it, and exits 1. ``--jobs N`` runs N fuzzing
processes at once, round-robin over the visible GPUs: one per target, or, with more jobs than targets,
several per target (shards with their own seeds sharing the target's examples and the database). A progress bar
per target shows the examples run; Ctrl-C stops the run and prints what ran and what failed (exit code 130).
Through the interpreter, without --examples or --seconds, each target stops after 25 examples or 30 s.
A target whose kernel cannot run on this device (the Gluon ones need an sm_90 GPU) is reported
"unavailable" with the reason; that alone does not make the exit code nonzero.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import torch
from hypothesis import assume, given, reproduce_failure, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import HypothesisException, Unsatisfiable
from hypothesis.reporting import with_reporter

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup
else:  # hypothesis raises the backport's groups there (it depends on it)
    from exceptiongroup import BaseExceptionGroup

from .. import options
from ..errors import MoEEpInputError
from ..testing import strategies as S
from ..testing.profiles import FUZZ, register_profiles
from ..testing.properties import PROPERTIES
from ..triton_runtime import INTERPRETER, device
from .common import name_list, print_table, progress

# --- the runner ----------------------------------------------------------------------------------------------

# through the interpreter an example costs up to seconds of Python: without --examples / --seconds a run there stops
# each target at whichever of these comes first; a GPU run takes the fuzz profile's examples, or this long per target
# if they take longer (so a default run ends in minutes whatever the GPU: a slow target does not hold up the others)
CPU_EXAMPLES = 25
CPU_SECONDS_PER_TARGET = 30.0
GPU_SECONDS_PER_TARGET = 60.0


def add_arguments(parser) -> None:
    parser.add_argument("--targets", default="all", help=f"'all' or a subset of {','.join(PROPERTIES)}")
    parser.add_argument("--examples", type=int, default=None, help="examples per target (default: the fuzz "
                        f"profile's 2000 on a GPU, {CPU_EXAMPLES} through the interpreter; unbounded with --seconds)")
    parser.add_argument("--seconds", type=float, default=None, help="total time, split evenly over the targets "
                        f"(default: at most {GPU_SECONDS_PER_TARGET:.0f} s per target on a GPU, "
                        f"{CPU_SECONDS_PER_TARGET:.0f} s through the interpreter)")
    parser.add_argument("--sizes", choices=sorted(S.BOUNDS), default=None,
                        help="case sizes (default: gpu on a GPU, tiny through the interpreter)")
    parser.add_argument("--database", default=None,
                        help="example database folder (default: ~/.cache/moe-ep/hypothesis)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default random)")
    parser.add_argument("--all-configs", action="store_true",
                        help="let the grouped GEMM autotune over its whole space (default: no search, "
                        "MOE_EP_AUTOTUNE=off, the first config that suits each shape: every new shape would "
                        "otherwise time ~10 configs)")
    parser.add_argument("--reproduce", default=None, metavar="VERSION:BLOB",
                        help="replay one failure printed by an earlier run (needs exactly one target)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="this many fuzzing processes at once, spread over the visible GPUs: one per "
                        "target, or with more jobs than targets several per target sharing its --examples "
                        "(--seconds stays the total wall time)")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)  # a --jobs child's results


def _database(args) -> str:
    return args.database or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                         "moe-ep", "hypothesis")


def _leaves(e: BaseException) -> list[BaseException]:
    """The exceptions an ``ExceptionGroup`` holds, flattened (``[e]`` for any other exception)."""
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


def _repro_command(args, target: str, blob: str | None, db: str, sizes: str) -> str:
    cmd = ["moe-ep", "fuzz", "--targets", target, "--sizes", sizes, "--database", db]
    if blob:
        cmd += ["--reproduce", blob]
    return " ".join(shlex.quote(c) for c in cmd)


def default_limits(args) -> tuple[int | None, float | None]:
    """(examples per target, seconds per target or None) when the caller gave neither, whichever comes first: the fuzz
    profile's examples or :data:`GPU_SECONDS_PER_TARGET` on a GPU; through the interpreter :data:`CPU_EXAMPLES` or
    :data:`CPU_SECONDS_PER_TARGET`."""
    if args.examples is not None or args.seconds is not None:
        return args.examples, None
    if INTERPRETER or not torch.cuda.is_available():
        return CPU_EXAMPLES, CPU_SECONDS_PER_TARGET
    return settings.get_profile(FUZZ).max_examples, GPU_SECONDS_PER_TARGET


def run_target(name: str, args, sizes: str, db: str, budget_s: float | None, dev, examples: int | None = None,
               advance=lambda: None) -> dict:
    """Fuzz one target in rounds until ``examples`` (None: unbounded) or ``budget_s`` are spent; stop at the first
    failure, or on Ctrl-C (status "interrupted": the caller stops and reports). ``advance()`` after each example."""
    cases, check, unavailable = PROPERTIES[name]
    why = unavailable()
    if why:  # a kernel this device cannot run (the Gluon one needs sm_90): nothing to fuzz, and not a finding
        return dict(target=name, status="unavailable", examples=0, seconds=0.0, detail=why)
    strategy = cases(S.BOUNDS[sizes])
    total = examples
    done, t0, lines = [0], time.perf_counter(), []

    def body(case):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            assume(False)  # time is up: the rest of this round is skipped (cheaply)
        done[0] += 1
        check(case, dev)
        advance()

    body.__name__ = body.__qualname__ = name

    def one_round(n):
        s = settings(settings.get_profile(FUZZ), max_examples=n, database=DirectoryBasedExampleDatabase(db),
                     print_blob=True, derandomize=False)
        prop = given(strategy)(body)
        prop = s(prop)
        if args.seed is not None:
            from hypothesis import seed as hyp_seed
            prop = hyp_seed(args.seed + done[0])(prop)
        if args.reproduce:
            version, _, blob = args.reproduce.partition(":")
            prop = reproduce_failure(version, blob.encode())(prop)
        with with_reporter(lines.append):
            prop()

    try:
        while True:
            left = None if total is None else total - done[0]
            if (left is not None and left <= 0) or (budget_s is not None and time.perf_counter() - t0 > budget_s):
                break
            try:
                one_round(max(1, min(left or 10, 10)))
            except Unsatisfiable:  # every example of the round came after the time was up
                if budget_s is None or time.perf_counter() - t0 <= budget_s:
                    raise
                break
            if args.reproduce:
                break
    except KeyboardInterrupt:
        return dict(target=name, status="interrupted", examples=done[0], seconds=time.perf_counter() - t0,
                    detail="Ctrl-C")
    except (Exception, AssertionError) as e:  # noqa: BLE001  (any exception in a kernel is a finding)
        if isinstance(e, HypothesisException) and not isinstance(e, AssertionError) and "Falsifying" not in "".join(lines):
            detail = f"{type(e).__name__}: {e}"
        else:  # several distinct failures come as an ExceptionGroup: say what each one is, not just how many
            detail = "; ".join(f"{type(x).__name__}: {str(x).strip()}" for x in _leaves(e))[:2000]
        # hypothesis attaches the falsifying example and the reproduce blob as exception notes (PEP 678)
        notes = [n for x in [e, *_leaves(e)] for n in getattr(x, "__notes__", [])]
        text = "\n".join(str(x) for x in lines + notes)
        m = re.search(r"@reproduce_failure\('([^']+)', b'([^']+)'\)", text)
        blob = f"{m.group(1)}:{m.group(2)}" if m else None
        return dict(target=name, status="FAILED", examples=done[0], seconds=time.perf_counter() - t0,
                    detail=detail, report=text, reproduce=_repro_command(args, name, blob, db, sizes))
    return dict(target=name, status="ok", examples=done[0], seconds=time.perf_counter() - t0, detail="")


def _child_argv(args, name: str, examples: int | None, seconds: float | None, seed: int | None,
                result_file: str) -> list[str]:
    """The command line of a ``--jobs`` child that fuzzes target ``name`` alone (one shard of it)."""
    argv = [sys.executable, "-m", "moe_ep.cli", "fuzz", "--targets", name, "--result-file", result_file]
    for flag, value in (("--examples", examples), ("--seconds", seconds), ("--sizes", args.sizes),
                        ("--database", args.database), ("--seed", seed)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--all-configs"] if args.all_configs else [])


def shard_plan(names: list[str], jobs: int, examples: int | None) -> list[tuple[str, int, int | None]]:
    """``(target, shard, examples)`` per child: with more jobs than targets, each target is split into
    ``jobs // len(names)`` shards (the first ``jobs % len(names)`` targets one more) that share its examples."""
    plan = []
    for i, name in enumerate(names):
        shards = max(1, jobs // len(names) + (i < jobs % len(names)))
        for s in range(shards):
            n = None if examples is None else examples // shards + (s < examples % shards)
            if n != 0:
                plan.append((name, s, n))
    return plan


def _merge_shards(results: list[dict]) -> list[dict]:
    """One row per target: examples summed over its shards, the longest shard's seconds, failed if any failed."""
    merged: dict[str, dict] = {}
    for r in results:
        m = merged.setdefault(r["target"], dict(r, status="ok", examples=0, seconds=0.0, detail=""))
        m["examples"] += r["examples"]
        m["seconds"] = max(m["seconds"], r["seconds"])
        if r["status"] != "ok" and m["status"] != "FAILED":
            m["status"], m["detail"] = r["status"], r["detail"]
    return list(merged.values())


def run_parallel(args, names: list[str]) -> list[dict]:
    """Fuzz in child processes, ``args.jobs`` at a time, round-robin over the visible GPUs: one per target,
    or several per target (:func:`shard_plan`, distinct seeds, one shared example database) when there are
    more jobs than targets. Each child's output is printed whole when it ends (so reports do not interleave)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v] or [str(i) for i in range(gpus)]
    plan = shard_plan(names, args.jobs, args.examples)
    seconds = None if args.seconds is None else args.seconds * min(args.jobs, len(plan)) / len(plan)
    results, running, todo = [], [], list(enumerate(plan))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _run_children(args, plan, seconds, visible, results, running, todo, tmp)
        except KeyboardInterrupt:  # Ctrl-C reached the children too: stop them, report what finished
            for name, tag, out, proc in running:
                proc.terminate()
                proc.wait()
                results.append(dict(target=name, status="interrupted", examples=0, seconds=0.0, detail="Ctrl-C"))
            results += [dict(target=name, status="not run", examples=0, seconds=0.0, detail="")
                        for _, (name, _, _) in todo]
    return _merge_shards(results)


def _run_children(args, plan, seconds, visible, results, running, todo, tmp) -> None:
    """The loop of :func:`run_parallel`: start children up to ``args.jobs``, collect each one's output and results."""
    while todo or running:
        while todo and len(running) < args.jobs:
            i, (name, shard, examples) = todo.pop(0)
            env = dict(os.environ)
            # each child's torch would start one CPU thread per core: N children would oversubscribe N-fold
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))
            if visible:
                env["CUDA_VISIBLE_DEVICES"] = visible[i % len(visible)]
            tag = f"{name}.{shard}"
            out = os.path.join(tmp, f"{tag}.json")
            seed = None if args.seed is None else args.seed + 1_000_003 * shard
            with open(os.path.join(tmp, f"{tag}.log"), "w") as log:  # a file: a pipe could fill and block
                proc = subprocess.Popen(_child_argv(args, name, examples, seconds, seed, out), env=env,
                                        stdout=log, stderr=subprocess.STDOUT)
            running.append((name, tag, out, proc))
        done = [r for r in running if r[3].poll() is not None]
        if not done:
            time.sleep(0.2)
        for name, tag, out, proc in done:
            running.remove((name, tag, out, proc))
            with open(os.path.join(tmp, f"{tag}.log")) as log:
                print(log.read(), end="", flush=True)
            if os.path.exists(out):
                with open(out) as f:
                    results += json.load(f)
            else:  # the child died before writing its results: that is a finding too
                results.append(dict(target=name, status="FAILED", examples=0, seconds=0.0,
                                    detail=f"the fuzzing process ({tag}) exited with code {proc.returncode}"))


def run(args) -> int:
    register_profiles()
    names = name_list(args.targets, "--targets", PROPERTIES)
    if args.reproduce and len(names) != 1:
        raise MoEEpInputError(f"--targets = {args.targets!r} with --reproduce; allowed: exactly one target")
    if args.examples is not None and args.examples <= 0:
        raise MoEEpInputError(f"--examples = {args.examples}; allowed: a positive int")
    if args.seconds is not None and args.seconds <= 0:
        raise MoEEpInputError(f"--seconds = {args.seconds}; allowed: a positive number")
    if args.jobs < 1:
        raise MoEEpInputError(f"--jobs = {args.jobs}; allowed: a positive int")
    if args.jobs > 1 and not args.reproduce:
        return _report(run_parallel(args, names), args)
    # untimed first configs unless the caller chose otherwise; for this run only (main() is also called in-process)
    search = {} if args.all_configs or "autotune" in options.explicit() else {"autotune": "off"}
    sizes = args.sizes or ("tiny" if INTERPRETER or not torch.cuda.is_available() else "gpu")
    db, dev = _database(args), device()
    os.makedirs(db, exist_ok=True)
    examples, budget = default_limits(args)
    if args.seconds is not None:
        budget = args.seconds / len(names)
    limits = ", ".join(([f"{examples} example(s)"] if examples else []) + ([f"{budget:.0f} s"] if budget else []))
    print(f"fuzzing {', '.join(names)} on {dev} ({sizes} sizes; per target at most {limits or 'no limit'}; "
          f"database {db})", flush=True)
    results = []
    with options.override(**search):
        for name in names:
            try:
                with progress(f"fuzz {name}", examples) as advance:
                    r = run_target(name, args, sizes, db, budget, dev, examples, advance)
            except KeyboardInterrupt:  # between examples, outside hypothesis
                r = dict(target=name, status="interrupted", examples=0, seconds=0.0, detail="Ctrl-C")
            results.append(r)
            print(f"  {name}: {r['status']} after {r['examples']} example(s), {r['seconds']:.1f} s", flush=True)
            if r["status"] == "FAILED":
                print(f"\nMISMATCH in {name}: {r['detail']}\n{r['report']}\nreproduce with:\n  {r['reproduce']}\n",
                      flush=True)
            if r["status"] == "interrupted":
                results += [dict(target=n, status="not run", examples=0, seconds=0.0, detail="")
                            for n in names[len(results):]]
                break
    return _report(results, args)


def _report(results: list[dict], args) -> int:
    """The summary table (and, for a ``--jobs`` child, the results file); exit code 1 on any failure."""
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump([{k: r[k] for k in ("target", "status", "examples", "seconds", "detail")} for r in results], f)
    print_table("moe-ep fuzz", ["target", "status", "examples", "seconds", "detail"],
                [[r["target"], r["status"], r["examples"], f"{r['seconds']:.1f}", r["detail"][:100]] for r in results])
    failed = [r["target"] for r in results if r["status"] == "FAILED"]
    if any(r["status"] in ("interrupted", "not run") for r in results):
        print("interrupted (Ctrl-C): " + (f"failed so far: {', '.join(failed)}" if failed else "no failure so far"))
        return 130
    return 1 if failed else 0
