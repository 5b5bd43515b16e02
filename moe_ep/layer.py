"""MoEEpLayer: the expert-parallel MoE layer, dispatch -> expert compute -> combine."""

from __future__ import annotations

import torch

from .compute import expert_compute
from .config import EpConfig
from .errors import MoEEpConfigError, MoEEpInputError, check
from .transports import make_transport
from .transports.torch_dist import group_rank_world
from .weights import ExpertWeights

_IDX_DTYPES = (torch.int32, torch.int64)
_W_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class MoEEpLayer(torch.nn.Module):
    """One MoE layer split across the ranks of ``group`` (None: the default group, or a single process).

    ``config`` says the model shape, algorithm/layout and formats; ``weights`` holds this rank's
    ``L = num_experts / world`` experts (see :meth:`ExpertWeights.from_global`). ``transport`` names the
    dispatch/combine implementation (``"torch"``: torch.distributed all_to_all; see
    :func:`moe_ep.transports.make_transport`).

    With world size 1 the LOW_LATENCY forward has no host sync (validation aside, see :meth:`forward`) and
    can be captured in a CUDA graph. With more ranks the portable transport syncs once per dispatch and
    once per combine (its all_to_all split sizes live on the host).
    """

    def __init__(self, config: EpConfig, weights: ExpertWeights, *, group=None, transport: str = "torch",
                 validate: bool = True):
        super().__init__()
        check(isinstance(config, EpConfig), "type(config)", type(config).__name__, "EpConfig", MoEEpConfigError)
        check(isinstance(weights, ExpertWeights), "type(weights)", type(weights).__name__, "ExpertWeights")
        self.config, self.weights, self.group, self.validate = config, weights, group, validate
        self.rank, self.world_size = group_rank_world(group)
        L = config.local_experts(self.world_size)
        want = (L, config.hidden_size, config.intermediate_size)
        got = (weights.num_local_experts, weights.hidden_size, weights.intermediate_size)
        check(got == want, "weights (local experts, hidden, intermediate)", got,
              f"{want} (num_experts / world size, hidden_size, intermediate_size)")
        check(weights.format is config.weight_format, "weights.format", weights.format.value,
              f"{config.weight_format.value!r} (EpConfig.weight_format)", MoEEpConfigError)
        self.transport = make_transport(transport, config, group, device=weights.device)

    def _check_inputs(self, x, idx, w, validate: bool) -> None:
        cfg, dev = self.config, self.weights.device
        for name, t in (("hidden_states", x), ("topk_idx", idx), ("topk_weights", w)):
            check(isinstance(t, torch.Tensor), f"type({name})", type(t).__name__, "a torch.Tensor")
            check(t.dim() == 2, f"{name}.shape", tuple(t.shape), "2-D")
            check(t.device == dev, f"{name}.device", str(t.device), f"{dev} (the weights' device)")
        B = x.shape[0]
        check(x.shape[1] == cfg.hidden_size, "hidden_states.shape", tuple(x.shape), f"[B, {cfg.hidden_size}]")
        check(x.dtype == torch.bfloat16, "hidden_states.dtype", x.dtype, "torch.bfloat16")
        check(B <= cfg.max_tokens_per_rank, "hidden_states.shape[0] (tokens)", B,
              f"<= max_tokens_per_rank ({cfg.max_tokens_per_rank})")
        check(tuple(idx.shape) == (B, cfg.top_k), "topk_idx.shape", tuple(idx.shape), f"({B}, {cfg.top_k})")
        check(idx.dtype in _IDX_DTYPES, "topk_idx.dtype", idx.dtype, "torch.int32, torch.int64")
        check(tuple(w.shape) == (B, cfg.top_k), "topk_weights.shape", tuple(w.shape), f"({B}, {cfg.top_k})")
        check(w.dtype in _W_DTYPES, "topk_weights.dtype", w.dtype, "torch.float32, torch.bfloat16, torch.float16")
        if validate and B and not _capturing(x):  # value checks: one host sync, details only on failure
            s = idx.sort(dim=1).values
            dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)
            bad = torch.stack([(idx < -1).any() | (idx >= cfg.num_experts).any(), dup.any(),
                               ~torch.isfinite(w).all()])
            if not bool(bad.any()):
                return
            if bool(bad[0]):
                lo, hi = int(idx.min()), int(idx.max())
                raise MoEEpInputError(f"topk_idx range = ({lo}, {hi}); allowed: ids in [-1, {cfg.num_experts})")
            if bool(bad[1]):
                row = int(dup.nonzero()[0, 0])
                raise MoEEpInputError(f"topk_idx[{row}] = {idx[row].tolist()}; allowed: distinct expert ids "
                                      "per row (-1 may repeat)")
            raise MoEEpInputError("topk_weights holds NaN or Inf; allowed: finite values")

    def forward(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                validate: bool | None = None) -> torch.Tensor:
        """``[B, H]`` bf16: ``sum_k topk_weights[b, k] * expert_{topk_idx[b, k]}(hidden_states[b])``.

        ``hidden_states [B, H]`` bf16 with ``B <= max_tokens_per_rank``; ``topk_idx [B, K]`` int32/int64
        global expert ids, -1 = no expert; ``topk_weights [B, K]`` float. Shapes, dtypes and devices are
        always checked (:class:`MoEEpInputError`). ``validate`` (default: the layer's flag, True) also
        checks id ranges, duplicate ids in a row and finite weights, which costs a host sync; it is skipped
        while a CUDA graph is being captured.
        """
        v = self.validate if validate is None else validate
        self._check_inputs(hidden_states, topk_idx, topk_weights, v)
        d = self.transport.dispatch(hidden_states, topk_idx, topk_weights)
        y = expert_compute(self.config, d, self.weights)
        return self.transport.combine(y)
