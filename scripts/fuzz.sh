#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a fixed time and prints libFuzzer's final stats.
#
#   scripts/fuzz.sh [SECONDS]        # default 60 seconds per target
#
# The targets (fuzz/fuzz_targets/, bodies in fuzz/src/), each decoding untrusted bytes and
# checking what it accepts (round trips, canonical encodings, exact byte accounting):
#   logical_key      GPCL logical prefix keys
#   physical_key     GPCK physical keys (the identity encoding)
#   frame            GPCW frames, requests and responses
#   resp_request     RESP2 requests of the Redis front, fed in arbitrary pieces
#   nixl_descriptor  NIXL block descriptors
#   block_header     FileStore block-file headers
#   mooncake_wire    Mooncake sidecar replies and stored objects
# Targets run one after another, each from its checked-in seeds (fuzz/seeds/<target>) plus the
# corpus it grew before (fuzz/corpus/<target>, git-ignored). A crash or failed assertion leaves
# its input under fuzz/artifacts/<target>/ and makes the script exit non-zero after the rest ran.
# Without cargo-fuzz, `cargo test --manifest-path fuzz/Cargo.toml` runs the same bodies over the
# seeds (scripts/test.sh does).
#
# The default build needs only the stable toolchain: the decoders are safe Rust, so it runs
# without a sanitizer. To fuzz under AddressSanitizer instead, use a nightly toolchain:
#   FUZZ_TOOLCHAIN=nightly FUZZ_SANITIZER=address scripts/fuzz.sh 300
set -euo pipefail

seconds="${1:-60}"
case "$seconds" in
    '' | *[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 2 ;;
esac
toolchain="${FUZZ_TOOLCHAIN:-}"
sanitizer="${FUZZ_SANITIZER:-none}"

cd "$(dirname "$0")/.."

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz not found; installing it" >&2
    cargo install cargo-fuzz
fi

cargo_fuzz=(cargo)
if [ -n "$toolchain" ]; then
    cargo_fuzz+=("+$toolchain")
fi
cargo_fuzz+=(fuzz)

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

mapfile -t targets < <("${cargo_fuzz[@]}" list)
failed=()
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t"
    echo "== $t: ${seconds}s (sanitizer: $sanitizer)" >&2
    status=0
    "${cargo_fuzz[@]}" run --sanitizer "$sanitizer" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        -max_total_time="$seconds" -print_final_stats=1 >"$logs/$t.log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        failed+=("$t")
        echo "-- $t FAILED (exit $status); the end of its log:" >&2
        tail -n 40 "$logs/$t.log" >&2
    fi
    # The last "#N DONE" line, then the final counters libFuzzer prints on exit.
    grep -E '^#[0-9]+[[:space:]]+DONE' "$logs/$t.log" | tail -n 1 | sed "s/^/$t: /" || true
    grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' \
        "$logs/$t.log" | sed "s/^/$t: /" || true
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "failing targets: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
