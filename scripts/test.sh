#!/usr/bin/env bash
# The whole GPUCache test suite on a fresh machine: installs what it needs, then runs the format
# check, clippy with warnings as errors, and every test (the conformance suite at
# GPUCACHE_CONFORMANCE_CASES generated cases per property, 1,000 unless set).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "scripts/test.sh: cargo is missing; install Rust with rustup first" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

# Debian packages are installed only where this shell may (root with apt-get).
can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
apt_install() {
    echo "installing $*"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 \
        || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "$@" >/dev/null; }
}

# The verbs feature's build needs cmake (sideway's loader stub) and libclang (bindgen); they
# are small Debian packages. libibverbs itself is loaded at run time and is not needed to build.
if ! command -v cmake >/dev/null 2>&1 || ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then
    if can_apt; then
        apt_install cmake libclang1-14 libclang-common-14-dev
    else
        echo "scripts/test.sh: cmake or libclang missing and cannot be installed here; the verbs step will fail" >&2
    fi
fi

# Real peers the integration tests drive: Prometheus scrapes /metrics, redis-cli and
# redis-benchmark talk to the RESP listener. Installed from Debian's packages when missing.
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
if [ ${#missing[@]} -gt 0 ]; then
    if can_apt; then
        apt_install "${missing[@]}"
    else
        echo "scripts/test.sh: ${missing[*]} missing and cannot be installed here; their tests will skip" >&2
    fi
fi
# The Mooncake and NIXL venvs below need python3 with venv.
if can_apt && ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    apt_install python3 python3-venv
fi
# Mooncake Store for the executor's live test: a venv under the build folder holding
# mooncake-transfer-engine-non-cuda from PyPI (scripts/bench-peers.sh makes it, with the
# bench's other peers).
mooncake_venv="${GPUCACHE_MOONCAKE_VENV:-${CARGO_TARGET_DIR:-target}/bench-venv}"
case "$mooncake_venv" in /*) ;; *) mooncake_venv="$PWD/$mooncake_venv" ;; esac
if [ ! -x "$mooncake_venv/bin/mooncake_master" ]; then
    echo "installing the Mooncake Store venv at $mooncake_venv"
    BENCH_VENV="$mooncake_venv" scripts/bench-peers.sh >/dev/null \
        || echo "scripts/test.sh: could not make the Mooncake venv at $mooncake_venv; its live test will skip" >&2
fi
export GPUCACHE_MOONCAKE_VENV="$mooncake_venv"
# In CI the peers must be there: their tests fail instead of skipping.
if [ "${CI:-}" = "true" ]; then
    export GPUCACHE_REQUIRE_PROMETHEUS=1 GPUCACHE_REQUIRE_REDIS_CLI=1 GPUCACHE_REQUIRE_MOONCAKE=1
fi

export GPUCACHE_CONFORMANCE_CASES="${GPUCACHE_CONFORMANCE_CASES:-1000}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Disk: this suite builds the workspace four times (plain, verbs, spdk/doca, nixl), and with full
# debug info and incremental caches that came to about 8 GB, more than a CI machine may have
# free. Line tables keep file:line in panics and backtraces at a fraction of the size; a
# one-shot run gains nothing from incremental caches. Either can be overridden from outside.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
target_dir="${CARGO_TARGET_DIR:-target}"

step() {
    # In CI no step reuses an earlier step's test executables (each feature set links its own),
    # so they are removed between steps: that keeps the build folder near 2 GB instead of 3.3.
    # Elsewhere they stay, so that a second run links nothing it need not.
    if [ "${CI:-}" = "true" ] && [ -d "$target_dir/debug/deps" ]; then
        find "$target_dir/debug/deps" -maxdepth 1 -type f -perm -u+x ! -name '*.so' -delete
    fi
    # Each step reports what the build folder holds and what the disk has left, so a full disk
    # shows up in the log before it fails a step.
    if [ -d "$target_dir" ]; then
        printf '\n(build folder %s; %s free on its disk)\n' \
            "$(du -sh "$target_dir" 2>/dev/null | cut -f1)" \
            "$(df -h --output=avail "$target_dir" 2>/dev/null | tail -1 | tr -d ' ')"
    fi
    printf '\n== %s\n' "$*"
}

step "format"
cargo fmt --all -- --check

step "clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "tests (conformance: ${GPUCACHE_CONFORMANCE_CASES} cases per property)"
cargo test --workspace --locked

# RDMA verbs (sideway, libibverbs loaded at run time): builds everywhere, runs only on RDMA
# hosts; here its tests check that discovery fails closed with the typed reason.
step "verbs feature (clippy, build, tests)"
cargo clippy -p gpucache-nic --all-targets --features verbs --locked -- -D warnings
cargo build -p gpucache-nic --features verbs --locked
cargo test -p gpucache-nic --features verbs --locked

# SPDK and DOCA are absent here: with their features the DPU agent's native queues must fail
# closed, naming what is missing (the conformance suite already ran in the workspace step).
step "dpu spdk/doca features (clippy, fail-closed tests)"
cargo clippy -p gpucache-dpu -p gpucache-cli --all-targets --features gpucache-dpu/spdk,gpucache-dpu/doca,gpucache-cli/spdk,gpucache-cli/doca --locked -- -D warnings
cargo test -p gpucache-dpu --features spdk,doca --locked --lib --test agent
cargo test -p gpucache-cli --features spdk,doca --locked --test dpu_serve

# NIXL (nixl-sys in stub mode, libnixl_capi.so from the nixl-cu12 wheel loaded at run time):
# a venv under the build folder holds the wheel; its bundled libraries go on LD_LIBRARY_PATH
# for this step only, with UCX_MODULES=^ib (the bundled libnl crashes at exit without it). In CI
# NIXL must be there (GPUCACHE_REQUIRE_NIXL=1); elsewhere its tests skip with the reason.
step "nixl feature (clippy, tests)"
nixl_venv="${CARGO_TARGET_DIR:-target}/nixl-venv"
case "$nixl_venv" in /*) ;; *) nixl_venv="$PWD/$nixl_venv" ;; esac
. scripts/nixl-venv.sh
if ! nixl_libs="$(nixl_libs "$nixl_venv")"; then
    echo "scripts/test.sh: could not make the NIXL venv at $nixl_venv; NIXL tests will skip" >&2
    nixl_libs=""
fi
# nixl-sys compiles its C++ loader stub (g++) and runs bindgen (libclang, installed above).
if ! command -v c++ >/dev/null 2>&1 && can_apt; then
    apt_install g++
fi
cargo clippy -p gpucache-nic -p gpucache-cli -p gpucache-gpu --all-targets --features gpucache-nic/nixl,gpucache-cli/nixl,gpucache-gpu/nixl --locked -- -D warnings
(
    if [ -n "$nixl_libs" ]; then
        export LD_LIBRARY_PATH="$nixl_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    export UCX_MODULES='^ib'
    if [ "${CI:-}" = "true" ]; then
        export GPUCACHE_REQUIRE_NIXL=1
    fi
    # nixl_conformance: the store conformance suite through the NIXL client (about 1-2 minutes
    # on two cores: each generated case starts a fresh server).
    cargo test -p gpucache-nic --features nixl --locked --lib --test nixl --test nixl_service \
        --test nixl_pool --test nixl_conformance
    cargo test -p gpucache-cli --features nixl --locked --test bench_nixl --test nixl_serve
    cargo test -p gpucache-gpu --features nixl --locked --test nixl_vram
)

# loom swaps the executor's locks for its model checker's, so this build differs from the one
# above; its own target folder keeps the main build's artifacts valid.
step "loom model checks (executor health monitor, admission credits)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom" \
    cargo test -p gpucache-dataplane --release --locked --lib loom
printf '\n(build folder %s at the end)\n' "$(du -sh "$target_dir" 2>/dev/null | cut -f1)"
