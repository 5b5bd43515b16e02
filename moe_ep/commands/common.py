"""What the subcommands share: model presets, argument parsing helpers, progress, torchrun setup, output (timing:
:mod:`moe_ep.commands.timing`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from ..errors import MoEEpInputError
from ..triton_runtime import INTERPRETER, device


@dataclass(frozen=True)
class Preset:
    """A model's MoE shape. ``ep`` is the expert-parallel size it is deployed at, so one rank holds
    ``experts // ep`` local experts (DeepSeek-V3: 256 experts over EP8 -> 32 per rank)."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    ep: int = 1

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    def as_dict(self) -> dict:
        return {**asdict(self), "local_experts": self.local_experts}


PRESETS = {p.name: p for p in (
    Preset("deepseek-v3", 256, 7168, 2048, 8, ep=8),
    Preset("qwen3-30b-a3b", 128, 2048, 768, 8),
    Preset("mixtral-8x7b", 8, 4096, 14336, 2),
    Preset("small", 8, 256, 512, 2),
)}


def get_preset(name: str, *, hidden: int | None = None, intermediate: int | None = None,
               experts: int | None = None, top_k: int | None = None) -> Preset:
    """The preset ``name``, with optional overrides (for quick runs on tiny shapes; ``experts`` is the model's total,
    spread over the preset's EP size). Unknown names and bad overrides raise :class:`MoEEpInputError` naming the
    option and what is allowed."""
    if name not in PRESETS:
        raise MoEEpInputError(f"--preset = {name!r}; allowed: {', '.join(PRESETS)}")
    p = PRESETS[name]
    for what, v, mult in (("hidden", hidden, 32), ("intermediate", intermediate, 16)):
        if v is not None and (v <= 0 or v % mult):
            raise MoEEpInputError(f"--{what} = {v}; allowed: a positive multiple of {mult}")
    if experts is not None and (experts <= 0 or experts % p.ep):
        raise MoEEpInputError(f"--experts = {experts}; allowed: a positive multiple of {p.ep} (preset {p.name}'s "
                              f"EP size: the experts of all ranks together)")
    p = replace(p, hidden=hidden or p.hidden, intermediate=intermediate or p.intermediate, experts=experts or p.experts)
    if top_k is not None:
        if not 0 < top_k <= p.experts:
            raise MoEEpInputError(f"--top-k = {top_k}; allowed: 1..{p.experts} (--experts)")
        p = replace(p, top_k=top_k)
    return p


SHAPE_OPTIONS = {"num_experts": "--experts", "top_k": "--top-k", "hidden_size": "--hidden",
                 "intermediate_size": "--intermediate", "max_tokens_per_rank": "--tokens",
                 "weight_format": "--weight-format", "activation_format": "--activation-format"}
"""EpConfig field -> the command-line option that sets it."""


def add_format_arguments(parser) -> None:
    """``--weight-format`` and ``--activation-format`` of the layer a subcommand builds, the same names everywhere;
    checked with the model shape by :func:`check_layer_shape` (EpConfig's rules: fp8 activations need fp8
    weights)."""
    from ..config import Format
    names = ", ".join(f.value for f in Format)
    parser.add_argument("--weight-format", default="bf16", help=f"the experts' weight format: {names} (default bf16)")
    parser.add_argument("--activation-format", default="bf16",
                        help=f"the format dispatch carries and the experts consume: {names} (default bf16; fp8 "
                        "needs --weight-format fp8)")


def add_shape_arguments(parser) -> None:
    """``--preset`` and the model-shape overrides, the same names in every subcommand (the demo's old ``--inter``
    still works: argparse takes an unambiguous prefix of ``--intermediate``)."""
    parser.add_argument("--preset", default="small", help=f"model shape: one of {', '.join(PRESETS)} "
                        "(default: small)")
    parser.add_argument("--experts", type=int, default=None,
                        help="override the number of experts E, all ranks together")
    parser.add_argument("--top-k", type=int, default=None, help="override the experts picked per token")
    parser.add_argument("--hidden", type=int, default=None, help="override the hidden size H")
    parser.add_argument("--intermediate", type=int, default=None, help="override the intermediate size I per expert")


def preset_from_args(args, name: str | None = None) -> Preset:
    return get_preset(name or args.preset, hidden=args.hidden, intermediate=args.intermediate,
                      experts=args.experts, top_k=args.top_k)


def check_layer_shape(p: Preset, tokens: int, ranks: int, weight_format: str = "bf16",
                      activation_format: str = "bf16") -> None:
    """The layer shape of ``p`` at ``tokens`` per rank over ``ranks`` ranks, in these formats, validated by
    :class:`EpConfig` before any work starts; its error names the command-line option (``--hidden = 100;
    allowed: ...``, ``--activation-format = 'fp8'; allowed: ... with --weight-format 'bf16'``)."""
    import re

    from ..config import EpConfig
    from ..errors import MoEEpConfigError
    if ranks < 1 or p.experts % ranks:
        divisors = [d for d in range(1, p.experts + 1) if p.experts % d == 0]
        raise MoEEpInputError(f"--ranks = {ranks}; allowed: a divisor of --experts ({p.experts}): "
                              f"{', '.join(map(str, divisors))}")
    try:
        EpConfig(p.experts, p.top_k, p.hidden, p.intermediate, tokens, weight_format=weight_format,
                 activation_format=activation_format)
    except MoEEpConfigError as e:
        m = re.match(r"EpConfig\.(\w+) = (.*)", str(e), re.DOTALL)
        if m is None or m.group(1) not in SHAPE_OPTIONS:
            raise
        said = re.sub(r"\b(weight_format|activation_format)\b", lambda f: SHAPE_OPTIONS[f.group(1)], m.group(2))
        raise MoEEpInputError(f"{SHAPE_OPTIONS[m.group(1)]} = {said} (EpConfig.{m.group(1)})") from None


def plain(doc: str | None) -> str:
    """A module docstring as terminal text for ``--help``: reStructuredText roles and literals unwrapped
    (``:class:`~moe_ep.X``` -> ``X``, double backquotes dropped)."""
    import re
    text = re.sub(r":[a-z]+:`~?([^`<]*?)(?: <[^>]*>)?`", lambda m: m.group(1).rsplit(".", 1)[-1]
                  if m.group(0).startswith((":class:`~", ":func:`~", ":mod:`~", ":data:`~")) else m.group(1),
                  doc or "")
    return text.replace("``", "").strip()


def int_list(text: str, what: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]``; anything else raises MoEEpInputError."""
    try:
        out = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or any(v <= 0 for v in out):
        raise MoEEpInputError(f"{what} = {text!r}; allowed: comma-separated positive ints, e.g. 1,8,64")
    return out


def name_list(text: str, what: str, allowed) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each in ``allowed`` (``all`` = every one)."""
    allowed = list(allowed)
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names == ["all"]:
        return allowed
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise MoEEpInputError(f"{what} = {text!r}; allowed: 'all' or a comma-separated subset of {', '.join(allowed)}")
    return names


def uniform_offsets(experts: int, rows: int, dev) -> torch.Tensor:
    """Ragged-layout offsets ``[experts + 1]`` (int32) of exactly ``rows`` rows per expert."""
    return torch.arange(0, experts * rows + 1, rows, dtype=torch.int32, device=dev)


def routed_offsets(experts: int, mean: int, dev, seed: int = 0) -> torch.Tensor:
    """Ragged-layout offsets ``[experts + 1]`` (int32) of ``experts * mean`` rows spread as routing spreads tokens:
    each row's expert drawn uniformly at random (seeded), so the counts vary around ``mean`` (a Poisson-like spread,
    as with balanced top-k routing) instead of being ``mean`` each."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    picks = torch.randint(0, experts, (experts * mean,), generator=gen, device=dev)
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(torch.bincount(picks, minlength=experts), 0)
    return offsets


# --- torchrun -------------------------------------------------------------------------------------------


def dist_setup() -> tuple[int, int]:
    """(rank, world size). Under torchrun (``WORLD_SIZE`` > 1) initialize the default process group (nccl with
    one rank per GPU; gloo on the CPU or when ranks share GPUs) and pick this rank's GPU; otherwise (0, 1) and
    nothing is initialized."""
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if gpus:  # more ranks than GPUs share them round-robin, over gloo (NCCL takes one rank per GPU)
            torch.cuda.set_device(local_rank % gpus)
        dist.init_process_group("nccl" if gpus and local_world <= gpus else "gloo")
    return dist.get_rank(), dist.get_world_size()


def dist_teardown() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- output ---------------------------------------------------------------------------------------------


def write_json(path: str, obj) -> None:
    """Write ``obj`` as JSON atomically (a half-written file never replaces a good one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def versions() -> dict:
    """Python, torch, triton, CUDA and NCCL versions, the device and how kernels run."""
    import platform

    import triton
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            nccl = f"unavailable ({type(e).__name__})"
    dev = device()
    return dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, nccl=nccl,
                device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                capability=".".join(map(str, torch.cuda.get_device_capability())) if dev.type == "cuda" else None,
                kernels="Triton interpreter" if INTERPRETER else "compiled Triton")


def console():
    """A rich Console, or None when rich is not installed (then plain prints)."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    """A table through rich when installed, else aligned plain text."""
    con = console()
    if con is not None:
        from rich.markup import escape
        from rich.table import Table
        t = Table(title=escape(title))
        for c in columns:
            t.add_column(escape(c), overflow="fold")
        for r in rows:  # cells are text, not markup: "moe-ep[nccl]" must print as written
            t.add_row(*[escape(str(v)) for v in r])
        con.print(t)
        return
    print(title)
    widths = [max(len(str(x)) for x in [c] + [r[i] for r in rows]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


# a plain progress line at most this often (seconds) where no live bar can be drawn (a log file, a pipe)
PLAIN_PROGRESS_EVERY_S = 5.0


@contextlib.contextmanager
def progress(description: str, total: int, enabled: bool = True):
    """A progress bar (rich) yielding ``advance(label=None)``. Where stdout is not a terminal (a log, a pipe: rich
    would draw nothing until the end) or rich is not installed: a plain ``[done/total]`` line for the first step, the
    last, and at most one per ``PLAIN_PROGRESS_EVERY_S`` between them."""
    if not enabled:
        yield lambda label=None: None
        return
    con = console()
    if con is None or not con.is_terminal:
        done, last = [0], [-PLAIN_PROGRESS_EVERY_S]

        def advance(label=None):
            done[0] += 1
            now = time.monotonic()
            if done[0] in (1, total) or now - last[0] >= PLAIN_PROGRESS_EVERY_S:
                last[0] = now
                print(f"[{done[0]}/{total}] {description}" + (f": {label}" if label else ""), flush=True)
        yield advance
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[label]}"), console=con) as p:
        task = p.add_task(description, total=total, label="")

        def advance(label=None):
            p.update(task, advance=1, label=label or "")
        yield advance
