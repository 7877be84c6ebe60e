#!/usr/bin/env bash
# The GPU check: the cross-process KV-block end-to-end test with a GPU demanded
# (GPUCACHE_REQUIRE_GPU=1), the probe tests, the device slots registered with NIXL as VRAM
# (the nixl_vram test, feature nixl), and the H2D/D2H bandwidth bench, then a summary with one
# PASS, FAIL or SKIPPED line per step. Meant for a machine with one NVIDIA GPU (an H200 lent
# through the device tool); under 8 minutes there. Needs no network.
#
#   scripts/gpu-check.sh               build (release) with cargo if present, else use the
#                                      prebuilt binaries in $PREBUILT, then run every step
#   scripts/gpu-check.sh --prepare     build here and copy the binaries into $PREBUILT, with the
#                                      NIXL wheel's libraries packed as $PREBUILT/nixl-libs.tar.xz
#                                      (.tar.gz without xz; for a GPU machine without a Rust
#                                      toolchain or network)
#   scripts/gpu-check.sh --dry-run     print the plan and run nothing
#
# The NIXL step loads libnixl_capi.so from, in order: $GPUCACHE_NIXL_LIBS (a folder), the NIXL
# venv of scripts/nixl-venv.sh (made by scripts/setup.sh nixl where cargo is, within the budget),
# or $PREBUILT/nixl-libs.tar.xz (or .tar.gz) unpacked into a temporary folder. With none of them, or when the
# test itself finds NIXL unusable, the step is SKIPPED with the reason and fails nothing.
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
. scripts/nixl-venv.sh
mode=run
case "${1:-}" in
    "") ;;
    --dry-run) mode=dry ;;
    --prepare) mode=prepare ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
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

# The nixl_vram test binary (feature nixl) into $PREBUILT, and, when the NIXL venv is (or can be
# made) ready, its wheel's two library folders packed beside it for a machine without network.
build_nixl() {
    local json exe libs
    json="$(cargo test --release --locked -p gpucache-gpu --features nixl --test nixl_vram \
        --no-run --message-format=json)" || return 1
    exe="$(printf '%s\n' "$json" | grep '"reason":"compiler-artifact"' \
        | grep '"name":"nixl_vram"' | grep '"kind":\["test"\]' \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)"
    [ -n "$exe" ] || { echo "no test binary named nixl_vram in cargo's output" >&2; return 1; }
    mkdir -p "$PREBUILT" || return 1
    cp "$exe" "$PREBUILT/nixl_vram" || return 1
    if command -v strip >/dev/null 2>&1; then strip --strip-debug "$PREBUILT/nixl_vram" || return 1; fi
    if [ "$mode" = prepare ]; then
        if libs="$(nixl_libs "$NIXL_VENV")"; then
            # Both folders, side by side as in the wheel: the libraries find each other, UCX's
            # modules and NIXL's plugins through $ORIGIN-relative paths. xz packs the 128 MiB
            # into about 18 MiB (gzip: 28), which leaves the binaries room in a 64 MiB carry.
            local packed="$PREBUILT/nixl-libs.tar.gz" how=-z
            if command -v xz >/dev/null 2>&1; then packed="$PREBUILT/nixl-libs.tar.xz" how=-J; fi
            rm -f "$PREBUILT"/nixl-libs.tar.* || return 1
            tar -C "$(dirname "$libs")" "$how" -cf "$packed" "$(basename "$libs")" nixl_cu12.libs \
                || return 1
            ls -l "$packed"
        else
            echo "no NIXL venv at $NIXL_VENV: no packed NIXL libraries made, the nixl step will skip" >&2
        fi
    fi
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
    echo "  5. nixl: GPUCACHE_REQUIRE_NIXL=1 UCX_MODULES=^ib LD_LIBRARY_PATH=<the NIXL wheel's libraries> $PREBUILT/nixl_vram --test-threads=1 --nocapture (cargo test -p gpucache-gpu --features nixl --test nixl_vram: device slots registered as VRAM); SKIPPED without NIXL"
    echo "  6. bench: $PREBUILT/gpucache-gpu-bench --bytes-per-point $BENCH_BYTES_PER_POINT (pinned vs pageable, H2D/D2H, 64 KiB..64 MiB)"
    echo "  7. summary: PASS, FAIL or SKIPPED per step, exit status 1 if any failed or ran out of budget"
    echo "each step is limited to ${STEP_TIMEOUT_S}s, and all of them together to ${TOTAL_TIMEOUT_S}s"
}

case "$mode" in
    dry) plan; exit 0 ;;
    prepare)
        command -v cargo >/dev/null 2>&1 || { echo "--prepare needs cargo" >&2; exit 1; }
        build || exit 1; build_nixl || exit 1; exit 0 ;;
esac

plan
declare -a summary=()
failed=0
# record NAME STATUS: STATUS starts with PASS, FAIL or SKIPPED. A FAIL fails the check, and so
# does a step skipped because the budget ran out; a step skipped for a missing optional piece
# (NIXL) does not.
record() {
    summary+=("$1: $2")
    case "$2" in PASS*) ;; "SKIPPED (no NIXL"*|"SKIPPED (NIXL"*) ;; *) failed=1 ;; esac
}
# Sets `limit` to the seconds the next step may take (what is left of the total budget, at
# most $STEP_TIMEOUT_S), or records NAME as skipped and returns 1 when nothing is left. Called
# in this shell, never in $(...), so that the record is kept.
step_limit() {
    local left=$((TOTAL_TIMEOUT_S - SECONDS))
    if [ "$left" -le 0 ]; then
        record "$1" "SKIPPED (the ${TOTAL_TIMEOUT_S}s budget is spent)"
        return 1
    fi
    limit=$((left < STEP_TIMEOUT_S ? left : STEP_TIMEOUT_S))
}
limit=0
run_step() {
    local name="$1"; shift
    printf '\n== %s\n' "$name"
    step_limit "$name" || return 0
    local start=$SECONDS rc=0
    timeout "$limit" "$@" || rc=$?
    if [ "$rc" = 0 ]; then record "$name" PASS; else record "$name" "FAIL (exit $rc)"; fi
    echo "-- $name took $((SECONDS - start))s"
}
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# Prints the folder holding libnixl_capi.so for the nixl step, or the reason there is none on
# stderr (returns 1). See the header for the order; making the venv may take `limit` seconds.
find_nixl_libs() {
    if [ -n "${GPUCACHE_NIXL_LIBS:-}" ]; then
        [ -e "$GPUCACHE_NIXL_LIBS/libnixl_capi.so" ] \
            || { echo "no libnixl_capi.so in GPUCACHE_NIXL_LIBS=$GPUCACHE_NIXL_LIBS" >&2; return 1; }
        printf '%s\n' "$GPUCACHE_NIXL_LIBS"
        return 0
    fi
    local libs
    if libs="$(nixl_lib_dir "$NIXL_VENV")"; then printf '%s\n' "$libs"; return 0; fi
    if [ "$use_cargo" = 1 ]; then
        # A host with cargo is taken to have network: make the venv, within the budget.
        if libs="$(timeout "$limit" bash -c '. scripts/nixl-venv.sh && nixl_libs "$1"' _ "$NIXL_VENV")"; then
            printf '%s\n' "$libs"
            return 0
        fi
    fi
    local packed
    for packed in "$PREBUILT/nixl-libs.tar.xz" "$PREBUILT/nixl-libs.tar.gz"; do
        [ -f "$packed" ] || continue
        tar -C "$scratch" -xf "$packed" || { echo "cannot unpack $packed" >&2; return 1; }
        libs="$(find "$scratch" -maxdepth 2 -name libnixl_capi.so -printf '%h\n' -quit)"
        [ -n "$libs" ] && { printf '%s\n' "$libs"; return 0; }
        echo "$packed holds no libnixl_capi.so" >&2
        return 1
    done
    echo "no NIXL venv at $NIXL_VENV and no $PREBUILT/nixl-libs.tar.xz or .tar.gz" >&2
    return 1
}

# The nixl_vram test with the wheel's libraries, the way scripts/test.sh's NIXL step runs it.
# NIXL is demanded once its libraries are found (GPUCACHE_REQUIRE_NIXL=1), so an agent that
# cannot be made fails the step; were the test to skip anyway, its SKIP line reports SKIPPED.
nixl_step() {
    printf '\n== nixl\n'
    if [ "$nixl_built" != 1 ]; then record nixl "FAIL (the nixl_vram build failed)"; return; fi
    if [ ! -x "$PREBUILT/nixl_vram" ]; then
        record nixl "SKIPPED (no NIXL test binary: $PREBUILT/nixl_vram; run --prepare again)"
        return
    fi
    local libs start=$SECONDS rc=0 skip_line
    step_limit nixl || return 0
    if ! libs="$(find_nixl_libs)"; then
        record nixl "SKIPPED (no NIXL libraries: see the reason above)"
        return
    fi
    echo "NIXL libraries: $libs"
    step_limit nixl || return 0
    timeout "$limit" env LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        UCX_MODULES='^ib' GPUCACHE_REQUIRE_NIXL=1 \
        "$PREBUILT/nixl_vram" --test-threads=1 --nocapture 2>&1 | tee "$scratch/nixl.log" \
        || rc=$?
    skip_line="$(grep -m 1 '^SKIP VRAM registration' "$scratch/nixl.log" || true)"
    if [ "$rc" != 0 ]; then
        record nixl "FAIL (exit $rc)"
    elif [ -n "$skip_line" ]; then
        record nixl "SKIPPED (NIXL test: ${skip_line#SKIP VRAM registration: })"
    else
        record nixl PASS
    fi
    echo "-- nixl took $((SECONDS - start))s"
}

printf '\n== build\n'
nixl_built=1
if [ "$use_cargo" = 1 ]; then
    if build; then record build PASS; else record build FAIL; fi
    build_nixl || nixl_built=0
else
    for b in e2e probe pool_conformance gpucache-gpu-bench; do
        [ -x "$PREBUILT/$b" ] || { echo "no cargo and no $PREBUILT/$b: run --prepare where cargo is, then carry $PREBUILT" >&2; exit 1; }
    done
    record build "PASS (prebuilt, $PREBUILT)"
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
nixl_step
run_step bench "$PREBUILT/gpucache-gpu-bench" --bytes-per-point "$BENCH_BYTES_PER_POINT"

printf '\n== summary\n'
for line in "${summary[@]}"; do echo "  $line"; done
exit "$failed"
