"""The ``moe-ep`` subcommands at tiny sizes (CPU: kernels through the interpreter): exit codes, output files,
tuned configs loaded by the kernels, fuzz failing loudly on a planted mismatch."""

import argparse
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
from moe_ep.triton_runtime import INTERPRETER, device

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
    assert [f["name"] for f in info["fast_paths"]] == ["gluon-fp8", "gluon-nvfp4", "sm100-fp4"]
    assert "fast paths" in p.stdout
    if INTERPRETER:
        assert not any(f["taken"] for f in info["fast_paths"]) and all(f["reason"] for f in info["fast_paths"])


def test_info_says_when_the_gluon_fp8_path_is_taken(monkeypatch):
    """``moe-ep info``'s fast-path rows follow the dispatcher: not taken where the kernels cannot run (the reason
    named), not taken while MOE_EP_GLUON_FP8_MIN_M is off (saying what to set), taken from its bucket on."""
    from moe_ep.commands.info import fast_paths
    from moe_ep.kernels.grouped_gemm import gluon_fp8
    monkeypatch.setattr(gluon_fp8, "not_dispatchable_reason", lambda: "needs an sm_90 GPU")
    monkeypatch.setattr(gluon_fp8, "dispatchable", lambda: False)
    with options.override(gluon_fp8_min_m=128):
        row = fast_paths()[0]
    assert (row["name"], row["taken"], row["reason"]) == ("gluon-fp8", False, "needs an sm_90 GPU")
    monkeypatch.setattr(gluon_fp8, "not_dispatchable_reason", lambda: None)
    monkeypatch.setattr(gluon_fp8, "dispatchable", lambda: True)
    with options.override(gluon_fp8_min_m="off"):
        row = fast_paths()[0]
    assert not row["taken"] and "MOE_EP_GLUON_FP8_MIN_M" in row["reason"] and "128" in row["reason"]
    with options.override(gluon_fp8_min_m=256):
        row = fast_paths()[0]
    assert row["taken"] and "from 256 tokens per expert" in row["reason"]


def test_fast_paths_name_why_they_do_not_run(monkeypatch):
    """The reasons ``available`` / ``dispatchable`` say no: no GPU of the capability (the one there named), or a
    Triton outside the checked ones."""
    import types

    from moe_ep import device_facts
    from moe_ep.kernels.grouped_gemm import gluon_fp8, sm100_fp4
    monkeypatch.setattr(sm100_fp4, "INTERPRETER", False)
    monkeypatch.setattr(device_facts, "properties", lambda: types.SimpleNamespace(major=9, minor=0))
    assert "this one is 9.0" in sm100_fp4.unavailable_reason() and not sm100_fp4.available()
    monkeypatch.setattr(device_facts, "properties", lambda: types.SimpleNamespace(major=10, minor=0))
    monkeypatch.setattr(sm100_fp4.triton, "__version__", "3.8.0")
    assert "Triton 3.8.0" in sm100_fp4.unavailable_reason() and not sm100_fp4.available()
    monkeypatch.setattr(sm100_fp4.triton, "__version__", "3.9.0")
    assert sm100_fp4.unavailable_reason() is None and sm100_fp4.available()
    monkeypatch.setattr(gluon_fp8, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gluon_fp8.triton, "__version__", "3.8.0")
    assert "Triton 3.8.0" in gluon_fp8.not_dispatchable_reason()
    monkeypatch.setattr(gluon_fp8.triton, "__version__", "3.6.0")
    assert gluon_fp8.not_dispatchable_reason() is None


def test_bench_small_preset_writes_json_and_png(tmp_path, capsys):
    rc = main(["bench", "--preset", "small", "--tokens", "2", "--kernels", "mlp,mlp-fp8,quant,bridge,layer",
               "--layouts", "ll-expert_major", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["world_size"] == 1 and res["presets"][0]["name"] == "small"
    assert res["ceilings"] == {"bandwidth": 4.8e12, "peak_flops": 795e12, "peak_flops_fp8": 1979e12}
    kernels = {r["kernel"] for r in res["rows"]}
    assert kernels == {"mlp", "mlp-fp8", "quant", "bridge", "layer[ll-expert_major]"}
    for r in res["rows"]:
        assert r["tokens"] == 2 and r["ours_us"] > 0 and r["peer_us"] > 0 and r["peer"]
        assert r["floor_us"] > 0 and 0 < r["pct_floor"] and r["peer_pct_floor"] > 0
    rows = {r["kernel"]: r for r in res["rows"]}
    assert rows["quant"]["diff"] == 0.0  # bit-exact against the reference
    assert rows["mlp"]["diff"] < 2e-2 and rows["layer[ll-expert_major]"]["diff"] < 2e-2
    assert rows["mlp-fp8"]["diff"] < 0.12  # W8A8 against the bf16 peer: x, weights, intermediate rounded to e4m3
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
    from moe_ep.kernels.grouped_gemm import tuned_files
    from moe_ep.kernels.grouped_gemm.config_space import config_dict, grouped_gemm_configs, shape_class
    with options.override(config_dir=str(tmp_path)):  # the folder the tune run writes and the kernels read
        written = str(tmp_path / f"{device_facts.device_name()}.json")
        # a stat before the run (kept for RESTAT_S; a GPU has its shipped file): tune must drop it
        assert written not in [p for p, _ in tuned_files.file_versions()]
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
        tuned_files.invalidate()  # (a hand edit is seen within tuned_files.RESTAT_S; at once after this)
        assert run_kernel().config == config_dict(other)
        # resumable: a rerun skips the shape already in the file
        capsys.readouterr()
        assert main(["tune", *TINY, "--gemms", "gemm1", "--formats", "bf16", "--buckets", "64"]) == 0
        assert "skipped" in capsys.readouterr().out
        assert json.loads(path.read_text())[key]["64"] == config_dict(other)


def test_tune_fp8_writes_fp8_keys_the_fp8_gemms_load(tmp_path):
    """``--formats fp8``: both GEMMs tuned under FP8 keys of their own (GEMM1 with its FP8 output), and an FP8 call of
    that shape takes the written config; the bf16 keys are not written."""
    from moe_ep import device_facts, options
    from moe_ep.kernels import plan_grouped_gemm
    from moe_ep.kernels.fp8 import quantize_fp8
    from moe_ep.kernels.grouped_gemm.config_space import shape_class
    with options.override(config_dir=str(tmp_path)):
        assert main(["tune", *TINY, "--gemms", "gemm1,gemm2", "--formats", "fp8", "--buckets", "8"]) == 0
        table = json.loads((tmp_path / f"{device_facts.device_name()}.json").read_text())
        assert set(table) == {shape_class(32, 64, False, True, True, True), shape_class(64, 32, False, False, True)}
        cfg = table[shape_class(32, 64, False, True, True, True)]["8"]
        assert cfg["BLOCK_N"] % 128 == 0
        dev = device()
        x = quantize_fp8(torch.randn(16, 64, device=dev).bfloat16(), 1)
        w = quantize_fp8(torch.randn(2, 64, 64, device=dev).bfloat16(), 128, gate_up=True)
        plan = plan_grouped_gemm(x, w, offsets=torch.tensor([0, 8, 16], device=dev), swiglu=True, m_hint=8,
                                 quantize_out=True)
        assert plan.config_source == "tuned-file" and plan.config == cfg


def test_tune_fp8_leaves_the_buckets_the_gluon_kernels_take(tmp_path, monkeypatch, capsys):
    """Where the Gluon FP8 kernels run (here made to seem so), ``--formats fp8`` tunes only the buckets below
    ``MOE_EP_GLUON_FP8_MIN_M`` (the tl kernel's configs of the others would never be read), says so per bucket, and
    does not count them as failed."""
    from moe_ep import device_facts, options
    from moe_ep.kernels.grouped_gemm import gluon_fp8
    monkeypatch.setattr(gluon_fp8, "dispatchable", lambda: True)
    with options.override(config_dir=str(tmp_path), gluon_fp8_min_m=16):
        assert main(["tune", *TINY, "--gemms", "gemm2", "--formats", "fp8", "--buckets", "8,16"]) == 0
    table = json.loads((tmp_path / f"{device_facts.device_name()}.json").read_text())
    assert [list(buckets) for buckets in table.values()] == [["8"]]
    assert "not tuned: the Gluon FP8 kernels take this bucket" in capsys.readouterr().out


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
    options.reload()
    with options.override(autotune=True) as before:  # on, not set in the environment: fuzz turns the search off
        assert main(["fuzz", "--targets", "quantize,gather_quantize,route,grouped_gemm", "--examples", "4",
                     "--database", str(tmp_path / "db")]) == 0
        assert options.current() == before and options.current().autotune


def test_fuzz_lists_the_gluon_target_and_reports_it_unavailable_where_it_cannot_run(tmp_path, capsys):
    """Without an sm_90 GPU the Gluon NVFP4 GEMM cannot run: its target is listed, reported "unavailable" with the
    reason (not "ok", not a failure), and the run (with a target that does run beside it) exits 0."""
    from moe_ep.testing.properties import PROPERTIES
    assert "gluon_nvfp4_grouped_gemm" in PROPERTIES
    why = PROPERTIES["gluon_nvfp4_grouped_gemm"].unavailable()
    if why is None:
        pytest.skip("the Gluon kernel runs here (an sm_90 GPU): nothing is unavailable")
    assert main(["fuzz", "--targets", "gluon_nvfp4_grouped_gemm,route", "--examples", "2",
                 "--database", str(tmp_path / "db")]) == 0
    out = capsys.readouterr().out
    table = out[out.rindex("moe-ep fuzz"):]
    row = next(ln for ln in table.splitlines() if "gluon_nvfp4_grouped_gemm" in ln)
    assert "unavailable" in row and "sm_90" in row, table
    assert "FAILED" not in table and "ok" in next(ln for ln in table.splitlines() if " route " in f" {ln} ")


def test_fuzz_exits_nonzero_when_an_available_target_fails_beside_an_unavailable_one(tmp_path, monkeypatch):
    """"unavailable" does not hide a failure of another target."""
    from hypothesis import strategies as st

    from moe_ep.commands import fuzz
    from moe_ep.testing.properties import Property

    def bad(case, dev):
        raise AssertionError("planted")

    monkeypatch.setattr(fuzz, "PROPERTIES", {
        "gone": Property(lambda b: st.integers(0, 9), bad, lambda: "not on this device"),
        "bad": Property(lambda b: st.integers(0, 9), bad)})
    assert main(["fuzz", "--targets", "gone", "--examples", "2", "--database", str(tmp_path / "db")]) == 0
    assert main(["fuzz", "--targets", "gone,bad", "--examples", "2", "--database", str(tmp_path / "db")]) == 1


@pytest.mark.one_triton
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


@pytest.mark.one_triton
def test_fuzz_jobs_shards_one_target_and_sums_its_examples(tmp_path, capsys):
    assert main(["fuzz", "--targets", "route", "--examples", "5", "--jobs", "2",
                 "--database", str(tmp_path / "db")]) == 0
    out = capsys.readouterr().out
    assert "  route: ok after 3 example(s)" in out and "  route: ok after 2 example(s)" in out
    table = out[out.rindex("moe-ep fuzz"):]
    assert table.count("route") == 1 and " 5 " in table.split("route")[1].splitlines()[0]


@pytest.mark.one_triton
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
    assert rc == 1, out
    assert "MISMATCH in unpermute_reduce" in out and "relative error" in out, out
    assert "Falsifying" in out or "Failing test case" in out  # hypothesis' shrunk counterexample
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("moe-ep fuzz --targets"))
    assert "--reproduce" in line and db in line
    # the printed command reproduces it, even with a fresh database
    argv = line.split()[1:]
    argv[argv.index("--database") + 1] = str(tmp_path / "fresh")
    assert main(argv) == 1
    assert "after 1 example" in capsys.readouterr().out


def test_fuzz_reports_each_of_several_distinct_failures(tmp_path, monkeypatch, capsys):
    # hypothesis raises an ExceptionGroup when it finds failures that differ (seen on a GPU): the report must say
    # what each one is, not only that there were two
    from moe_ep.commands.fuzz import BaseExceptionGroup
    from moe_ep.kernels import bridge

    def wrong(*a, **kw):
        raise BaseExceptionGroup("two", [AssertionError("planted: relative error 1.0 > 0.01"), ValueError("planted 2")])

    monkeypatch.setattr(bridge, "unpermute_reduce", wrong)
    rc = main(["fuzz", "--targets", "unpermute_reduce", "--examples", "5", "--database", str(tmp_path / "db")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "AssertionError: planted: relative error 1.0 > 0.01" in out and "ValueError: planted 2" in out


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(
    sys.executable), "torchrun")), reason="torchrun not installed")
@pytest.mark.one_triton
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
    idle = timing.time_host_idle(nap, iters=5, warmup=2)
    for t in (timing.time_call(nap), timing.time_graph(nap), ours, peer, loop.device, loop.host, idle):
        assert 0.02 <= t < 1.0, t
    assert how == "eager" and len(calls) == 6  # one call each: through the interpreter a call costs seconds


@pytest.mark.gpu
def test_host_time_onto_an_idle_gpu_leaves_out_the_queue_of_earlier_work():
    """A call that enqueues a long GPU job: onto an idle GPU its host time is the enqueueing alone, far under the
    job's GPU time (the sync before each call is not counted)."""
    from moe_ep.commands import timing
    a = torch.randn(4096, 4096, device="cuda")
    job = lambda: a @ a  # noqa: E731  (a few ms of GPU time, microseconds to enqueue)
    gpu = timing.time_loop(job, iters=5).device
    assert timing.time_host_idle(job, iters=5) < gpu / 5


# --- the CLI with its defaults (issue 23) ---------------------------------------------------------------------


@pytest.mark.skipif(not INTERPRETER, reason="only the interpreter's config space has a TMA candidate at a decode bucket "
                    "(the GPU space's TMA tiles are 128 rows, pruned below 64 tokens per expert)")
def test_tune_times_what_launches_and_never_raises_for_a_tma_config_at_decode(tmp_path, capsys):
    """At a decode bucket a TMA candidate runs as the same tiles through pointer loads: that config is timed (once,
    beside its pointer-load twin) and written, and the table says tma=0."""
    report = tmp_path / "report.json"
    with options.override(config_dir=str(tmp_path)):
        assert main(["tune", *TINY, "--gemms", "gemm1", "--formats", "bf16", "--buckets", "16",
                     "--report", str(report)]) == 0
    shape = json.loads(report.read_text())["shapes"][0]
    timed = [t["config"] for t in shape["timings"] if "us" in t]
    assert shape["candidates"] > shape["distinct"] == len(timed)  # a candidate launched as another one did
    assert len({json.dumps(c, sort_keys=True) for c in timed}) == len(timed)
    assert not any(c["TMA"] for c in timed) and shape["best"]["TMA"] is False
    assert "tma=0" in capsys.readouterr().out


def test_tune_writes_to_the_user_folder_the_kernels_search_not_the_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    options.reload()  # the environment is read with the options
    try:
        _tune_into_the_user_folder(tmp_path, capsys)
    finally:
        monkeypatch.undo()
        options.reload()


def _tune_into_the_user_folder(tmp_path, capsys):
    from moe_ep import device_facts
    from moe_ep.kernels import plan_grouped_gemm
    from moe_ep.kernels.grouped_gemm import tuned_files
    shipped = {f: os.stat(os.path.join(tuned_files.SHIPPED_DIR, f)).st_mtime
               for f in os.listdir(tuned_files.SHIPPED_DIR)}
    with options.override(config_dir=None):
        assert main(["tune", *TINY, "--gemms", "gemm1", "--formats", "bf16", "--buckets", "8"]) == 0
        path = str(tmp_path / "moe-ep" / "configs" / f"{device_facts.device_name()}.json")
        assert f"wrote 1 config(s) to {path}" in capsys.readouterr().out
        dirs = tuned_files.config_dirs()
        assert dirs.index(os.path.dirname(path)) < dirs.index(tuned_files.SHIPPED_DIR)
        dev = device()
        x = torch.randn(16, 64, device=dev).to(torch.bfloat16)
        w = torch.randn(2, 64, 64, device=dev).to(torch.bfloat16)
        plan = plan_grouped_gemm(x, w, offsets=torch.tensor([0, 8, 16], device=dev), swiglu=True, m_hint=8)
        assert (plan.config_source, plan.config_file) == ("tuned-file", path)
    assert {f: os.stat(os.path.join(tuned_files.SHIPPED_DIR, f)).st_mtime
            for f in os.listdir(tuned_files.SHIPPED_DIR)} == shipped  # the package's files stay as shipped


def _fake_targets(monkeypatch, **checks):
    """Replace the fuzz targets by cheap ones: name -> check(case, dev) on integer cases."""
    from hypothesis import strategies as st

    from moe_ep.commands import fuzz
    from moe_ep.testing.properties import Property
    monkeypatch.setattr(fuzz, "PROPERTIES", {n: Property(lambda bounds: st.integers(0, 10 ** 6), c)
                                             for n, c in checks.items()})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default of a run through the interpreter")
def test_fuzz_default_through_the_interpreter_ends_soon(tmp_path, monkeypatch, capsys):
    from moe_ep.commands import fuzz
    calls = []
    _fake_targets(monkeypatch, a=lambda case, dev: calls.append(case))
    assert main(["fuzz", "--targets", "a", "--database", str(tmp_path / "db")]) == 0
    assert len(calls) == fuzz.CPU_EXAMPLES < 2000  # not the fuzz profile's 2000 per target
    assert f"at most {fuzz.CPU_EXAMPLES} example(s), 30 s" in capsys.readouterr().out


def test_fuzz_default_on_a_gpu_stops_each_target_at_its_examples_or_its_seconds(monkeypatch):
    """On a GPU a default run takes the fuzz profile's examples per target, but no target longer than
    GPU_SECONDS_PER_TARGET (so a default run ends in minutes on any GPU); limits the caller gave are kept as given."""
    from moe_ep.commands import fuzz
    monkeypatch.setattr(fuzz, "INTERPRETER", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(examples=None, seconds=None)
    assert fuzz.default_limits(args) == (2000, fuzz.GPU_SECONDS_PER_TARGET) and fuzz.GPU_SECONDS_PER_TARGET <= 60
    assert fuzz.default_limits(argparse.Namespace(examples=10000, seconds=None)) == (10000, None)
    assert fuzz.default_limits(argparse.Namespace(examples=None, seconds=600.0)) == (None, None)


def test_fuzz_ctrl_c_prints_what_ran_and_failed(tmp_path, monkeypatch, capsys):
    calls = []

    def interrupted(case, dev):
        calls.append(case)
        if len(calls) == 3:
            raise KeyboardInterrupt

    _fake_targets(monkeypatch, a=lambda case, dev: None, b=interrupted, c=lambda case, dev: None)
    try:
        rc = main(["fuzz", "--targets", "a,b,c", "--examples", "5", "--database", str(tmp_path / "db")])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped moe-ep fuzz without a summary")
    out = capsys.readouterr().out
    assert rc == 130 and "interrupted (Ctrl-C): no failure so far" in out
    table = out[out.rindex("moe-ep fuzz"):]
    for target, status in (("a", "ok"), ("b", "interrupted"), ("c", "not run")):
        assert any(f" {target} " in ln and status in ln for ln in table.splitlines()), (target, status, table)


def _subparsers():
    import argparse

    from moe_ep.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


@pytest.mark.parametrize("cmd", ["", "demo", "info", "bench", "tune", "fuzz"])
def test_help_is_plain_text_with_help_on_every_option(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"] if cmd else ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for rst in ("``", ":class:", ":mod:", ":func:", ":data:"):
        assert rst not in out, (rst, out)
    parser = _subparsers()[1][cmd] if cmd else _subparsers()[0]
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]


def test_model_shape_options_have_one_name_in_every_subcommand():
    choices = _subparsers()[1]
    for cmd in ("demo", "bench", "tune"):
        opts = {s for a in choices[cmd]._actions for s in a.option_strings}
        assert {"--preset", "--experts", "--top-k", "--hidden", "--intermediate"} <= opts, cmd
        args = choices[cmd].parse_args(["--experts", "16", "--intermediate", "48"])
        assert (args.experts, args.intermediate) == (16, 48)


@pytest.mark.parametrize("argv, option", [(["--ranks", "3"], "--ranks"), (["--ranks", "0"], "--ranks"),
                                          (["--hidden", "100"], "--hidden"), (["--experts", "6", "--ranks", "4"], "--ranks"),
                                          (["--tokens", "0"], "--tokens"), (["--top-k", "9"], "--top-k")])
def test_demo_validates_before_spawning_and_names_the_option(argv, option, capsys, monkeypatch):
    import torch.multiprocessing as mp
    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned ranks for a bad option"))
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"moe-ep demo: error: MoEEpInputError: {option} = ") and "allowed" in err, err


def test_version_is_the_installed_or_the_package_version():
    from importlib import metadata
    try:
        want = metadata.version("moe-ep")
    except metadata.PackageNotFoundError:
        want = moe_ep.__version__
    p = subprocess.run([sys.executable, "-m", "moe_ep.cli", "--version"], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"moe-ep {want}", (p.stdout, p.stderr)


# ---- formats: --weight-format / --activation-format (demo, bench), --formats (tune) ----

FORMAT_ERRORS = [  # (argv after the command, the option the error names, what it says)
    (["--activation-format", "fp8"], "--activation-format", "'bf16' or 'nvfp4' with --weight-format 'bf16'"),
    (["--weight-format", "nvfp4", "--activation-format", "fp8"], "--activation-format", "FP8 activations need FP8"),
    (["--weight-format", "fp8", "--activation-format", "nvfp4"], "--activation-format",
     "'bf16' or 'fp8' with --weight-format 'fp8'"),
    (["--weight-format", "fp4"], "--weight-format", "'bf16', 'nvfp4', 'fp8'"),
    (["--weight-format", "fp8", "--activation-format", "fp8", "--hidden", "48"], "--hidden", "multiple of"),
]


@pytest.mark.parametrize("cmd", ["demo", "bench"])
@pytest.mark.parametrize("argv, option, says", FORMAT_ERRORS)
def test_format_options_are_checked_before_any_work(cmd, argv, option, says, capsys, monkeypatch, tmp_path):
    import torch.multiprocessing as mp

    from moe_ep.commands import bench
    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned ranks for a bad option"))
    monkeypatch.setattr(bench, "Bench", lambda *a, **k: pytest.fail("benched with a bad option"))
    extra = ["--kernels", "layer", "--out", str(tmp_path)] if cmd == "bench" else []
    assert main([cmd, *argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moe-ep {cmd}: error: MoEEpInputError: {option} = ") and says in err, err


def test_demo_takes_fp8_weights_and_activations_to_its_ranks(monkeypatch, capsys):
    import torch.multiprocessing as mp

    import moe_ep.cli as cli
    seen = []
    monkeypatch.setattr(cli, "_quantizer_demo", lambda args, dev: True)
    monkeypatch.setattr(mp, "spawn", lambda fn, args, nprocs: seen.append(args[2]))
    assert main(["demo", "--weight-format", "fp8", "--activation-format", "fp8"]) == 0
    assert [(a.weight_format, a.activation_format) for a in seen] == [("fp8", "fp8")]
    assert "weights fp8, activations fp8" in capsys.readouterr().out
    assert max(cli.DEMO_BOUNDS[f] for f in ("fp8", "fp8")) == cli.DEMO_BOUNDS["fp8"] > cli.DEMO_BOUNDS["bf16"]


def test_bench_layer_rows_take_the_formats(monkeypatch):
    """The layer rows build EpConfig and ExpertWeights in the options' formats (the bf16 default stays)."""
    import argparse

    from moe_ep.commands import bench
    from moe_ep.commands.common import add_format_arguments
    p = argparse.ArgumentParser()
    add_format_arguments(p)
    assert (p.parse_args([]).weight_format, p.parse_args([]).activation_format) == ("bf16", "bf16")
    args = p.parse_args(["--weight-format", "fp8", "--activation-format", "fp8"])
    assert bench._weight_bytes(torch.tensor([1, 0]), 128, 128, False, True) == 3 * 128 * 128 * (1 + 4 / 128 ** 2)
    made = []

    class Built(Exception):
        pass

    def layer(cfg, w, **k):
        made.append((cfg, w))
        raise Built  # stop once the layer is built: its compute is not what this checks

    monkeypatch.setattr("moe_ep.layer.MoEEpLayer", layer)
    monkeypatch.setattr("moe_ep.weights.ExpertWeights", lambda w13, w2, fmt="bf16", **k: fmt)
    args.seed, args.kernel_list, args.peak_flops, args.peak_flops_fp8 = 0, ["layer"], 795e12, 1979e12
    b = bench.Bench.__new__(bench.Bench)
    b.p, b.world, b.args, b.dev = get_preset("small"), 1, args, torch.device("cpu")
    b.w13, b.w2, b.gen = torch.zeros(8, 1024, 256), torch.zeros(8, 256, 512), torch.Generator().manual_seed(0)
    with pytest.raises(Built):
        b.row("layer", 2, "ll-expert_major")
    [(cfg, fmt)] = made
    assert (cfg.weight_format.value, cfg.activation_format.value, fmt) == ("fp8", "fp8", "fp8")


def test_tune_formats_name_what_is_allowed(capsys):
    from moe_ep.commands import tune
    shapes = tune.shapes(get_preset("small"), ["gemm1"], ["fp8"], [8])
    assert [(s["fp8"], s["w_fp4"]) for s in shapes] == [(True, False)]
    assert main(["tune", *TINY, "--formats", "fp9"]) == 2
    assert "bf16, nvfp4, fp8" in capsys.readouterr().err


def test_demo_ranks_build_the_layer_in_the_formats(monkeypatch, tmp_path):
    """A demo rank (run in this process, world 1) builds EpConfig and the weights in the options' formats."""
    import argparse
    import types

    import torch.distributed as dist

    import moe_ep.cli as cli
    made = []

    class Built(Exception):
        pass

    def layer(cfg, w, **k):
        made.append((cfg, w))
        raise Built

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(moe_ep, "MoEEpLayer", layer)
    monkeypatch.setattr(moe_ep, "ExpertWeights", types.SimpleNamespace(from_global=lambda *a, **k: a[4]))
    args = argparse.Namespace(experts=2, top_k=1, hidden=128, inter=32, tokens=2, weight_format="fp8",
                              activation_format="fp8")
    with pytest.raises(Built):
        cli._demo_worker(0, 1, str(tmp_path / "store"), args, None)
    [(cfg, fmt)] = made
    assert (cfg.weight_format.value, cfg.activation_format.value, fmt) == ("fp8", "fp8", "fp8")


# `python -m moe_ep.cli ARGS` in a fresh process, then the heavy modules it imported (a JSON line on stderr)
_IMPORTS_OF = r"""
import json, runpy, sys
sys.argv = ["moe-ep", *sys.argv[1:]]
try:
    runpy.run_module("moe_ep.cli", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "numpy", "hypothesis", "transformers"))
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_import_neither_torch_nor_triton(argv):
    """``moe-ep --help`` / ``--version`` (and a bare ``moe-ep``, which says what is missing) answer at once: the
    subcommands' modules, which import torch, are not imported for them."""
    p = subprocess.run([sys.executable, "-c", _IMPORTS_OF, *argv], env=_env(), capture_output=True, text=True,
                       timeout=120)
    seen = json.loads(p.stderr.strip().splitlines()[-1])
    assert seen["heavy"] == [], seen["heavy"]
    if argv == ["--help"]:
        assert seen["code"] == 0
        listed = {ln.split()[0] for ln in p.stdout.splitlines() if ln.startswith("    ") and ln[4] != " "}
        assert listed == {"demo", "info", "bench", "tune", "fuzz"}, p.stdout
    elif argv == ["--version"]:
        assert seen["code"] == 0 and p.stdout.startswith("moe-ep "), p.stdout
    else:
        assert seen["code"] == 2 and "COMMAND" in p.stderr, p.stderr


def test_a_command_gets_its_options_only_when_asked_for(capsys):
    """main builds only the asked command's options (the others' modules stay unimported); a command's own
    --help still lists them."""
    from moe_ep.cli import build_parser
    choices = next(a for a in build_parser([])._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(choices) == {"demo", "info", "bench", "tune", "fuzz"}
    assert all(len(p._actions) == 1 for p in choices.values())  # --help only
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    assert "--presets" in capsys.readouterr().out


@pytest.mark.parametrize("every_s, printed", [(0.0, [1, 2, 3, 4, 5]), (1e9, [1, 5])], ids=["every", "throttled"])
def test_progress_without_a_terminal_prints_plain_lines_first_last_and_throttled(every_s, printed, monkeypatch,
                                                                                capsys):
    """Under pytest stdout is not a terminal, as in a log or a pipe, where rich's live bar would print nothing until
    the end: plain lines, the first and the last step always, those between at most one per interval."""
    from moe_ep.commands import common
    monkeypatch.setattr(common, "PLAIN_PROGRESS_EVERY_S", every_s)
    with common.progress("bench", 5) as advance:
        for i in range(5):
            advance(f"row {i + 1}")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[{i}/5] bench: row {i}" for i in printed]


def test_bench_lists_the_gemm_shapes_no_tuned_file_holds(tmp_path):
    """bench says up front which of its GEMM shapes will autotune on first use (a fresh GPU bench takes minutes
    longer): every key of the rows' formats, less those a tuned file of this device holds."""
    from moe_ep import device_facts
    from moe_ep.commands.bench import untuned_shapes
    from moe_ep.kernels.grouped_gemm import tuned_files
    from moe_ep.kernels.grouped_gemm.config_space import config_dict, grouped_gemm_configs, shape_class
    small = get_preset("small")
    gate_up = shape_class(small.intermediate, small.hidden, False, True)
    with options.override(config_dir=str(tmp_path)):
        tuned_files.invalidate()
        every = untuned_shapes([small], ["mlp", "mlp-nvfp4", "mlp-fp8", "quant"])
        assert len(every) == 6 and f"small: {gate_up}" in every, every
        assert untuned_shapes([small], ["quant", "bridge"]) == []
        assert len(untuned_shapes([small], ["layer"], "nvfp4")) == 2
        (tmp_path / f"{device_facts.device_name()}.json").write_text(
            json.dumps({gate_up: {"64": config_dict(grouped_gemm_configs()[0])}}))
        tuned_files.invalidate()
        assert untuned_shapes([small], ["mlp", "mlp-nvfp4", "mlp-fp8"]) == [s for s in every if gate_up not in s]
    tuned_files.invalidate()
