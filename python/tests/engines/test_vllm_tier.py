"""The vLLM secondary tier through vLLM's own TieringOffloadingSpec: the spec reads the
documented secondary_tiers entry, SecondaryTierFactory loads GPUCacheTier by module path and
hands it the CPU primary tier's memoryview (vLLM's shared offload region), against a running
`gpucache serve`."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from engine_require import require

vconfig = require("vllm.v1.kv_offload.config")
vbase = require("vllm.v1.kv_offload.base")
vtier = require("vllm.v1.kv_offload.tiering.base")
vspec = require("vllm.v1.kv_offload.tiering.spec")

from gpucache.connectors import vllm as tiermod  # noqa: E402

BLOCK_TOKENS, BLOCKS_PER_CHUNK, WORKER_BYTES_PER_BLOCK = 16, 1, 4096
CHUNKS = 8
# Liveness bound for a lookup's answer from a running server.
ANSWER_PATIENCE_S = 60.0


def documented_tier(url: str) -> dict:
    """The secondary_tiers entry of the module's doc, with the test server's address."""
    doc = tiermod.__doc__
    start = doc.index("'{") + 1
    end = doc.index("}'", start) + 1
    config = json.loads(doc[start:end])
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    assert tier["url"] == "gpucache://127.0.0.1:7470?tenant=default"
    return {**tier, "url": url}


def make_tier(server, unique, model="org/vllm-model", dtype="float16", tp=1):
    url = f"gpucache://{server.native}?tenant=default&local=false"
    cfg = vconfig.OffloadingConfig(
        groups=(vconfig.OffloadingGroupConfig(
            tokens_per_block=BLOCK_TOKENS, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=WORKER_BYTES_PER_BLOCK,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": CHUNKS * WORKER_BYTES_PER_BLOCK * tp,
            "tier_poll_interval_s": 0,
            "secondary_tiers": [documented_tier(url)],
        },
        engine_id=f"{unique}-{model}-{dtype}-{tp}".replace("/", "-"),
        model=vconfig.OffloadingModelConfig(name=model, dtype=dtype),
        cache=vconfig.OffloadingCacheConfig(
            tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=vconfig.OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )
    spec = vspec.TieringOffloadingSpec(cfg)
    manager = spec.get_manager()
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, tiermod.GPUCacheTier)
    return manager, tier, np.asarray(manager.primary_tier.get_kv_memoryview())


def job(job_id, keys, chunk_ids, promotion):
    return vtier.TransferJob(
        job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=promotion, req_context=vbase.ReqContext(req_id=f"r{job_id}"))


def finished(tier):
    tier.drain_jobs()
    return {r.job_id: r for r in tier.get_finished_jobs()}


def resolve(tier, key, ctx):
    """The tier's answer for `key` once its lookup came back: it answers RETRY until then, and
    sends what it was asked at the end of each scheduler step."""
    deadline = time.monotonic() + ANSWER_PATIENCE_S
    while (r := tier.lookup(key, ctx)) == vbase.LookupResult.RETRY:
        assert time.monotonic() < deadline, "no lookup answer from a running server"
        tier.on_schedule_end(None)
        time.sleep(0.01)
    return r


def offload_key(unique, i):
    return vbase.make_offload_key(f"{unique}-{i}".encode().ljust(32, b"."), 0)


@pytest.fixture
def managers():
    made = []
    yield made
    for m in made:
        m.shutdown()


def test_chunks_cascade_out_and_promote_back(server, unique, managers):
    m1, t1, rows1 = make_tier(server, unique + "a")
    m2, t2, rows2 = make_tier(server, unique + "b")
    managers += [m1, m2]
    assert rows1.shape[0] >= 3 and rows1.shape[1] == t1.block_size_bytes
    rng = np.random.default_rng(11)
    rows1[:3] = rng.integers(0, 256, size=rows1[:3].shape, dtype=np.uint8)
    keys = [offload_key(unique, i) for i in range(3)]
    ctx = vbase.ReqContext(req_id="r")
    assert all(resolve(t2, k, ctx) == vbase.LookupResult.MISS for k in keys)
    t2.on_request_finished(ctx)
    t1.submit_store(job(1, keys[:2], [0, 1], promotion=False))
    done = finished(t1)
    assert done[1].success and done[1].transfer_bytes == 2 * t1.block_size_bytes
    assert [resolve(t2, k, ctx) for k in keys] == [vbase.LookupResult.HIT] * 2 + [
        vbase.LookupResult.MISS]
    # Another engine's primary tier, at other slots.
    rows2[:] = 0
    t2.submit_load(job(2, keys[:2], [5, 3], promotion=True))
    done = finished(t2)
    assert done[2].success and done[2].successful_keys is None
    assert np.array_equal(rows2[5], rows1[0]) and np.array_equal(rows2[3], rows1[1])
    # A load that meets a missing chunk reports only the chunks that came whole.
    t2.submit_load(job(3, [keys[0], keys[2]], [6, 7], promotion=True))
    done = finished(t2)
    assert not done[3].success and list(done[3].successful_keys) == [keys[0]]
    assert not t2.has_pending_work()


def test_other_models_dtypes_and_topologies_miss(server, unique, managers):
    m1, t1, rows1 = make_tier(server, unique)
    managers.append(m1)
    key = offload_key(unique, 0)
    rows1[0] = 7
    t1.submit_store(job(1, [key], [0], promotion=False))
    assert finished(t1)[1].success
    ctx = vbase.ReqContext(req_id="r")
    assert resolve(t1, key, ctx) == vbase.LookupResult.HIT
    for kw in ({"model": "org/other"}, {"dtype": "bfloat16"}, {"tp": 2}):
        m, t, _ = make_tier(server, unique + str(kw), **kw)
        managers.append(m)
        assert resolve(t, key, ctx) == vbase.LookupResult.MISS, f"{kw} must miss"


def test_a_tier_without_an_address_is_refused(server, unique):
    tier = documented_tier("x")
    del tier["url"]
    with pytest.raises(ValueError, match="url"):
        vtier_factory = require("vllm.v1.kv_offload.tiering.factory")
        vtier_factory.SecondaryTierFactory.create_secondary_tier(
            tier, memoryview(np.zeros((1, 8), dtype=np.uint8)), object())
