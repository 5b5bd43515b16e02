"""NVFP4 activations keep tokens apart: a token's codes, and its layer output, do not depend on the other tokens of
its batch (per-token global scales, or one static scale), and a non-finite token is reported (validate) or comes
out NaN alone. The checks are moe_ep.testing.properties' (also run by ``moe-ep fuzz``)."""

import pytest
import torch
from hypothesis import given

from moe_ep import EpConfig, ExpertWeights, MoEEpLayer
from moe_ep.kernels import quantize_nvfp4_tokens
from moe_ep.testing import properties as P
from moe_ep.testing.strategies import LAYER_LAYOUTS, layer_cases, quant_cases


@given(quant_cases())
def test_token_quantization_matches_the_reference_and_ignores_the_company(dev, case):
    P.check_quantize_tokens(case, dev)


@given(layer_cases())
def test_layer_output_of_a_token_ignores_the_company(dev, case):
    P.check_layer_batch_invariance(case, dev)


@pytest.mark.parametrize("layout", LAYER_LAYOUTS)
@pytest.mark.parametrize("wf, static", [("bf16", False), ("nvfp4", True)])
def test_every_layout_is_batch_invariant(dev, layout, wf, static):
    case = dict(E=4, K=2, H=64, I=32, B=6, layout=layout, wf=wf, af="nvfp4", routing="random", seed=7 + static)
    P.check_layer_batch_invariance(case, dev)


@pytest.mark.parametrize("wf, af", [("bf16", "nvfp4"), ("fp8", "bf16"), ("fp8", "fp8")])
def test_nan_and_inf_tokens_stay_apart_when_unvalidated(dev, wf, af):
    """validate=False: a NaN and an Inf token come out NaN; every other token equals its output alone (FP8: the
    tokens are quantized per token too, before dispatch or after it)."""
    E, K, H, I = 4, 2, 64, 32
    g = torch.Generator().manual_seed(3)
    cfg = EpConfig(E, K, H, I, 4, "ht", "flat", weight_format=wf, activation_format=af)
    layer = MoEEpLayer(cfg, ExpertWeights(torch.randn(E, 2 * I, H, generator=g).to(dev) / 8,
                                          torch.randn(E, H, I, generator=g).to(dev) / 6, wf), validate=False)
    x = torch.randn(4, H, generator=g).bfloat16()
    x[1, 3], x[2, 9] = float("nan"), float("-inf")
    idx, w = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]), torch.rand(4, K, generator=g)
    out = layer(x.to(dev), idx.to(dev), w.to(dev)).cpu()
    assert torch.isnan(out[1:3]).all()
    for b in (0, 3):
        alone = layer(x[b:b + 1].to(dev), idx[b:b + 1].to(dev), w[b:b + 1].to(dev)).cpu()
        assert torch.isfinite(out[b]).all()
        assert (out[b] - alone[0]).abs().max() <= 1e-2 * alone[0].abs().max()  # other batch size: other tiles


def test_static_scale_is_used_for_every_token(dev):
    x = torch.randn(3, 32).bfloat16().to(dev)
    q = quantize_nvfp4_tokens(x, 512.0)
    assert q.global_scale.shape == (3,) and bool((q.global_scale == 512.0).all())
