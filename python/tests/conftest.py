"""Fixtures of the gpucache Python tests: a `gpucache serve` on a FileStore in a temporary
directory, on loopback ports the system picks, with its same-host socket; started once per test
module, ready when it prints its start line (within START_PATIENCE_S), stopped by its PID.

The package must be importable (scripts/setup.sh installs it into the Python venv): without it
every test module is skipped with the import error as the reason, unless
GPUCACHE_REQUIRE_PYTHON=1 (CI), which stops the run with that error.
The server binary is $GPUCACHE_BIN, else $CARGO_TARGET_DIR/debug/gpucache, else
target/debug/gpucache of this checkout.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
START_PATIENCE_S = 60.0
STOP_PATIENCE_S = 30.0
START_LINES_MAX = 200
OBJECT_BYTES_MAX = 1 << 20
SEALED_TENANT = "sealed"
OTHER_TENANT = "t1"

try:
    import gpucache  # noqa: F401

    IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the install
    IMPORT_ERROR = e


def pytest_configure(config):
    if IMPORT_ERROR is not None and os.environ.get("GPUCACHE_REQUIRE_PYTHON") == "1":
        raise pytest.UsageError(
            f"GPUCACHE_REQUIRE_PYTHON=1 but gpucache does not import ({IMPORT_ERROR}); "
            "run scripts/setup.sh python"
        )


def server_binary() -> Path:
    if os.environ.get("GPUCACHE_BIN"):
        # Relative to where pytest was started (the servers run in their own directories).
        return Path(os.environ["GPUCACHE_BIN"]).resolve()
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target.is_absolute():
        target = REPO / target
    return target / "debug" / "gpucache"


@dataclass
class Server:
    """A running `gpucache serve` and what its start line says."""

    pid: int
    native: str
    resp: str
    local: str
    root: Path
    key_file: Path
    key_id: str
    fields: dict


def fields_of(line: str) -> dict:
    out = {}
    for word in line.split():
        if "=" in word:
            k, v = word.split("=", 1)
            out[k] = v
    return out


def start_server(workdir: Path) -> tuple[subprocess.Popen, Server]:
    binary = server_binary()
    if not binary.exists():
        pytest.fail(f"{binary} is missing: build it with `cargo build -p gpucache-cli` "
                    "(or set GPUCACHE_BIN)")
    root = workdir / "store"
    key_id = "k1"
    key_file = workdir / "sealed.keys"
    key_file.write_text(f"{key_id} {secrets.token_hex(32)}\n")
    key_file.chmod(0o600)
    config = workdir / "gpucache.toml"
    config.write_text(
        f'[store]\nkind = "file"\nroot = "{root}"\n\n'
        f"[limits]\nobject_bytes_max = {OBJECT_BYTES_MAX}\n\n"
        '[listen]\nnative = "127.0.0.1:0"\nresp = "127.0.0.1:0"\nmetrics = "127.0.0.1:0"\n'
        'resp_tenant = "default"\n\n'
        '[[tenants]]\nname = "default"\nrights = ["read", "write"]\n\n'
        f'[[tenants]]\nname = "{OTHER_TENANT}"\nrights = ["read", "write"]\n\n'
        f'[[tenants]]\nname = "{SEALED_TENANT}"\nrights = ["read", "write"]\n'
        f'secret_file = "{key_file}"\n'
    )
    proc = subprocess.Popen(
        [str(binary), "serve", "--config", str(config)],
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue(maxsize=START_LINES_MAX)

    def drain():
        # Keeps reading the log so the server never blocks on it; keeps the first lines.
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                lines.put_nowait(line.rstrip("\n"))
            except queue.Full:
                pass
        try:
            lines.put_nowait(None)
        except queue.Full:
            pass

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + START_PATIENCE_S
    seen = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            stop(proc)
            pytest.fail(f"serve printed no start line within {START_PATIENCE_S} s:\n"
                        + "\n".join(seen))
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line is None:
            proc.wait(timeout=STOP_PATIENCE_S)
            pytest.fail("serve exited before it listened:\n" + "\n".join(seen))
        seen.append(line)
        if "listening native=" in line:
            f = fields_of(line)
            return proc, Server(proc.pid, f["native"], f["resp"], f["local"], root, key_file,
                                key_id, f)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM by PID, then SIGKILL when it has not exited within STOP_PATIENCE_S."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_PATIENCE_S)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_PATIENCE_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, srv = start_server(tmp_path_factory.mktemp("serve"))
    try:
        yield srv
    finally:
        stop(proc)


@pytest.fixture
def client(server):
    import gpucache

    c = gpucache.Client(server.native, tenant="default", local=False)
    yield c
    c.close()


@pytest.fixture
def unique():
    """A fresh name per test, so tests sharing a module's server never meet."""
    return "t-" + secrets.token_hex(8)
