"""GPUCacheConnector's scheduler side against a running `gpucache serve`, with vLLM's own config
class for the transfer config: lookups never wait on the server, a block counts only when every
worker holds it, hits become load plans and newly full blocks save plans, and a configuration
the connector cannot serve safely stops the start with the reason.

The worker side (copies between vLLM's KV tensors and the server) runs in the whole-engine test.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from engine import require_vllm
from serving import pause

require_vllm()

from gpucache.connectors import _url, vllm_native  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

BLOCK_TOKENS = 16
# The connector gives a lookup this long before its request goes ahead as a miss.
LOOKUP_WAIT_S = 1.0
# A stated deadline for one scheduler call while the server answers nothing.
CALL_DEADLINE_S = 0.5
ANSWER_PATIENCE_S = 60.0


def config(url, tp=1, dtype="auto", policy="recompute", groups=1, **extra):
    transfer = KVTransferConfig(
        kv_connector="GPUCacheConnector", kv_role="kv_both",
        kv_connector_module_path="gpucache.connectors.vllm_native",
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"url": url, "lookup_wait_s": LOOKUP_WAIT_S, **extra})
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer,
        cache_config=SimpleNamespace(block_size=BLOCK_TOKENS, cache_dtype=dtype),
        model_config=SimpleNamespace(
            model="org/native-model", dtype="float32", revision=None, tokenizer_revision=None,
            hf_config=SimpleNamespace(to_json_string=lambda: '{"layers": 2}')),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        prefill_context_parallel_size=1,
                                        decode_context_parallel_size=1),
    )
    spec = SimpleNamespace(num_kv_heads=2, head_size=8, page_size_bytes=2 * 2 * 8 * BLOCK_TOKENS * 4)
    kv_cache_config = SimpleNamespace(
        num_blocks=64,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])] * groups)
    return vllm_config, kv_cache_config


@pytest.fixture
def connectors():
    made = []
    yield made
    for c in made:
        c.shutdown()


def scheduler(url, connectors, **kw):
    vllm_config, kv_cache_config = config(url, **kw)
    c = vllm_native.GPUCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    connectors.append(c)
    return c


def request(unique, name, blocks, extra_tokens=1):
    return SimpleNamespace(
        request_id=name,
        block_hashes=[f"{unique}-{name}-{i}".encode() for i in range(blocks)],
        num_tokens=blocks * BLOCK_TOKENS + extra_tokens,
    )


def store(url, c, hashes, ranks=None):
    """Puts a block under each given worker's key of each hash."""
    client = _url.parse(url).connect(client_name="test-native")
    try:
        for rank in ranks or list(c.identities):
            for key in c.identities[rank].block_keys(hashes):
                assert client.put(key, b"kv" * 64)
    finally:
        client.close()


def answer(c, req, computed=0):
    deadline = time.monotonic() + ANSWER_PATIENCE_S
    while True:
        got = c.get_num_new_matched_tokens(req, computed)
        if got[0] is not None:
            return got
        assert time.monotonic() < deadline, "no lookup answer from a running server"
        time.sleep(0.01)


def address(file_server):
    return file_server.url()


def test_a_lookup_never_waits_on_the_server_and_ends_as_a_miss(file_server, unique, connectors):
    c = scheduler(address(file_server), connectors)
    req = request(unique, "stalled", 4)
    store(address(file_server), c, req.block_hashes)
    pause(file_server.proc.pid)
    try:
        start = time.monotonic()
        calls = 0
        while True:
            t = time.monotonic()
            got = c.get_num_new_matched_tokens(req, 0)
            assert time.monotonic() - t < CALL_DEADLINE_S
            calls += 1
            if got[0] is not None:
                break
            time.sleep(0.05)
        # Past lookup_wait_s the request goes ahead, computing everything.
        assert got == (0, False) and calls > 1
        assert time.monotonic() - start >= LOOKUP_WAIT_S
    finally:
        os.kill(file_server.proc.pid, signal.SIGCONT)
    fresh = request(unique, "stalled", 4)
    fresh.request_id = "after"
    assert answer(c, fresh) == (4 * BLOCK_TOKENS, True)


def test_hits_are_leading_blocks_every_worker_holds(file_server, unique, connectors):
    url = address(file_server)
    c = scheduler(url, connectors, tp=2)
    req = request(unique, "r", 5)
    store(url, c, req.block_hashes[:3])  # both workers, blocks 0-2
    store(url, c, req.block_hashes[3:4], ranks=[(0, 0)])  # block 3 on one worker only
    store(url, c, req.block_hashes[4:5])  # block 4 on both, after a gap
    assert answer(c, req) == (3 * BLOCK_TOKENS, True)
    # Blocks vLLM already has locally are not counted again.
    other = request(unique, "r", 5)
    other.request_id = "r-local"
    assert answer(c, other, computed=BLOCK_TOKENS) == (2 * BLOCK_TOKENS, True)
    # The last prompt token is always computed: a fully stored prompt restores all but it.
    whole = request(unique, "w", 2, extra_tokens=0)
    store(url, c, whole.block_hashes)
    assert answer(c, whole) == (BLOCK_TOKENS, True)


def test_hits_become_load_plans_and_full_blocks_save_plans(file_server, unique, connectors):
    url = address(file_server)
    c = scheduler(url, connectors)
    req = request(unique, "plan", 5, extra_tokens=1)
    store(url, c, req.block_hashes[:3])
    assert answer(c, req) == (3 * BLOCK_TOKENS, True)
    block_ids = [10, 11, 12, 13, 14, 15]
    c.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 3 * BLOCK_TOKENS)
    empty = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    meta = c.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=empty, num_scheduled_tokens={},
        scheduled_spec_decode_tokens={}))
    assert meta.loads == {"plan": list(zip(block_ids[:3], req.block_hashes[:3]))}
    assert meta.saves == []
    # Loaded, the request is scheduled: its other two full blocks are saved once they are
    # computed, never the restored ones, and a draft token's block is not full yet.
    new = SimpleNamespace(req_id="plan", block_ids=(block_ids,), num_computed_tokens=3 * BLOCK_TOKENS)
    meta = c.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=empty,
        num_scheduled_tokens={"plan": 2 * BLOCK_TOKENS + 1},
        scheduled_spec_decode_tokens={"plan": [1]}))
    assert meta.loads == {} and meta.saves == list(zip(block_ids[3:5], req.block_hashes[3:5]))
    cached = SimpleNamespace(req_ids=["plan"], resumed_req_ids=set(), new_block_ids=[None],
                             num_computed_tokens=[5 * BLOCK_TOKENS + 1])
    meta = c.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"plan": 1},
        scheduled_spec_decode_tokens={}))
    assert meta.saves == []
    assert c.request_finished(req, block_ids) == (False, None)


@pytest.mark.parametrize("change,reason", [
    ({"policy": "fail"}, "kv_load_failure_policy"),
    ({"groups": 2}, "one KV cache group"),
    ({"stray": 1}, "unknown kv_connector_extra_config"),
    ({"url": "gpucache://127.0.0.1:1?tenant=default"}, "cannot reach the GPUCache server"),
])
def test_a_config_it_cannot_serve_safely_stops_the_start(file_server, change, reason):
    url = change.pop("url", address(file_server))
    with pytest.raises(ValueError, match=reason):
        vllm_config, kv_cache_config = config(url, **change)
        vllm_native.GPUCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_a_save_is_best_effort_so_preemption_owes_nothing(file_server, connectors):
    c = scheduler(address(file_server), connectors)
    assert c.requires_kv_delivery is False


def test_every_kv_cache_dtype_name_is_its_own_identity(file_server, connectors):
    names = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla",
             "int8_per_token_head", "nvfp4", "a_dtype_from_a_later_vllm"]
    keys = set()
    for name in names:
        c = scheduler(address(file_server), connectors, dtype=name)
        keys.add(bytes(c.identities[(0, 0)].block_keys([b"h"])[0]))
    assert len(keys) == len(names)
    # Each worker has its own keys.
    c = scheduler(address(file_server), connectors, tp=2)
    assert c.identities[(0, 0)].block_keys([b"h"]) != c.identities[(1, 0)].block_keys([b"h"])
