"""Bad arguments to EpConfig, ExpertWeights and MoEEpLayer, one table: each case raises its named error whose
message names the argument (where the user wrote it), or gives an exact, safe result (SAME: the call returns
(got, want), compared with torch.equal)."""

import re
import threading

import numpy as np
import pytest
import torch

from moe_ep import (EpConfig, ExpertWeights, MoEEpConcurrentUseError, MoEEpConfigError, MoEEpInputError,
                    MoEEpLayer)
from moe_ep.triton_runtime import device

E, K, H, I, T = 4, 2, 32, 32, 4
BASE = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens_per_rank=T)
LAYOUTS = [("ll", "expert_major"), ("ll", "rank_major"), ("ht", "flat"), ("ht", "expert_major")]
SAME = "same"


def cfg(**kw):
    return EpConfig(**{**BASE, **kw})


def wts(L=E, dtype=torch.float32, wf="bf16", dev=None, fill=None, grad=False):
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(L, 2 * I, H, generator=g) / H ** 0.5, torch.randn(L, H, I, generator=g) / I ** 0.5
    if fill is not None:
        w13[0, 0, 0] = fill
    w13, w2 = (t.to(dtype).to(dev or device()).requires_grad_(grad) for t in (w13, w2))
    return ExpertWeights(w13, w2, wf)


def layer(alg="ll", lay="expert_major", **kw):
    return MoEEpLayer(cfg(algorithm=alg, layout=lay), wts(), **kw)


def inputs(B=3, idx=None, idx_dtype=torch.int64):
    g = torch.Generator().manual_seed(1)
    dev = device()
    x = torch.randn(B, H, generator=g).bfloat16().to(dev)
    idx = torch.tensor([[0, 1], [2, -1], [3, 0]] if idx is None else idx, dtype=idx_dtype).to(dev)
    return x, idx, torch.rand(B, K, generator=g).to(dev)


def same_as_no_expert(alg, lay, bad, idx_dtype=torch.int64):
    """validate=False with the out-of-range id ``bad`` at [0, 0] == the same call with -1 there."""
    m = layer(alg, lay)
    x, idx, w = inputs(idx_dtype=idx_dtype)
    bad_idx, none_idx = idx.clone(), idx.clone()
    bad_idx[0, 0], none_idx[0, 0] = bad, -1
    want = m(x, none_idx, w).clone()
    return m(x, bad_idx, w, validate=False), want


def concurrent_forward():
    """A second thread's forward while the first is inside the same layer's forward."""
    m = layer()
    inside, release = threading.Event(), threading.Event()
    real = m._run

    def slow_run(*a, **k):
        inside.set()
        release.wait(30)
        return real(*a, **k)
    m._run = slow_run
    t = threading.Thread(target=lambda: m(*inputs()))
    t.start()
    try:
        assert inside.wait(30)
        m(*inputs())
    finally:
        release.set()
        t.join(60)


def other_transport_gets_ids_in_range(monkeypatch):
    """A transport other than the portable one (which maps them itself) is handed out-of-range ids as -1."""
    seen = []

    class Spy:
        name, graph_capturable, replayable = "nccl_ep", False, False

        def dispatch(self, x, idx, w):
            seen.append(idx.clone())
            raise StopIteration
    monkeypatch.setattr("moe_ep.layer.make_transport", lambda *a, **k: Spy())
    m = layer()
    x, _, w = inputs()
    with pytest.raises(StopIteration):
        m(x, torch.tensor([[2 ** 40, 1], [-7, -1], [3, 2 ** 31]], device=x.device), w, validate=False)
    return seen[0], torch.tensor([[-1, 1], [-1, -1], [3, -1]], device=x.device)


def fresh_under_no_grad():
    m = layer()
    x, idx, w = inputs()
    want = m(x, idx, w).clone()
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.no_grad():
        return m(x, idx, w), want


def no_grad_weights():
    with torch.no_grad():
        a = wts(grad=True)
    b = wts()
    return a.w13, b.w13


def group_5_with_process_group():
    """A process group exists (world 1, gloo), but ``group`` is not one."""
    import tempfile

    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(f"{d}/store", 1), rank=0, world_size=1)
        try:
            layer(group=5)
        finally:
            dist.destroy_process_group()


def nvfp4_inf_token():
    m = MoEEpLayer(cfg(activation_format="nvfp4"), wts())
    x, idx, w = inputs()
    x[1, 5] = float("inf")
    m(x, idx, w)


def world2_shard_without_init():
    MoEEpLayer(cfg(), wts(L=E // 2))


CASES = [
    # EpConfig: wrong types and sizes, said as EpConfig.<field>
    ("config_num_experts_str", lambda: cfg(num_experts="4"), (MoEEpConfigError, "EpConfig.num_experts = '4'")),
    ("config_top_k_float", lambda: cfg(top_k=2.0), (MoEEpConfigError, "EpConfig.top_k = 2.0")),
    ("config_hidden_bool", lambda: cfg(hidden_size=True), (MoEEpConfigError, "EpConfig.hidden_size = True")),
    ("config_max_tokens_2_40", lambda: cfg(max_tokens_per_rank=2 ** 40),
     (MoEEpConfigError, "EpConfig.max_tokens_per_rank = 1099511627776; allowed: an int in [1, 2147483647]")),
    ("config_tokens_times_topk_int32", lambda: cfg(num_experts=8, top_k=4, max_tokens_per_rank=2 ** 30),
     (MoEEpConfigError, "max_tokens_per_rank * top_k")),
    ("config_algorithm_list", lambda: cfg(algorithm=["ll"]), (MoEEpConfigError, "EpConfig.algorithm = ['ll']")),
    ("config_layout_int", lambda: cfg(layout=3), (MoEEpConfigError, "EpConfig.layout = 3")),
    ("config_weight_format_none", lambda: cfg(weight_format=None), (MoEEpConfigError, "EpConfig.weight_format")),
    ("config_static_scale_with_bf16_activations", lambda: cfg(activation_global_scale=100.0),
     (MoEEpConfigError, "EpConfig.activation_global_scale = 100.0; allowed: None unless activation_format")),
    ("config_static_scale_zero", lambda: cfg(activation_format="nvfp4", activation_global_scale=0.0),
     (MoEEpConfigError, "EpConfig.activation_global_scale = 0.0")),
    ("config_static_scale_inf", lambda: cfg(activation_format="nvfp4", activation_global_scale=float("inf")),
     (MoEEpConfigError, "EpConfig.activation_global_scale = inf")),
    ("config_static_scale_str", lambda: cfg(activation_format="nvfp4", activation_global_scale="1"),
     (MoEEpConfigError, "EpConfig.activation_global_scale = '1'")),
    ("config_static_scale_tensor", lambda: cfg(activation_format="nvfp4", activation_global_scale=torch.tensor(2.0)),
     (MoEEpConfigError, "EpConfig.activation_global_scale = tensor(2.)")),
    ("config_numpy_int_taken_as_int", lambda: (torch.tensor(type(cfg(num_experts=np.int64(4)).num_experts) is int),
                                               torch.tensor(True)), SAME),
    # MoEEpLayer's own arguments, said as MoEEpLayer(<arg>=...)
    ("layer_group_5_no_process_group", lambda: layer(group=5), (MoEEpConfigError, "MoEEpLayer(group=...) = 5")),
    ("layer_group_5_with_process_group", group_5_with_process_group,
     (MoEEpConfigError, "type(MoEEpLayer(group=...)) = 'int'")),
    ("layer_cuda_graph_yes", lambda: layer(cuda_graph="yes"), (MoEEpConfigError, "MoEEpLayer(cuda_graph=...) = 'yes'")),
    ("layer_validate_no", lambda: layer(validate="no"), (MoEEpConfigError, "MoEEpLayer(validate=...) = 'no'")),
    ("layer_transport_int", lambda: layer(transport=5), (MoEEpConfigError, "MoEEpLayer(transport=...) = 5")),
    ("layer_timeout_negative", lambda: layer(timeout=-1), (MoEEpConfigError, "MoEEpLayer(timeout=...) = -1")),
    ("layer_timeout_str", lambda: layer(timeout="5"), (MoEEpConfigError, "MoEEpLayer(timeout=...) = '5'")),
    ("layer_config_none", lambda: MoEEpLayer(None, wts()), (MoEEpConfigError, "type(config)")),
    ("layer_shard_without_init_process_group", world2_shard_without_init,
     (MoEEpInputError, "torch.distributed is not initialized, so the world size is 1")),
    # ExpertWeights: one float rule (fp32/bf16/fp16, as routing weights), finite, in bf16's range, no autograd
    ("weights_float64", lambda: wts(dtype=torch.float64), (MoEEpInputError, "w13.dtype = torch.float64")),
    ("weights_int", lambda: wts(dtype=torch.int32), (MoEEpInputError, "w13.dtype = torch.int32")),
    ("weights_meta", lambda: wts(dev="meta"), (MoEEpInputError, "w13.device = 'meta'")),
    ("weights_beyond_bf16", lambda: wts(fill=3.4e38), (MoEEpInputError, "w13 max |value| = 3.4e+38")),
    ("weights_nan", lambda: wts(fill=float("nan")), (MoEEpInputError, "w13 holds NaN or Inf")),
    ("weights_inf_nvfp4", lambda: wts(fill=float("inf"), wf="nvfp4"), (MoEEpInputError, "w13 holds NaN or Inf")),
    ("weights_requires_grad", lambda: wts(grad=True), (MoEEpInputError, "w13.requires_grad = True")),
    ("weights_requires_grad_under_no_grad", no_grad_weights, SAME),
    ("weights_format_list", lambda: ExpertWeights(torch.zeros(1, 32, 16), torch.zeros(1, 16, 16), ["bf16"]),
     (MoEEpConfigError, "weight_format = ['bf16']")),
    ("from_global_not_a_tensor", lambda: ExpertWeights.from_global([[0]], torch.zeros(4, H, I), 0, 1),
     (MoEEpInputError, "w13_all.shape = 'list'")),
    ("from_global_bad_device", lambda: ExpertWeights.from_global(torch.zeros(4, 2 * I, H), torch.zeros(4, H, I), 0, 1,
                                                                 device="nope"), (MoEEpInputError, "device = 'nope'")),
    ("from_global_rank_float", lambda: ExpertWeights.from_global(torch.zeros(4, 2 * I, H), torch.zeros(4, H, I), 0.5, 1),
     (MoEEpInputError, "type(rank) = 'float'")),
    # forward
    ("forward_meta_inputs", lambda: layer()(*(t.to("meta") for t in inputs())),
     (MoEEpInputError, "hidden_states.device = 'meta'")),
    ("forward_hidden_requires_grad", lambda: layer()(inputs()[0].requires_grad_(), *inputs()[1:]),
     (MoEEpInputError, "hidden_states.requires_grad = True")),
    ("forward_weights_requires_grad", lambda: layer()(*inputs()[:2], inputs()[2].requires_grad_()),
     (MoEEpInputError, "topk_weights.requires_grad = True")),
    ("forward_requires_grad_under_no_grad", fresh_under_no_grad, SAME),
    ("forward_validate_str", lambda: layer()(*inputs(), validate="no"),
     (MoEEpConfigError, "forward(validate=...) = 'no'")),
    ("forward_float64_routing_weights", lambda: layer()(*inputs()[:2], inputs()[2].double()),
     (MoEEpInputError, "topk_weights.dtype = torch.float64")),
    ("forward_id_2_31_validated", lambda: layer()(*inputs(idx=[[0, 1], [2 ** 31, -1], [3, 0]])),
     (MoEEpInputError, "topk_idx range = (-1, 2147483648)")),
    ("forward_nvfp4_activations_inf_token_validated", nvfp4_inf_token,
     (MoEEpInputError, "hidden_states[1] holds NaN or Inf")),
    ("forward_concurrent_threads", concurrent_forward, (MoEEpConcurrentUseError, "another thread")),
    # validate=False: ids outside [0, E) are no expert, exactly, never another expert (int64 past int32 included)
    *[(f"unvalidated_id_2_32_plus_1_{a}_{lay}", lambda a=a, lay=lay: same_as_no_expert(a, lay, 2 ** 32 + 1), SAME)
      for a, lay in LAYOUTS],
    ("unvalidated_id_minus_2_32_plus_2", lambda: same_as_no_expert("ht", "flat", -2 ** 32 + 2), SAME),
    ("unvalidated_id_E_int32", lambda: same_as_no_expert("ll", "rank_major", E, torch.int32), SAME),
    ("unvalidated_other_transport_gets_minus_1", "monkeypatch", SAME),
]


@pytest.mark.parametrize("case,fn,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, fn, expected, monkeypatch):
    if fn == "monkeypatch":
        fn = lambda: other_transport_gets_ids_in_range(monkeypatch)  # noqa: E731
    if expected == SAME:
        got, want = fn()
        assert torch.equal(got, want), (got, want)
        return
    exc, fragment = expected
    with pytest.raises(exc, match=re.escape(fragment)):
        fn()


def test_the_table_is_large_enough():
    assert len(CASES) >= 25
