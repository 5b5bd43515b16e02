"""The EP layer on R in {1, 2, 4} ranks (gloo, CPU) against the dense single-process MoE, every
algorithm/layout x weight format (+ NVFP4 activations), adversarial routings. One spawn per R."""

import pytest
import torch

from multirank import run_cases, spawn_and_check


def test_world_1_no_process_group():
    from moe_ep.triton_runtime import device
    fails = run_cases(0, 1, None, device())
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_gloo(world):
    if torch.cuda.is_available():
        pytest.skip("CPU ranks: the GPU variant is test_gpu_layer.py")
    fails = spawn_and_check(world)
    assert not fails, "\n".join(fails)
