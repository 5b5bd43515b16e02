"""``fused_moe``: the MoE on one GPU, all experts local, no process group: what inference engines call
``fused_experts``. The same kernels, plans and tuned configs as :class:`~moe_ep.MoEEpLayer`'s bridge layouts, and
the same checks (``moe_ep.routing_checks``)."""

from __future__ import annotations

import torch

from .compute import activations, bridged_mlp
from .config import Format
from .errors import check, fail
from .routing_checks import check_routing_inputs, check_routing_values
from .weights import ExpertWeights


def fused_moe(hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
              weights: ExpertWeights, *, activation_format: Format | str = Format.BF16,
              activation_global_scale: float | None = None, validate: bool = True) -> torch.Tensor:
    """``out[b] = sum_k topk_weights[b, k] * expert_{topk_idx[b, k]}(hidden_states[b])``, bf16 ``[B, H]``.

    ``hidden_states [B, H]`` bf16; ``topk_idx [B, K]`` int32/int64 expert ids, -1 = no expert (the router's
    output as it is: the routing weights are applied here, once, in fp32); ``topk_weights [B, K]``
    float32/bfloat16/float16; ``weights``: an :class:`ExpertWeights` holding **all** ``E`` experts (bf16, NVFP4 or
    FP8; with FP8 weights the tokens are quantized to FP8 per token per 128 channels before GEMM1),
    on the device the kernels run on. Each expert is the SwiGLU MLP ``w2 @ (silu(w1 x) * w3 x)``.

    ``activation_format`` ``"nvfp4"`` quantizes the tokens to NVFP4 before GEMM1, one global scale per token (or
    ``activation_global_scale`` for all, a checkpoint's ``1 / input_scale``): a token's output never depends on
    the rest of its batch. ``validate`` (default) also checks id ranges, duplicate ids in a row, finite routing
    weights and, with NVFP4 activations or FP8 weights, finite tokens (one host sync; skipped while a CUDA graph is
    being captured). Without it, ids outside ``[0, E)`` are no expert. No other host sync: the call can be captured in
    a CUDA graph. Bad arguments raise :class:`~moe_ep.MoEEpInputError` / :class:`~moe_ep.MoEEpConfigError`.
    """
    check(isinstance(weights, ExpertWeights), "type(weights)", type(weights).__name__, "ExpertWeights")
    try:
        fmt = Format(activation_format)
    except (ValueError, TypeError):
        fail("activation_format", activation_format, "'bf16', 'nvfp4', 'fp8' (with FP8 weights)")
    nvfp4 = fmt is Format.NVFP4
    fp8 = weights.format is Format.FP8
    if fp8 and fmt is Format.NVFP4 or not fp8 and fmt is Format.FP8:
        fail("activation_format", fmt.value, "'bf16' or 'fp8' with FP8 weights (the tokens are quantized to FP8 "
             "here), else 'bf16' or 'nvfp4'")
    if activation_global_scale is not None:
        check(nvfp4, "activation_global_scale", activation_global_scale, "None unless activation_format is 'nvfp4'")
        check(isinstance(activation_global_scale, (int, float)) and not isinstance(activation_global_scale, bool)
              and 0 < activation_global_scale < float("inf"), "activation_global_scale", activation_global_scale,
              "None (one scale per token) or a positive finite float")
    if validate is not True and validate is not False:
        fail("validate", validate, "True or False")
    check(not nvfp4 or weights.hidden_size % 32 == 0, "weights.hidden_size", weights.hidden_size,
          "a multiple of 32 with NVFP4 activations")
    x, idx, w = hidden_states, topk_idx, topk_weights
    K = idx.shape[1] if isinstance(idx, torch.Tensor) and idx.dim() == 2 else -1
    check_routing_inputs(x, idx, w, hidden_size=weights.hidden_size, top_k=K, device=weights.device)
    B, E = x.shape[0], weights.num_local_experts
    if validate and B and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_routing_values(x, idx, w, E, nvfp4 or fp8)
    tokens_per_expert = max(1, -(-B * K // E))  # the GEMMs' tuned tiles, as the layer picks them
    return bridged_mlp(activations(x, nvfp4, activation_global_scale, fp8), idx, w, weights,
                       tokens_per_expert=tokens_per_expert)
