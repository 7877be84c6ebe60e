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

export GPUCACHE_CONFORMANCE_CASES="${GPUCACHE_CONFORMANCE_CASES:-1000}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step() { printf '\n== %s\n' "$*"; }

step "format"
cargo fmt --all -- --check

step "clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "tests (conformance: ${GPUCACHE_CONFORMANCE_CASES} cases per property)"
cargo test --workspace --locked
