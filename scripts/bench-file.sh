#!/usr/bin/env bash
# FileStore against fio on this machine: installs fio when it is missing (scripts/setup.sh),
# builds the release CLI, then runs `gpucache-bench file` on both engines at 64K, 256K, 1M and
# 4M blocks, plus a reopen of 100,000 small blocks, and writes everything to one output file.
#
# Usage: scripts/bench-file.sh [OUTPUT] [-- extra `gpucache-bench file` arguments]
#   OUTPUT                 where to write the report
#                          (default: $CARGO_TARGET_DIR or target, /bench-file-<UTC time>.txt)
#   BENCH_DIR=/path        file system to measure (default: the system temp directory)
#   BENCH_FILE_MIB=1024    working set per size and engine
#   BENCH_SECONDS=10       deadline per phase
#   BENCH_QUEUE_DEPTH=32   store queue depth and fio --iodepth
#   BENCH_REPEAT=3         rounds per size and engine (the table shows medians)
#   BENCH_OPEN_BLOCKS=100000
#   BENCH_DROP_CACHES=0    1: drop the page cache before every read phase (root)
# Extra arguments after `--` go to the benchmark unchanged (e.g. -- --direct).
# Disk: the store files of every round stay until the run ends (sizes x 2 engines x rounds x
# BENCH_FILE_MIB, 24 GiB with the defaults), plus 100,000 small files.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
out="$target_dir/bench-file-$(date -u +%Y%m%dT%H%M%SZ).txt"
if [[ $# -gt 0 && "$1" != "--" ]]; then
    out="$1"
    shift
fi
if [[ $# -gt 0 && "$1" == "--" ]]; then
    shift
fi

step() { printf '\n== %s\n' "$*" >&2; }

step "fio"
scripts/setup.sh fio >&2

step "building the release CLI"
cargo build --release --locked -p gpucache-cli >&2
bin="$target_dir/release/gpucache-bench"

args=(
    file
    --engine both
    --sizes 64K,256K,1M,4M
    --file-mib "${BENCH_FILE_MIB:-1024}"
    --seconds "${BENCH_SECONDS:-10}"
    --queue-depth "${BENCH_QUEUE_DEPTH:-32}"
    --repeat "${BENCH_REPEAT:-3}"
    --open-blocks "${BENCH_OPEN_BLOCKS:-100000}"
    --fio
)
if [[ -n "${BENCH_DIR:-}" ]]; then
    args+=(--dir "$BENCH_DIR")
fi
if [[ "${BENCH_DROP_CACHES:-0}" == "1" ]]; then
    args+=(--drop-caches)
fi
args+=("$@")

mkdir -p "$(dirname "$out")"
step "running: gpucache-bench ${args[*]}"
{
    echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "# command: gpucache-bench ${args[*]}"
    "$bin" "${args[@]}"
} >"$out"
step "report written to $out"
cat "$out"
