#!/usr/bin/env bash
# Installs the inference engines' interfaces that python/tests/engines/ tests the connectors
# against, into the Python package's venv (scripts/setup.sh python makes it), from PyPI with
# pinned versions and no pip cache: torch (PyPI's CUDA build, which also runs on CPU; about
# 5.4 GB installed), transformers, LMCache with its dependencies, and SGLang and vLLM without
# theirs (they pull GPU kernels and another torch) plus the small packages their modules under
# test import. Ready means each interface imports: SGLang's HiCacheStorage,
# StorageBackendFactory and MHATokenToKVPoolHost, LMCache's ConnectorAdapter, RemoteBackend and
# LocalCPUBackend, vLLM's TieringOffloadingSpec, transformers' LlamaForCausalLM, and the
# gpucache connectors built on them. Idempotent: when all of that imports at the pinned
# versions nothing is installed. Prints how long the step took and what the venv holds.
#
# Usage: scripts/setup-engines.sh VENV [PIN...]   (normally run as: scripts/setup.sh engines)
#   PIN  a NAME==VERSION the venv already holds and must keep (scripts/setup.sh passes its
#        Python tools), given to pip with the engines so that it resolves around them
#
# Exit status: 0 ready, 1 not (too little disk, pip failed, an interface does not import; the
# reason is printed), 2 on a usage error.
set -euo pipefail
cd "$(dirname "$0")/.."

# SGLang 0.5.23 pins torch 2.14.1 and transformers 5.19.0 (vLLM 0.33.0 wants torch 2.14.0 and
# transformers below 5.21, so SGLang's pins are taken); torchvision 0.29 is torch 2.14's.
# The rest is what SGLang's modules under test import beyond those (the host KV pool module
# reaches its config, quantization and kernel packages), pinned where SGLang pins them. SGLang
# itself goes in without its dependencies.
WITH_DEPS=(
    "torch==2.14.1" "torchvision==0.29.1" "transformers==5.19.0" "lmcache==0.5.6"
    "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
    "gguf==0.19.0" "loguru==0.7.3" "dill==0.4.1" "orjson==3.13.0" "pybase64==1.5.1"
    "IPython==9.18.1" "pyzmq==27.3.0" "msgspec==0.23.0" "psutil==7.2.2" "pillow==13.0.0"
    "starlette==1.10.0" "sortedcontainers==2.4.0"
    # What vLLM's KV offloading tiering modules import, at vLLM 0.33.0's pins.
    "cbor2==6.3.0" "openai-harmony==0.0.8" "openai==3.57.0" "cloudpickle==3.1.3"
    "uvloop==0.23.0" "xgrammar==0.2.8" "partial-json-parser==0.2.1.1.post7"
    "llguidance==1.7.6"
)
# vLLM (about 0.9 GB) is installed for its OffloadingConnector's secondary-tier interface
# only: its compiled kernels (vllm._C) are built for its own torch pin and do not load, which
# the tiering modules do not need.
NO_DEPS=("sglang==0.5.23" "vllm==0.33.0")
# Free space the install needs on the venv's disk, in MiB: a fresh install added 7,537 MiB
# (torch with its CUDA libraries, LMCache's dependencies, SGLang, vLLM), plus room to spare.
NEED_MIB=9000

log() { printf 'setup-engines: %s\n' "$*" >&2; }
die() { printf 'setup-engines: %s\n' "$*" >&2; exit 1; }

[ $# -ge 1 ] || { echo "usage: scripts/setup-engines.sh VENV [PIN...]" >&2; exit 2; }
# Absolute: the import checks run from / so that the checkout's python/ is not on the path.
venv="$(cd "$1" 2>/dev/null && pwd || printf '%s' "$1")"
shift
keep=("$@")
py="$venv/bin/python"
[ -x "$py" ] || die "no venv at $venv: run scripts/setup.sh python first"
start=$SECONDS

# Why the engines are not ready (nothing when they are): every pin is installed at its version
# and every interface imports (the engines' warnings on a good import are not a problem).
problem() {
    local out
    out="$(cd / && "$py" - "${WITH_DEPS[@]}" "${NO_DEPS[@]}" "${keep[@]}" 2>&1 <<'PY'
import importlib.metadata as m, sys
def have(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "not installed"
wrong = [f"{p} ({have(p.split('==')[0])})" for p in sys.argv[1:] if have(p.split("==")[0]) != p.split("==")[1]]
if wrong:
    sys.exit("not at the pinned version: " + ", ".join(wrong))
import torch
from transformers import LlamaForCausalLM  # noqa: F401
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: F401
from lmcache.v1.storage_backend.connector import ConnectorAdapter  # noqa: F401
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: F401
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: F401
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # noqa: F401
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: F401
import gpucache.connectors.sglang, gpucache.connectors.lmcache, gpucache.connectors.lmcache_mp  # noqa: E401,F401
import gpucache.connectors.vllm  # noqa: F401
torch.zeros(4).add_(1)
PY
)" || printf '%s\n' "$out" | tail -3
}

site_mib() { du -sm "$venv" 2>/dev/null | cut -f1; }

why="$(problem)"
if [ -z "$why" ]; then
    log "ready already: torch, transformers, SGLang, LMCache and vLLM import in $venv ($(site_mib) MiB)"
    exit 0
fi
log "not ready ($why); installing"

dir="$venv"
avail="$(df -Pm "$dir" | awk 'NR == 2 { print $4 }')"
if [ "$avail" -lt "$NEED_MIB" ]; then
    die "the engines need about $NEED_MIB MiB free on the disk of $venv; only $avail MiB are free"
fi

before="$(site_mib)"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
log "pip install ${WITH_DEPS[*]} (with dependencies)"
"${pip[@]}" "${WITH_DEPS[@]}" "${keep[@]}" >&2 || die "pip install ${WITH_DEPS[*]} failed (pip's message above)"
log "pip install --no-deps ${NO_DEPS[*]}"
"${pip[@]}" --no-deps "${NO_DEPS[@]}" >&2 || die "pip install --no-deps failed (pip's message above)"

why="$(problem)"
[ -z "$why" ] || die "the engines still do not import after installing: $why"
after="$(site_mib)"
log "ready in $((SECONDS - start)) s: the venv grew from $before to $after MiB ($venv)"
