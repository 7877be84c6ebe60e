#!/usr/bin/env bash
# The service beside a raw socket, Redis, Mooncake Store, iperf3 and memcpy, and on its FileStore
# beside Redis with an append-only file: installs the peers when they are missing
# (scripts/setup.sh), builds the release CLI, and runs `gpucache-bench service` over the full
# matrix (64K, 256K, 1M, 4M values; 1, 8 and 32 clients; every row, the on-disk ones included).
# The report, JSON and SVG chart go to $CARGO_TARGET_DIR/bench-service/ (default
# target/bench-service/); the stores' and append-only files go to BENCH_DIR.
#
# Usage: scripts/bench-service.sh [--quick] [-- extra `gpucache-bench service` arguments]
#   --quick                 a smoke run (64K and 1M, one client, 0.5 s phases, every row)
#   BENCH_SECONDS=3         deadline of each PUT and GET phase per point
#   BENCH_WORKING_SET=512M  distinct bytes a point's PUT phase writes at most (on disk too:
#                           each on-disk point needs this much free space and 256 MiB more,
#                           checked before it writes)
#   BENCH_DIR=$target_dir/tmp  where the scratch directory (stores, logs) goes; a disk, not a
#                           tmpfs, since the cold rows drop the stores' files from the page cache
#   BENCH_PEERS=...         the rows (default: all of them, as below)
# The extra arguments may not repeat an option the script passes (--peers, --dir, and without
# --quick --sizes, --clients, --seconds, --working-set): use the variables above for those.
# The on-disk rows write the whole working set per point and flush it (per-block, appendfsync
# always), so the run's length depends on the disk: about 20 to 30 minutes with the defaults on
# a 2-core machine (estimated from shorter runs of every row). Mooncake runs 32 worker processes
# at 32 clients; that fits a 2-core machine (slowly), so no point is left out.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
out_dir="$target_dir/bench-service"
quick=()
if [[ $# -gt 0 && "$1" == "--quick" ]]; then
    quick=(--quick)
    shift
fi
if [[ $# -gt 0 && "$1" == "--" ]]; then
    shift
fi

step() { printf '\n== %s\n' "$*" >&2; }

step "peers"
scripts/setup.sh redis iperf3 mooncake >&2
. scripts/peers-env.sh

step "building the release CLI"
cargo build --release --locked -p gpucache-cli >&2
bin="$target_dir/release/gpucache-bench"

stamp="$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out_dir"
scratch="${BENCH_DIR:-$target_dir/tmp}"
mkdir -p "$scratch"
peers="${BENCH_PEERS:-ours,ours-shm,raw-socket,redis,mooncake,iperf3,memcpy,ours-file,redis-aof}"
args=(service "${quick[@]}" --peers "$peers" --dir "$scratch")
if [[ ${#quick[@]} -eq 0 ]]; then
    args+=(--sizes 64K,256K,1M,4M --clients 1,8,32
        --seconds "${BENCH_SECONDS:-3}" --working-set "${BENCH_WORKING_SET:-512M}")
fi
args+=(--mooncake-venv "$MOONCAKE_VENV"
    --json "$out_dir/bench-service-$stamp.json" --svg "$out_dir/bench-service-$stamp.svg")
args+=("$@")
step "running: gpucache-bench ${args[*]}"
status=0
"$bin" "${args[@]}" | tee "$out_dir/bench-service-$stamp.txt" || status=$?
step "report, JSON and SVG in $out_dir/bench-service-$stamp.{txt,json,svg}"
exit "$status"
