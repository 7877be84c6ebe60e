#!/usr/bin/env bash
# The cold tier against a real S3 server on loopback (moto): `gpucache-bench cold` packs and
# stores blocks of 64 KiB and 1 MiB through the cold sink, refills them in batches (every block
# checked byte for byte), and does the same with one plain object per block on the same bucket,
# then reports throughputs, refill p50/p99 and the ratios cold / plain.
#
# Usage: scripts/bench-cold.sh [BENCH FLAGS...]   (e.g. --bytes 128MiB --batch 16)
#   BUCKET=gpucache-bench-cold       the bucket made on the server
#   GPUCACHE_MOTO_VENV=...           the moto venv (default: target/moto-venv, then
#                                    $CARGO_TARGET_DIR/moto-venv; scripts/setup.sh moto)
# The JSON goes to $CARGO_TARGET_DIR/bench-cold/result.json, moto's log beside it.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
out="$target_dir/bench-cold"
bucket="${BUCKET:-gpucache-bench-cold}"

venv="${GPUCACHE_MOTO_VENV:-target/moto-venv}"
if [ -z "${GPUCACHE_MOTO_VENV:-}" ] && [ ! -x "$venv/bin/moto_server" ]; then
    venv="$target_dir/moto-venv"
fi
moto="$venv/bin/moto_server"
if [ ! -x "$moto" ]; then
    echo "bench-cold: no moto server at $moto: run scripts/setup.sh moto first" >&2
    exit 2
fi

cargo build --release -p gpucache-cli >&2
bin="$target_dir/release/gpucache-bench"
mkdir -p "$out"

# A free loopback port: bound and let go here, then taken by moto (a server that loses the
# race exits, which the readiness loop notices).
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
endpoint="http://127.0.0.1:$port"
"$moto" -H 127.0.0.1 -p "$port" > "$out/moto.log" 2>&1 &
moto_pid=$!
stop() {
    kill "$moto_pid" 2>/dev/null || true
    wait "$moto_pid" 2>/dev/null || true
}
trap stop EXIT

# Ready once the server makes the bucket: PUT it until it answers 200, for at most 60 s.
deadline=$((SECONDS + 60))
until curl -fsS -o /dev/null --max-time 5 -X PUT "$endpoint/$bucket" 2>/dev/null; do
    if ! kill -0 "$moto_pid" 2>/dev/null; then
        echo "bench-cold: moto_server exited before it answered:" >&2
        cat "$out/moto.log" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "bench-cold: moto_server did not make the bucket within 60 s" >&2
        exit 1
    fi
    sleep 0.1
done
echo "bench-cold: moto at $endpoint (pid $moto_pid), bucket $bucket; $(uptime)" >&2

set +e
"$bin" cold --endpoint "$endpoint" --bucket "$bucket" --json "$out/result.json" "$@" \
    > /dev/null
status=$?
set -e
echo "bench-cold: exit status $status; JSON in $out/result.json" >&2
uptime
exit "$status"
