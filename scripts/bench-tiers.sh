#!/usr/bin/env bash
# The tiered store against a single FileStore of the same capacity, all behind `gpucache serve`
# on loopback: a trace replay (`gpucache-bench trace --addr`) through each, with 64 KiB blocks.
# The tiered servers hold MEMORY_SHARE of the trace's distinct blocks in memory over FILE_SHARE
# in their file tier, one writing through ("tiered") and one writing back ("back"); the
# FileStore server holds FILE_SHARE. All evict by `prefix`, with no flushes (durability
# "none"). Every hit is verified byte for byte by the bench; the tiered servers' own metrics
# say which tier served it.
#
# Usage: scripts/bench-tiers.sh [TRACE]   (default: ../shared/traces/mooncake_synthetic_trace.jsonl)
#   MEMORY_SHARE=5 FILE_SHARE=20   percentages of the trace's distinct blocks
#   BENCH_DIR=$target_dir/tmp      where the stores' files go (a disk; FILE_SHARE of the trace
#                                  at 64 KiB per block must fit, checked first)
# Results (JSON per server, the servers' logs) go to $CARGO_TARGET_DIR/bench-tiers/.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
out="$target_dir/bench-tiers"
trace="${1:-../shared/traces/mooncake_synthetic_trace.jsonl}"
memory_share="${MEMORY_SHARE:-5}"
file_share="${FILE_SHARE:-20}"
block=65536
dir="${BENCH_DIR:-$target_dir/tmp}/bench-tiers"

[ -r "$trace" ] || { echo "bench-tiers: cannot read the trace $trace" >&2; exit 2; }
cargo build --release -p gpucache-cli >&2
bin="$target_dir/release/gpucache"
bench="$target_dir/release/gpucache-bench"

# Distinct blocks of the trace: the bench's own count, from a replay of no request... the
# distinct ids are what the trace's lines name, so count them here the same way.
unique="$(python3 -c '
import json, sys
seen = set()
for line in open(sys.argv[1]):
    line = line.strip()
    if line:
        ids = json.loads(line)["hash_ids"]
        seen.update((tuple(ids[: i + 1]) for i in range(len(ids))))
print(len(seen))' "$trace")"
memory_bytes=$((unique * memory_share / 100 * block))
file_bytes=$((unique * file_share / 100 * block))

rm -rf "$dir" && mkdir -p "$dir" "$out"
free_kib="$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')"
need_kib=$((file_bytes * 3 / 1024 + 262144))
if [ "$free_kib" -lt "$need_kib" ]; then
    echo "bench-tiers: $dir has $((free_kib / 1024)) MiB free; the three stores need $((need_kib / 1024)) MiB" >&2
    exit 2
fi

write_config() {
    local name="$1" port="$2" store="$3"
    cat > "$dir/$name.toml" <<EOF
[store]
root = "$dir/data-$name"
durability = "none"
$store
[limits]
object_bytes_max = "1MiB"
retained_bytes_max = $file_bytes
tenant_retained_bytes_max = $file_bytes
[listen]
native = "127.0.0.1:$port"
resp = "127.0.0.1:$((port + 1))"
metrics = "127.0.0.1:$((port + 2))"
local = ""
EOF
}
tiers() {
    cat <<EOF
kind = "tiered"
[[store.tiers]]
kind = "memory"
capacity = $memory_bytes
eviction = "prefix"
write = "$1"
[[store.tiers]]
kind = "file"
capacity = $file_bytes
eviction = "prefix"
EOF
}
write_config tiered 17470 "$(tiers through)"
write_config file 17480 "kind = \"file\"
eviction = \"prefix\""
write_config back 17490 "$(tiers back)"

pids=()
stop() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
trap stop EXIT

# Starts a server and waits (at most 30 s) for its start line ("listening native=..."), which
# it logs once every listener accepts.
serve() {
    local name="$1"
    "$bin" serve --config "$dir/$name.toml" > "$out/$name.log" 2>&1 &
    pids+=("$!")
    for _ in $(seq 300); do
        grep -q "listening native=" "$out/$name.log" 2>/dev/null && return 0
        kill -0 "${pids[-1]}" 2>/dev/null || break
        sleep 0.1
    done
    echo "bench-tiers: the $name server did not start:" >&2
    cat "$out/$name.log" >&2
    exit 1
}

serve tiered
serve file
serve back
for name in tiered file back; do
    metrics=()
    case "$name" in
        tiered) port=17470 metrics=(--metrics 127.0.0.1:17472) ;;
        file) port=17480 ;;
        back) port=17490 metrics=(--metrics 127.0.0.1:17492) ;;
    esac
    echo "bench-tiers: replaying $trace through the $name server (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    "$bench" trace --addr "127.0.0.1:$port" "${metrics[@]}" --trace "$trace" \
        --block-size 64K --capacity "${file_share}%" --json "$out/$name.json"
done
