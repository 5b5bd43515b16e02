"""The GPU studies' row loop (moe_ep.commands.bench_rows), on a stand-in GPU: a failing row is kept with its error and
the next still runs; the output file holds every finished row after each one."""

import json

import pytest
import torch

from moe_ep.commands.bench_rows import rel_err, run_rows, timed_column


def test_a_failing_row_is_kept_and_the_file_holds_each_finished_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    out = tmp_path / "rows.json"
    seen = []

    def run_row(name, n):
        seen.append(json.loads(out.read_text())["rows"] if out.exists() else [])  # the file before this row
        if n == 2:
            raise RuntimeError("planted")
        return {"shape": name, "n": n}

    rows = run_rows([("a", 1), ("b", 2), ("c", 3)], run_row, str(out), lambda s: {"shape": s[0], "n": s[1]})
    assert [r["shape"] for r in rows] == ["a", "b", "c"]
    assert "RuntimeError: planted" in rows[1]["row_error"] and "row_error" not in rows[2]
    assert [len(s) for s in seen] == [0, 1, 2]  # written after every row
    assert json.loads(out.read_text()) == {"device": "Stand-in GPU", "triton": __import__("triton").__version__,
                                           "rows": rows}
    assert "failed: RuntimeError: planted" in capsys.readouterr().out


def test_without_a_gpu_it_exits_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        run_rows([("a",)], lambda name: {}, str(tmp_path / "x.json"))


def test_a_column_records_its_error_and_time_or_what_failed(monkeypatch, capsys):
    """``timed_column``: with a reference, the call's relative error and then its time (in us, from the timer);
    without one, the time alone; a call that raises leaves its traceback's tail and a printed line, not a number."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ref = torch.tensor([3.0, 4.0])
    row = {}
    timed_column(row, "a", lambda: torch.tensor([3.0, 4.5]), ref, timer=lambda call: 2e-6)
    assert row == {"rel_err_a": rel_err(torch.tensor([3.0, 4.5]), ref), "a_us": 2.0}
    assert row["rel_err_a"] == pytest.approx(0.1)  # |(0, 0.5)| / |(3, 4)|
    timed_column(row, "b", lambda: None, timer=lambda call: 5e-6)
    assert row["b_us"] == 5.0 and "rel_err_b" not in row

    def broken():
        raise ValueError("planted")
    timed_column(row, "c", broken, ref, label="shape 16", timer=lambda call: 1.0)
    assert "ValueError: planted" in row["c_error"] and "c_us" not in row and "rel_err_c" not in row
    assert "shape 16: c failed: ValueError: planted" in capsys.readouterr().out

