#!/usr/bin/env bash
# The GPU check: the cross-process KV-block end-to-end test with a GPU demanded
# (GPUCACHE_REQUIRE_GPU=1), the probe tests, and the H2D/D2H bandwidth bench, then a summary.
# Meant for a machine with one NVIDIA GPU (an H200 lent through the device tool); under
# 8 minutes there. Needs no network.
#
#   scripts/gpu-check.sh               build (release) with cargo if present, else use the
#                                      prebuilt binaries in $PREBUILT, then run every step
#   scripts/gpu-check.sh --prepare     build here and copy the binaries into $PREBUILT
#                                      (for a GPU machine without a Rust toolchain)
#   scripts/gpu-check.sh --dry-run     print the plan and run nothing
#
# Through the device tool (its machine has CUDA but no Rust toolchain and no network):
#   here:   scripts/gpu-check.sh --prepare
#   device: run(command="scripts/gpu-check.sh 2>&1 | tee $OUT/gpu-check.log",
#               carry=["target/gpu-check"], timeout_s=540)
# The binaries are built on Debian 12 (glibc 2.36); the device image is newer, so they load.
# GPUCACHE_GPU_CHECK_CARGO=0 forces the prebuilt binaries even where cargo exists.
set -euo pipefail
cd "$(dirname "$0")/.."

PREBUILT="${GPUCACHE_GPU_PREBUILT:-target/gpu-check}"
BENCH_BYTES_PER_POINT="${GPUCACHE_GPU_BENCH_BYTES:-1073741824}"
STEP_TIMEOUT_S="${GPUCACHE_GPU_STEP_TIMEOUT_S:-240}"
# The whole run's budget, under the device tool's 540 s timeout above so the summary always
# prints: each step gets at most what is left of it.
TOTAL_TIMEOUT_S="${GPUCACHE_GPU_TOTAL_TIMEOUT_S:-500}"
mode=run
case "${1:-}" in
    "") ;;
    --dry-run) mode=dry ;;
    --prepare) mode=prepare ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "scripts/gpu-check.sh: unknown argument $1 (--dry-run, --prepare)" >&2; exit 64 ;;
esac

use_cargo=0
if [ "${GPUCACHE_GPU_CHECK_CARGO:-1}" = 1 ] && command -v cargo >/dev/null 2>&1; then
    use_cargo=1
fi

# Builds the release binaries and copies them to $PREBUILT under fixed names. Every command
# returns on failure itself: called as `if build`, the function runs without `set -e`.
build() {
    cargo build --release --locked -p gpucache-gpu --bin gpucache-gpu-bench || return 1
    local json
    json="$(cargo test --release --locked -p gpucache-gpu --no-run --message-format=json)" \
        || return 1
    mkdir -p "$PREBUILT" || return 1
    for t in e2e probe pool_conformance; do
        local exe
        exe="$(printf '%s\n' "$json" | grep '"reason":"compiler-artifact"' \
            | grep "\"name\":\"$t\"" | grep '"kind":\["test"\]' \
            | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)"
        [ -n "$exe" ] || { echo "no test binary named $t in cargo's output" >&2; return 1; }
        cp "$exe" "$PREBUILT/$t" || return 1
    done
    cp "${CARGO_TARGET_DIR:-target}/release/gpucache-gpu-bench" "$PREBUILT/gpucache-gpu-bench" \
        || return 1
    if command -v strip >/dev/null 2>&1; then
        strip --strip-debug "$PREBUILT"/e2e "$PREBUILT"/probe "$PREBUILT"/pool_conformance \
            "$PREBUILT"/gpucache-gpu-bench || return 1
    fi
    ls -l "$PREBUILT"
}

plan() {
    echo "plan:"
    if [ "$use_cargo" = 1 ]; then
        echo "  1. build: cargo build/test --release --no-run -p gpucache-gpu, binaries into $PREBUILT"
    else
        echo "  1. build: none (no cargo); use the prebuilt binaries in $PREBUILT"
    fi
    echo "  2. gpu: nvidia-smi, and the driver folders on LD_LIBRARY_PATH"
    echo "  3. probe: GPUCACHE_REQUIRE_GPU=1 $PREBUILT/probe (device description, typed errors), then $PREBUILT/pool_conformance (the registration contract over device and pinned slots)"
    echo "  4. e2e: GPUCACHE_REQUIRE_GPU=1 $PREBUILT/e2e --test-threads=1 --nocapture (writer and reader processes, exact bytes, sentinel, misses)"
    echo "  5. bench: $PREBUILT/gpucache-gpu-bench --bytes-per-point $BENCH_BYTES_PER_POINT (pinned vs pageable, H2D/D2H, 64 KiB..64 MiB)"
    echo "  6. summary: one line per step, exit status 1 if any failed"
    echo "each step is limited to ${STEP_TIMEOUT_S}s, and all of them together to ${TOTAL_TIMEOUT_S}s"
}

case "$mode" in
    dry) plan; exit 0 ;;
    prepare)
        command -v cargo >/dev/null 2>&1 || { echo "--prepare needs cargo" >&2; exit 1; }
        build || exit 1; exit 0 ;;
esac

plan
declare -a summary=()
failed=0
record() { summary+=("$1: $2"); case "$2" in ok*) ;; *) failed=1 ;; esac; }
run_step() {
    local name="$1"; shift
    printf '\n== %s\n' "$name"
    local left=$((TOTAL_TIMEOUT_S - SECONDS))
    if [ "$left" -le 0 ]; then
        record "$name" "SKIPPED (the ${TOTAL_TIMEOUT_S}s budget is spent)"
        return
    fi
    local limit=$((left < STEP_TIMEOUT_S ? left : STEP_TIMEOUT_S))
    local start=$SECONDS rc=0
    timeout "$limit" "$@" || rc=$?
    if [ "$rc" = 0 ]; then record "$name" ok; else record "$name" "FAILED (exit $rc)"; fi
    echo "-- $name took $((SECONDS - start))s"
}

printf '\n== build\n'
if [ "$use_cargo" = 1 ]; then
    if build; then record build ok; else record build FAILED; fi
else
    for b in e2e probe pool_conformance gpucache-gpu-bench; do
        [ -x "$PREBUILT/$b" ] || { echo "no cargo and no $PREBUILT/$b: run --prepare where cargo is, then carry $PREBUILT" >&2; exit 1; }
    done
    record build "ok (prebuilt, $PREBUILT)"
fi

printf '\n== gpu\n'
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/libcuda.so.1" ]; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
    echo "nvidia-smi not found"
fi

export GPUCACHE_REQUIRE_GPU=1
run_step probe "$PREBUILT/probe" --test-threads=1 --nocapture
run_step pool "$PREBUILT/pool_conformance" --test-threads=1
run_step e2e "$PREBUILT/e2e" --test-threads=1 --nocapture
run_step bench "$PREBUILT/gpucache-gpu-bench" --bytes-per-point "$BENCH_BYTES_PER_POINT"

printf '\n== summary\n'
for line in "${summary[@]}"; do echo "  $line"; done
exit "$failed"
