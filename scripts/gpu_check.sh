#!/usr/bin/env bash
# The GPU check of issue 11, run once on a machine with a CUDA GPU (about 9 minutes in all):
#   1. the GPU test matrix (pytest -m gpu: tests/test_kernels_cuda.py, tests/test_paged_flex.py), then
#   2. run.py bench kernels --device cuda (the engine against SDPA's backends, FlexAttention called directly and
#      flash-attn if importable), starting no new case after $STOP_AFTER seconds.
# Results go to $OUT (default results/gpu_check), at most 8 files, read back by whoever lent the machine:
#   machine.txt  GPU, torch, flash-attn, and each step's exit status    pytest.txt  the test run (skips with reasons)
#   bench.txt    the benchmark's tables                                  bench/      kernels.json, .csv and 3 plots
# Usage, from the repository root:  bash scripts/gpu_check.sh     (PYTHON=python3 OUT=... STOP_AFTER=... TEST_S=...)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_check}
PYTHON=${PYTHON:-python3}
TEST_S=${TEST_S:-210}          # the test matrix's time limit (compiles Flex for each mask structure)
STOP_AFTER=${STOP_AFTER:-200}  # the benchmark starts no new case after this many seconds ...
BENCH_S=${BENCH_S:-330}        # ... and is stopped after this many
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT/bench"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
  "$PYTHON" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null || echo "flash-attn: not importable (its rows say so)"
} > "$OUT/machine.txt" 2>&1

timeout "$TEST_S" "$PYTHON" -m pytest -m gpu -v -rs --durations=10 -p no:cacheprovider tests/test_kernels_cuda.py tests/test_paged_flex.py > "$OUT/pytest.txt" 2>&1
echo "pytest -m gpu: exit $? (124 would mean: stopped at ${TEST_S} s)" >> "$OUT/machine.txt"

timeout "$BENCH_S" "$PYTHON" run.py bench kernels --device cuda --repeats 5 --quiet --stop-after "$STOP_AFTER" \
  --out "$OUT/bench" > "$OUT/bench.txt" 2>&1
echo "bench kernels --device cuda: exit $? (124 would mean: stopped at ${BENCH_S} s)" >> "$OUT/machine.txt"
cat "$OUT/machine.txt"
tail -n 40 "$OUT/pytest.txt"
grep -A 12 "^target" "$OUT/bench.txt" || tail -n 30 "$OUT/bench.txt"
