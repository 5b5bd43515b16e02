"""MoEEpLayer: the expert-parallel MoE layer, dispatch -> expert compute -> combine."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import options, rank_agreement
from .compute import expert_compute, kept_routes
from .config import MAX_INT32, EpConfig, Format
from .errors import MoEEpConcurrentUseError, MoEEpConfigError, MoEEpError, MoEEpPeerError, check, fail
from .forward_plan import ForwardPlans
from .transports import TRANSPORTS, make_transport
from .transports.base import group_rank_world
from .transports.discovery import require_transport
from .routing_checks import IDX_DTYPES, check_routing_inputs, check_routing_values
from .weights import FLOAT_DTYPES, ExpertWeights


def _rank_world(group) -> tuple[int, int]:
    """(rank, world size) of ``group`` (None: the default group, or a single process), after checking that a
    ``group`` given is a ProcessGroup this process belongs to."""
    if group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            fail("MoEEpLayer(group=...)", group, "None (a single process) until torch.distributed."
                 "init_process_group has run; then None (the default group) or a ProcessGroup", MoEEpConfigError)
        if not isinstance(group, dist.ProcessGroup):
            fail("type(MoEEpLayer(group=...))", type(group).__name__, "None or a torch.distributed.ProcessGroup",
                 MoEEpConfigError)
        if dist.get_rank(group) < 0:
            fail("MoEEpLayer(group=...) membership", f"this process (global rank {dist.get_rank()}) is not in it",
                 "a group this process belongs to", MoEEpConfigError)
    return group_rank_world(group)


def _timeout(t) -> timedelta:
    """``timeout`` (seconds or a timedelta) as a positive timedelta."""
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e9:
        return timedelta(seconds=t)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t
    fail("MoEEpLayer(timeout=...)", t, "a positive number of seconds or a datetime.timedelta", MoEEpConfigError)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: tuple  # static (hidden_states, topk_idx, topk_weights) the graph reads
    out: torch.Tensor  # what the graph writes


class _ForwardGraphs:
    """``forward`` as CUDA-graph replays: one graph per (batch size, id dtype, weight dtype), captured on first
    use from static input buffers; a call copies its inputs into them (one ``_foreach_copy_``) and replays.
    Inputs that *are* those buffers (:meth:`MoEEpLayer.graph_inputs`) skip the checks and the copy: the
    forward is then the replay alone. Graphs share one memory pool."""

    def __init__(self, layer: MoEEpLayer):
        self.layer, self.pool, self.graphs = layer, torch.cuda.graph_pool_handle(), {}
        self.by_static = {}  # id(static hidden_states) -> its graph entry

    def static_entry(self, x, idx, w):
        """The entry whose static inputs *are* (x, idx, w), else None: their shapes, dtypes and device are
        then known, so forward skips its checks and copies."""
        e = self.by_static.get(id(x))
        return e if e is not None and e.inputs[0] is x and e.inputs[1] is idx and e.inputs[2] is w else None

    def get(self, B: int, idx_dtype: torch.dtype, w_dtype: torch.dtype, like=None) -> _Graph:
        """The graph for this key, captured now if new. ``like``: inputs to start the
        buffers from (else distinct ids per row, so a warm-up autotune sees a real routing)."""
        key = (B, idx_dtype, w_dtype)
        if key not in self.graphs:
            e = self.graphs[key] = self._capture(B, idx_dtype, w_dtype, like)
            self.by_static[id(e.inputs[0])] = e
        return self.graphs[key]

    def _capture(self, B, idx_dtype, w_dtype, like):
        cfg, dev = self.layer.config, self.layer.weights.device
        if like is not None:
            static = tuple(t.clone(memory_format=torch.contiguous_format) for t in like)
        else:
            ids = (torch.arange(B, device=dev)[:, None] * cfg.top_k + torch.arange(cfg.top_k, device=dev))
            static = (torch.zeros(B, cfg.hidden_size, dtype=torch.bfloat16, device=dev),
                      (ids % cfg.num_experts).to(idx_dtype), torch.full((B, cfg.top_k), 1.0 / cfg.top_k,
                                                                       dtype=w_dtype, device=dev))
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture: autotuning, buffers, Triton's compiles
            for _ in range(2):
                self.layer._run(*static)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.layer._run(*static)
        return _Graph(graph, static, out)

    def __call__(self, x, idx, w):
        graph, static, out = self.get(x.shape[0], idx.dtype, w.dtype, like=(x, idx, w))
        torch._foreach_copy_(list(static), [x, idx, w])
        graph.replay()
        return out


class MoEEpLayer(torch.nn.Module):
    """One MoE layer split across the ranks of ``group`` (None: the default group, or a single process).

    ``config`` says the model shape, algorithm/layout and formats; ``weights`` holds this rank's
    ``L = num_experts / world`` experts (see :meth:`ExpertWeights.from_global`). ``transport`` names the
    dispatch/combine implementation (``"torch"``: torch.distributed all_to_all; see
    :func:`moe_ep.transports.make_transport`).

    The forward has no host sync (validation aside, see :meth:`forward`) at world size 1, and over
    NCCL-EP (LOW_LATENCY) or NIXL-EP at any world size, and can then be captured in a CUDA graph.
    ``cuda_graph=True`` does that inside the layer: each batch size is captured on first use and every
    later ``forward`` replays it (a few us of host time instead of hundreds; the returned tensor is then
    the graph's output buffer, overwritten by the next forward of that size: clone it to keep it). A
    capture runs the forward twice to warm up, collectives included, so with several ranks every rank
    must capture the same batch sizes in the same order: call :meth:`graph_inputs` for each size on all
    ranks first (a rank may then replay any of them, or run 0 tokens eagerly, in any step). With more
    ranks the portable transport syncs once per dispatch and once per combine (its all_to_all split
    sizes live on the host), so it cannot be captured.

    Inference only: inputs or weights that need a gradient are refused (:class:`MoEEpInputError`), never
    silently cut off from autograd. One forward at a time: a layer owns buffers and collectives, so a
    second thread entering ``forward`` while one is inside raises :class:`MoEEpConcurrentUseError` (give
    each thread its own layer).

    Ranks agree, or fail loudly and in bounded time (:mod:`moe_ep.rank_agreement`):

    * Construction with world size > 1 is collective: every rank of the group must construct its layers
      in the same order. One small all_gather checks that every rank holds the same EpConfig, weight
      format, weight shapes, weights' device type, transport and ``cuda_graph``; a difference raises
      :class:`MoEEpConfigError` on every rank, naming each field and each rank's value. A rank whose own
      arguments fail the layer's checks still joins that exchange: it raises its own error, its peers
      raise :class:`MoEEpPeerError` naming it and its error. A rank that does not arrive within
      ``timeout`` (seconds or a timedelta, default 300 s) makes the others raise :class:`MoEEpPeerError`
      (the group is then unusable: end the job).
    * ``forward`` over the portable ``"torch"`` transport with several ranks: a rank whose inputs fail the
      checks still takes part in the dispatch's first collective, carrying a failure marker instead of its
      counts: it raises its own :class:`MoEEpInputError`, its peers raise :class:`MoEEpPeerError` naming
      it and its reason, nothing is dispatched, and the next forward may run on every rank. This costs
      nothing when the inputs are fine. Waiting for peers that are not in a forward at all is bounded by
      ``timeout`` on the failing rank, by the process group's own timeout on the others.
    * ``forward`` over ``"nccl_ep"`` / ``"nixl_ep"`` (graph-capturable: no host round trip to piggyback
      on): a rank that raises leaves its peers in the transport's collectives until the process group's
      timeout (``init_process_group(timeout=...)``); keep every rank's inputs valid, or end the job on error.
    """

    def __init__(self, config: EpConfig, weights: ExpertWeights, *, group=None, transport: str = "torch",
                 validate: bool = True, cuda_graph: bool = False, timeout: float | timedelta = 300.0):
        super().__init__()
        check(isinstance(config, EpConfig), "type(config)", type(config).__name__, "EpConfig", MoEEpConfigError)
        check(isinstance(weights, ExpertWeights), "type(weights)", type(weights).__name__, "ExpertWeights")
        for name, v in (("validate", validate), ("cuda_graph", cuda_graph)):
            check(isinstance(v, bool), f"MoEEpLayer({name}=...)", v, "True or False", MoEEpConfigError)
        check(isinstance(transport, str), "MoEEpLayer(transport=...)", transport,
              ", ".join(repr(t) for t in TRANSPORTS), MoEEpConfigError)
        self.timeout = _timeout(timeout)
        self.config, self.weights, self.group, self.validate = config, weights, group, validate
        # validate checks tokens finite too where they are quantized, before dispatch or after it (FP8 weights): a NaN
        # block has no FP8 / NVFP4 codes (as fused_moe)
        self._finite_tokens = (config.activation_format in (Format.NVFP4, Format.FP8)
                               or config.weight_format is Format.FP8)
        self.rank, self.world_size = _rank_world(group)
        self._busy = threading.Lock()  # one forward at a time (MoEEpConcurrentUseError)
        self._graphs = None
        try:  # this rank's own checks; with peers, its verdict travels in the agreement check (no one waits)
            name = self._check_setup(transport, cuda_graph)
            error = None
        except MoEEpError as e:
            if self.world_size == 1:
                raise
            name, error = transport, e
        if self.world_size > 1:
            try:
                rank_agreement.agree(rank_agreement.fingerprint(config, weights, name, cuda_graph, self.world_size),
                                     error, group, self.rank, self.world_size, weights.device, self.timeout)
            except MoEEpPeerError as peer:
                if error is None:
                    raise
                raise error from peer  # this rank's own mistake comes first
            if error is not None:
                raise error
        self.transport = make_transport(name, config, group, device=weights.device)
        # a failing rank's peers hear of it in the portable transport's count exchange (rank_agreement)
        self._tell_peers = self.world_size > 1 and self.transport.name == "torch"
        # the portable transport treats ids outside [0, E) as no expert; others get them as -1 (_run)
        self._map_ids = self.transport.name != "torch"
        # where the layout's compute routes the picks, its route buffers are kept between forwards (no torch op each)
        self._routes = kept_routes(config, self.world_size, weights.device)
        # eager forwards replayed from a recording per input signature (MOE_EP_FORWARD_PLAN), where the transport's
        # work is all kernels and torch ops of this process (forward_plan.py)
        self._plans = ForwardPlans() if self.transport.replayable else None
        if cuda_graph:
            check(self.transport.graph_capturable,
                  f"cuda_graph=True with transport {self.transport.name!r}, {config.algorithm.value}, world size",
                  self.world_size, "a transport that runs without host syncs: 'torch' at world size "
                  "1, 'nccl_ep' with LOW_LATENCY, 'nixl_ep'", MoEEpConfigError)
            # the same verdict on every rank: transport, world size and the weights' device type agree
            check(weights.device.type == "cuda", "cuda_graph=True with weights on", str(weights.device),
                  "CUDA weights", MoEEpConfigError)
            self._graphs = _ForwardGraphs(self)

    def _check_setup(self, transport: str, cuda_graph: bool) -> str:
        """This rank's checks of its arguments (no collectives); returns the transport's resolved name."""
        config, weights = self.config, self.weights
        L = config.local_experts(self.world_size)
        want = (L, config.hidden_size, config.intermediate_size)
        got = (weights.num_local_experts, weights.hidden_size, weights.intermediate_size)
        if got != want:
            no_pg = self.group is None and not dist.is_initialized()
            fail("weights (local experts, hidden, intermediate)", got,
                 f"{want} (num_experts / world size, hidden_size, intermediate_size)" + (
                     "; torch.distributed is not initialized, so the world size is 1: call "
                     "torch.distributed.init_process_group first if these are one rank's shard" if no_pg else ""))
        check(weights.format is config.weight_format, "weights.format", weights.format.value,
              f"{config.weight_format.value!r} (EpConfig.weight_format)", MoEEpConfigError)
        rows = self.world_size * config.max_tokens_per_rank * config.top_k
        check(rows <= MAX_INT32, "EpConfig.max_tokens_per_rank", config.max_tokens_per_rank,
              f"world size ({self.world_size}) * max_tokens_per_rank * top_k <= {MAX_INT32} (int32 slot indices)",
              MoEEpConfigError)
        return require_transport(transport)  # the one check of the name

    def _check_inputs(self, x, idx, w, validate: bool) -> None:
        cfg = self.config
        check_routing_inputs(x, idx, w, hidden_size=cfg.hidden_size, top_k=cfg.top_k, device=self.weights.device,
                             max_tokens=cfg.max_tokens_per_rank)
        if validate and x.shape[0] and not _capturing(x):
            self._check_values(x, idx, w)

    def _check_values(self, x, idx, w) -> None:
        check_routing_values(x, idx, w, self.config.num_experts, self._finite_tokens)

    def forward(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                validate: bool | None = None) -> torch.Tensor:
        """``[B, H]`` bf16: ``sum_k topk_weights[b, k] * expert_{topk_idx[b, k]}(hidden_states[b])``.

        ``hidden_states [B, H]`` bf16 with ``B <= max_tokens_per_rank``; ``topk_idx [B, K]`` int32/int64
        global expert ids, -1 = no expert; ``topk_weights [B, K]`` float32/bfloat16/float16. Shapes, dtypes,
        devices and ``requires_grad`` (inference only: a tensor that needs a gradient is refused) are always
        checked (:class:`MoEEpInputError`). ``validate`` (default: the layer's flag, True) also checks id
        ranges, duplicate ids in a row, finite weights and, with NVFP4 or FP8 activations or FP8 weights, finite
        hidden states, which costs a host sync; it is skipped while a CUDA graph is being captured. Without it, an
        id outside ``[0, num_experts)`` (-1 or not, int64 ids of 2**31 and more included) is taken as "no expert":
        it never lands on another expert. Duplicate ids and non-finite weights are then the caller's to avoid
        (their result is unspecified, never a crash); a token holding NaN or Inf with NVFP4 activations comes out
        NaN (per-token scales; a static ``activation_global_scale`` gives it unspecified values), and no other
        token changes; with FP8 activations or weights the 128-channel blocks holding NaN or Inf get unspecified
        codes and scales (that token only).
        """
        if validate is None:
            v = self.validate
        elif validate is True or validate is False:
            v = validate
        else:
            self._fail_forward(MoEEpConfigError(f"forward(validate=...) = {validate!r}; allowed: True, False or "
                                                "None (the layer's flag)"))
        if not self._busy.acquire(blocking=False):
            raise MoEEpConcurrentUseError("MoEEpLayer.forward called while another thread is inside this layer's "
                                          "forward; allowed: one forward at a time per layer (one layer per "
                                          "thread, or serialize the calls)")
        try:
            if self._graphs is not None:  # the graph's own static inputs: replay alone (a few us of host time)
                e = self._graphs.static_entry(hidden_states, topk_idx, topk_weights)
                if e is not None:
                    if v:
                        self._check_values(hidden_states, topk_idx, topk_weights)
                    e.graph.replay()
                    return e.out
            try:
                self._check_inputs(hidden_states, topk_idx, topk_weights, v)
            except MoEEpError as e:
                self._fail_forward(e)
            if self._graphs is not None and hidden_states.shape[0] and not _capturing(hidden_states):
                return self._graphs(hidden_states, topk_idx, topk_weights)
            # ids unchecked (validate off, or a capture) -> mapped for transports that need it (_run)
            map_ids = self._map_ids and (not v or _capturing(hidden_states))
            if self._plans is not None:
                opts = options.current()  # (read once: the plan's signature holds them too)
                if opts.forward_plan and not _capturing(hidden_states):
                    return self._plans.run(lambda h, i, w: self._run(h, i, w, map_ids),
                                           (hidden_states, topk_idx, topk_weights), (map_ids, self.weights), opts)
            return self._run(hidden_states, topk_idx, topk_weights, map_ids)
        finally:
            self._busy.release()

    def _fail_forward(self, error: MoEEpError):
        """Raise ``error``, this rank's forward failing its checks; with the portable transport at world size
        > 1, first tell the peers (they raise MoEEpPeerError instead of waiting in the dispatch)."""
        if self._tell_peers:
            try:
                rank_agreement.send_failure(error, self.group, self.rank, self.world_size, self.transport.device,
                                            self.timeout)
            except MoEEpPeerError as peer:
                raise error from peer
        raise error

    def graph_inputs(self, batch_size: int, idx_dtype: torch.dtype = torch.int64,
                     weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static ``(hidden_states, topk_idx, topk_weights)`` buffers of the graph for ``batch_size``
        (captured now if new; needs ``cuda_graph=True``). Fill them in place and pass them to ``forward``:
        it then replays without copying its inputs."""
        if self._graphs is None:
            fail("graph_inputs with cuda_graph", False, "MoEEpLayer(..., cuda_graph=True)", MoEEpConfigError)
        if not 0 < batch_size <= self.config.max_tokens_per_rank:
            fail("batch_size", batch_size, f"1..{self.config.max_tokens_per_rank} (max_tokens_per_rank)")
        if idx_dtype not in IDX_DTYPES:
            fail("idx_dtype", idx_dtype, "torch.int32, torch.int64")
        if weight_dtype not in FLOAT_DTYPES:
            fail("weight_dtype", weight_dtype, "torch.float32, torch.bfloat16, torch.float16")
        return self._graphs.get(batch_size, idx_dtype, weight_dtype).inputs

    def _run(self, hidden_states, topk_idx, topk_weights, map_ids: bool | None = None) -> torch.Tensor:
        """dispatch -> compute -> combine. ``map_ids`` (default: whenever the transport needs it, as in a graph
        capture) turns ids outside [-1, E) into -1 on the device first."""
        if self._map_ids if map_ids is None else map_ids:  # on the device (captured into graphs)
            E = self.config.num_experts
            topk_idx = topk_idx.masked_fill((topk_idx < -1) | (topk_idx >= E), -1)
        d = self.transport.dispatch(hidden_states, topk_idx, topk_weights)
        y = expert_compute(self.config, d, self.weights,
                           self.config.tokens_per_expert(self.world_size, hidden_states.shape[0]), self._routes)
        return self.transport.combine(y)
