#!/usr/bin/env bash
# Checks that the crates keep the shape the workspace's folders promise, from what cargo itself
# resolves (`cargo tree`), not from reading manifests:
# - gpucache-storage pulls in no metrics, authentication, randomness or JSON crate;
# - gpucache-wire pulls in nothing that does I/O (no io_uring, libc, memory maps, sockets,
#   async runtimes, randomness from the system);
# - no crate below the service (the Python package included) depends on gpucache-service;
# - etcd and its async runtime stay in gpucache-cluster: the contract, the stores, the wire and
#   the plain client pull in neither;
# - cli/src, the thin binary, stays under 2,000 lines.
# Exit status 1 names every broken rule.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
deps() {
    # Every package in the normal (non-dev, non-build) dependency tree of crate $1.
    cargo tree --locked -p "$1" -e normal --prefix none --format '{p}' | awk '{print $1}' | sort -u
}
forbid() {
    local crate=$1
    shift
    local found
    found=$(deps "$crate" | grep -Fx -f <(printf '%s\n' "$@") || true)
    if [ -n "$found" ]; then
        echo "check-layers: $crate depends on $(echo "$found" | tr '\n' ' ')" >&2
        fail=1
    else
        echo "check-layers: $crate: none of $*"
    fi
}

forbid gpucache-storage prometheus-client hmac sha2 getrandom serde_json
forbid gpucache-wire io-uring libc memmap2 getrandom tokio mio socket2 nix
for crate in gpucache-dataplane gpucache-storage gpucache-wire gpucache-client; do
    forbid "$crate" etcd-client tokio tonic
done
for crate in gpucache-dataplane gpucache-storage gpucache-wire gpucache-client gpucache-cluster gpucache-mooncake \
    gpucache-nic gpucache-dpu gpucache-gpu gpucache-python; do
    forbid "$crate" gpucache-service gpucache-bench gpucache-cli
done

lines=$(cat cli/src/*.rs | wc -l)
if [ "$lines" -ge 2000 ]; then
    echo "check-layers: cli/src holds $lines lines (at most 1,999)" >&2
    fail=1
else
    echo "check-layers: cli/src holds $lines lines"
fi
exit "$fail"
