#!/usr/bin/env bash
# NIXL beside our TCP path and memcpy: builds the release CLI with the `nixl` feature, puts the
# nixl-cu12 wheel's libraries on LD_LIBRARY_PATH (the venv under the build folder, made here
# when missing, as scripts/test.sh does), and runs `gpucache-bench nixl` over 64K, 256K, 1M and
# 4M blocks. The report goes to $CARGO_TARGET_DIR/bench-nixl/ and the JSON to
# docs/bench-nixl.json.
#
# Usage: scripts/bench-nixl.sh [-- extra `gpucache-bench nixl` arguments]
#   BENCH_ITERATIONS=200   timed blocks per size and path
#   BENCH_UCX_TLS=tcp      also pass --ucx-tls (NIXL over UCX's TCP transport); the JSON then
#                          goes to docs/bench-nixl-ucx-<tls>.json
# Under a minute on a 2-core machine once built.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
case "$target_dir" in /*) ;; *) target_dir="$PWD/$target_dir" ;; esac
out_dir="$target_dir/bench-nixl"
if [[ $# -gt 0 && "$1" == "--" ]]; then
    shift
fi

step() { printf '\n== %s\n' "$*" >&2; }

step "the NIXL wheel"
venv="$target_dir/nixl-venv"
. scripts/nixl-venv.sh
libs="$(nixl_libs "$venv")"
echo "libraries: $libs" >&2

step "building the release CLI with the nixl feature"
cargo build --release --locked -p gpucache-cli --features nixl >&2
bin="$target_dir/release/gpucache-bench"

stamp="$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out_dir"
json="docs/bench-nixl.json"
args=(nixl --sizes 64K,256K,1M,4M --iterations "${BENCH_ITERATIONS:-200}")
if [[ -n "${BENCH_UCX_TLS:-}" ]]; then
    args+=(--ucx-tls "$BENCH_UCX_TLS")
    json="docs/bench-nixl-ucx-${BENCH_UCX_TLS//[^a-z0-9_]/-}.json"
fi
args+=(--json "$json" "$@")
step "running: gpucache-bench ${args[*]}"
status=0
LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" UCX_MODULES='^ib' \
    "$bin" "${args[@]}" | tee "$out_dir/bench-nixl-$stamp.txt" || status=$?
step "report in $out_dir/bench-nixl-$stamp.txt, JSON in $json"
exit "$status"
