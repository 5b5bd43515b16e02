"""Ranks agree, or fail loudly and in bounded time.

Two protocols keep the ranks of one :class:`~moe_ep.MoEEpLayer` group in step:

* **At construction**, every rank all-gathers one fixed-length int64 *fingerprint* (:data:`FIELDS`: the
  EpConfig, the weights' format, shapes and device type, the transport, the world size), plus an error flag
  and the text of its own construction error, if it had one. A collective of one fixed size cannot itself
  mismatch, so every rank sees every rank's values and raises the same error: :class:`MoEEpConfigError`
  naming each field that differs and each rank's value, or :class:`MoEEpPeerError` naming a rank that failed
  its own checks and why. The wait is bounded by the layer's ``timeout``; a rank that never arrives (it
  raised before the layer, or is slow) makes its peers raise :class:`MoEEpPeerError` when it expires.
* **At a forward over the portable "torch" transport with several ranks**, a rank whose inputs fail the
  layer's checks still takes part in the dispatch's first collective (the all_to_all of per-rank counts),
  sending :data:`FAILED` instead of its counts, then all ranks all-gather the failing ranks' error texts
  (:func:`send_failure` / :func:`raise_if_peer_failed`). Its peers raise :class:`MoEEpPeerError` naming
  it and its reason; the failing rank raises its own error. Nothing is dispatched, so the ranks stay in
  step and the next forward may run. This adds nothing when every rank's inputs are fine.
"""

from __future__ import annotations

import struct
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import Algorithm, EpConfig, Format, Layout
from .errors import MoEEpConfigError, MoEEpPeerError

PROTOCOL = 2
"""Bumped when FIELDS change, so ranks running different moe-ep versions say so instead of misreading."""

FIELDS = ("protocol", "world size", "EpConfig.num_experts", "EpConfig.top_k", "EpConfig.hidden_size",
          "EpConfig.intermediate_size", "EpConfig.max_tokens_per_rank", "EpConfig.algorithm", "EpConfig.layout",
          "EpConfig.weight_format", "EpConfig.activation_format", "EpConfig.activation_global_scale", "weights.format",
          "weights.num_local_experts", "weights.hidden_size", "weights.intermediate_size", "weights device type",
          "transport", "cuda_graph")
_ENUMS = {"EpConfig.algorithm": Algorithm, "EpConfig.layout": Layout, "EpConfig.weight_format": Format,
          "EpConfig.activation_format": Format, "weights.format": Format}
_DEVICE_TYPES = ("cpu", "cuda")
_TRANSPORTS = ("torch", "nccl_ep", "nixl_ep")
_MSG_WORDS = 64  # an error's text travels as up to 8 * 64 UTF-8 bytes

FAILED = -1
"""What a failing rank sends in place of its dispatch counts (real counts are >= 0)."""


def fingerprint(config: EpConfig, weights, transport: str, cuda_graph: bool, world: int) -> list[int]:
    """This rank's values of :data:`FIELDS`, as ints (enums by their position, names by theirs)."""
    def pos(seq, v):
        return list(seq).index(v) if v in list(seq) else len(seq)
    return [PROTOCOL, world, config.num_experts, config.top_k, config.hidden_size, config.intermediate_size,
            config.max_tokens_per_rank, pos(Algorithm, config.algorithm), pos(Layout, config.layout),
            pos(Format, config.weight_format), pos(Format, config.activation_format),
            _scale_bits(config.activation_global_scale), pos(Format, weights.format),
            weights.num_local_experts, weights.hidden_size, weights.intermediate_size,
            pos(_DEVICE_TYPES, weights.device.type), pos(_TRANSPORTS, transport), int(cuda_graph)]


def _scale_bits(scale: float | None) -> int:
    """A static activation scale as the bits of its float64 (None: -1, which no positive float has)."""
    return -1 if scale is None else struct.unpack("<q", struct.pack("<d", scale))[0]


def _shown(field: str, v: int):
    """A fingerprint value as the user wrote it."""
    if field == "EpConfig.activation_global_scale":
        return None if v == -1 else struct.unpack("<d", struct.pack("<q", v))[0]
    seq = {"weights device type": _DEVICE_TYPES, "transport": _TRANSPORTS}.get(field)
    if field in _ENUMS:
        seq = [m.value for m in _ENUMS[field]]
    if seq is not None:
        return seq[v] if 0 <= v < len(seq) else f"<unknown {v}>"
    return bool(v) if field == "cuda_graph" else v


def _encode(text: str) -> list[int]:
    raw = text.encode()[:8 * _MSG_WORDS].ljust(8 * _MSG_WORDS, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).tolist()


def _decode(words: torch.Tensor) -> str:
    return words.cpu().contiguous().view(torch.uint8).numpy().tobytes().rstrip(b"\0").decode(errors="replace")


def collective_device(group, device: torch.device) -> torch.device:
    """Where this group's collectives take their tensors: the CUDA device for NCCL, the host otherwise."""
    if dist.get_backend(group) == "nccl":
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work, timeout: timedelta, what: str, world: int) -> None:
    try:
        work.wait(timeout)
    except RuntimeError as e:  # gloo: "timed out", or a peer that went away; NCCL: its watchdog's error
        raise MoEEpPeerError(
            f"{what}: not every rank of the group (world size {world}) took part within {timeout.total_seconds():g}"
            f" s ({str(e).splitlines()[0] if str(e) else type(e).__name__}); a peer raised before reaching it "
            "(see that rank's own error), or is slower than the layer's timeout allows (raise "
            "MoEEpLayer(..., timeout=...)). The group is no longer usable: end the job.") from e


def agree(values: list[int], error: BaseException | None, group, rank: int, world: int, device: torch.device,
          timeout: timedelta) -> None:
    """Exchange :func:`fingerprint` ``values`` (and this rank's construction ``error``, None if it had none)
    with every rank of ``group``; raise unless all ranks hold the same values and none failed. A rank that
    passes ``error`` returns normally after the exchange (it raises its own error then)."""
    n = len(FIELDS)
    row = torch.tensor(values + [int(error is not None)] + _encode(f"{type(error).__name__}: {error}" if error
                                                                    else ""), dtype=torch.int64)
    dev = collective_device(group, device)
    mine = row.to(dev)
    rows = [torch.empty_like(mine) for _ in range(world)]
    _wait(dist.all_gather(rows, mine, group=group, async_op=True), timeout, "MoEEpLayer's construction check", world)
    table = torch.stack([r.cpu() for r in rows])
    if error is not None:
        return
    failed = [r for r in range(world) if int(table[r, n])]
    if failed:
        raise MoEEpPeerError("; ".join(f"rank {r} failed to construct its MoEEpLayer: {_decode(table[r, n + 1:])}"
                                       for r in failed) + f" (this is rank {rank}: its own arguments passed)")
    if (table[:, 0] != PROTOCOL).any():
        raise MoEEpConfigError(f"moe-ep rank agreement protocol = {table[:, 0].tolist()} (per rank); allowed: "
                               "the same moe-ep version on every rank")
    diffs = [f"{f}: " + ", ".join(f"rank {r} = {_shown(f, int(table[r, i]))!r}" for r in range(world))
             for i, f in enumerate(FIELDS) if (table[:, i] != table[0, i]).any()]
    if diffs:
        raise MoEEpConfigError("MoEEpLayer configuration differs between ranks: " + "; ".join(diffs)
                               + "; allowed: the same value on every rank")


def send_failure(error: BaseException, group, rank: int, world: int, device: torch.device,
                 timeout: timedelta) -> None:
    """This rank's forward failed its checks: take part in the dispatch's count exchange with :data:`FAILED`
    and share ``error``'s text, so peers raise instead of waiting (the caller then raises ``error``)."""
    dev = collective_device(group, device)
    counts = torch.full((world, 2), FAILED, dtype=torch.int64, device=dev)
    _wait(dist.all_to_all_single(torch.empty_like(counts), counts, group=group, async_op=True), timeout,
          f"rank {rank}'s forward failed its checks ({error}); telling its peers", world)
    _share_errors(f"{type(error).__name__}: {error}", group, world, dev, timeout)


def raise_if_peer_failed(recv_counts: list[int], group, rank: int, world: int, device: torch.device) -> None:
    """Called by the portable transport with the counts it received from each rank (host ints): when a rank
    sent :data:`FAILED`, join :func:`send_failure`'s error exchange and raise :class:`MoEEpPeerError`."""
    if min(recv_counts) >= 0:
        return
    failed = [r for r, c in enumerate(recv_counts) if c < 0]
    texts = _share_errors("", group, world, collective_device(group, device), None)
    raise MoEEpPeerError("; ".join(f"rank {r} failed its forward checks: {texts[r]}" for r in failed)
                         + f" (this is rank {rank}: nothing was dispatched; every rank may run the next forward)")


def _share_errors(text: str, group, world: int, dev: torch.device, timeout: timedelta | None) -> list[str]:
    mine = torch.tensor(_encode(text), dtype=torch.int64, device=dev)
    rows = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    if timeout is None:  # a peer already sent its marker: it is here too
        work.wait()
    else:
        _wait(work, timeout, "sharing a forward's error with the peers", world)
    return [_decode(r) for r in rows]
