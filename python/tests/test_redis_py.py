"""redis-py, unchanged, against the RESP front of a real `gpucache serve`.

redis-py 8 opens every connection with `HELLO 3` (then `CLIENT SETINFO LIB-NAME/LIB-VER`), and
LMCache's plain `redis://` connector is redis-py's asyncio client with its defaults, so this
file drives the front through exactly those clients: the default handshake (RESP3) and
`protocol=2`, the commands LMCache sends (SET, GET, EXISTS, DEL), MGET, pipelines, SET's
expiry and condition options, the create-only answers to a re-put, and AUTH through HELLO for a
tenant with keys.

The server is the binary `conftest.server_binary` names, with a memory store on loopback ports
the system picks, started and stopped by `serving.launch` / `serving.stop` (ready when it prints
its start line; stopped by its PID).

Without redis-py the file is skipped, unless `GPUCACHE_REQUIRE_PYTHON=1`, which makes that a
failure.
"""

import asyncio
import os
from pathlib import Path

import pytest
from conftest import server_binary
from serving import launch, stop

try:
    import redis
    import redis.asyncio
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as missing:
    if os.environ.get("GPUCACHE_REQUIRE_PYTHON") == "1":
        raise ImportError(
            f"GPUCACHE_REQUIRE_PYTHON=1 but redis-py cannot be imported ({missing}); "
            "the Python test environment must include redis-py"
        ) from missing
    pytest.skip(f"redis-py is not installed ({missing})", allow_module_level=True)

# Every client call gives up after this long instead of hanging the run.
CLIENT_TIMEOUT_S = 10.0
KEY_ID = "k1"
SECRET_HEX = "5a" * 32


class Server:
    """One `gpucache serve` with a memory store; `resp` is the RESP listener's (host, port)."""

    def __init__(self, workdir: Path, with_keys: bool):
        self.workdir = workdir
        tenant = ['name = "t0"', 'rights = ["read", "write"]']
        if with_keys:
            keys = workdir / "t0.keys"
            keys.write_text(f"{KEY_ID} {SECRET_HEX}\n")
            keys.chmod(0o600)
            tenant.append(f'secret_file = "{keys}"')
        config = workdir / "gpucache.toml"
        config.write_text(
            "\n".join(
                [
                    "[store]",
                    'kind = "memory"',
                    "[listen]",
                    'native = "127.0.0.1:0"',
                    'resp = "127.0.0.1:0"',
                    'metrics = "127.0.0.1:0"',
                    "[[tenants]]",
                    *tenant,
                    "",
                ]
            )
        )
        self.proc, fields = launch(server_binary(), config, workdir)
        host, port = fields["resp"].rsplit(":", 1)
        self.resp = (host, int(port))

    def stop(self):
        stop(self.proc)

    def client(self, **kwargs) -> "redis.Redis":
        host, port = self.resp
        return redis.Redis(
            host=host,
            port=port,
            socket_timeout=CLIENT_TIMEOUT_S,
            socket_connect_timeout=CLIENT_TIMEOUT_S,
            **kwargs,
        )


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("open"), with_keys=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("keyed"), with_keys=True)
    yield server
    server.stop()


# `None`: redis-py's default, which is the HELLO 3 handshake.
PROTOCOLS = [None, 2, 3]


def client_for(server, protocol, **kwargs):
    if protocol is not None:
        kwargs["protocol"] = protocol
    return server.client(**kwargs)


def negotiated(r) -> int:
    """The protocol the connection's HELLO agreed on (2 when no HELLO was sent)."""
    conn = r.connection_pool.get_connection()
    try:
        meta = conn.handshake_metadata or {}
        return int(meta.get(b"proto", meta.get("proto", 2)))
    finally:
        r.connection_pool.release(conn)


def test_the_default_client_says_hello_3_and_gets_resp3(open_server):
    r = open_server.client()
    assert r.ping() is True
    assert negotiated(r) == 3
    conn = r.connection_pool.get_connection()
    try:
        meta = conn.handshake_metadata
        assert meta[b"server"] == b"gpucache"
        assert meta[b"mode"] == b"standalone"
        assert meta[b"role"] == b"master"
        assert meta[b"modules"] == []
        # HELLO names the connection's id, and CLIENT ID on that connection agrees.
        conn.send_command("CLIENT", "ID")
        assert conn.read_response() == meta[b"id"]
    finally:
        r.connection_pool.release(conn)
    assert open_server.client(protocol=2).ping() is True
    assert negotiated(open_server.client(protocol=2)) == 2
    r.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_commands_and_create_only_answers(open_server, protocol):
    r = client_for(open_server, protocol)
    p = f"p{protocol}:"
    value = bytes(range(256)) * 3
    assert r.set(p + "k", value) is True
    assert r.get(p + "k") == value
    assert r.get(p + "missing") is None
    assert r.mget([p + "k", p + "missing"]) == [value, None]
    assert r.exists(p + "k", p + "missing", p + "k") == 2
    # The same bytes again: the key holds what was asked, so the SET succeeds.
    assert r.set(p + "k", value) is True
    # Other bytes cannot replace a value: a typed error, and the value stays.
    with pytest.raises(redis.exceptions.ResponseError, match="create-only"):
        r.set(p + "k", b"other")
    assert r.get(p + "k") == value
    # NX on an existing key and XX on a missing one are nil and store nothing.
    assert r.set(p + "k", b"other", nx=True) is None
    assert r.set(p + "absent", b"v", xx=True) is None
    assert r.exists(p + "absent") == 0
    assert r.set(p + "k", value, xx=True) is True
    assert r.set(p + "new", b"v", get=True) is None
    assert r.set(p + "new", b"v", get=True) == b"v"
    # DEL, then the key takes another value.
    assert r.delete(p + "k", p + "missing") == 1
    assert r.get(p + "k") is None
    assert r.set(p + "k", b"other") is True
    assert r.get(p + "k") == b"other"
    big = os.urandom(1 << 20)
    assert r.set(p + "big", big) is True
    assert r.get(p + "big") == big
    r.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pipelines(open_server, protocol):
    r = client_for(open_server, protocol)
    p = f"pipe{protocol}:"
    # Without a transaction, and with redis-py's default one (MULTI ... EXEC).
    for transaction in (False, True):
        q = f"{p}{transaction}:"
        pipe = r.pipeline(transaction=transaction)
        pipe.set(q + "a", b"1").set(q + "b", b"2").get(q + "a").mget(q + "a", q + "nope")
        pipe.exists(q + "a", q + "b").delete(q + "b").get(q + "b")
        assert pipe.execute() == [True, True, b"1", [b"1", None], 2, 1, None]
    # A command that fails inside a transaction raises at execute(), after the others ran.
    pipe = r.pipeline()
    pipe.set(p + "c", b"x").set(p + "c", b"y").get(p + "c")
    with pytest.raises(redis.ResponseError):
        pipe.execute()
    assert r.get(p + "c") == b"x"
    r.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_set_with_an_expiry(open_server, protocol):
    r = client_for(open_server, protocol)
    p = f"ttl{protocol}:"
    assert r.set(p + "ex", b"v", ex=100) is True
    assert r.get(p + "ex") == b"v"
    assert r.ttl(p + "ex") in (99, 100)
    assert r.set(p + "keep", b"v", px=100_000) is True
    assert r.set(p + "keep", b"v", keepttl=True) is True
    assert 0 < r.pttl(p + "keep") <= 100_000
    assert r.set(p + "keep", b"v") is True
    assert r.ttl(p + "keep") == -1
    assert r.ttl(p + "nothing") == -2
    # A deadline in the past: the key reads as a miss at once.
    assert r.set(p + "past", b"v", pxat=1) is True
    assert r.get(p + "past") is None
    assert r.exists(p + "past") == 0
    # A deadline passing on its own is tested against the front with a manual clock
    # (service/tests/resp.rs); here a future one holds until then.
    assert r.set(p + "later", b"v", px=60_000) is True
    assert r.get(p + "later") == b"v"
    assert 0 < r.pttl(p + "later") <= 60_000
    with pytest.raises(redis.exceptions.ResponseError, match="invalid expire time"):
        r.set(p + "bad", b"v", ex=0)
    r.close()


def test_client_names_and_library_info(open_server):
    r = open_server.client(client_name="lmcache-worker")
    assert r.client_getname() == "lmcache-worker"
    assert r.client_setinfo("LIB-NAME", "custom") is True
    with pytest.raises(redis.exceptions.ResponseError, match="CLIENT ID, GETNAME, SETNAME"):
        r.client_list()
    r.close()


def test_lmcache_style_asyncio_client_from_a_redis_url(open_server):
    """What LMCache's `redis://` connector does: an asyncio pool from the URL, kv bytes then
    metadata, EXISTS on the metadata key, GET both, DEL."""
    host, port = open_server.resp

    async def run():
        pool = redis.asyncio.ConnectionPool.from_url(
            f"redis://{host}:{port}", max_connections=8, socket_timeout=CLIENT_TIMEOUT_S
        )
        r = redis.asyncio.Redis.from_pool(pool)
        try:
            key = "lmcache@model@1@0@abcdef"
            kv = os.urandom(64 << 10)
            await r.set(key + "kv_bytes", kv)
            await r.set(key + "metadata", b"meta")
            assert bool(await r.exists(key + "metadata")) is True
            assert await r.get(key + "metadata") == b"meta"
            assert await r.get(key + "kv_bytes") == kv
            # The same chunk stored again by another worker is fine.
            await r.set(key + "kv_bytes", kv)
            assert await r.exists("lmcache@model@1@0@nothing" + "metadata") == 0
            assert await r.delete(key + "metadata") == 1
            assert await r.get(key + "metadata") is None
        finally:
            await r.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_auth_through_hello_for_a_tenant_with_keys(keyed_server, protocol):
    r = client_for(keyed_server, protocol, username=KEY_ID, password=SECRET_HEX)
    p = f"auth{protocol}:"
    assert r.set(p + "k", b"v") is True
    assert r.get(p + "k") == b"v"
    assert negotiated(r) == (2 if protocol == 2 else 3)
    r.close()
    # The same credentials in a URL, as LMCache's remote_url carries them.
    host, port = keyed_server.resp
    query = "" if protocol is None else f"?protocol={protocol}"
    url = redis.Redis.from_url(f"redis://{KEY_ID}:{SECRET_HEX}@{host}:{port}{query}")
    assert url.get(p + "k") == b"v"
    assert negotiated(url) == (2 if protocol == 2 else 3)
    url.close()
    # redis-py retries a refused connection (with backoff) by default; once is enough here.
    once = Retry(NoBackoff(), 0)
    for bad in [
        dict(username=KEY_ID, password="00" * 32),
        dict(username="nobody", password=SECRET_HEX),
    ]:
        wrong = client_for(keyed_server, protocol, retry=once, **bad)
        with pytest.raises(redis.exceptions.AuthenticationError, match="invalid username-password pair"):
            wrong.get(p + "k")
        wrong.close()
    anonymous = client_for(keyed_server, protocol, retry=once)
    with pytest.raises(redis.exceptions.AuthenticationError, match="Authentication required"):
        anonymous.get(p + "k")
    anonymous.close()
