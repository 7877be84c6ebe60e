"""The LMCache multiprocess-mode L2 adapter through LMCache's own classes: the documented
``--l2-adapter`` line parsed by LMCache's argument parser, the adapter built by its plugin
factory, and LMCache's StorageManager (L1 in host memory, its store and prefetch controllers)
moving real memory objects to and from a running `gpucache serve`."""

from __future__ import annotations

import argparse
import json
import os
import select
import shlex
import signal
import time

import pytest
from engine_require import require

torch = require("torch")
lm_api = require("lmcache.v1.distributed.api")
lm_dist_config = require("lmcache.v1.distributed.config")
lm_l2 = require("lmcache.v1.distributed.l2_adapters")
lm_l2_config = require("lmcache.v1.distributed.l2_adapters.config")
lm_storage = require("lmcache.v1.distributed.storage_manager")
lm_memory = require("lmcache.v1.memory_management")

from gpucache.connectors import lmcache_mp as mp  # noqa: E402
from serving import launch, pause, server_binary, stop  # noqa: E402

MODEL = "org/lmcache-mp-model"
SHAPE = torch.Size([2, 2, 16, 64])  # 8 KiB of bfloat16 per object
DTYPE = torch.bfloat16
WAIT_S = 30.0
POLL_MS = 50
# How long past its deadline_s a task may be reported (scheduling slack only).
REPORT_SLACK_S = 1.0
SHORT_DEADLINE_S = 1.5
L1_ARGS = ["--l1-size-gb", "0.05", "--no-l1-use-lazy", "--eviction-policy", "LRU"]


def documented_command() -> list:
    """The ``lmcache server`` command line of the module's doc, as argv words."""
    doc = mp.__doc__
    start = doc.index("    lmcache server --") + 4
    line = doc[start : doc.index("\n\n", start)].replace("\\\n", " ")
    words = shlex.split(line)
    assert words[:2] == ["lmcache", "server"]
    return words


def documented_spec(url: str, **params) -> str:
    """The ``--l2-adapter`` JSON of the module's doc, with the test server's address."""
    words = documented_command()
    spec = json.loads(words[words.index("--l2-adapter") + 1])
    assert spec["adapter_params"]["url"] == "gpucache://127.0.0.1:7470?tenant=default"
    spec["adapter_params"]["url"] = url
    spec["adapter_params"].update(params)
    return json.dumps(spec)


def url_of(server) -> str:
    return f"gpucache://{server.native}?tenant=default&local=false"


def build(spec: str):
    """The adapter as LMCache builds it: its --l2-adapter parser, then its factory."""
    args = argparse.Namespace(l2_adapter=[spec])
    (config,) = lm_l2_config.parse_args_to_l2_adapters_config(args).adapters
    return lm_l2.create_l2_adapter(config)


@pytest.fixture
def adapter(server):
    a = build(documented_spec(url_of(server)))
    assert isinstance(a, mp.GPUCacheL2Adapter)
    yield a
    a.close()


def okey(unique: str, i: int, salt: str = "") -> "lm_api.ObjectKey":
    return lm_api.ObjectKey(
        chunk_hash=f"{unique}-{i}".encode(), model_name=MODEL, kv_rank=0, cache_salt=salt
    )


def memobj(fill: float | None = None):
    """An LMCache tensor memory object in host memory (as its L1 hands out)."""
    nbytes = SHAPE.numel() * DTYPE.itemsize
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    meta = lm_memory.MemoryObjMetadata(
        shape=SHAPE, dtype=DTYPE, address=0, phy_size=nbytes, ref_count=1,
        shapes=[SHAPE], dtypes=[DTYPE],
    )
    obj = lm_memory.TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)
    if fill is not None:
        obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(int(fill))))
    return obj


def wait_result(fd: int, query, limit_s: float = WAIT_S):
    """Waits on the adapter's event fd (as LMCache's controllers do) until ``query()`` gives
    a result; fails past ``limit_s``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    until = time.monotonic() + limit_s
    while True:
        got = query()
        if got is not None:
            return got
        left = until - time.monotonic()
        assert left > 0, f"no result within {limit_s} s"
        poller.poll(min(POLL_MS, left * 1000))


def store(a, keys, objs, limit_s=WAIT_S):
    tid = a.submit_store_task(keys, objs)
    done = {}

    def query():
        done.update(a.pop_completed_store_tasks())
        return done.get(tid)

    return wait_result(a.get_store_event_fd(), query, limit_s)


def lookup(a, keys, limit_s=WAIT_S):
    tid = a.submit_lookup_and_lock_task(keys, {})
    bm = wait_result(a.get_lookup_and_lock_event_fd(),
                     lambda: a.query_lookup_and_lock_result(tid), limit_s)
    a.submit_unlock(keys)
    return [bool(bm.test(i)) for i in range(len(keys))]


def load(a, keys, objs, limit_s=WAIT_S):
    tid = a.submit_load_task(keys, objs)
    bm = wait_result(a.get_load_event_fd(), lambda: a.query_load_result(tid), limit_s)
    return [bool(bm.test(i)) for i in range(len(keys))]


def test_the_documented_command_parses_with_lmcache_servers_own_parser():
    server_cmd = require("lmcache.cli.commands.server")
    parser = argparse.ArgumentParser()
    server_cmd.ServerCommand().add_arguments(parser)
    args = parser.parse_args(documented_command()[2:])
    (plugin,) = lm_dist_config.parse_args_to_config(args).l2_adapter_config.adapters
    assert plugin.module_path == mp.__name__
    assert getattr(mp, plugin.class_name) is mp.GPUCacheL2Adapter
    assert set(plugin.adapter_params) <= set(mp.CONFIG_FIELDS)


# ---- through the adapter LMCache's factory built ---------------------------------------------


def test_objects_round_trip_and_an_absent_key_is_a_miss(adapter, unique):
    keys = [okey(unique, i) for i in range(3)]
    objs = [memobj(fill=i + 1) for i in range(3)]
    result = store(adapter, keys[:2], objs[:2])
    assert result.is_successful()
    assert result.bytes_transferred() == 2 * objs[0].get_size()

    assert lookup(adapter, keys) == [True, True, False]
    dst = [memobj() for _ in keys]
    assert load(adapter, keys, dst) == [True, True, False]
    for i in range(2):
        assert torch.equal(dst[i].tensor, objs[i].tensor)
    assert not dst[2].tensor.any(), "a miss leaves its buffer alone"
    # Storing again is not an error (the store is create-only).
    assert store(adapter, keys[:1], objs[:1]).is_successful()


def test_salt_rank_and_group_each_name_other_blocks(adapter, unique):
    base = okey(unique, 0)
    assert store(adapter, [base], [memobj(fill=7)]).is_successful()
    others = [
        okey(unique, 0, salt="user-b"),
        lm_api.ObjectKey(base.chunk_hash, MODEL, kv_rank=1),
        lm_api.ObjectKey(base.chunk_hash, MODEL, kv_rank=0, object_group_id=1),
        lm_api.ObjectKey(base.chunk_hash, MODEL + "-other", kv_rank=0),
    ]
    assert lookup(adapter, [base] + others) == [True, False, False, False, False]


@pytest.mark.parametrize("delta", [-2, +2])
def test_a_block_of_another_length_is_a_miss(adapter, client, unique, delta):
    k = okey(unique, 0)
    good = memobj(fill=3)
    size = good.get_size()
    # A damaged block under the adapter's key: shorter or longer than the object.
    assert client.put(adapter.gpucache_key(k), bytes(size + delta))
    assert lookup(adapter, [k]) == [True]
    dst = memobj()
    assert load(adapter, [k], [dst]) == [False]
    assert not dst.tensor.any(), "nothing of a damaged block reaches the L1 object"
    # The adapter's neighbours in the same task still load.
    k2 = okey(unique, 1)
    assert store(adapter, [k2], [good]).is_successful()
    dsts = [memobj(), memobj()]
    assert load(adapter, [k, k2], dsts) == [False, True]
    assert torch.equal(dsts[1].tensor, good.tensor)


def test_batches_split_under_the_call_limits(adapter, unique, monkeypatch):
    monkeypatch.setattr(mp, "CALL_KEYS_MAX", 2)
    assert mp.GPUCacheL2Adapter._groups([1] * 5) == [(0, 2), (2, 4), (4, 5)]
    monkeypatch.setattr(mp, "STAGING_BYTES_MAX", 10)
    assert mp.GPUCacheL2Adapter._groups([4, 4, 4, 20, 1]) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    monkeypatch.setattr(mp, "STAGING_BYTES_MAX", 1 << 30)
    keys = [okey(unique, i) for i in range(5)]
    objs = [memobj(fill=i + 10) for i in range(5)]
    assert store(adapter, keys, objs).is_successful()
    dst = [memobj() for _ in keys]
    assert load(adapter, keys, dst) == [True] * 5
    assert all(torch.equal(d.tensor, o.tensor) for d, o in zip(dst, objs))


# ---- a server that stops or stops answering ---------------------------------------------------


@pytest.fixture
def own_server(tmp_path):
    """A server of this test alone (it is stopped or paused by the test)."""
    root = tmp_path / "store"
    config = tmp_path / "gpucache.toml"
    config.write_text(
        f'[store]\nkind = "file"\nroot = "{root}"\n\n'
        '[listen]\nnative = "127.0.0.1:0"\n\n'
        '[[tenants]]\nname = "default"\nrights = ["read", "write"]\n'
    )
    proc, fields = launch(server_binary(), config, tmp_path)
    try:
        yield proc, fields["native"]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


def test_a_stopped_server_gives_misses_and_failed_stores_within_the_deadline(own_server, unique):
    proc, native = own_server
    a = build(documented_spec(f"gpucache://{native}?local=false", deadline_s=SHORT_DEADLINE_S))
    try:
        k = okey(unique, 0)
        assert store(a, [k], [memobj(fill=5)]).is_successful()
        assert lookup(a, [k]) == [True]
        stop(proc)
        limit = SHORT_DEADLINE_S + REPORT_SLACK_S
        t0 = time.monotonic()
        assert lookup(a, [k], limit) == [False]
        assert load(a, [k], [memobj()], limit) == [False]
        assert not store(a, [okey(unique, 1)], [memobj(fill=6)], limit).is_successful()
        assert time.monotonic() - t0 < 3 * limit
    finally:
        a.close()


def test_a_server_that_stops_answering_is_reported_at_the_deadline(own_server, unique):
    proc, native = own_server
    # The address allows 30 s per call: the adapter's deadline still ends every task in time.
    a = build(documented_spec(f"gpucache://{native}?local=false&timeout_s=30",
                              deadline_s=SHORT_DEADLINE_S))
    assert a.address.timeout_s == SHORT_DEADLINE_S
    try:
        k = okey(unique, 0)
        assert store(a, [k], [memobj(fill=8)]).is_successful()
        pause(proc.pid)  # connected, but nothing answers
        limit = SHORT_DEADLINE_S + REPORT_SLACK_S
        dst = memobj()
        t0 = time.monotonic()
        assert load(a, [k], [dst], limit) == [False]
        assert lookup(a, [k], limit) == [False]
        assert not store(a, [okey(unique, 1)], [memobj(fill=9)], limit).is_successful()
        assert time.monotonic() - t0 < 3 * limit
        assert not dst.tensor.any()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        closed = time.monotonic()
        a.close()
        assert time.monotonic() - closed < SHORT_DEADLINE_S + mp.CLOSE_SLACK_S + REPORT_SLACK_S


def test_a_closed_adapter_reports_outstanding_and_new_tasks_as_failed(adapter, unique):
    k = okey(unique, 0)
    assert store(adapter, [k], [memobj(fill=1)]).is_successful()
    adapter.close()
    # Reported at once (the event fds are closed with the adapter).
    tid = adapter.submit_lookup_and_lock_task([k], {})
    bm = adapter.query_lookup_and_lock_result(tid)
    assert bm is not None and not bm.test(0)
    tid = adapter.submit_store_task([okey(unique, 1)], [memobj(fill=2)])
    assert not adapter.pop_completed_store_tasks()[tid].is_successful()
    adapter.close()  # a second close does nothing


# ---- configuration errors stop the start -----------------------------------------------------


@pytest.mark.parametrize(
    "params, words",
    [
        ({"url": "gpucache://127.0.0.1"}, "host and a port"),
        ({"url": "redis://127.0.0.1:6379"}, "gpucache://"),
        ({"url": "gpucache://127.0.0.1:7470?tenat=x"}, "unknown field"),
        ({"urll": "gpucache://127.0.0.1:7470"}, "unknown adapter_params"),
        ({"deadline_s": 40}, "deadline_s"),
        ({"deadline_s": 0}, "deadline_s"),
    ],
)
def test_a_bad_setting_is_refused_with_its_reason(server, params, words):
    spec = json.loads(documented_spec(url_of(server)))
    if "urll" in params:
        del spec["adapter_params"]["url"]
    spec["adapter_params"].update(params)
    with pytest.raises(mp.GPUCacheConfigError, match=words):
        build(json.dumps(spec))


def test_an_unreachable_server_or_a_bad_setting_stops_lmcaches_start(server):
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = documented_spec(f"gpucache://127.0.0.1:{port}?local=false")
    config = lm_dist_config.parse_args(L1_ARGS + ["--l2-adapter", spec])
    t0 = time.monotonic()
    with pytest.raises(mp.GPUCacheConfigError, match="cannot reach"):
        lm_storage.StorageManager(config)
    assert time.monotonic() - t0 < WAIT_S
    spec = documented_spec(url_of(server), deadline_s="soon")
    config = lm_dist_config.parse_args(L1_ARGS + ["--l2-adapter", spec])
    with pytest.raises(mp.GPUCacheConfigError, match="deadline_s"):
        lm_storage.StorageManager(config)


# ---- LMCache's StorageManager: L1 -> GPUCache -> L1 ------------------------------------------


def test_lmcache_storage_manager_stores_to_and_prefetches_from_gpucache(server, client, unique):
    config = lm_dist_config.parse_args(
        L1_ARGS + ["--l2-adapter", documented_spec(url_of(server))]
    )
    sm = lm_storage.StorageManager(config)
    try:
        ((desc, a),) = sm.l2_adapters()
        assert isinstance(a, mp.GPUCacheL2Adapter)
        layout = lm_api.MemoryLayoutDesc(shapes=[SHAPE], dtypes=[DTYPE])
        keys = [okey(unique, i) for i in range(4)]
        want = {}
        reserved = sm.reserve_write(keys, layout)
        assert set(reserved) == set(keys)
        for i, k in enumerate(keys):
            t = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + i)).to(DTYPE)
            reserved[k].tensor.copy_(t)
            want[k] = t
        sm.finish_write(keys)

        # LMCache's store controller copies the new L1 objects to GPUCache.
        gkeys = [a.gpucache_key(k) for k in keys]
        until = time.monotonic() + WAIT_S
        while not all(client.batch_exists(gkeys)):
            assert time.monotonic() < until, "LMCache did not store the objects to GPUCache"
            select.select([], [], [], POLL_MS / 1000)
        for k, g in zip(keys, gkeys):
            assert client.get(g) == want[k].view(torch.uint8).flatten().numpy().tobytes()

        # Drop them from L1 (the store controller lets go of them once GPUCache holds them) ...
        until = time.monotonic() + WAIT_S
        deleted = 0
        while deleted < len(keys):
            assert time.monotonic() < until, "L1 kept the objects"
            gone, _skipped = sm.delete_l1_keys(keys)
            deleted += gone
            if deleted < len(keys):
                select.select([], [], [], POLL_MS / 1000)

        # ... and a prefetch brings them back from GPUCache; an unknown key is a miss.
        missing = okey(unique, 99)
        ask = keys + [missing]
        handle = sm.submit_prefetch_task(
            lm_api.PrefetchTaskSpec([lm_api.GroupedObjectKeys(ask, 0, layout)],
                                    fetching_policy="full")
        )
        until = time.monotonic() + WAIT_S
        result = None
        while result is None:
            assert time.monotonic() < until, "the prefetch did not finish"
            sm.wait_prefetch_status(handle, POLL_MS / 1000)
            result = sm.query_prefetch_status(handle)
        assert result.l2_hit_cells[0].get_indices_list() == [0, 1, 2, 3]
        assert result.l1_hit_cells[0].get_indices_list() == [], "they came from GPUCache"
        owners = result.l1_owners or None
        with sm.read_prefetched_results(keys, owners) as got:
            assert got is not None and len(got) == len(keys)
            for k, obj in zip(keys, got):
                assert torch.equal(obj.tensor, want[k])
        sm.finish_read_prefetched(keys, l1_owners=owners)
    finally:
        sm.close()
