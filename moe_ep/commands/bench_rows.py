"""The row loop of the GPU studies in ``benchmarks/``: one row per shape, each measured on its own (a row that raises
is kept with its error, and the next shape still runs), printed as a JSON line and written to the output file after
every row, so that a run cut short (a call's time limit) still leaves the rows it finished."""

from __future__ import annotations

import json
import sys
import traceback

import torch
import triton

from .timing import time_graph


def run_rows(shapes, run_row, out: str, failed_row=lambda shape: {"shape": list(shape)}) -> list[dict]:
    """``run_row(*shape)`` (a dict) for each of ``shapes`` on this CUDA GPU (exits saying so without one); a row that
    raises becomes ``failed_row(shape)`` with its ``row_error``. After each row the file ``out`` holds
    ``{"device", "triton", "rows"}``. Returns the rows."""
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    print(f"device {device}, capability {torch.cuda.get_device_capability()}, triton {triton.__version__}, "
          f"torch {torch.__version__}", flush=True)
    rows = []
    for shape in shapes:
        try:
            row = run_row(*shape)
        except Exception:  # noqa: BLE001  (kept in its row: the next shape still runs)
            row = {**failed_row(shape), "row_error": traceback.format_exc()[-2000:]}
            print(f"  {shape}: failed: {error_line(row['row_error'])}", flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump({"device": device, "triton": triton.__version__, "rows": rows}, f, indent=1)
    return rows


def error_line(tb: str) -> str:
    """The last line of a recorded traceback (the exception and its message), at most 300 characters: how a row's
    error is printed."""
    return tb.strip().splitlines()[-1][:300]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative Frobenius error of ``a`` against ``b``, in fp32: the studies' error columns."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def timed_column(row: dict, col: str, call, ref: torch.Tensor | None = None, err=rel_err, label: str = "",
                 timer=time_graph) -> None:
    """One column of a study's row: with ``ref``, ``call()`` once and its error against ``ref`` as
    ``row["rel_err_<col>"]`` (``err(out, ref)``); then its time in us as ``row["<col>_us"]`` (``timer(call)``
    seconds, default the CUDA-graph median of :func:`~.timing.time_graph`). An exception is kept as
    ``row["<col>_error"]`` (the traceback's tail) and printed after ``label``, and the row's other columns still run."""
    try:
        if ref is not None:
            out = call()
            torch.cuda.synchronize()
            row[f"rel_err_{col}"] = err(out, ref)
        row[f"{col}_us"] = timer(call) * 1e6
    except Exception:  # noqa: BLE001  (kept in the row: its other columns still run)
        row[f"{col}_error"] = traceback.format_exc()[-2000:]
        print(f"  {label}: {col} failed: {error_line(row[f'{col}_error'])}", flush=True)

