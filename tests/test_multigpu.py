"""The layer across several GPUs (one rank each, nccl) over every available transport: launches
tests/multigpu_worker.py under torchrun with 2, 4 and 8 ranks where that many GPUs are visible."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_layer_across_gpus(ranks):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < ranks:
        pytest.skip(f"needs {ranks} GPUs, {have} visible")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        os.path.join(here, "multigpu_worker.py")], env=env, capture_output=True, text=True,
                       timeout=900)
    print(r.stdout[-20000:])
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "MULTIGPU OK" in r.stdout
