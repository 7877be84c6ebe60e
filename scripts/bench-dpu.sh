#!/usr/bin/env bash
# The DPU agent beside the FileStore and fio on this machine: builds the release CLI, runs
# `gpucache-bench dpu` at 64K, 256K, 1M and 4M blocks and writes its JSON to one output file
# (the table goes to stderr).
#
# Usage: scripts/bench-dpu.sh [OUTPUT] [-- extra `gpucache-bench dpu` arguments]
#   OUTPUT              where to write the JSON
#                       (default: $CARGO_TARGET_DIR or target, /bench-dpu-<UTC time>.json)
#   BENCH_DIR=/path     file system to measure (default: the system temp directory)
#   BENCH_DPU_MIB=256   MiB per path and block size
#   BENCH_REACTORS=2    agent reactors (pinned best effort to the allowed cores, in order)
# Extra arguments after `--` go to the benchmark unchanged (e.g. -- --no-sync).
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
out="$target_dir/bench-dpu-$(date -u +%Y%m%dT%H%M%SZ).json"
if [[ $# -gt 0 && "$1" != "--" ]]; then
    out="$1"
    shift
fi
if [[ $# -gt 0 && "$1" == "--" ]]; then
    shift
fi

step() { printf '\n== %s\n' "$*" >&2; }

if ! command -v fio >/dev/null 2>&1; then
    echo "scripts/bench-dpu.sh: fio is not on PATH; its entries will say skipped" >&2
fi

step "building the release CLI"
cargo build --release --locked -p gpucache-cli >&2
bin="$target_dir/release/gpucache-bench"

args=(
    dpu
    --sizes 64K,256K,1M,4M
    --mib "${BENCH_DPU_MIB:-256}"
    --reactors "${BENCH_REACTORS:-2}"
)
if [[ -n "${BENCH_DIR:-}" ]]; then
    args+=(--dir "$BENCH_DIR")
fi
args+=("$@")

mkdir -p "$(dirname "$out")"
step "running: gpucache-bench ${args[*]} (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
"$bin" "${args[@]}" >"$out"
step "report written to $out"
