#!/usr/bin/env bash
# The GPU check of the NCCL-EP / NIXL-EP transports, for the lent H200 (torch 2.11): run from the repository
# root with the two kits carried (build them first, here: bash shared/tools/nccl-ep-kit/make_kit.sh .kits/nccl
# && bash shared/tools/nixl-ep-kit/make_kit.sh .kits/nixl; together ~60 MB, under a call's 64 MiB).
#   bash benchmarks/run_transports_on_device.sh            (world size 1, then 2 if two GPUs are visible)
# Writes $OUT/bench_transports_w1.json (and _w2). NVLink multicast stays off (the kits export the variables).
set -uo pipefail
out=${OUT:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the scripts import moe_ep from this checkout
source .kits/nccl/setup_on_device.sh .kits/nccl || exit 1
source .kits/nixl/setup_on_device.sh .kits/nixl || exit 1
python3 -c "import moe_ep; from moe_ep.transports.discovery import format_transports_table as f; print(f())"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -m "transport and gpu" tests/test_transports_gpu.py
timeout 240 python3 benchmarks/bench_transports.py --out "$out/bench_transports_w1.json"
timeout 120 python3 benchmarks/bench_transports.py --nvfp4 --transports nccl_ep --out "$out/bench_transports_w1_nvfp4.json"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/bench_transports.py \
    --out "$out/bench_transports_w2.json"
fi
