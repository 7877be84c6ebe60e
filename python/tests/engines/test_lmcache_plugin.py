"""The LMCache plugin through LMCache's own loading path: the configuration lines of the
module's doc, read by LMCacheEngineConfig.from_file, make LMCache's RemoteBackend (the plugin
loader, its ConnectorManager and its instrumented wrapper) around GPUCacheConnector, against a
running `gpucache serve`."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_require import require

torch = require("torch")
lm_config = require("lmcache.v1.config")
lm_metadata = require("lmcache.v1.metadata")
lm_utils = require("lmcache.utils")
local_cpu = require("lmcache.v1.storage_backend.local_cpu_backend")
remote_backend = require("lmcache.v1.storage_backend.remote_backend")
lm_connector = require("lmcache.v1.storage_backend.connector")

from gpucache.connectors import lmcache as plugin  # noqa: E402

LAYERS, CHUNK, HEADS, HEAD_DIM = 2, 16, 2, 8
MODEL = "org/lmcache-model"
WAIT_S = 30.0
LOCAL_CPU_GB = 0.032


def documented_yaml(url: str) -> str:
    """The YAML block of the plugin module's doc, with the test server's address."""
    doc = plugin.__doc__
    start = doc.index("::\n\n") + 4
    end = doc.index("\n\n", start)
    lines = [line[4:] for line in doc[start:end].splitlines()]
    text = "\n".join(lines) + "\n"
    assert "gpucache://127.0.0.1:7470?tenant=default" in text
    assert "max_local_cpu_size: 5\n" in text
    # LMCache allocates its whole local CPU buffer up front: 5 GB per backend is too much for
    # a test machine, 32 MB holds these tests' chunks.
    text = text.replace("max_local_cpu_size: 5\n", f"max_local_cpu_size: {LOCAL_CPU_GB}\n")
    return text.replace("gpucache://127.0.0.1:7470?tenant=default", url)


def metadata(worker_id=0, world_size=1, dtype=torch.float16):
    return lm_metadata.LMCacheMetadata(
        model_name=MODEL, world_size=world_size, local_world_size=world_size,
        worker_id=worker_id, local_worker_id=worker_id, kv_dtype=dtype,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK,
    )


def make_backend(tmp_path, server, loop, yaml_text=None, plugin_name="gpucache", md=None):
    url = f"gpucache://{server.native}?tenant=default&local=false"
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml_text if yaml_text is not None else documented_yaml(url))
    config = lm_config.LMCacheEngineConfig.from_file(str(path))
    md = md or metadata()
    local = local_cpu.LocalCPUBackend(config, md, dst_device="cpu")
    backend = remote_backend.RemoteBackend(
        config, md, loop, local, dst_device="cpu", plugin_name=plugin_name
    )
    # LMCache logs a failed connector and carries on without one: that is a failure here.
    assert backend.connection is not None, "LMCache made no GPUCache connector"
    return backend, local, md


def chunk(local, md, fill):
    obj = local.allocate(md.get_shapes(), md.get_dtypes(), None)
    assert obj is not None
    obj.tensor.copy_(fill.reshape(obj.tensor.shape).to(obj.tensor.dtype))
    return obj


def key(md, h, dtype=torch.float16):
    return lm_utils.CacheEngineKey(MODEL, md.world_size, md.worker_id, h, dtype)


def release(*groups):
    """Hands the test's chunks back to LMCache's allocator."""
    for group in groups:
        for obj in group:
            if obj is not None:
                obj.ref_count_down()


def fills(n, seed):
    g = torch.Generator().manual_seed(seed)
    numel = LAYERS * 2 * CHUNK * HEADS * HEAD_DIM
    return [torch.randn(numel, generator=g) for _ in range(n)]


def test_documented_plugin_config_stores_and_reads_chunks(tmp_path, server, loop, unique):
    backend, local, md = make_backend(tmp_path, server, loop)
    assert "GPUCacheConnector" in repr(backend.connection._connector)
    base = abs(hash(unique)) % (1 << 40)
    keys = [key(md, base + i) for i in range(3)]
    data = fills(3, seed=base % 1000)
    assert backend.batched_contains(keys) == 0
    objs = [chunk(local, md, d) for d in data]
    for k, o in zip(keys[:2], objs[:2]):
        backend.submit_put_task(k, o).result(WAIT_S)
    assert backend.contains(keys[0]) and backend.contains(keys[1])
    assert not backend.contains(keys[2])
    assert backend.batched_contains(keys) == 2
    got = backend.get_blocking(keys[1])
    assert got is not None and torch.equal(got.tensor, objs[1].tensor)
    many = backend.batched_get_blocking(keys)
    assert many[2] is None
    assert torch.equal(many[0].tensor, objs[0].tensor)
    # The connector's own list, ping and remove.
    conn = backend.connection._connector
    listed = asyncio.run_coroutine_threadsafe(conn.list(), loop).result(WAIT_S)
    assert sorted(listed) == sorted(k.to_string() for k in keys[:2])
    assert asyncio.run_coroutine_threadsafe(conn.ping(), loop).result(WAIT_S) == 0
    assert conn.remove_sync(keys[0]) and not backend.contains(keys[0])
    release(objs, [got], many)


def test_batched_put_and_the_prefix_of_a_non_blocking_get(tmp_path, server, loop, unique):
    backend, local, md = make_backend(tmp_path, server, loop)
    conn = backend.connection._connector
    base = abs(hash(unique)) % (1 << 40)
    keys = [key(md, base + i) for i in range(4)]
    objs = [chunk(local, md, d) for d in fills(4, seed=3)]
    put = [keys[0], keys[1], keys[3]]
    asyncio.run_coroutine_threadsafe(
        conn.batched_put(put, [objs[0], objs[1], objs[3]]), loop).result(WAIT_S)
    n = asyncio.run_coroutine_threadsafe(
        conn.batched_async_contains("lookup", keys), loop).result(WAIT_S)
    assert n == 2
    got = asyncio.run_coroutine_threadsafe(
        conn.batched_get_non_blocking("lookup", keys), loop).result(WAIT_S)
    assert len(got) == 2, "the read stops at the first missing chunk"
    assert all(torch.equal(g.tensor, o.tensor) for g, o in zip(got, objs))
    release(objs, got)


def test_identity_separates_workers_dtypes_and_models(tmp_path, server, loop, unique):
    backend, local, md = make_backend(tmp_path, server, loop)
    h = abs(hash(unique)) % (1 << 40)
    obj = chunk(local, md, fills(1, 5)[0])
    backend.submit_put_task(key(md, h), obj).result(WAIT_S)
    release([obj])
    assert backend.contains(key(md, h))
    assert not backend.contains(lm_utils.CacheEngineKey(MODEL, 2, 1, h, torch.float16))
    assert not backend.contains(lm_utils.CacheEngineKey(MODEL, 1, 0, h, torch.bfloat16))
    assert not backend.contains(lm_utils.CacheEngineKey(MODEL + "-b", 1, 0, h, torch.float16))
    # Another chunk geometry (here: tokens per chunk) is another layout.
    other = metadata()
    other.chunk_size = CHUNK * 2
    other.kv_shape = (LAYERS, 2, CHUNK * 2, HEADS, HEAD_DIM)
    b2, _, _ = make_backend(tmp_path, server, loop, md=other)
    assert not b2.contains(key(other, h))


def test_a_missing_or_bad_setting_is_refused_with_its_reason(tmp_path, server, loop):
    url = f"gpucache://{server.native}?tenant=default"
    cases = {
        "remote_storage_plugin.gpucache.url": documented_yaml(url).replace(
            "remote_storage_plugin.gpucache.url", "remote_storage_plugin.gpucache.where"),
        "unknown field": documented_yaml(url.replace("tenant=", "tenat=")),
        "remote_serde: naive": documented_yaml(url).replace(
            "remote_serde: naive", "remote_serde: cachegen"),
    }
    md = metadata()
    for reason, text in cases.items():
        path = tmp_path / "broken.yaml"
        path.write_text(text)
        config = lm_config.LMCacheEngineConfig.from_file(str(path))
        local = local_cpu.LocalCPUBackend(config, md, dst_device="cpu")
        with pytest.raises(ValueError, match=reason):
            lm_connector.CreateConnector(
                "plugin://gpucache", loop, local, config, md, plugin_name="gpucache")


def test_a_bad_setting_stops_lmcaches_start_instead_of_running_without_the_tier(tmp_path, server, loop):
    # LMCache's RemoteBackend swallows a connector's ordinary errors and runs with no remote
    # tier; a configuration error must reach the engine's start.
    url = f"gpucache://{server.native}?tenant=default"
    path = tmp_path / "typo.yaml"
    path.write_text(documented_yaml(url.replace("tenant=", "tenat=")))
    config = lm_config.LMCacheEngineConfig.from_file(str(path))
    md = metadata()
    local = local_cpu.LocalCPUBackend(config, md, dst_device="cpu")
    with pytest.raises(plugin.GPUCacheConfigError, match="unknown field"):
        remote_backend.RemoteBackend(config, md, loop, local, dst_device="cpu", plugin_name="gpucache")


def test_reads_end_before_lmcache_stops_waiting_and_a_late_one_keeps_nothing(
        tmp_path, server, loop, unique, monkeypatch):
    backend, local, md = make_backend(tmp_path, server, loop)
    config = backend.config
    # LMCache wraps the connector it made in its instrumented one.
    conn = backend.connection._connector
    assert isinstance(conn, plugin.GPUCacheConnector)
    assert conn.address.timeout_s <= config.blocking_timeout_secs / 2
    k = key(md, int(unique[2:], 16))
    obj = chunk(local, md, torch.full((LAYERS, 2, CHUNK, HEADS, HEAD_DIM), 3.0))
    conn._put_sync([k], [obj])
    allocated = []
    real = conn._allocate

    def counting():
        m = real()
        allocated.append(m)
        return m

    conn._allocate = counting
    # LMCache already gave up: nothing is allocated.
    assert conn._get_sync(k, time.monotonic() - 1) is None
    assert conn._batched_get_sync([k], time.monotonic() - 1) == [None]
    assert allocated == []
    # It gives up while the read runs (the plugin's clock reads 0 before the read and 10
    # after it, the deadline is 5): what the read allocated is released, nothing returned.
    clock = iter([0.0, 10.0])
    monkeypatch.setattr(plugin.time, "monotonic", lambda: next(clock))
    assert conn._get_sync(k, 5.0) is None
    monkeypatch.undo()
    assert len(allocated) == 1 and allocated[0].get_ref_count() == 0
    # In time, the chunk comes back.
    got = conn._get_sync(k, time.monotonic() + 60)
    assert got is not None and torch.equal(got.tensor, obj.tensor)
    release([obj, got])
