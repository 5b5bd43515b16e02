"""fused_moe: one device, all experts, no process group, against the dense MoE reference (every weight and activation
format, adversarial routings), its named errors, and the same result as the world-1 layer."""

import pytest
import torch
from hypothesis import given

from moe_ep import EpConfig, ExpertWeights, MoEEpConfigError, MoEEpInputError, MoEEpLayer, fused_moe
from moe_ep.reference import moe_reference
from moe_ep.testing.properties import LAYER_NVFP4_TOL, LAYER_TOL, assert_rel_close
from moe_ep.testing.strategies import layer_cases, make_layer_inputs


@given(layer_cases())
def test_matches_the_dense_reference(dev, case):
    x, idx, wts, w13, w2 = make_layer_inputs(case)
    weights = ExpertWeights(w13.to(dev), w2.to(dev), case["wf"])
    out = fused_moe(x.to(dev), idx.to(dev), wts.to(dev), weights, activation_format=case["af"])
    d13, d2 = weights.dense()
    ref = moe_reference(x, idx, wts, d13.cpu(), d2.cpu())
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_rel_close(out, ref, torch.ones(case["B"], dtype=torch.bool),
                     LAYER_NVFP4_TOL if case["af"] == "nvfp4" else LAYER_TOL, "fused_moe")


@pytest.mark.parametrize("af", ["bf16", "nvfp4"])
def test_same_bits_as_the_world_1_layer(dev, af):
    """fused_moe is the layer's HT FLAT compute without the transport: the same kernels and tiles, so the same bits."""
    E, K, H, I, B = 4, 2, 64, 32, 5
    g = torch.Generator().manual_seed(2)
    weights = ExpertWeights((torch.randn(E, 2 * I, H, generator=g) / 8).to(dev), (torch.randn(E, H, I, generator=g) / 6).to(dev))
    x = torch.randn(B, H, generator=g).bfloat16().to(dev)
    idx = torch.tensor([[0, 1], [1, -1], [3, 2], [2, 0], [-1, -1]], device=dev)
    w = torch.rand(B, K, generator=g).to(dev)
    layer = MoEEpLayer(EpConfig(E, K, H, I, B, "ht", "flat", activation_format=af), weights)
    assert torch.equal(fused_moe(x, idx, w, weights, activation_format=af), layer(x, idx, w))


def test_unvalidated_out_of_range_ids_are_no_expert(dev):
    E, K, H, I = 4, 2, 32, 16
    weights = ExpertWeights(torch.randn(E, 2 * I, H).to(dev) / 6, torch.randn(E, H, I).to(dev) / 4)
    x, w = torch.randn(3, H).bfloat16().to(dev), torch.rand(3, K).to(dev)
    bad = torch.tensor([[0, 2 ** 40], [E, 1], [-7, 3]], device=dev)
    none = torch.tensor([[0, -1], [-1, 1], [-1, 3]], device=dev)
    assert torch.equal(fused_moe(x, bad, w, weights, validate=False), fused_moe(x, none, w, weights))


def _args(dev, **kw):
    E, K, H, I = 4, 2, 32, 16
    a = dict(hidden_states=torch.randn(3, H).bfloat16().to(dev), topk_idx=torch.tensor([[0, 1], [2, 3], [1, 0]]).to(dev),
             topk_weights=torch.rand(3, K).to(dev),
             weights=ExpertWeights(torch.randn(E, 2 * I, H).to(dev) / 6, torch.randn(E, H, I).to(dev) / 4))
    a.update(kw)
    return a


BAD = [  # (name, arguments changed, error, message fragment)
    ("weights_not_expert_weights", lambda d: dict(weights=torch.zeros(1)), MoEEpInputError, "type(weights)"),
    ("hidden_fp32", lambda d: dict(hidden_states=torch.randn(3, 32).to(d)), MoEEpInputError, "hidden_states.dtype"),
    ("hidden_wrong_width", lambda d: dict(hidden_states=torch.randn(3, 48).bfloat16().to(d)), MoEEpInputError,
     "hidden_states.shape"),
    ("idx_float", lambda d: dict(topk_idx=torch.zeros(3, 2).to(d)), MoEEpInputError, "topk_idx.dtype"),
    ("idx_out_of_range", lambda d: dict(topk_idx=torch.tensor([[0, 4], [2, 3], [1, 0]]).to(d)), MoEEpInputError,
     "topk_idx range = (0, 4)"),
    ("idx_duplicate", lambda d: dict(topk_idx=torch.tensor([[0, 0], [2, 3], [1, 0]]).to(d)), MoEEpInputError,
     "topk_idx[0]"),
    ("weights_nan", lambda d: dict(topk_weights=torch.tensor([[0.5, float("nan")]] * 3).to(d)), MoEEpInputError,
     "topk_weights holds NaN"),
    ("weights_shape", lambda d: dict(topk_weights=torch.rand(3, 3).to(d)), MoEEpInputError, "topk_weights.shape"),
    ("format_fp8", lambda d: dict(activation_format="fp8"), MoEEpInputError, "activation_format = 'fp8'"),
    ("static_scale_bf16", lambda d: dict(activation_global_scale=2.0), MoEEpInputError, "activation_global_scale"),
    ("static_scale_zero", lambda d: dict(activation_format="nvfp4", activation_global_scale=0.0), MoEEpInputError,
     "activation_global_scale = 0.0"),
    ("validate_str", lambda d: dict(validate="no"), MoEEpInputError, "validate = 'no'"),
    ("nvfp4_inf_token", lambda d: dict(activation_format="nvfp4",
                                       hidden_states=torch.tensor([[1.0] * 32, [float("inf")] * 32, [0.0] * 32])
                                       .bfloat16().to(d)), MoEEpInputError, "hidden_states[1] holds NaN or Inf"),
    ("requires_grad", lambda d: dict(topk_weights=torch.rand(3, 2).to(d).requires_grad_()), MoEEpInputError,
     "topk_weights.requires_grad"),
]


@pytest.mark.parametrize("name, change, error, says", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments(dev, name, change, error, says):
    import re
    with pytest.raises(error, match=re.escape(says)):
        fused_moe(**_args(dev, **change(dev)))
    assert error in (MoEEpInputError, MoEEpConfigError)
