"""GPU-only layer tests (marked gpu, skipped without CUDA): world size 1 on cuda for every layout, two
ranks sharing the GPU (gloo, CUDA tensors staged through host memory), CUDA-graph capture of LL."""

import pytest
import torch

from multirank import CFG, LAYOUTS, case_id, matrix, run_cases, spawn_and_check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ci", range(len(matrix())), ids=[case_id(c) for c in matrix()])
def test_world_1_cuda_all_layouts(ci):
    """One case of the layer's matrix at world size 1 on cuda (each case its own test, so that workers share them)."""
    fails = run_cases(0, 1, None, torch.device("cuda"), cases=[matrix()[ci]], first_index=ci)
    assert not fails, "\n".join(fails)


def test_two_ranks_share_the_gpu_gloo_staged():
    fails = spawn_and_check(2, use_cuda=True)
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("wf,af", [("bf16", "bf16"), ("nvfp4", "bf16"), ("bf16", "nvfp4")])
def test_cuda_graph_capture_and_replay_ll(layout, wf, af):
    from moe_ep import EpConfig, ExpertWeights, MoEEpLayer
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    E, H, I, K, T = CFG["num_experts"], 256, 512, CFG["top_k"], 64
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dev)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dev)
    cfg = EpConfig(E, K, H, I, T, "ll", layout, wf, af)
    layer = MoEEpLayer(cfg, ExpertWeights(w13, w2, wf))
    B = 48
    x = torch.randn(B, H, device=dev).bfloat16()
    idx = torch.rand(B, E, device=dev).topk(K, dim=1).indices
    idx[::5, 1] = -1
    w = torch.rand(B, K, device=dev)
    for _ in range(2):  # warm up: autotune, buffers
        layer(x, idx, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, idx, w)
    for step in range(3):  # new inputs in the captured buffers, replay, compare with eager
        x.copy_(torch.randn(B, H, device=dev).bfloat16())
        idx.copy_(torch.rand(B, E, device=dev).topk(K, dim=1).indices)
        idx[step::3, 0] = -1
        w.copy_(torch.rand(B, K, device=dev))
        graph.replay()
        torch.cuda.synchronize()
        eager = layer(x, idx, w)
        assert torch.equal(out, eager), (step, (out.float() - eager.float()).abs().max())


@pytest.mark.parametrize("alg,layout", LAYOUTS)
def test_cuda_graph_forward_matches_eager(alg, layout):
    """MoEEpLayer(cuda_graph=True): one graph per (batch size, dtypes), inputs copied in or filled in place;
    every replay equals the eager layer on the same new inputs."""
    from moe_ep import EpConfig, ExpertWeights, MoEEpLayer
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    E, H, I, K, T = CFG["num_experts"], 256, 512, CFG["top_k"], 64
    weights = ExpertWeights((torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dev),
                            (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dev))
    cfg = EpConfig(E, K, H, I, T, alg, layout)
    graphed, eager = MoEEpLayer(cfg, weights, cuda_graph=True), MoEEpLayer(cfg, weights)

    def fill(x, idx, w, step):
        x.copy_(torch.randn(x.shape, device=dev).bfloat16())
        idx.copy_(torch.rand(x.shape[0], E, device=dev).topk(K, dim=1).indices)
        idx[step::3, 0] = -1
        w.copy_(torch.rand(w.shape, device=dev))
    for step, (B, idt) in enumerate([(48, torch.int64), (17, torch.int64), (48, torch.int32), (48, torch.int64)]):
        x, idx, w = (torch.empty(B, H, device=dev, dtype=torch.bfloat16), torch.empty(B, K, device=dev, dtype=idt),
                     torch.empty(B, K, device=dev))
        fill(x, idx, w, step)
        out = graphed(x, idx, w).clone()
        ref = eager(x, idx, w)
        assert torch.equal(out, ref), (step, (out.float() - ref.float()).abs().max())
    assert len(graphed._graphs.graphs) == 3  # (48, int64) captured once, replayed at step 3
    static = graphed.graph_inputs(48)
    for step in range(2):  # in place: no input copy
        fill(*static, step)
        out = graphed(*static).clone()
        assert torch.equal(out, eager(*static)), step


def test_cuda_graph_static_inputs_still_validated():
    from moe_ep import EpConfig, ExpertWeights, MoEEpInputError, MoEEpLayer
    dev = torch.device("cuda")
    E, H, I, K = CFG["num_experts"], 256, 512, CFG["top_k"]
    weights = ExpertWeights(torch.randn(E, 2 * I, H, device=dev) / H ** 0.5,
                            torch.randn(E, H, I, device=dev) / I ** 0.5)
    layer = MoEEpLayer(EpConfig(E, K, H, I, 32, "ll", "expert_major"), weights, cuda_graph=True)
    x, idx, w = layer.graph_inputs(32)
    layer(x, idx, w)  # the buffers start valid (distinct ids per row)
    idx[3, 1] = idx[3, 0]
    with pytest.raises(MoEEpInputError, match=r"topk_idx\[3\]"):
        layer(x, idx, w)
    layer(x, idx, w, validate=False)  # the caller's call: no check, no sync
