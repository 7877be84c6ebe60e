#!/usr/bin/env bash
# Installs the peers `gpucache bench service` compares the service with, only what is missing:
#   - redis-server and iperf3 from Debian (apt-get, as root);
#   - a Python venv at $CARGO_TARGET_DIR/bench-venv (default target/bench-venv) holding
#     mooncake-transfer-engine-non-cuda from PyPI, whose wheel ships mooncake_master,
#     mooncake_http_metadata_server and mooncake_client.
# Idempotent: a second run installs nothing and says so. Prints what it installed.
#
# Usage: scripts/bench-peers.sh
#   BENCH_VENV=/path      the venv to use instead of $CARGO_TARGET_DIR/bench-venv
#   PYTHON=python3        the interpreter that makes the venv
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
venv="${BENCH_VENV:-$target_dir/bench-venv}"
python="${PYTHON:-python3}"
installed=()

step() { printf '== %s\n' "$*" >&2; }

missing_debs=()
command -v redis-server >/dev/null 2>&1 || missing_debs+=(redis-server)
command -v iperf3 >/dev/null 2>&1 || missing_debs+=(iperf3)
if [[ ${#missing_debs[@]} -gt 0 ]]; then
    step "installing ${missing_debs[*]} (apt-get)"
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "scripts/bench-peers.sh: ${missing_debs[*]} missing and this is not root; install them first" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y "${missing_debs[@]}" >&2; then
        apt-get update >&2
        apt-get install -y "${missing_debs[@]}" >&2
    fi
    installed+=("${missing_debs[@]}")
fi

# The release the live tests and the bench were checked against (its start-up order matters to
# tests/tests/mooncake_live.rs: the client mounts its segment before it listens).
MOONCAKE_VERSION="${MOONCAKE_VERSION:-0.3.13.post1}"
mooncake_bins=(mooncake_master mooncake_http_metadata_server mooncake_client)
have_mooncake() {
    [[ -x "$venv/bin/python" ]] || return 1
    local b
    for b in "${mooncake_bins[@]}"; do
        [[ -x "$venv/bin/$b" ]] || return 1
    done
    "$venv/bin/python" -c 'import mooncake.store' 2>/dev/null
}
if ! have_mooncake; then
    if [[ ! -x "$venv/bin/python" ]]; then
        step "making the venv $venv"
        mkdir -p "$(dirname "$venv")"
        "$python" -m venv "$venv"
        installed+=("venv $venv")
    fi
    step "pip install mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" >&2
    installed+=(mooncake-transfer-engine-non-cuda)
    for b in "${mooncake_bins[@]}"; do
        if [[ ! -x "$venv/bin/$b" ]]; then
            echo "scripts/bench-peers.sh: the wheel did not install $venv/bin/$b" >&2
            exit 1
        fi
    done
    if ! "$venv/bin/python" -c 'import mooncake.store' >&2; then
        echo "scripts/bench-peers.sh: mooncake.store does not import in $venv" >&2
        exit 1
    fi
fi

if [[ ${#installed[@]} -eq 0 ]]; then
    echo "bench peers: nothing to install (redis-server, iperf3 and $venv are present)"
else
    echo "bench peers: installed ${installed[*]}"
fi
echo "redis-server: $(redis-server --version | head -1)"
echo "iperf3: $(iperf3 --version | head -1)"
echo "mooncake: $("$venv/bin/pip" show mooncake-transfer-engine-non-cuda 2>/dev/null | sed -n 's/^Version: //p') in $venv"
