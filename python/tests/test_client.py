"""The gpucache Client against a real `gpucache serve` on a FileStore: round trips of every call
with bytes, bytearray, memoryview, numpy arrays and raw addresses; batches; misses as values;
refusals as typed exceptions; plain names shared with the RESP front and the CLI; the same-host
path against TCP; the GIL released while a call waits."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import OBJECT_BYTES_MAX, OTHER_TENANT, SEALED_TENANT, server_binary
from serving import launch, stop

gpucache = pytest.importorskip("gpucache")


def ident(**kw):
    base = dict(tenant="default", model="test/model-a", model_config=b'{"layers": 2}',
                kv_dtype="f16", layout="test-layout", block_tokens=4)
    base.update(kw)
    return gpucache.Identity(**base)


def resp_command(addr: str, *args: bytes) -> bytes:
    """One RESP request on a fresh connection; the whole reply (one bulk string or line)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(10)
        req = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        s.sendall(req)
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"RESP connection closed after {buf!r}"
            buf += chunk
        head, rest = buf.split(b"\r\n", 1)
        if head.startswith(b"$") and head != b"$-1":
            n = int(head[1:])
            while len(rest) < n + 2:
                chunk = s.recv(65536)
                assert chunk, "RESP reply cut short"
                rest += chunk
            return rest[:n]
        return head


def test_put_get_exists_remove_by_plain_name(client, unique):
    assert client.get(unique) is None
    assert client.exists(unique) is False
    assert client.put(unique, b"first value") is True
    assert client.exists(unique) is True
    assert client.get(unique) == b"first value"
    # Create-only: a second put leaves the block as it was.
    assert client.put(unique, b"first value") is False
    assert client.get(unique.encode()) == b"first value"  # bytes name == str name
    assert client.remove(unique) is True
    assert client.remove(unique) is False
    assert client.get(unique) is None


def test_get_into_every_kind_of_destination(client, unique):
    data = os.urandom(4096)
    assert client.put(unique, data)
    ba = bytearray(5000)
    assert client.get_into(unique, ba) == 4096
    assert bytes(ba[:4096]) == data and ba[4096:] == bytearray(904)
    arr = np.zeros(1024, dtype=np.float32)  # 4096 bytes
    assert client.get_into(unique, arr) == 4096
    assert arr.tobytes() == data
    mv = memoryview(bytearray(4096))
    assert client.get_into(unique, mv) == 4096
    assert mv.tobytes() == data
    raw = (ctypes.c_char * 4096)()
    assert client.get_into(unique, ctypes.addressof(raw), size=4096) == 4096
    assert raw.raw == data
    # A miss is a value and leaves the destination alone.
    keep = bytearray(b"\x07" * 16)
    assert client.get_into(unique + "-absent", keep) is None
    assert keep == bytearray(b"\x07" * 16)


def test_put_from_every_kind_of_source(client, unique):
    data = os.urandom(3000)
    raw = ctypes.create_string_buffer(data, 3000)
    assert client.put_from(unique + "-raw", ctypes.addressof(raw), size=3000) is True
    assert client.put_from(unique + "-np", np.frombuffer(data, dtype=np.uint8)) is True
    assert client.put_from(unique + "-mv", memoryview(data)[:1000]) is True
    assert client.put_from(unique + "-size", bytearray(data), size=10) is True
    assert client.get(unique + "-raw") == data
    assert client.get(unique + "-np") == data
    assert client.get(unique + "-mv") == data[:1000]
    assert client.get(unique + "-size") == data[:10]


def test_batches_with_identity_keys_and_misses_in_place(client):
    idt = ident(model="test/batch-" + os.urandom(4).hex())
    keys = idt.chain_keys([f"block-{i}".encode() for i in range(6)])
    blocks = [os.urandom(512 + i) for i in range(6)]
    assert client.prefix_len(keys) == 0
    assert client.batch_put_from(keys[:4], blocks[:4]) == [True] * 4
    assert client.batch_put_from(keys[:2], blocks[:2]) == [False, False]
    assert client.batch_exists(keys) == [True, True, True, True, False, False]
    assert client.prefix_len(keys) == 4
    dsts = [bytearray(1024) for _ in keys]
    got = client.batch_get_into(keys, dsts)
    assert got == [512, 513, 514, 515, None, None]
    for i in range(4):
        assert bytes(dsts[i][: got[i]]) == blocks[i]
    # A hole in the middle: prefix_len stops at it, batch_exists reports each key.
    assert client.remove(keys[1]) is True
    assert client.prefix_len(keys) == 1
    assert client.batch_exists(keys)[:3] == [True, False, True]
    # Sizes per item, into one numpy pool at disjoint offsets.
    pool = np.zeros(4096, dtype=np.uint8)
    base = pool.ctypes.data
    got = client.batch_get_into([keys[0], keys[2]], [base, base + 2048], sizes=[1024, 1024])
    assert got == [512, 514]
    assert pool[:512].tobytes() == blocks[0] and pool[2048:2048 + 514].tobytes() == blocks[2]


def test_overlapping_destinations_are_refused_before_anything_moves(client, unique):
    client.put(unique, b"x" * 100)
    buf = bytearray(200)
    with pytest.raises(ValueError, match="overlap"):
        client.batch_get_into([unique, unique], [memoryview(buf)[:150], memoryview(buf)[100:]])
    assert buf == bytearray(200)


def test_over_limit_block_is_refused_with_a_reason(client, server, unique):
    big = bytes(OBJECT_BYTES_MAX + 1)
    with pytest.raises(gpucache.RefusedError) as e:
        client.put(unique, big)
    assert e.value.reason == "too_large", e.value.detail
    assert str(OBJECT_BYTES_MAX) in e.value.detail
    assert e.value.retired is True
    assert client.exists(unique) is False
    # In a batch, the refusal names its item; the other items are stored.
    with pytest.raises(gpucache.RefusedError) as e:
        client.batch_put_from([unique + "-ok", unique], [b"fine", big])
    assert e.value.reason == "too_large" and e.value.index == 1
    assert client.get(unique + "-ok") == b"fine"
    # The exception says what every item did: the first was stored, the third already held.
    with pytest.raises(gpucache.RefusedError) as e:
        client.batch_put_from([unique + "-new", unique, unique + "-ok"], [b"a", big, b"fine"])
    assert e.value.index == 1
    assert e.value.results[0] is True and e.value.results[2] is False
    assert e.value.results[1] is e.value
    assert client.offers()["object_bytes_max"] == OBJECT_BYTES_MAX


def test_too_small_destination_is_refused_with_the_size_needed(client, unique):
    client.put(unique, b"y" * 100)
    small = bytearray(10)
    with pytest.raises(gpucache.BufferTooSmallError) as e:
        client.get_into(unique, small)
    assert e.value.needed == 100
    assert e.value.reason == "buffer_too_small"
    assert isinstance(e.value, gpucache.RefusedError)
    # In a batch the other items still land, and the exception says how each went.
    fits, other = bytearray(100), bytearray(10)
    with pytest.raises(gpucache.BufferTooSmallError) as e:
        client.batch_get_into([unique, unique + "-absent", unique], [fits, other, small])
    assert e.value.index == 2
    assert e.value.results[:2] == [100, None] and e.value.results[2] is e.value
    assert fits == b"y" * 100


def test_bad_arguments_are_type_and_value_errors(client):
    with pytest.raises(TypeError):
        client.get(12)
    with pytest.raises(ValueError, match="size"):
        client.get_into("x", 12345)
    with pytest.raises(TypeError):
        client.get_into("x", b"read-only bytes")
    with pytest.raises(ValueError):
        client.batch_get_into(["a", "b"], [bytearray(1)])
    with pytest.raises(ValueError):
        client.put_from("x", bytearray(4), size=5)


def test_key_of_another_tenant_is_refused(client):
    other = ident(tenant=OTHER_TENANT).chain_keys([b"b0"])[0]
    with pytest.raises(gpucache.RefusedError) as e:
        client.put(other, b"data")
    assert e.value.reason == "wrong_tenant"
    with pytest.raises(gpucache.RefusedError) as e:
        client.get(other)
    assert e.value.reason == "wrong_tenant"


def test_sealed_tenant_needs_its_key_file(server, tmp_path, unique):
    good = gpucache.Client(server.native, tenant=SEALED_TENANT, key_file=str(server.key_file),
                           local=False)
    assert good.put(unique, b"sealed") is True
    assert good.get(unique) == b"sealed"
    wrong = tmp_path / "wrong.keys"
    wrong.write_text(f"{server.key_id} {'ab' * 32}\n")
    wrong.chmod(0o600)
    with pytest.raises(gpucache.RefusedError) as e:
        gpucache.Client(server.native, tenant=SEALED_TENANT, key_file=str(wrong), local=False)
    assert e.value.reason == "auth"
    wrong.chmod(0o644)
    with pytest.raises(gpucache.RefusedError) as e:
        gpucache.Client(server.native, tenant=SEALED_TENANT, key_file=str(wrong), local=False)
    assert e.value.reason == "key_file" and "chmod 600" in e.value.detail
    with pytest.raises(gpucache.RefusedError) as e:
        gpucache.Client(server.native, tenant="nobody", local=False)
    assert e.value.reason == "unknown_tenant"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_unavailable():
    with pytest.raises(gpucache.UnavailableError) as e:
        gpucache.Client(f"127.0.0.1:{free_port()}", timeout_s=2.0)
    assert e.value.reason == "unavailable" and e.value.retired is True


def test_a_waiting_call_releases_the_gil():
    # A listener that accepts and never answers HELLO: the handshake waits out its deadline,
    # and a Python thread must run meanwhile.
    with socket.socket() as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(4)
        addr = "127.0.0.1:%d" % lsn.getsockname()[1]
        stop = threading.Event()
        count = [0]

        def spin():
            while not stop.is_set():
                count[0] += 1

        t = threading.Thread(target=spin)
        t.start()
        try:
            before = count[0]
            with pytest.raises(gpucache.UnavailableError, match="HELLO"):
                gpucache.Client(addr, timeout_s=1.0, local=False)
            during = count[0] - before
        finally:
            stop.set()
            t.join(timeout=10)
    assert during > 10_000, f"the spinning thread ran {during} times during a 1 s wait"


def test_plain_names_are_the_resp_fronts_keys(client, server, unique):
    assert client.put(unique, b"from python") is True
    assert resp_command(server.resp, b"GET", unique.encode()) == b"from python"
    assert resp_command(server.resp, b"SET", (unique + "-r").encode(), b"from resp") == b"+OK"
    assert client.get(unique + "-r") == b"from resp"
    assert bytes(client.key(unique)) == bytes(gpucache.plain_key("default", unique))


def test_plain_names_are_the_clis_keys(client, server, unique):
    out = subprocess.run([str(server_binary()), "put", unique, "--addr", server.native],
                         input=b"from the cli", capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert client.get(unique) == b"from the cli"


def test_same_host_and_tcp_give_the_same_bytes(server, unique):
    local = gpucache.Client(server.native, local=True)
    tcp = gpucache.Client(server.native, local=False)
    auto = gpucache.Client(server.native)
    assert local.transport == "local" and tcp.transport == "tcp" and auto.transport == "local"
    o = tcp.offers()
    assert o["same_host_offered"] is True and o["local_socket"] == server.local
    blocks = [os.urandom(10_000 + i) for i in range(5)]
    names = [f"{unique}-{i}" for i in range(5)]
    assert local.batch_put_from(names[:3], blocks[:3]) == [True] * 3
    assert tcp.batch_put_from(names[3:], blocks[3:]) == [True] * 2
    for c in (local, tcp):
        dsts = [bytearray(20_000) for _ in names]
        got = c.batch_get_into(names, dsts)
        assert [bytes(d[:n]) for d, n in zip(dsts, got)] == blocks
    # Into a buffer of the shared segment: written there by the server, no bounce.
    sb = local.shared_buffer(20_000)
    assert sb is not None
    before = local.offers()["shared"]
    assert local.get_into(names[0], sb) == 10_000
    assert bytes(gpucache.shared_view(sb)[:10_000]) == blocks[0]
    after = local.offers()["shared"]
    assert after["direct_items"] == before["direct_items"] + 1
    assert after["bounced_items"] == before["bounced_items"]
    with pytest.raises(gpucache.RefusedError) as e:
        tcp.shared_buffer(10)
    assert e.value.reason == "not_local"


def test_local_true_without_an_offer_is_refused(tmp_path):
    # A memory store offers no same-host socket.
    cfg = tmp_path / "mem.toml"
    cfg.write_text('[store]\nkind = "memory"\n\n[listen]\nnative = "127.0.0.1:0"\n'
                   'resp = "127.0.0.1:0"\nmetrics = "127.0.0.1:0"\n\n'
                   '[[tenants]]\nname = "default"\nrights = ["read", "write"]\n')
    proc, fields = launch(server_binary(), cfg, tmp_path)
    try:
        assert fields["local"] == "none", fields
        native = fields["native"]
        with pytest.raises(gpucache.RefusedError) as e:
            gpucache.Client(native, local=True)
        assert e.value.reason == "no_local_socket"
        auto = gpucache.Client(native)
        assert auto.transport == "tcp"
        assert auto.offers()["same_host_offered"] is False
    finally:
        stop(proc)


def test_closed_client_refuses_calls(server):
    c = gpucache.Client(server.native, local=False)
    c.close()
    with pytest.raises(gpucache.UnavailableError):
        c.get("x")


def test_module_main_reports_version_reachability_and_offers(server):
    out = subprocess.run([sys.executable, "-m", "gpucache", server.native], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"gpucache {gpucache.__version__}" in out.stdout
    assert "reachable" in out.stdout and "not reachable" not in out.stdout
    assert f"same-host path: offered at {server.local}" in out.stdout
    assert f"object_bytes_max: {OBJECT_BYTES_MAX}" in out.stdout
    dead = subprocess.run([sys.executable, "-m", "gpucache", f"127.0.0.1:{free_port()}",
                           "--timeout-s", "2"], capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1
    assert "not reachable" in dead.stdout


def test_a_pool_in_the_shared_segment_is_served_in_place(server, unique):
    c = gpucache.Client(server.native, local=True, segment_bytes=16 << 20)
    pool = c.shared_buffer(1 << 20)
    assert pool is not None
    assert c.register_buffer(pool) is True
    assert c.register_buffer(bytearray(4096)) is False  # outside: one copy here each way
    with pytest.raises(ValueError, match="overlap"):
        c.register_buffer(pool.ptr + 4096, size=10)
    view = np.frombuffer(gpucache.shared_view(pool), dtype=np.uint8)
    blocks = [os.urandom(8192) for _ in range(4)]
    for i, b in enumerate(blocks):
        view[i * 8192:(i + 1) * 8192] = np.frombuffer(b, dtype=np.uint8)
    names = [f"{unique}-{i}" for i in range(4)]
    before = c.offers()["shared"]
    addrs = [pool.ptr + i * 8192 for i in range(4)]
    assert c.batch_put_from(names, addrs, sizes=[8192] * 4) == [True] * 4
    view[:] = 0
    assert c.batch_get_into(names[::-1], addrs, sizes=[8192] * 4) == [8192] * 4
    after = c.offers()["shared"]
    assert after["direct_items"] - before["direct_items"] == 8
    assert after["bounced_items"] == before["bounced_items"]
    assert [view[i * 8192:(i + 1) * 8192].tobytes() for i in range(4)] == blocks[::-1]
    # The same names read over TCP give the same bytes.
    tcp = gpucache.Client(server.native, local=False)
    assert [tcp.get(n) for n in names] == blocks
    assert tcp.register_buffer(bytearray(16)) is False
    ptrs = [p for p, _, _ in c.registered_buffers()]
    assert pool.ptr in ptrs
    c.unregister_buffer(pool)
    assert pool.ptr not in [p for p, _, _ in c.registered_buffers()]
    with pytest.raises(ValueError):
        c.unregister_buffer(pool)


def test_registrations_are_bounded(client):
    pool = (ctypes.c_char * (gpucache.REGISTERED_BUFFERS_MAX + 1))()
    base = ctypes.addressof(pool)
    for i in range(gpucache.REGISTERED_BUFFERS_MAX):
        client.register_buffer(base + i, size=1)
    with pytest.raises(gpucache.RefusedError) as e:
        client.register_buffer(base + gpucache.REGISTERED_BUFFERS_MAX, size=1)
    assert e.value.reason == "registrations"


def test_threads_share_one_client(server, unique):
    c = gpucache.Client(server.native)
    blocks = {f"{unique}-{i}": os.urandom(50_000 + i) for i in range(8)}
    errors = []

    def work(name, data):
        try:
            assert c.put(name, data) is True
            for _ in range(5):
                dst = bytearray(len(data))
                assert c.get_into(name, dst) == len(data) and bytes(dst) == data
        except BaseException as e:  # reported below, with the name
            errors.append((name, e))

    threads = [threading.Thread(target=work, args=item) for item in blocks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client thread did not finish in 60 s"
    assert errors == []
    assert c.batch_exists(list(blocks)) == [True] * len(blocks)


def test_batch_tier_names_the_tier_that_holds_each_block(client, unique, tmp_path):
    # A store of one tier holds a block without tiers.
    client.put(unique, b"v" * 100)
    assert client.batch_tier([unique, unique + "-absent"]) == ["single", None]
    # A tiered server whose memory holds two 4 KiB blocks, writing through: the third PUT
    # pushes the first block's copy out of memory; the file tier keeps every block.
    config = tmp_path / "tiered.toml"
    config.write_text(
        f'[store]\nkind = "tiered"\nroot = "{tmp_path / "store"}"\n'
        '[[store.tiers]]\nkind = "memory"\ncapacity = 8192\n\n'
        '[listen]\nnative = "127.0.0.1:0"\nresp = "127.0.0.1:0"\nmetrics = "127.0.0.1:0"\n'
        'local = ""\n\n[[tenants]]\nname = "default"\nrights = ["read", "write"]\n'
    )
    proc, fields = launch(server_binary(), config, tmp_path)
    try:
        tiered = gpucache.Client(fields["native"], tenant="default", local=False)
        names = [f"{unique}-{i}" for i in range(3)]
        for i, name in enumerate(names):
            assert tiered.put(name, bytes([i]) * 4096) is True
        assert tiered.batch_tier(names + [unique + "-absent"]) == ["file", "memory", "memory", None]
        # A lookup is not a read: asking again changes nothing; a GET promotes the first.
        assert tiered.batch_tier(names) == ["file", "memory", "memory"]
        assert tiered.get(names[0]) == bytes([0]) * 4096
        assert tiered.batch_tier(names)[0] == "memory"
        tiered.close()
    finally:
        stop(proc)
