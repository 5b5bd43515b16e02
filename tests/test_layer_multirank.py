"""The EP layer on R in {1, 2, 4} ranks (gloo, CPU) against the dense single-process MoE, every
algorithm/layout x weight format (+ NVFP4 activations), adversarial routings. One spawn per R, which also runs
tests/test_hf.py's multi-rank checks."""

import importlib.util

import pytest
import torch

from multirank import LAYOUTS, case_id, matrix, run_cases, spawn_and_check


def test_matrix_covers_every_layout_weight_format_and_activation_pair():
    """The cases every world size runs (here and in tests/test_gpu_layer.py): each layout with each weight format,
    and each (weight, activation) format pair the layer accepts somewhere."""
    from moe_ep.config import ACTIVATION_FORMATS, Format
    cases = matrix()
    assert {(a, lay, wf) for a, lay, wf, _ in cases} == {(a, lay, f.value) for a, lay in LAYOUTS for f in Format}
    assert {(wf, af) for *_, wf, af in cases} == {(w.value, x.value) for w, xs in ACTIVATION_FORMATS.items() for x in xs}


@pytest.mark.parametrize("ci", range(len(matrix())), ids=[case_id(c) for c in matrix()])
def test_world_1_no_process_group(ci):
    """One case of the matrix at world size 1 without a process group, in the interpreter (each case its own test,
    so that workers share them)."""
    if torch.cuda.is_available():
        pytest.skip("the kernels' interpreter path: on a GPU the same cases are tests/test_gpu_layer.py's")
    fails = run_cases(0, 1, None, torch.device("cpu"), cases=[matrix()[ci]], first_index=ci)
    assert not fails, "\n".join(fails)


@pytest.mark.one_triton
@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_gloo(world):
    """The layer's matrix, then tests/test_hf.py's converted models (logits and greedy tokens against the
    unconverted model, each rank's shard), on the same spawned ranks."""
    if torch.cuda.is_available():
        pytest.skip("CPU ranks: the GPU variant is test_gpu_layer.py")
    fails = spawn_and_check(world, with_hf=importlib.util.find_spec("transformers") is not None)
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("alg, layout", LAYOUTS)
def test_layer_picks_gemm_tiles_by_the_expected_rows_per_expert(monkeypatch, alg, layout):
    """The expert MLP's tiles follow the rows an expert gets on average (world * batch * top_k / experts), not
    the layout's row capacity (every pick of every token, or every token per expert)."""
    import moe_ep.compute
    from moe_ep import EpConfig, ExpertWeights, MoEEpLayer
    from moe_ep.triton_runtime import device
    hints, real = [], moe_ep.compute.expert_mlp
    monkeypatch.setattr(moe_ep.compute, "expert_mlp", lambda *a, **k: hints.append(k["m_hint"]) or real(*a, **k))
    E, K, H, I, B = 8, 2, 32, 32, 12
    cfg = EpConfig(E, K, H, I, 16, alg, layout)
    assert cfg.tokens_per_expert(1, B) == 3 and cfg.tokens_per_expert(4, 1) == 1 and cfg.tokens_per_expert(2, 0) == 1
    dev = device()
    layer = MoEEpLayer(cfg, ExpertWeights.from_global(torch.randn(E, 2 * I, H), torch.randn(E, H, I), 0, 1,
                                                      device=dev))
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(B)]).to(dev)
    layer(torch.randn(B, H).bfloat16().to(dev), idx, torch.rand(B, K).to(dev))
    assert hints == [3]
