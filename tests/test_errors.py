"""Every bad config / input raises its named error, and the message names the field."""

import pytest
import torch

from moe_ep import EpConfig, ExpertWeights, MoEEpConfigError, MoEEpInputError, MoEEpLayer
from moe_ep.transports import make_transport
from moe_ep.triton_runtime import device

BASE = dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=32, max_tokens_per_rank=4)

CONFIG_CASES = [
    (dict(num_experts=0), "num_experts"),
    (dict(top_k=5), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(hidden_size=24), "hidden_size"),
    (dict(hidden_size=48, activation_format="nvfp4"), "hidden_size"),
    (dict(intermediate_size=40), "intermediate_size"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
    (dict(algorithm="ht", layout="rank_major"), "layout"),
    (dict(algorithm="ll", layout="flat"), "layout"),
    (dict(algorithm="fast"), "algorithm"),
    (dict(weight_format="fp4"), "weight_format"),
    (dict(activation_format="fp8"), "activation_format"),   # FP8 activations need FP8 weights
]


@pytest.mark.parametrize("change,field", CONFIG_CASES)
def test_bad_config(change, field):
    with pytest.raises(MoEEpConfigError, match=field):
        EpConfig(**{**BASE, **change})


def test_experts_not_divisible_by_world():
    with pytest.raises(MoEEpConfigError, match="num_experts"):
        EpConfig(**{**BASE, "num_experts": 6}).local_experts(4)
    with pytest.raises(MoEEpConfigError, match="num_experts"):
        ExpertWeights.from_global(torch.zeros(6, 64, 32), torch.zeros(6, 32, 32), 0, 4)


def test_unknown_transport():
    with pytest.raises(MoEEpConfigError, match="transport"):
        make_transport("carrier-pigeon", EpConfig(**BASE))
    with pytest.raises(MoEEpConfigError, match="transport"):
        _layer(transport="carrier-pigeon")


def _layer(wf="bf16", **kw):
    dev = device()
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights(torch.randn(4, 64, 32, generator=g).to(dev), torch.randn(4, 32, 32, generator=g).to(dev), wf)
    return MoEEpLayer(EpConfig(**BASE, weight_format=wf), w, **kw)


def test_bad_weights():
    dev = device()
    cfg = EpConfig(**BASE)
    with pytest.raises(MoEEpInputError, match="weights"):  # 2 local experts, config wants 4
        MoEEpLayer(cfg, ExpertWeights(torch.zeros(2, 64, 32, device=dev), torch.zeros(2, 32, 32, device=dev)))
    with pytest.raises(MoEEpInputError, match="w2.shape"):
        ExpertWeights(torch.zeros(4, 64, 32), torch.zeros(4, 32, 16))
    with pytest.raises(MoEEpConfigError, match="weights.format"):
        MoEEpLayer(cfg, ExpertWeights(torch.zeros(4, 64, 32, device=dev), torch.zeros(4, 32, 32, device=dev),
                                      "nvfp4"))


def _inputs(B=3):
    dev = device()
    return (torch.randn(B, 32, device=dev).bfloat16(), torch.tensor([[0, 1], [2, -1], [-1, -1]] * (B // 3 + 1),
            device=dev)[:B], torch.rand(B, 2, device=dev))


INPUT_CASES = [
    ("hidden_states.shape", lambda x, i, w: (x[:, :16], i, w)),
    ("hidden_states.dtype", lambda x, i, w: (x.float(), i, w)),
    ("hidden_states.shape", lambda x, i, w: (x[0], i, w)),
    ("topk_idx.shape", lambda x, i, w: (x, i[:, :1], w)),
    ("topk_idx.shape", lambda x, i, w: (x, i[:2], w)),
    ("topk_idx.dtype", lambda x, i, w: (x, i.float(), w)),
    ("topk_weights.shape", lambda x, i, w: (x, i, w[:, :1])),
    ("topk_weights.dtype", lambda x, i, w: (x, i, w.to(torch.int32))),
    ("topk_idx range", lambda x, i, w: (x, torch.where(i == 2, 4, i), w)),
    ("topk_idx range", lambda x, i, w: (x, torch.where(i == -1, -2, i), w)),
    (r"topk_idx\[0\]", lambda x, i, w: (x, torch.where(i == 1, 0, i), w)),
    ("topk_weights holds NaN", lambda x, i, w: (x, i, w.masked_fill(w > -1, float("nan")))),
    ("type.topk_idx", lambda x, i, w: (x, i.tolist(), w)),
]


@pytest.mark.parametrize("field,mutate", INPUT_CASES)
def test_bad_input(field, mutate):
    layer = _layer()
    with pytest.raises(MoEEpInputError, match=field.replace("type.", r"type\(") + (r"\)" if "type." in field else "")):
        layer(*mutate(*_inputs()))


def test_too_many_tokens():
    with pytest.raises(MoEEpInputError, match="max_tokens_per_rank"):
        _layer()(*_inputs(5))


def test_device_mismatch():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices (cpu and cuda)")
    x, i, w = _inputs()
    with pytest.raises(MoEEpInputError, match="device"):
        _layer()(x.cpu(), i, w)


def test_cuda_graph_needs_a_capturable_transport_and_cuda_weights(monkeypatch):
    with pytest.raises(MoEEpConfigError, match="cuda_graph"):
        _layer().graph_inputs(2)
    if device().type == "cpu":
        with pytest.raises(MoEEpConfigError, match="CUDA weights"):
            _layer(cuda_graph=True)

    class Syncing:  # a transport whose dispatch needs the host (the portable one with several ranks)
        name, graph_capturable, replayable = "torch", False, False
    monkeypatch.setattr("moe_ep.layer.make_transport", lambda *a, **k: Syncing())
    with pytest.raises(MoEEpConfigError, match="world size 1"):
        _layer(cuda_graph=True)


def test_validate_off_skips_value_checks(monkeypatch):
    """validate=False (per call or per layer) skips the value checks (and their host sync); True keeps them."""
    x, i, w = _inputs()
    dup = torch.where(i == 1, 0, i)  # row 0 picks expert 0 twice: only the value checks catch that
    for layer, kw in ((_layer(), dict(validate=False)), (_layer(validate=False), {})):
        layer(x, dup, w, **kw)  # no error: not checked
        calls = []
        monkeypatch.setattr(layer, "_check_values", lambda *a, calls=calls: calls.append(a))
        layer(x, i, w, **kw)
        assert not calls, "validate=False still ran the value checks"
    with pytest.raises(MoEEpInputError, match=r"topk_idx\[0\]"):
        _layer()(x, dup, w)
    with pytest.raises(MoEEpInputError, match=r"topk_idx\[0\]"):
        _layer(validate=False)(x, dup, w, validate=True)
