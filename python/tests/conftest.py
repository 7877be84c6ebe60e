"""Fixtures of the gpucache Python tests: a `gpucache serve` on a FileStore in a temporary
directory, on loopback ports the system picks, with its same-host socket; started once per test
module, ready when it prints its start line (serving.launch), stopped by its PID.

The package must be importable (scripts/setup.sh installs it into the Python venv): without it
every test module is skipped with the import error as the reason, unless
GPUCACHE_REQUIRE_PYTHON=1 (CI), which stops the run with that error.
The server binary is $GPUCACHE_BIN, else $CARGO_TARGET_DIR/debug/gpucache, else
target/debug/gpucache of this checkout.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from serving import fields_of, launch, server_binary, stop  # noqa: F401  (stop: for the tests)

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


def start_server(workdir: Path) -> tuple[subprocess.Popen, Server]:
    binary = server_binary()
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
    proc, f = launch(binary, config, workdir)
    return proc, Server(proc.pid, f["native"], f["resp"], f["local"], root, key_file, key_id, f)


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
