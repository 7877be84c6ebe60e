"""The SGLang HiCache backend against SGLang's own classes: loaded by SGLang's
StorageBackendFactory as a "dynamic" backend, over SGLang's real host KV pool
(MHATokenToKVPoolHost on CPU), against a running `gpucache serve`."""

from __future__ import annotations

import json

import pytest
from engine_require import require

torch = require("torch")
hicache_storage = require("sglang.srt.mem_cache.hicache_storage")
factory = require("sglang.srt.mem_cache.storage.backend_factory")
pool_info = require("sglang.srt.mem_cache.device_pool_info")
mha_pool = require("sglang.srt.mem_cache.pool_host.mha")
import gpucache  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 2, 2, 8, 4, 64
_seeds = iter(range(1, 1 << 30))


def host_pool(layout="page_first", dtype=torch.float16, layers=LAYERS, device_tokens=DEVICE_TOKENS):
    """SGLang's MHA host pool on CPU, over CPU 'device' buffers, filled with random K/V
    (another draw for every pool, so no two pools hold the same bytes)."""
    k = tuple(torch.zeros(device_tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(layers))
    bufs = pool_info.KVBuffers(
        k=k,
        v=v,
        k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
        v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
        layout=pool_info.KVBufferLayout.NHD,
    )
    info = pool_info.MHABufferInfo(
        buffers=bufs, page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM, dtype=dtype, device=torch.device("cpu"),
    )
    pool = mha_pool.MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
    )
    g = torch.Generator().manual_seed(next(_seeds))
    flat = pool.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=g).to(dtype))
    return pool


def storage_config(server, *, model="org/model-a", tp_rank=0, tp_size=1, mla=False,
                   metrics=False, **extra):
    url = f"gpucache://{server.native}?tenant=default&local=false"
    cfg = {
        "backend_name": "gpucache",
        "module_path": "gpucache.connectors.sglang",
        "class_name": "GPUCacheHiCacheStorage",
        "interface_v1": 1,
        "url": url,
    }
    cfg.update(extra)
    return hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=True, model_name=model,
        extra_config={k: v for k, v in cfg.items() if v is not None},
    )


def attach(config, pool):
    """What SGLang's cache controller does: the factory, then register_mem_pool_host."""
    backend = factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_bytes(pool, index):
    return pool.get_data_page(index, flat=True).contiguous().view(torch.uint8).clone()


def hashes(unique, n):
    return [f"{unique}-page{i}" for i in range(n)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_pages_round_trip_between_host_pools(server, unique, layout):
    src, dst = host_pool(layout), host_pool(layout)
    a = attach(storage_config(server), src)
    b = attach(storage_config(server), dst)
    keys = hashes(unique, 3)
    src_idx = src.alloc(3 * PAGE)
    assert a.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, src_idx) == [True, True, True]
    assert b.batch_exists(keys) == 3
    # Another place in the other pool: the pages land where the indices say.
    dst.alloc(2 * PAGE)
    dst_idx = dst.alloc(3 * PAGE)
    assert b.batch_get_v1(keys, dst_idx) == [True, True, True]
    for i in range(3):
        want = page_bytes(src, int(src_idx[i * PAGE]))
        got = page_bytes(dst, int(dst_idx[i * PAGE]))
        assert torch.equal(want, got), f"page {i} differs after the round trip"
    # Storing the same pages again is not an error (the first bytes stay).
    assert a.batch_set_v1(keys, src_idx) == [True, True, True]


def test_batch_exists_counts_the_leading_whole_pages(server, unique):
    pool = host_pool()
    s = attach(storage_config(server), pool)
    keys = hashes(unique, 4)
    idx = pool.alloc(4 * PAGE)
    assert s.batch_set_v1([keys[0], keys[1], keys[3]],
                          torch.cat([idx[: 2 * PAGE], idx[3 * PAGE:]])) == [True] * 3
    assert s.batch_exists(keys) == 2, "the prefix stops at the missing page 2"
    assert s.exists(keys[3]) and not s.exists(keys[2])
    # A page missing one piece (its V) is not a whole page: neither counted nor read.
    piece_keys = s._keys_of([keys[1]])
    assert len(piece_keys) == 2
    c = gpucache.Client(server.native, tenant="default", local=False)
    assert c.remove(piece_keys[1])
    assert s.batch_exists(keys) == 1
    other = host_pool()
    got = s.batch_get_v1(keys[:2], other.alloc(2 * PAGE))
    assert got == [True, False]


def test_a_request_with_more_pieces_than_one_client_call_takes_is_split(server, unique):
    # A long request of a deep model (layer_first: one piece per layer and per K and V) names
    # more piece keys than one client call may carry; its pages are asked about in spans.
    pool = host_pool()
    s = attach(storage_config(server), pool)
    pages = gpucache.BATCH_KEYS_MAX // 2 + 5
    keys = hashes(unique, pages)
    assert len(s._keys_of(keys)) > gpucache.BATCH_KEYS_MAX
    assert s.batch_set_v1(keys[:3], pool.alloc(3 * PAGE)) == [True] * 3
    assert s.batch_exists(keys) == 3


def test_keys_differ_by_model_shard_dtype_and_layout(server, unique):
    keys = hashes(unique, 2)
    base = host_pool()
    writer = attach(storage_config(server), base)
    assert writer.batch_set_v1(keys, base.alloc(2 * PAGE)) == [True, True]
    assert attach(storage_config(server), host_pool()).batch_exists(keys) == 2
    others = {
        "another model": attach(storage_config(server, model="org/model-b"), host_pool()),
        "another TP rank": attach(storage_config(server, tp_rank=1, tp_size=2), host_pool()),
        "another dtype": attach(storage_config(server), host_pool(dtype=torch.bfloat16)),
        "another layout": attach(storage_config(server), host_pool("layer_first")),
        "another depth": attach(storage_config(server), host_pool(layers=LAYERS + 1)),
        "another model config": attach(
            storage_config(server, model_config_file=__file__), host_pool()),
    }
    for what, backend in others.items():
        assert backend.batch_exists(keys) == 0, f"{what} must not see these pages"


def test_mla_pages_are_one_copy_written_by_the_writer_rank(server, unique):
    keys = hashes(unique, 2)
    rank1_pool = host_pool()
    rank1 = attach(storage_config(server, tp_rank=1, tp_size=2, mla=True), rank1_pool)
    assert rank1.batch_set_v1(keys, rank1_pool.alloc(2 * PAGE)) == [True, True]
    assert rank1.batch_exists(keys) == 0, "a non-writer rank stores nothing"
    rank0_pool = host_pool()
    rank0 = attach(storage_config(server, tp_rank=0, tp_size=2, mla=True), rank0_pool)
    idx = rank0_pool.alloc(2 * PAGE)
    assert rank0.batch_set_v1(keys, idx) == [True, True]
    assert rank1.batch_exists(keys) == 2, "every rank reads the shared copy"
    # Reads land in the reading rank's own pool, at the indices it gives.
    didx = rank1_pool.alloc(2 * PAGE)
    assert not torch.equal(page_bytes(rank0_pool, int(idx[0])), page_bytes(rank1_pool, int(didx[0])))
    assert rank1.batch_get_v1(keys, didx) == [True, True]
    for i in range(2):
        assert torch.equal(page_bytes(rank0_pool, int(idx[i * PAGE])),
                           page_bytes(rank1_pool, int(didx[i * PAGE])))


def test_generic_get_and_set_of_one_tensor(server, unique):
    s = attach(storage_config(server), host_pool())
    value = torch.arange(64, dtype=torch.float32)
    assert s.set(unique, value)
    out = torch.zeros(64, dtype=torch.float32)
    assert s.get(unique, out) is out and torch.equal(out, value)
    assert s.get(unique + "-absent", torch.zeros(64)) is None
    # Another size names another value: a miss, never a short read.
    assert s.get(unique, torch.zeros(32, dtype=torch.float32)) is None
    assert s.batch_get([unique], [torch.zeros(64)])[0] is not None
    with pytest.raises(ValueError):
        s.get(unique, None)


def test_stats_and_clear(server, unique):
    pool = host_pool()
    s = attach(storage_config(server, metrics=True), pool)
    keys = hashes(unique, 3)
    idx = pool.alloc(3 * PAGE)
    assert s.batch_set_v1(keys, idx) == [True] * 3
    assert s.batch_get_v1(keys, host_pool().alloc(3 * PAGE)) == [True] * 3
    m = s.get_stats()
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
    assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0
    assert s.get_stats().backup_pgs == [], "get_stats hands each sample over once"
    assert s.clear() is True
    assert s.batch_exists(keys) == 0
    assert attach(storage_config(server), host_pool()).get_stats() is None


def test_bad_configurations_are_refused(server):
    pool = host_pool()
    cases = {
        "url": storage_config(server, url=None),
        "interface_v1": storage_config(server, interface_v1=0),
        "unknown field": storage_config(server, url=f"gpucache://{server.native}?tenat=x"),
        "a host and a port": storage_config(server, url="gpucache://127.0.0.1"),
        "model": storage_config(server, model=None),
    }
    for needle, cfg in cases.items():
        with pytest.raises(ValueError, match=needle):
            attach(cfg, pool)
    s = factory.StorageBackendFactory.create_backend("dynamic", storage_config(server), pool)
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        s.batch_exists(["x"])
    reg = attach(storage_config(server), pool)
    with pytest.raises(ValueError, match="host indices"):
        reg.batch_get_v1(["a", "b"], pool.alloc(PAGE))


def test_the_documented_launch_line_parses(server):
    """The extra config the module's doc shows is JSON SGLang's parser accepts."""
    from gpucache.connectors import sglang as conn

    doc = conn.__doc__
    start = doc.index("'{") + 1
    end = doc.index("}'", start) + 1
    text = doc[start:end].replace("\\\n", " ")
    parsed = json.loads(text)
    assert parsed["module_path"] == "gpucache.connectors.sglang"
    assert parsed["class_name"] == conn.GPUCacheHiCacheStorage.__name__
    assert parsed["interface_v1"] == 1
