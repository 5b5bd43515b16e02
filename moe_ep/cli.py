"""The ``moe-ep`` command: demo, info, bench, tune, fuzz.

Each subcommand's logic lives in its own module under ``moe_ep.commands``; this file wires argparse and the demo.
Those modules import torch, so a command's options are added only when it is the one asked for: ``moe-ep --help``
and ``--version`` import neither torch nor triton.
Bad arguments raise named errors (:class:`moe_ep.MoEEpInputError` / :class:`moe_ep.MoEEpConfigError`),
reported as ``moe-ep <cmd>: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import __version__
from .errors import MoEEpError

DESCRIPTION = """moe-ep: run, check and tune an expert-parallel Mixture-of-Experts layer.

Run 'moe-ep COMMAND --help' for a command's options. Bad arguments are reported as
'moe-ep COMMAND: error: ...' with exit code 2."""

EPILOG = """examples:
  moe-ep demo                          the quantizer and the layer on a small model, 2 local ranks
  moe-ep info                          device, versions, transports and tuned configs found
  moe-ep bench --tokens 1,64           kernels and the layer vs their peers and floors
  torchrun --nproc-per-node 2 -m moe_ep.cli bench --kernels layer
  moe-ep tune --presets deepseek-v3    tuned grouped-GEMM configs for this GPU
  moe-ep fuzz --seconds 600            kernels vs the references, 10 minutes in all"""


def _quantizer_demo(args, dev) -> bool:
    import torch

    from .commands.bench_rows import rel_err
    from .kernels import dequantize_nvfp4, quantize_nvfp4

    torch.manual_seed(0)
    x = torch.randn(args.quant_tokens, args.hidden, dtype=torch.bfloat16, device=dev)
    rel = rel_err(dequantize_nvfp4(quantize_nvfp4(x)), x)
    print(f"[1] NVFP4 round trip of a random bf16 batch [{args.quant_tokens}, {args.hidden}]: relative error "
          f"{rel:.4f} (bound for normal data about 0.1)")
    return rel < 0.15


def _demo_worker(rank: int, world: int, store_path: str, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from . import EpConfig, ExpertWeights, MoEEpLayer
    from .compute import expert_compute
    from .config import SUPPORTED_LAYOUTS
    from .reference import moe_reference
    from .triton_runtime import device

    dev = device()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    E, K, H, I, B = args.experts, args.top_k, args.hidden, args.inter, args.tokens
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    gx = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(B, H, generator=gx).bfloat16().to(dev)
    idx = torch.rand(B, E, generator=gx).topk(K, dim=1).indices.to(dev)
    w = torch.rand(B, K, generator=gx).softmax(1).to(dev)
    ref = moe_reference(x, idx, w, w13.to(dev), w2.to(dev))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    wf, af = args.weight_format, args.activation_format
    for alg, lay in [(a.value, lay.value) for a, lay in SUPPORTED_LAYOUTS]:
        cfg = EpConfig(E, K, H, I, B, alg, lay, weight_format=wf, activation_format=af)
        layer = MoEEpLayer(cfg, ExpertWeights.from_global(w13, w2, rank, world, wf, device=dev))
        layer(x, idx, w)  # warm up (autotune, buffers)
        times = []
        sync()
        t0 = time.perf_counter()
        d = layer.transport.dispatch(x, idx, w)
        sync()
        t1 = time.perf_counter()
        y = expert_compute(cfg, d, layer.weights, cfg.tokens_per_expert(world, B))
        sync()
        t2 = time.perf_counter()
        out = layer.transport.combine(y)
        sync()
        t3 = time.perf_counter()
        times = [t1 - t0, t2 - t1, t3 - t2]
        err = torch.tensor([(out.float() - ref).abs().max().item(), ref.abs().max().item()])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        tt = torch.tensor(times)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put((f"{alg}/{lay}", err.tolist(), tt.tolist()))
    dist.destroy_process_group()


def _demo(args) -> int:
    import os
    import tempfile

    import torch.multiprocessing as mp

    from .commands.common import check_layer_shape, preset_from_args
    from .errors import MoEEpInputError
    from .triton_runtime import INTERPRETER, device

    if args.tokens is None:
        args.tokens = 4 if INTERPRETER else 128
    p = preset_from_args(args)  # every option checked before a rank is spawned
    check_layer_shape(p, args.tokens, args.ranks, args.weight_format, args.activation_format)
    if args.quant_tokens < 1:
        raise MoEEpInputError(f"--quant-tokens = {args.quant_tokens}; allowed: a positive int")
    args.experts, args.top_k, args.hidden, args.inter = p.experts, p.top_k, p.hidden, p.intermediate
    dev = device()
    print(f"moe-ep demo on {dev} ({'Triton interpreter' if INTERPRETER else 'compiled Triton'})")
    ok = _quantizer_demo(args, dev)
    bound = max(DEMO_BOUNDS[args.weight_format], DEMO_BOUNDS[args.activation_format])
    print(f"[2] MoE layer: {args.experts} experts, top-{args.top_k}, H {args.hidden}, I {args.inter}, "
          f"{args.tokens} tokens on each of {args.ranks} ranks (gloo, spawned), weights {args.weight_format}, "
          f"activations {args.activation_format}, vs the dense fp32 reference (bound {bound:g} of max |ref|)")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(_demo_worker, args=(args.ranks, os.path.join(d, "store"), args, queue), nprocs=args.ranks)
        except mp.ProcessRaisedException as e:  # the rank's traceback is in e; one line here
            last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1]
            print(f"moe-ep demo: error: rank {e.error_index} failed: {last}", file=sys.stderr)
            return 1
    print(f"{'algorithm/layout':<18}{'max |err|':>11}{'max |ref|':>11}{'dispatch':>11}{'compute':>11}{'combine':>11}")
    while not queue.empty():
        name, (err, ref), times = queue.get()
        ok &= err <= bound * max(ref, 1e-6) + 1e-3
        print(f"{name:<18}{err:>11.2e}{ref:>11.2e}" + "".join(f"{t * 1e3:>9.2f}ms" for t in times))
    print("demo: OK" if ok else "demo: error above the bound")
    return 0 if ok else 1


DEMO_BOUNDS = {"bf16": 0.02, "fp8": 0.1, "nvfp4": 0.3}
"""The demo's error bound (of max |ref|) per format; a run takes the larger of its weights' and activations': bf16
arithmetic, e4m3's 3 mantissa bits, e2m1 codes."""


def version() -> str:
    """The installed distribution's version, else the package's own (a checkout on PYTHONPATH)."""
    from importlib import metadata
    try:
        return metadata.version("moe-ep")
    except metadata.PackageNotFoundError:
        return __version__


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The ``moe-ep`` argument parser: every subcommand, with its options for those in ``commands`` (default: all;
    a subcommand's options come from its module, which imports torch)."""
    parser = argparse.ArgumentParser(prog="moe-ep", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"moe-ep {version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="one of these:")
    for name, help_text in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
        if commands is None or name in commands:
            _add_options(name, p)
    return parser


def _add_options(name: str, parser: argparse.ArgumentParser) -> None:
    """Subcommand ``name``'s description and options: the demo's here, the others' from ``moe_ep.commands.<name>``
    (each has ``add_arguments`` and ``run``)."""
    import importlib

    from .commands.common import add_format_arguments, add_shape_arguments, plain
    if name == "demo":
        parser.description = plain(DEMO_DESCRIPTION)
        add_shape_arguments(parser)
        add_format_arguments(parser)
        parser.add_argument("--tokens", type=int, default=None,
                            help="tokens per rank (default 4 on the CPU, 128 on a GPU)")
        parser.add_argument("--ranks", type=int, default=2, help="ranks to spawn (gloo, this machine); must divide "
                            "--experts (default 2)")
        parser.add_argument("--quant-tokens", type=int, default=64,
                            help="rows of the NVFP4 round-trip check (default 64)")
        parser.set_defaults(func=_demo)
        return
    mod = importlib.import_module(f"moe_ep.commands.{name}")
    parser.description = plain(mod.__doc__)
    mod.add_arguments(parser)
    parser.set_defaults(func=mod.run)


def _command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` asks for (the first word not an option: the top level has only --help and
    --version), None for none or an unknown one (argparse then says what is allowed)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in _COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = _command_in(argv)
    args = build_parser([cmd] if cmd else []).parse_args(argv)
    try:
        return args.func(args)
    except MoEEpError as e:
        print(f"moe-ep {args.cmd}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


DEMO_DESCRIPTION = """Run the NVFP4 quantizer on a random batch, then the MoE layer with every supported
algorithm/layout on --ranks local ranks (gloo, spawned), each against the dense fp32
reference: the error and the dispatch / compute / combine times per layout. The model
shape is a preset (default small) with overrides."""


_COMMANDS = {
    "demo": "run the quantizer and the layer on a small model, checked against the reference",
    "info": "device, versions, transports available (and why not), tuned configs found",
    "bench": "time the kernels and the layer against their peers and floors; JSON + PNG",
    "tune": "sweep the grouped GEMM configs per shape and token bucket; write the tuned-config JSON",
    "fuzz": "differential fuzzing of every kernel and the layer against the references (hypothesis)",
}


if __name__ == "__main__":
    sys.exit(main())
