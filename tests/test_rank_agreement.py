"""Ranks agree, or fail loudly and in bounded time (moe_ep.rank_agreement), on 2 and 4 gloo ranks (CPU).

One spawn per world size runs every scenario in order on every rank, each rank writing each scenario's outcome
(exception type, message, seconds) as it goes; the test then checks what every rank saw and how long it took.
The process group's timeout (PG_TIMEOUT) is far above every bound asserted here, so a rank left waiting for a
peer shows as a bound exceeded, never as a pass; the spawn itself is joined with a deadline and stragglers killed.
"""

import json
import os
import socket
import tempfile
import time
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.one_triton  # gloo ranks and timeouts: the same on every Triton (pyproject.toml)

E, K, H, I, T = 8, 2, 32, 32, 4
PG_TIMEOUT = 90        # the group's own timeout: what a peer would wait without the protocol
LAYER_TIMEOUT = 3      # MoEEpLayer(timeout=...) in the scenarios
BOUND = 40             # every scenario but the absent-peer one ends within this (s), on every rank
JOIN_DEADLINE = 420    # the whole spawn (imports, interpreter kernels on 2 shared cores)
LAYOUTS = [("ll", "expert_major"), ("ll", "rank_major"), ("ht", "flat"), ("ht", "expert_major")]


def _weights(rank, world, num_experts=E, wf="bf16", hidden=H):
    from moe_ep import ExpertWeights
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * I, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, I, generator=g) / I ** 0.5
    return ExpertWeights.from_global(w13, w2, rank, world, wf)


def _layer(rank, world, alg="ll", lay="expert_major", num_experts=E, wf="bf16", weights=None, sync=True):
    from moe_ep import EpConfig, MoEEpLayer
    cfg = EpConfig(num_experts, K, H, I, T, alg, lay, weight_format=wf)
    w = weights if weights is not None else _weights(rank, world, num_experts, wf)
    if sync:  # the ranks arrive together (NVFP4 weights take seconds to quantize in the interpreter)
        torch.distributed.barrier()
    return MoEEpLayer(cfg, w, timeout=LAYER_TIMEOUT)


def _inputs(rank, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=g)


def _dense_check(layer, x, idx, w):
    """The layer's output against the single-process reference (relative error bound of bf16)."""
    from moe_ep import ExpertWeights
    from moe_ep.reference import moe_reference
    full = _weights(0, 1)
    d13, d2 = ExpertWeights(full.w13, full.w2).dense()
    out, ref = layer(x, idx, w), moe_reference(x, idx, w, d13, d2)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"rel err {err}"


# ---- scenarios: each runs on every rank; its outcome is what it raised (or "ok") --------------------------------
def config_num_experts_differs(rank, world):
    _layer(rank, world, num_experts=16 if rank == world - 1 else E)


def config_layout_differs(rank, world):
    _layer(rank, world, *(("ht", "flat") if rank == world - 1 else ("ll", "expert_major")))


def config_weight_format_differs(rank, world):
    _layer(rank, world, wf="nvfp4" if rank == world - 1 else "bf16")


def construction_fails_on_last_rank(rank, world):
    _layer(rank, world, weights=_weights(rank, world, hidden=2 * H) if rank == world - 1 else None)


def forward_bad_dtype_on_last_rank_then_recovers(rank, world):
    layer = _layer(rank, world)
    x, idx, w = _inputs(rank)
    try:
        layer(x.float() if rank == world - 1 else x, idx, w)
    finally:  # every rank, failed or not, runs the next forward: the ranks are still in step
        _dense_check(layer, *_inputs(rank, seed=1))


def forward_bad_ids_validated_on_rank_0(rank, world):
    layer = _layer(rank, world, "ht", "flat")
    x, idx, w = _inputs(rank)
    if rank == 0:
        idx[1, 0] = 2 ** 31
    layer(x, idx, w)


def forward_two_ranks_fail(rank, world):
    layer = _layer(rank, world, "ll", "rank_major")
    x, idx, w = _inputs(rank)
    if rank == 0:
        w = w.double()
    if rank == world - 1:
        x = x[:, :16]
    layer(x, idx, w)


def unvalidated_out_of_range_ids_are_no_expert(rank, world):
    """validate=False: ids 2**40, E, -5 give exactly what -1 gives, every layout (never another expert)."""
    for alg, lay in LAYOUTS:
        layer = _layer(rank, world, alg, lay)
        x, idx, w = _inputs(rank, seed=2)
        bad = idx.clone()
        bad[0, 0], bad[1, 1], bad[2, 0] = 2 ** 40, E, -5
        none = idx.clone()
        none[0, 0], none[1, 1], none[2, 0] = -1, -1, -1
        want = layer(x, none, w).clone()
        got = layer(x, bad, w, validate=False)
        assert torch.equal(got, want), f"{alg}/{lay}: {(got.float() - want.float()).abs().max()}"


def peer_absent_at_construction(rank, world):
    """The last rank never builds its layer (here: it is late, past the others' timeout)."""
    if rank == world - 1:
        time.sleep(LAYER_TIMEOUT + 4)
        return
    _layer(rank, world, sync=False)


SCENARIOS = [config_num_experts_differs, config_layout_differs, config_weight_format_differs,
             construction_fails_on_last_rank, forward_bad_dtype_on_last_rank_then_recovers,
             forward_bad_ids_validated_on_rank_0, forward_two_ranks_fail, unvalidated_out_of_range_ids_are_no_expert,
             peer_absent_at_construction]  # the last one leaves the group unusable


def _rank_main(rank, world, port, out_dir):
    import torch.distributed as dist

    import moe_ep  # noqa: F401  (the interpreter before triton)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT))
    results = {}
    for fn in SCENARIOS:
        t0 = time.monotonic()
        try:
            fn(rank, world)
            outcome = ("ok", "")
        except Exception as e:  # noqa: BLE001  (the outcome is what the test checks)
            outcome = (type(e).__name__, str(e))
        results[fn.__name__] = (*outcome, time.monotonic() - t0)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    os._exit(0)  # the last scenario left a collective pending: no teardown that could wait on it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int) -> list[dict]:
    """Run every scenario on ``world`` gloo ranks; each rank's {scenario: (outcome, message, seconds)}."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, d)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_DEADLINE
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stragglers = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in stragglers:
            procs[r].kill()
            procs[r].join(10)
        out = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.json")
            if not os.path.exists(path):
                out.append({})
                continue
            with open(path) as f:
                out.append(json.load(f))
    assert not stragglers, f"ranks {stragglers} still running after {JOIN_DEADLINE} s: {out}"
    return out


def _expect(res, scenario, rank, kind, *fragments, bound=BOUND):
    got_kind, msg, secs = res[rank][scenario]
    assert got_kind == kind, f"{scenario} rank {rank}: {got_kind} {msg}"
    for frag in fragments:
        assert frag in msg, f"{scenario} rank {rank}: {frag!r} not in {msg!r}"
    assert secs < bound, f"{scenario} rank {rank}: {secs:.1f} s >= {bound} s"


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    if torch.cuda.is_available():
        pytest.skip("CPU ranks (gloo)")
    return request.param, spawn(request.param)


def test_every_rank_reported_every_scenario(results):
    world, res = results
    for r in range(world):
        assert set(res[r]) == {fn.__name__ for fn in SCENARIOS}, (r, res[r])


def test_config_disagreement_is_named_on_every_rank(results):
    world, res = results
    last = world - 1
    experts = ", ".join(f"rank {r} = {16 if r == last else 8}" for r in range(world))
    local = ", ".join(f"rank {r} = {(16 if r == last else 8) // world}" for r in range(world))
    for r in range(world):
        _expect(res, "config_num_experts_differs", r, "MoEEpConfigError", f"EpConfig.num_experts: {experts}",
                f"weights.num_local_experts: {local}")
        _expect(res, "config_layout_differs", r, "MoEEpConfigError", "EpConfig.algorithm: rank 0 = 'll'",
                f"rank {last} = 'ht'", "EpConfig.layout: rank 0 = 'expert_major'", f"rank {last} = 'flat'")
        _expect(res, "config_weight_format_differs", r, "MoEEpConfigError", "EpConfig.weight_format: rank 0 = 'bf16'",
                f"rank {last} = 'nvfp4'", "weights.format:")


def test_a_rank_failing_its_construction_checks_is_named_by_its_peers(results):
    world, res = results
    last = world - 1
    _expect(res, "construction_fails_on_last_rank", last, "MoEEpInputError", "weights (local experts, hidden")
    for r in range(last):
        _expect(res, "construction_fails_on_last_rank", r, "MoEEpPeerError",
                f"rank {last} failed to construct its MoEEpLayer: MoEEpInputError: weights (local experts, hidden")


def test_a_rank_failing_its_forward_checks_is_named_by_its_peers_and_all_go_on(results):
    world, res = results
    last = world - 1
    s = "forward_bad_dtype_on_last_rank_then_recovers"  # a failed _dense_check would show as AssertionError
    _expect(res, s, last, "MoEEpInputError", "hidden_states.dtype = torch.float32")
    for r in range(last):
        _expect(res, s, r, "MoEEpPeerError", f"rank {last} failed its forward checks: MoEEpInputError: "
                "hidden_states.dtype = torch.float32", "nothing was dispatched")
    s = "forward_bad_ids_validated_on_rank_0"
    _expect(res, s, 0, "MoEEpInputError", "topk_idx range")
    for r in range(1, world):
        _expect(res, s, r, "MoEEpPeerError", "rank 0 failed its forward checks: MoEEpInputError: topk_idx range")


def test_two_failing_ranks(results):
    world, res = results
    last, s = world - 1, "forward_two_ranks_fail"
    _expect(res, s, 0, "MoEEpInputError", "topk_weights.dtype = torch.float64")
    _expect(res, s, last, "MoEEpInputError", "hidden_states.shape")
    for r in range(1, last):
        _expect(res, s, r, "MoEEpPeerError", "rank 0 failed its forward checks: MoEEpInputError: topk_weights.dtype",
                f"rank {last} failed its forward checks: MoEEpInputError: hidden_states.shape")


def test_unvalidated_out_of_range_ids_are_no_expert(results):
    world, res = results
    for r in range(world):
        _expect(res, "unvalidated_out_of_range_ids_are_no_expert", r, "ok", bound=4 * BOUND)


def test_an_absent_peer_ends_in_the_layers_timeout(results):
    world, res = results
    s = "peer_absent_at_construction"
    for r in range(world - 1):
        _expect(res, s, r, "MoEEpPeerError", "not every rank of the group", f"within {LAYER_TIMEOUT} s",
                bound=LAYER_TIMEOUT + 10)
        assert res[r][s][2] >= LAYER_TIMEOUT - 0.5, res[r][s]
