#!/usr/bin/env bash
# The GPU test suites and the checks that need a GPU, in one command for a lent H100 / H200 (one device call each):
#   bash tests/run_on_gpu.sh TRITON STEP...     from the repository root; TRITON: 36 (the image's Triton 3.6) or 39
#                                               (Triton 3.9 from the kit in .triton-kit: carry it; build it here first
#                                               with bash shared/tools/triton-kit/make_kit.sh .triton-kit)
# STEP: suite (every test but the CPU compile checks; with 39 less the one_triton tests, as CI's second run),
#       tests:"PYTEST ARGS" (some test files; the args split as a shell would, so that -k "'a and not b'" keeps its
#       expression whole), fp8_bench (benchmarks/bench_grouped_gemm.py --weights fp8 --quick, the
#       rows from 128 tokens per expert: the dispatcher's Gluon FP8 path on from there, the tl kernel beside it; with
#       FP8_VARIANTS=GEMM1,GEMM2 through those Gluon variants instead of the defaults),
#       nvfp4_bench (benchmarks/bench_grouped_gemm.py --weights nvfp4 --quick, the rows from NVFP4_ROWS_FROM (default
#       64) tokens per expert through the dispatcher's Gluon NVFP4 prefill path from there, taken before its tests pass here
#       (--gluon-nvfp4-unverified), the tl paths beside it),
#       gluon_bench (benchmarks/bench_gluon_nvfp4.py: the Gluon NVFP4 kernels at decode shapes),
#       nvfp4_prefill (benchmarks/bench_gluon_nvfp4_prefill.py: the Gluon NVFP4-weight prefill GEMM's variants beside
#       the tl NVFP4 and bf16 paths and torch._grouped_mm, prefill shapes; PREFILL_SHAPES=0,2 some of its shapes),
#       fp8_gemms (benchmarks/bench_gluon_fp8.py: every Gluon FP8 variant of both forms beside the tl FP8 and bf16
#       kernels, prefill shapes; its two tables printed whole),
#       layer (bench_layer.py, with its cProfile reports of the eager and the replayed forward),
#       ablate (benchmarks/ablate_gluon_fp8.py: both Gluon FP8 defaults and the plain GEMM of GEMM1's FLOPs with parts
#       of their work switched off; the plain GEMM also with its w tile as GEMM1's two boxes).
# WORKERS (default 16): pytest-xdist workers of suite and tests steps; fewer where a few test files with large
# shapes run side by side (tests/test_gluon_fp8.py's benchmark shapes take several GiB each: -n 16 of them alone
# outgrows an 80 GB card, where the whole suite spreads them out).
# Logs and JSON go to $OUT (./out when unset; git-ignored); a step stops at its share of DEADLINE seconds from the
# start (default 585: under a call's 600 s limit), the suite at SUITE_S (default 480); a suite stopped by its limit is
# interrupted (SIGINT), so pytest still prints what passed and failed so far. The last lines printed are each step's
# summary.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-./out}; mkdir -p "$out"
tri=${1:?usage: bash tests/run_on_gpu.sh 36|39 STEP...}; shift
if [ "$tri" = 39 ]; then source .triton-kit/setup_on_device.sh .triton-kit || exit 9; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$(date +%s)
# work stealing (pytest-xdist >= 3.2) keeps the 16 workers busy to the end: the slowest tests take minutes each
steal='import xdist; print("--dist=worksteal" if tuple(map(int, xdist.__version__.split(".")[:2])) >= (3, 2) else "")'
dist=$(python3 -c "$steal" 2>/dev/null)
left() { local l=$(( ${DEADLINE:-585} - ($(date +%s) - t0) )); [ $l -gt 1 ] && echo $l || echo 1; }
summary() { echo "$1 rc=$2"; grep -E "^(FAILED|ERROR)" "$3" | head -30; tail -3 "$3"; }
for step in "$@"; do
  s=$(date +%s)
  case $step in
    suite)
      only=(); [ "$tri" = 39 ] && only=(-m 'not one_triton')
      timeout -s INT -k 30 "${SUITE_S:-480}" python3 -m pytest -q -n "${WORKERS:-16}" $dist -p no:cacheprovider \
        --durations=25 tests --ignore=tests/test_compile.py "${only[@]}" > "$out/suite$tri.log" 2>&1
      summary suite $? "$out/suite$tri.log" ;;
    tests:*)
      mapfile -t args < <(python3 -c 'import shlex, sys; print("\n".join(shlex.split(sys.argv[1])))' "${step#tests:}")
      timeout -s INT -k 30 "$(left)" python3 -m pytest -q -n "${WORKERS:-16}" $dist -p no:cacheprovider "${args[@]}" \
        > "$out/tests$tri.log" 2>&1
      summary tests $? "$out/tests$tri.log" ;;
    fp8_bench)
      timeout "$(left)" python3 benchmarks/bench_grouped_gemm.py --weights fp8 --quick --rows-from 128 \
        --gluon-fp8-min-m 128 ${FP8_VARIANTS:+--gluon-fp8-variants "$FP8_VARIANTS"} --out "$out/fp8.json" \
        > "$out/fp8_bench.log" 2>&1
      summary fp8_bench $? "$out/fp8_bench.log"; tail -12 "$out/fp8_bench.log" ;;
    nvfp4_bench)
      timeout "$(left)" python3 benchmarks/bench_grouped_gemm.py --weights nvfp4 --quick \
        --rows-from "${NVFP4_ROWS_FROM:-64}" --gluon-nvfp4-min-m "${NVFP4_ROWS_FROM:-64}" --gluon-nvfp4-unverified \
        --out "$out/nvfp4.json" > "$out/nvfp4_bench.log" 2>&1
      summary nvfp4_bench $? "$out/nvfp4_bench.log"; tail -14 "$out/nvfp4_bench.log" ;;
    gluon_bench)
      timeout "$(left)" python3 benchmarks/bench_gluon_nvfp4.py --out "$out/gluon.json" > "$out/gluon_bench.log" 2>&1
      summary gluon_bench $? "$out/gluon_bench.log"; tail -12 "$out/gluon_bench.log" ;;
    nvfp4_prefill)
      timeout "$(left)" python3 benchmarks/bench_gluon_nvfp4_prefill.py ${PREFILL_SHAPES:+--shapes "$PREFILL_SHAPES"} \
        --out "$out/nvfp4_prefill.json" \
        > "$out/nvfp4_prefill.log" 2>&1
      summary nvfp4_prefill $? "$out/nvfp4_prefill.log"; tail -22 "$out/nvfp4_prefill.log" ;;
    fp8_gemms)
      timeout "$(left)" python3 benchmarks/bench_gluon_fp8.py --out "$out/gluon_fp8.json" > "$out/fp8_gemms.log" 2>&1
      summary fp8_gemms $? "$out/fp8_gemms.log"; tail -19 "$out/fp8_gemms.log" ;;
    ablate)
      for run in "gemm1 0,8,1,4,16,31" "gemm2 0,8,3,4,15" "plain 0,32,15,47"; do read -r form switches <<< "$run"
        timeout "$(left)" python3 benchmarks/ablate_gluon_fp8.py --form "$form" --switches "$switches" \
          --out "$out/ablate.jsonl" >> "$out/ablate.log" 2>&1
      done
      summary ablate $? "$out/ablate.log"; cat "$out/ablate.log" ;;
    layer)
      timeout "$(left)" python3 benchmarks/bench_layer.py --out "$out/layer.json" --profile "$out/layer_profile" \
        > "$out/layer.log" 2>&1
      summary layer $? "$out/layer.log"; tail -20 "$out/layer.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "[$step: $(( $(date +%s) - s )) s]"
done
echo "[total $(( $(date +%s) - t0 )) s]"
