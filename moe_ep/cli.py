"""The ``moe-ep`` command: demo, info, bench, tune, fuzz.

Each subcommand's logic lives in its own module under ``moe_ep.commands``; this file only wires argparse.
Bad arguments raise named errors (:class:`moe_ep.MoEEpInputError` / :class:`moe_ep.MoEEpConfigError`),
reported as ``moe-ep <cmd>: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import moe_ep


def _demo(args) -> int:
    import torch

    from .kernels import dequantize_nvfp4, quantize_nvfp4
    from .triton_runtime import INTERPRETER, device

    dev = device()
    print("moe-ep demo: the NVFP4 quantizer (the MoE layer demo arrives with the layer).")
    print(f"device: {dev} ({'Triton interpreter' if INTERPRETER else 'compiled Triton'})")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device=dev)
    q = quantize_nvfp4(x)
    y = dequantize_nvfp4(q)
    rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
    reps = 3 if INTERPRETER else 50
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        quantize_nvfp4(x, q.global_scale, check_finite=False)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / reps
    nbytes = x.numel() * 2 + q.data.numel() + q.scales.numel()
    print(f"round trip of a random bf16 batch [{args.tokens}, {args.hidden}]: relative error {rel:.4f} "
          f"(NVFP4's bound for normal data is about 0.1)")
    print(f"quantize: {dt * 1e3:.3f} ms per call, {nbytes / dt / 1e9:.2f} GB/s (bytes read + written)")
    return 0 if rel < 0.15 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-ep", description=__doc__)
    parser.add_argument("--version", action="version", version=moe_ep.__version__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="run the demo on a small default model")
    demo.add_argument("--tokens", type=int, default=128)
    demo.add_argument("--hidden", type=int, default=1024)
    demo.set_defaults(func=_demo)
    _add_commands(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except moe_ep.MoEEpError as e:
        print(f"moe-ep {args.cmd}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


_COMMANDS = {
    "info": "device, versions, transports available (and why not), tuned configs found",
    "bench": "time the kernels and the layer against their peers and floors; JSON + PNG",
    "tune": "sweep the grouped GEMM configs per shape and token bucket; write the tuned-config JSON",
    "fuzz": "differential fuzzing of every kernel and the layer against the references (hypothesis)",
}


def _add_commands(sub) -> None:
    """The subcommands in ``moe_ep.commands``: each module has ``add_arguments`` and ``run``."""
    import importlib
    for name, help_text in _COMMANDS.items():
        mod = importlib.import_module(f"moe_ep.commands.{name}")
        p = sub.add_parser(name, help=help_text, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)


if __name__ == "__main__":
    sys.exit(main())
