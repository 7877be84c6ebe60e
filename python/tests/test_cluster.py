"""gpucache.Client.cluster against a cluster on loopback: one etcd member (Debian
`etcd-server`, started and stopped by PID here) and two `gpucache serve` nodes. Without etcd
these tests skip, unless GPUCACHE_REQUIRE_ETCD=1 (CI), where they fail."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import server_binary
from serving import launch, stop

gpucache = pytest.importorskip("gpucache")

PATIENCE_S = 20.0
LEASE_TTL_S = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what, check, patience=PATIENCE_S):
    """Polls `check` (a short pause between tries) until it holds, or fails saying `what`."""
    deadline = time.monotonic() + patience
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {patience} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    if shutil.which("etcd") is None:
        if os.environ.get("GPUCACHE_REQUIRE_ETCD") == "1":
            pytest.fail("GPUCACHE_REQUIRE_ETCD=1 but etcd is missing (scripts/setup.sh etcd)")
        pytest.skip("no etcd here (scripts/setup.sh etcd installs it)")
    d = tmp_path_factory.mktemp("etcd")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        ["etcd", "--name", "e0", "--data-dir", str(d / "data"),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"e0={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield client
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def node(workdir: Path, etcd: str, number: int):
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "gpucache.toml"
    config.write_text(
        '[store]\nkind = "memory"\n\n'
        '[listen]\nnative = "127.0.0.1:0"\nresp = "127.0.0.1:0"\nmetrics = "127.0.0.1:0"\n\n'
        f'[cluster]\netcd = ["{etcd}"]\nname = "py"\nnode = {number}\n'
        f"lease_ttl_s = {LEASE_TTL_S}\npoll_ms = 100\n\n"
        '[[tenants]]\nname = "default"\nrights = ["read", "write"]\n'
    )
    proc, _ = launch(server_binary(), config, workdir)
    return proc


def test_a_cluster_client_routes_batches_and_a_dead_node_is_misses(etcd, tmp_path):
    nodes = {n: node(tmp_path / f"n{n}", etcd, n) for n in (1, 2)}
    try:
        c = gpucache.Client.cluster([etcd], name="py", poll_ms=100)
        assert c.transport == "cluster"
        wait_until("both nodes in the view", lambda: len(c.offers()["members"]) == 2)
        keys = [c.key(f"block-{i}") for i in range(64)]
        values = [bytes([i]) * 1024 for i in range(64)]

        def stored():
            try:
                return all(c.batch_put_from(keys, values)) or all(c.batch_exists(keys))
            except gpucache.Error:
                return False  # the view is settling: some writes are refused for a moment

        wait_until("every block stored", lambda: all(c.batch_exists(keys)) or stored())
        bufs = [bytearray(1024) for _ in keys]
        assert c.batch_get_into(keys, bufs) == [1024] * len(keys)
        assert [bytes(b) for b in bufs] == values
        offers = c.offers()
        assert {m[0] for m in offers["members"]} == {1, 2}

        # Node 2 dies: its keys are misses (never errors, never other bytes); node 1's hit.
        nodes.pop(2).send_signal(signal.SIGKILL)
        got = c.batch_get_into(keys, [bytearray(1024) for _ in keys])
        hits = [n is not None for n in got]
        assert 0 < sum(hits) < len(keys), hits
        for k, v, hit in zip(keys, values, hits):
            if hit:
                assert c.get(k) == v
        wait_until("node 2 leaves the view", lambda: len(c.offers()["members"]) == 1,
                   patience=LEASE_TTL_S * 5)
        assert c.offers()["members"][0][0] == 1
    finally:
        for p in nodes.values():
            stop(p)


def test_a_connector_address_can_name_a_cluster(etcd, tmp_path):
    from gpucache.connectors import _url

    nodes = [node(tmp_path / f"n{n}", etcd, n) for n in (1, 2)]
    try:
        members = etcd.removeprefix("http://")
        address = _url.parse(f"gpucache+etcd://{members}/py?tenant=default&timeout_s=10")
        c = address.connect(client_name="connector-test")
        assert c.transport == "cluster" and c.tenant == "default"
        wait_until("both nodes in the view", lambda: len(c.offers()["members"]) == 2)
        keys = [c.key(f"via-url-{i}") for i in range(16)]

        def stored():
            try:
                return all(c.batch_put_from(keys, [bytes([i]) * 64 for i in range(16)]))
            except gpucache.Error:
                return False  # the view is settling: some writes are refused for a moment

        wait_until("every block stored", lambda: all(c.batch_exists(keys)) or stored())
        assert [c.get(k) for k in keys] == [bytes([i]) * 64 for i in range(16)]
        c.close()
    finally:
        for p in nodes:
            stop(p)


def test_a_cluster_client_needs_an_etcd_that_answers():
    with pytest.raises(gpucache.UnavailableError):
        gpucache.Client.cluster([f"http://127.0.0.1:{free_port()}"], timeout_s=2.0)
    with pytest.raises(ValueError):
        gpucache.Client.cluster([])
