"""The ``moe-ep`` subcommands at tiny sizes (CPU: kernels through the interpreter): exit codes, output files,
tuned configs loaded by the kernels, fuzz failing loudly on a planted mismatch."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import moe_ep
from moe_ep import options
from moe_ep.cli import main
from moe_ep.commands.common import PRESETS, get_preset
from moe_ep.triton_runtime import device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--hidden", "64", "--intermediate", "32", "--experts", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_info_process_exit_code_and_json(tmp_path):
    out = tmp_path / "info.json"
    p = subprocess.run([sys.executable, "-m", "moe_ep.cli", "info", "--json", str(out)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "transports" in p.stdout and "tuned configs" in p.stdout
    info = json.loads(out.read_text())
    assert {t["name"] for t in info["transports"]} >= {"torch"}
    assert all("reason" in t for t in info["transports"])
    assert info["versions"]["torch"] == torch.__version__
    for t in info["transports"]:  # the install hint prints as written (rich would eat "[nccl]" as markup)
        if not t["available"] and t["install"].startswith("pip"):
            assert t["install"] in p.stdout, (t["install"], p.stdout)


def test_bench_small_preset_writes_json_and_png(tmp_path, capsys):
    rc = main(["bench", "--preset", "small", "--tokens", "2", "--kernels", "mlp,quant,bridge,layer",
               "--layouts", "ll-expert_major", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["world_size"] == 1 and res["presets"][0]["name"] == "small"
    assert res["ceilings"] == {"bandwidth": 4.8e12, "peak_flops": 795e12}
    kernels = {r["kernel"] for r in res["rows"]}
    assert kernels == {"mlp", "quant", "bridge", "layer[ll-expert_major]"}
    for r in res["rows"]:
        assert r["tokens"] == 2 and r["ours_us"] > 0 and r["peer_us"] > 0 and r["peer"]
        assert r["floor_us"] > 0 and 0 < r["pct_floor"] and r["peer_pct_floor"] > 0
    rows = {r["kernel"]: r for r in res["rows"]}
    assert rows["quant"]["diff"] == 0.0  # bit-exact against the reference
    assert rows["mlp"]["diff"] < 2e-2 and rows["layer[ll-expert_major]"]["diff"] < 2e-2
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC
    assert "% floor" in capsys.readouterr().out


def test_bench_without_grouped_mm_names_the_reference_peer(tmp_path, monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    rc = main(["bench", *TINY, "--tokens", "1", "--kernels", "mlp", "--out", str(tmp_path)])
    assert rc == 0
    row = json.loads((tmp_path / "bench.json").read_text())["rows"][0]
    assert row["peer"].startswith("torch reference") and "_grouped_mm" in row["peer"]
    assert row["diff"] < 2e-2


def test_unknown_preset_is_a_named_error_listing_the_allowed(capsys, tmp_path):
    with pytest.raises(moe_ep.MoEEpInputError, match="deepseek-v3.*qwen3-30b-a3b.*mixtral-8x7b.*small"):
        get_preset("llama")
    assert main(["bench", "--preset", "llama", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "MoEEpInputError" in err and "allowed" in err and "small" in err
    assert main(["tune", "--buckets", "0", *TINY]) == 2
    assert main(["fuzz", "--targets", "nope"]) == 2


def test_presets_match_the_models():
    assert PRESETS["deepseek-v3"].local_experts == 32 and PRESETS["deepseek-v3"].hidden == 7168
    assert (PRESETS["qwen3-30b-a3b"].experts, PRESETS["qwen3-30b-a3b"].intermediate) == (128, 768)
    assert (PRESETS["mixtral-8x7b"].top_k, PRESETS["mixtral-8x7b"].intermediate) == (2, 14336)


def test_tune_writes_configs_the_kernels_load_and_resumes(tmp_path, monkeypatch, capsys):
    from moe_ep import device_facts, options
    from moe_ep.kernels import grouped_gemm
    from moe_ep.kernels.grouped_gemm.config_space import config_dict, grouped_gemm_configs, shape_class
    with options.override(config_dir=str(tmp_path)):  # the folder the tune run writes and the kernels read
        rc = main(["tune", *TINY, "--gemms", "gemm1", "--formats", "bf16", "--buckets", "64",
                   "--report", str(tmp_path / "report.json")])
        assert rc == 0
        path = tmp_path / f"{device_facts.device_name()}.json"
        table = json.loads(path.read_text())
        key = shape_class(32, 64, False, True)
        cfg = table[key]["64"]
        assert json.loads((tmp_path / "report.json").read_text())["shapes"][0]["best"] == cfg

        def run_kernel():
            dev = device()
            x = torch.randn(128, 64, device=dev).to(torch.bfloat16)
            w = torch.randn(2, 64, 64, device=dev).to(torch.bfloat16)
            return grouped_gemm(x, w, offsets=torch.tensor([0, 64, 128], device=dev), swiglu=True, m_hint=64,
                                return_plan=True)[1]

        launch = run_kernel()
        assert launch.config_source == "tuned-file" and launch.config == cfg
        # the kernels read the file, not a cached answer: plant the other config of the space there
        other = next(c for c in grouped_gemm_configs() if c.kwargs["BLOCK_M"] != cfg["BLOCK_M"])
        table[key]["64"] = config_dict(other)
        path.write_text(json.dumps(table))
        os.utime(path, (1, 1))  # a different mtime (the loader caches per mtime)
        assert run_kernel().config == config_dict(other)
        # resumable: a rerun skips the shape already in the file
        capsys.readouterr()
        assert main(["tune", *TINY, "--gemms", "gemm1", "--formats", "bf16", "--buckets", "64"]) == 0
        assert "skipped" in capsys.readouterr().out
        assert json.loads(path.read_text())[key]["64"] == config_dict(other)


def test_routed_offsets_spread_rows_around_the_mean():
    from moe_ep.commands.common import routed_offsets
    offs = routed_offsets(32, 16, torch.device("cpu"))
    counts = offs[1:] - offs[:-1]
    assert offs.dtype == torch.int32 and offs[0] == 0 and offs[-1] == 32 * 16 and bool((counts >= 0).all())
    assert counts.max() > 16 > counts.min()  # spread, as a router spreads tokens (not 16 each)
    assert torch.equal(offs, routed_offsets(32, 16, torch.device("cpu")))  # seeded: every run tunes the same rows


def test_fuzz_passes_on_the_real_kernels(tmp_path, monkeypatch):
    """(Untimed first configs for the run, and the caller's options as they were afterwards.)"""
    monkeypatch.delenv("MOE_EP_AUTOTUNE", raising=False)
    before = options.reload()  # autotune on, not set by the caller: fuzz turns the search off for its run
    assert main(["fuzz", "--targets", "quantize,gather_quantize,route,grouped_gemm", "--examples", "4",
                 "--database", str(tmp_path / "db")]) == 0
    assert options.current() == before and options.current().autotune


def test_fuzz_jobs_runs_targets_in_parallel_processes(tmp_path, capsys):
    assert main(["fuzz", "--targets", "quantize,route,permute", "--examples", "3", "--jobs", "2",
                 "--database", str(tmp_path / "db")]) == 0
    out = capsys.readouterr().out
    for t in ("quantize", "route", "permute"):  # each child's report, then the joint table
        assert f"  {t}: ok after 3 example(s)" in out
        assert out.rindex(t) > out.rindex("moe-ep fuzz")


def test_fuzz_shard_plan_splits_targets_and_their_examples():
    from moe_ep.commands.fuzz import shard_plan
    assert shard_plan(["a", "b"], 1, 10) == [("a", 0, 10), ("b", 0, 10)]
    assert shard_plan(["a", "b"], 5, 10) == [("a", 0, 4), ("a", 1, 3), ("a", 2, 3), ("b", 0, 5), ("b", 1, 5)]
    assert shard_plan(["a"], 3, 2) == [("a", 0, 1), ("a", 1, 1)]  # no shard is left with zero examples
    assert shard_plan(["a"], 2, None) == [("a", 0, None), ("a", 1, None)]


def test_fuzz_jobs_shards_one_target_and_sums_its_examples(tmp_path, capsys):
    assert main(["fuzz", "--targets", "route", "--examples", "5", "--jobs", "2",
                 "--database", str(tmp_path / "db")]) == 0
    out = capsys.readouterr().out
    assert "  route: ok after 3 example(s)" in out and "  route: ok after 2 example(s)" in out
    table = out[out.rindex("moe-ep fuzz"):]
    assert table.count("route") == 1 and " 5 " in table.split("route")[1].splitlines()[0]


def test_fuzz_jobs_reports_a_child_that_died(tmp_path, monkeypatch, capsys):
    from moe_ep.commands import fuzz
    monkeypatch.setattr(fuzz, "_child_argv", lambda *a: [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert main(["fuzz", "--targets", "quantize,route", "--jobs", "2", "--database", str(tmp_path / "db")]) == 1
    assert "exited with code 3" in capsys.readouterr().out


def test_fuzz_planted_mismatch_exits_nonzero_with_a_reproduction(tmp_path, monkeypatch, capsys):
    from moe_ep.kernels import bridge
    orig = bridge.unpermute_reduce

    def wrong(y, route, weights=None, **kw):
        out = orig(y, route, weights, **kw)
        if out.shape[0] > 2:
            out[2] += 1.0
        return out

    monkeypatch.setattr(bridge, "unpermute_reduce", wrong)
    db = str(tmp_path / "db")
    rc = main(["fuzz", "--targets", "unpermute_reduce", "--examples", "40", "--database", db])
    out = capsys.readouterr().out
    assert rc == 1
    assert "MISMATCH in unpermute_reduce" in out and "relative error" in out
    assert "Falsifying" in out or "Failing test case" in out  # hypothesis' shrunk counterexample
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("moe-ep fuzz --targets"))
    assert "--reproduce" in line and db in line
    # the printed command reproduces it, even with a fresh database
    argv = line.split()[1:]
    argv[argv.index("--database") + 1] = str(tmp_path / "fresh")
    assert main(argv) == 1
    assert "after 1 example" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(
    sys.executable), "torchrun")), reason="torchrun not installed")
def test_bench_under_torchrun_two_ranks(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run([torchrun if os.path.exists(torchrun) else "torchrun", "--nproc-per-node", "2",
                        "-m", "moe_ep.cli", "bench", *TINY, "--tokens", "2", "--kernels", "quant,layer",
                        "--layouts", "ht-flat", "--out", str(tmp_path)],
                       env=_env(), capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["world_size"] == 2
    assert {r["rank"] for r in res["rows"]} == {0, 1}
    layer = [r for r in res["rows"] if r["kernel"].startswith("layer")]
    assert len(layer) == 2  # each rank's output against the dense MoE over both ranks' experts: the real error
    assert all(r["diff"] < 2e-2 and "all experts" in r["diff_kind"] for r in layer), layer
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.skipif(torch.cuda.is_available(), reason="the timing of a run without a GPU")
def test_timing_without_a_gpu_is_one_wall_clock_call_in_seconds():
    import time

    from moe_ep.commands import timing
    calls = []

    def nap():
        calls.append(1)
        time.sleep(0.02)
    ours, peer, how = timing.time_pair(nap, nap)
    loop = timing.time_loop(nap, iters=5, warmup=2)
    for t in (timing.time_call(nap), timing.time_graph(nap), ours, peer, loop.device, loop.host):
        assert 0.02 <= t < 1.0, t
    assert how == "eager" and len(calls) == 5  # one call each: through the interpreter a call costs seconds
