"""The SGLang HiCache backend on the paths of hybrid models and of a busy server, against
SGLang's own classes: SGLang's host pools on CPU (an MHA KV anchor, a Mamba state pool, an SWA
pool), SGLang's cache controllers' own backup, hit-query and sidecar-load methods (called on
controller objects made without their GPU-bound constructors), and a running `gpucache serve`.
A client wrapper counts the keys of each call and injects Busy answers."""

from __future__ import annotations

import ctypes
import hashlib
import queue
import types

import pytest
from engine_require import require

torch = require("torch")
hicache_storage = require("sglang.srt.mem_cache.hicache_storage")
factory = require("sglang.srt.mem_cache.storage.backend_factory")
pool_info = require("sglang.srt.mem_cache.device_pool_info")
mamba_pool = require("sglang.srt.mem_cache.pool_host.mamba")
base_ctrl = require("sglang.srt.managers.cache_controller")
hybrid_ctrl = require("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
import gpucache  # noqa: E402
from gpucache.connectors import sglang as conn  # noqa: E402
from test_sglang_hicache import HEAD_DIM, HEADS, PAGE, host_pool  # noqa: E402

PoolName = hicache_storage.PoolName
PoolTransfer = hicache_storage.PoolTransfer
Policy = hicache_storage.PoolHitPolicy

_seeds = iter(range(1000, 1 << 30))


def mha_host_pool(layout="page_first", layers=2, device_tokens=64):
    """SGLang's MHA host pool on CPU over CPU 'device' buffers, filled with random bytes."""
    return host_pool(layout, layers=layers, device_tokens=device_tokens)


def mamba_host_pool(slots=8, layers=2):
    """SGLang's Mamba state host pool on CPU (one temporal and one conv state per slot)."""
    info = pool_info.MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 3, 4, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, 5, dtype=torch.bfloat16),),
    )
    pool = mamba_pool.MambaPoolHost(
        info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
        layout="page_first",
    )
    g = torch.Generator().manual_seed(next(_seeds))
    for t in [pool.temporal_buffer, *pool.conv_buffer]:
        t.view(-1).copy_(torch.randn(t.numel(), generator=g).to(t.dtype))
    return pool


def storage_config(server, *, model="org/hybrid", tp_rank=0, tp_size=1, mla=False):
    extra = {
        "backend_name": "gpucache",
        "module_path": "gpucache.connectors.sglang",
        "class_name": "GPUCacheHiCacheStorage",
        "interface_v1": 1,
        "url": f"gpucache://{server.native}?tenant=default&local=false",
    }
    return hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=model, extra_config=extra,
    )


def attach(config, anchor, extra=None):
    """What SGLang's hybrid controller does on attach: the factory, register_mem_pool_host,
    register_mem_host_pool_v2 for each extra pool, then on_host_pools_registered."""
    backend = factory.StorageBackendFactory.create_backend("dynamic", config, anchor)
    backend.register_mem_pool_host(anchor)
    for name, pool in (extra or {}).items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def hybrid_controller(backend, config, anchor, extra):
    """SGLang's HybridCacheController without its constructor (which needs a GPU and
    process groups): the attributes its storage methods read."""
    c = hybrid_ctrl.HybridCacheController.__new__(hybrid_ctrl.HybridCacheController)
    c.storage_backend = backend
    c.storage_backend_type = "dynamic"
    c.storage_config = config
    c.storage_host_pool = anchor
    c.page_size = PAGE
    c.page_set_func = c._page_set_zero_copy
    c.page_get_func = c._page_get_zero_copy
    c.prefetch_sync_queue = queue.Queue()
    entries = {name: types.SimpleNamespace(host_pool=p) for name, p in extra.items()}
    c.mem_pool_host = types.SimpleNamespace(entry_map=entries, page_size=PAGE)
    c.extra_host_mem_release_queues = {name: queue.Queue() for name in extra}
    return c


def plain_controller(backend, config, anchor):
    """SGLang's base HiCacheController without its constructor, for its backup loop."""
    c = base_ctrl.HiCacheController.__new__(base_ctrl.HiCacheController)
    c.storage_backend = backend
    c.storage_config = config
    c.storage_host_pool = anchor
    c.page_size = PAGE
    c.page_set_func = c._page_set_zero_copy
    return c


def piece_bytes(pool, indices):
    """The bytes of every piece of the pages at `indices`, as the pool describes them."""
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return [ctypes.string_at(int(p), int(s)) for p, s in zip(ptrs, sizes)]


def page_hashes(token_ids, prior_hash=None, page_size=PAGE):
    """One hex hash per full page, each covering the pages before it: the shape of SGLang's
    storage page hashes (its own function needs a C++ extension built at first use, which a
    test machine may lack, so the hybrid controller's hit query is given this one)."""
    out, prior = [], bytes.fromhex(prior_hash) if prior_hash else b""
    for i in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        h = hashlib.sha256(prior)
        for t in token_ids[i : i + page_size]:
            h.update(int(t).to_bytes(8, "little", signed=True))
        prior = h.digest()
        out.append(h.hexdigest())
    return out


@pytest.fixture(autouse=True)
def python_page_hashes(monkeypatch):
    monkeypatch.setattr(hybrid_ctrl, "get_storage_hash_str", page_hashes)


def token_ids(unique, pages):
    base = abs(hash(unique)) % 100_000
    return [base + i for i in range(pages * PAGE)]


class Wrapped:
    """The backend's real client, counting the keys of each batch call; `busy` names piece
    keys whose PUT is answered Busy (not stored) while `busy_left` allows; `on_busy` runs
    before each injected refusal."""

    def __init__(self, client):
        self._client = client
        self.largest_call = 0
        self.busy = set()
        self.busy_left = 0
        self.injected = 0
        self.on_busy = None

    def __getattr__(self, name):
        return getattr(self._client, name)

    def _count(self, keys):
        self.largest_call = max(self.largest_call, len(keys))

    def batch_exists(self, keys):
        self._count(keys)
        return self._client.batch_exists(keys)

    def batch_get_into(self, keys, dsts, sizes=None):
        self._count(keys)
        return self._client.batch_get_into(keys, dsts, sizes)

    def batch_put_from(self, keys, srcs, sizes=None):
        self._count(keys)
        hit = [i for i, k in enumerate(keys) if bytes(k) in self.busy]
        if not hit or self.busy_left <= 0:
            return self._client.batch_put_from(keys, srcs, sizes)
        self.busy_left -= 1
        self.injected += 1
        if self.on_busy is not None:
            self.on_busy(keys, srcs, sizes, hit)
        rest = [i for i in range(len(keys)) if i not in hit]
        answers = [None] * len(keys)
        if rest:
            got = self._client.batch_put_from(
                [keys[i] for i in rest], [srcs[i] for i in rest],
                None if sizes is None else [sizes[i] for i in rest],
            )
            for i, a in zip(rest, got):
                answers[i] = a
        for i in hit:
            e = gpucache.RefusedError("busy: another writer holds the key right now")
            e.reason = "busy"
            answers[i] = e
        err = gpucache.RefusedError("busy: injected")
        err.reason = "busy"
        err.index = hit[0]
        err.results = answers
        raise err


# ---- the v2 interface through SGLang's hybrid controller ----------------------------------


def test_hybrid_pools_back_up_hit_and_load_through_sglangs_controller(server, unique):
    pages = 5
    anchor, mamba, swa = mha_host_pool(), mamba_host_pool(), mha_host_pool()
    extra = {PoolName.MAMBA: mamba, PoolName.SWA: swa}
    cfg = storage_config(server)
    backend = attach(cfg, anchor, extra)
    ctrl = hybrid_controller(backend, cfg, anchor, extra)

    tokens = token_ids(unique, pages)
    hashes = page_hashes(tokens)
    kv_idx, mamba_idx, swa_idx = anchor.alloc(pages * PAGE), mamba.alloc(1), swa.alloc(2 * PAGE)
    op = hybrid_ctrl.StorageOperation(
        kv_idx, tokens, hash_value=hashes,
        pool_transfers=[
            PoolTransfer(name=PoolName.MAMBA, host_indices=mamba_idx, keys=hashes[-1:],
                         hit_policy=Policy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.SWA, host_indices=swa_idx, keys=hashes[-2:],
                         hit_policy=Policy.TRAILING_PAGES),
        ],
    )
    ctrl._page_backup_with_stable_layout(op)
    assert op.completed_tokens == pages * PAGE
    assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1, PoolName.SWA: 2}

    # Another instance's backend and pools: the hit query of the same prompt.
    anchor2, mamba2, swa2 = mha_host_pool(), mamba_host_pool(), mha_host_pool()
    extra2 = {PoolName.MAMBA: mamba2, PoolName.SWA: swa2}
    backend2 = attach(storage_config(server), anchor2, extra2)
    ctrl2 = hybrid_controller(backend2, cfg, anchor2, extra2)
    m_idx2, s_idx2 = mamba2.alloc(1), swa2.alloc(2 * PAGE)
    pre = hybrid_ctrl.PrefetchOperation(
        types.SimpleNamespace(rid="r1"), tokens,
        pool_transfers=[
            PoolTransfer(name=PoolName.MAMBA, host_indices=m_idx2, keys=hashes[-1:],
                         hit_policy=Policy.TRAILING_PAGES),
            PoolTransfer(name=PoolName.SWA, host_indices=s_idx2, keys=hashes[-2:],
                         hit_policy=Policy.TRAILING_PAGES),
        ],
    )
    hit_hashes, hit_tokens = ctrl2._storage_hit_query(pre)
    assert hit_hashes == hashes and hit_tokens == pages * PAGE
    # The Mamba state exists for the last page only: no shorter prefix is restorable.
    assert pre.pool_storage_result.restorable_prefix_pages == [pages]
    assert pre.query_pool_hit_pages == {
        PoolName.KV: pages, PoolName.MAMBA: pages, PoolName.SWA: pages,
    }

    # The KV pages (v1), then the sidecar load SGLang runs after them (v2).
    kv_idx2 = anchor2.alloc(pages * PAGE)
    assert backend2.batch_get_v1(hashes, kv_idx2) == [True] * pages
    pre.hash_value = hit_hashes
    ctrl2._page_transfer_sidecar(pre, pages)
    ack = ctrl2.prefetch_sync_queue.get_nowait()
    assert ack.pool_hits == {PoolName.MAMBA: 1, PoolName.SWA: 2}
    assert piece_bytes(anchor, kv_idx) == piece_bytes(anchor2, kv_idx2)
    assert piece_bytes(mamba, mamba_idx) == piece_bytes(mamba2, m_idx2)
    assert piece_bytes(swa, swa_idx) == piece_bytes(swa2, s_idx2)


def test_hit_query_policies_and_missing_sidecars(server, unique):
    pages = 4
    anchor, mamba, swa = mha_host_pool(), mamba_host_pool(), mha_host_pool()
    extra = {PoolName.MAMBA: mamba, PoolName.SWA: swa}
    s = attach(storage_config(server), anchor, extra)
    keys = [f"{unique}-p{i}" for i in range(pages)]
    assert s.batch_set_v1(keys, anchor.alloc(pages * PAGE)) == [True] * pages
    # Mamba state at pages 2 and 4 (1-based), SWA at pages 1..3 only.
    got = s.batch_set_v2([
        PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.alloc(2), keys=[keys[1], keys[3]]),
        PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(3 * PAGE), keys=keys[:3]),
    ])
    assert got == {PoolName.MAMBA: [True, True], PoolName.SWA: [True] * 3}

    def query(*transfers):
        return s.batch_exists_v2(keys, list(transfers))

    r = query(PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=Policy.TRAILING_PAGES))
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [2, 4])
    r = query(PoolTransfer(name=PoolName.SWA, keys=keys[-2:], hit_policy=Policy.TRAILING_PAGES))
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [1, 2, 3])
    r = query(PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=Policy.ALL_PAGES),
              PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=Policy.TRAILING_PAGES))
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (2, [2])
    assert r.extra_pool_hit_pages[PoolName.SWA] == 3
    r = query(PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=Policy.BLOCK_GROUPS,
                           block_pages=2, group_pages=2))
    assert r.kv_hit_pages == 4, "block groups never shorten the KV hit"
    assert r.extra_pool_hit_pages[PoolName.SWA] == 2
    # Another TP rank's Mamba state is its own: none of it is found.
    other = attach(storage_config(server, tp_rank=1, tp_size=2), mha_host_pool(),
                   {PoolName.MAMBA: mamba_host_pool()})
    assert other.batch_exists_v2(keys, [PoolTransfer(
        name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=Policy.TRAILING_PAGES)]).kv_hit_pages == 0
    with pytest.raises(ValueError, match="never registered"):
        query(PoolTransfer(name=PoolName.INDEXER, keys=keys))


def test_mla_shared_sidecars_are_written_once_mamba_and_mha_pools_per_rank(server, unique):
    keys = [f"{unique}-p{i}" for i in range(2)]

    def rank(tp):
        pools = {PoolName.MAMBA: mamba_host_pool(), PoolName.DRAFT: mha_host_pool(),
                 # A pool that is neither Mamba nor MHA: one copy under an MLA model.
                 PoolName.INDEXER: mamba_host_pool()}
        return attach(storage_config(server, tp_rank=tp, tp_size=2, mla=True),
                      mha_host_pool(), pools), pools

    (s0, p0), (s1, p1) = rank(0), rank(1)
    assert not s1._pools[str(PoolName.MAMBA)].shared
    assert not s1._pools[str(PoolName.DRAFT)].shared, "an MHA pool holds each rank's heads"
    assert s1._pools[str(PoolName.INDEXER)].shared
    moves = lambda pools: [  # noqa: E731
        PoolTransfer(name=PoolName.MAMBA, host_indices=pools[PoolName.MAMBA].alloc(2), keys=keys),
        PoolTransfer(name=PoolName.INDEXER, host_indices=pools[PoolName.INDEXER].alloc(2),
                     keys=keys),
    ]
    # The non-writer rank stores its own Mamba state but not the shared pool.
    assert s1.batch_set_v2(moves(p1)) == {PoolName.MAMBA: [True] * 2, PoolName.INDEXER: [True] * 2}
    found = lambda s, name: s._exists_pages(keys, s._pools[str(name)], False)  # noqa: E731
    assert found(s1, PoolName.MAMBA) == [True, True]
    assert found(s1, PoolName.INDEXER) == [False, False]
    assert found(s0, PoolName.MAMBA) == [False, False], "rank 0 never sees rank 1's state"
    assert s0.batch_set_v2(moves(p0)) == {PoolName.MAMBA: [True] * 2, PoolName.INDEXER: [True] * 2}
    assert found(s1, PoolName.INDEXER) == [True, True], "every rank reads the shared copy"


# ---- every client call stays under BATCH_KEYS_MAX -----------------------------------------


def test_a_hit_query_with_more_pieces_than_one_call_takes_is_split(server, unique):
    # A deep layer_first pool names 2 pieces per layer per page: a request of a few hundred
    # pages names more piece keys than one client call may carry.
    layers = 128
    pages = gpucache.BATCH_KEYS_MAX // (2 * layers) + 44
    anchor = mha_host_pool()
    deep = mha_host_pool("layer_first", layers=layers, device_tokens=pages * PAGE // 2 + PAGE)
    s = attach(storage_config(server), anchor, {PoolName.INDEXER: deep})
    w = Wrapped(s.client)
    s.client = w
    keys = [f"{unique}-p{i}" for i in range(pages)]
    one_page = anchor.alloc(PAGE)
    assert s.batch_set_v1(keys, one_page.repeat(pages)) == [True] * pages
    assert s.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=deep.alloc(2 * PAGE),
                                        keys=keys[:2])]) == {PoolName.INDEXER: [True, True]}
    r = s.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                              hit_policy=Policy.ALL_PAGES)])
    assert len(s._keys_of(keys, s._pools[str(PoolName.INDEXER)])) > gpucache.BATCH_KEYS_MAX
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[PoolName.INDEXER]) == (2, 2)
    assert 0 < w.largest_call <= gpucache.BATCH_KEYS_MAX
    # The reads of the deep pool are split too.
    w.largest_call = 0
    read = s.batch_get_v2([PoolTransfer(name=PoolName.INDEXER,
                                        host_indices=deep.alloc(pages * PAGE), keys=keys)])
    assert read[PoolName.INDEXER] == [True, True] + [False] * (pages - 2)
    assert 0 < w.largest_call <= gpucache.BATCH_KEYS_MAX


# ---- a Busy piece does not fail the rest of a backup --------------------------------------

BACKUP_PAGES = base_ctrl.STORAGE_BATCH_SIZE + 2


def _busy_setup(server, unique):
    anchor = mha_host_pool()
    cfg = storage_config(server)
    s = attach(cfg, anchor)
    w = Wrapped(s.client)
    s.client = w
    tokens = token_ids(unique, BACKUP_PAGES)
    hashes = page_hashes(tokens)
    idx = anchor.alloc(PAGE).repeat(BACKUP_PAGES)
    op = base_ctrl.StorageOperation(idx, tokens, hash_value=hashes)
    w.busy = {bytes(k) for k in s._keys_of([hashes[5]])}
    return s, w, plain_controller(s, cfg, anchor), op, hashes


def test_a_busy_page_is_retried_and_the_backup_goes_on(server, unique):
    s, w, ctrl, op, hashes = _busy_setup(server, unique)
    w.busy_left = 1
    ctrl._page_backup(op)
    assert w.injected == 1
    assert op.completed_tokens == BACKUP_PAGES * PAGE, "the pages after the busy one are backed up"
    assert s.batch_exists(hashes) == BACKUP_PAGES, "the busy page was stored on its retry"
    assert s.busy_skipped_pages == 0


def test_a_page_another_writer_commits_meanwhile_counts_as_stored(server, unique):
    s, w, ctrl, op, hashes = _busy_setup(server, unique)
    w.busy_left = 1 << 30  # every put of it answers busy: only the other writer stores it
    other = gpucache.Client(server.native, tenant="default", local=False)

    def other_writer_commits(keys, srcs, sizes, hit):
        for i in hit:
            other.put_from(keys[i], srcs[i], sizes[i])

    w.on_busy = other_writer_commits
    ctrl._page_backup(op)
    assert op.completed_tokens == BACKUP_PAGES * PAGE
    assert s.batch_exists(hashes) == BACKUP_PAGES
    assert w.injected == 1, "the committed page is not put again"
    assert s.busy_skipped_pages == 0


def test_a_page_busy_past_the_deadline_is_skipped_not_fatal(server, unique):
    s, w, ctrl, op, hashes = _busy_setup(server, unique)
    w.busy_left = 1 << 30
    ctrl._page_backup(op)
    assert w.injected == 2, "one put, then one retry after the deadline"
    assert op.completed_tokens == BACKUP_PAGES * PAGE
    assert s.busy_skipped_pages == 1
    assert s.batch_exists(hashes) == 5, "page 5 is absent: a miss later, nothing worse"
    assert s.batch_exists(hashes[6:]) == BACKUP_PAGES - 6


# ---- clear() purges the namespace on the server -------------------------------------------


def test_clear_purges_every_rank_pool_and_instance_of_the_model(server, unique):
    keys = [f"{unique}-p{i}" for i in range(3)]
    ranks = []
    for tp in range(2):
        anchor, mamba = mha_host_pool(), mamba_host_pool()
        s = attach(storage_config(server, tp_rank=tp, tp_size=2), anchor,
                   {PoolName.MAMBA: mamba})
        assert s.batch_set_v1(keys, anchor.alloc(3 * PAGE)) == [True] * 3
        assert s.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.alloc(3),
                                            keys=keys)]) == {PoolName.MAMBA: [True] * 3}
        ranks.append(s)
    other_model = attach(storage_config(server, model="org/other"), mha_host_pool())
    other_pool = other_model.mem_pool_host
    assert other_model.batch_set_v1(keys, other_pool.alloc(3 * PAGE)) == [True] * 3
    # The same model under another connector's layout (not sglang-...): not this namespace.
    c = gpucache.Client(server.native, tenant="default", local=False)
    foreign = gpucache.Identity(tenant="default", model="org/hybrid", layout="vllm-paged",
                                block_tokens=PAGE).chain_keys([unique])[0]
    c.put(foreign, b"keep me")

    # A later instance of rank 0 (a fresh process) asks for the clear.
    again = attach(storage_config(server, tp_rank=0, tp_size=2), mha_host_pool(),
                   {PoolName.MAMBA: mamba_host_pool()})
    assert again.clear() is True
    mamba_of = lambda s: s._exists_pages(keys, s._pools[str(PoolName.MAMBA)], False)  # noqa: E731
    for s in ranks:
        assert s.batch_exists(keys) == 0, "every rank's KV pages are gone"
        assert mamba_of(s) == [False] * 3, "every rank's Mamba states are gone"
    assert other_model.batch_exists(keys) == 3, "another model's pages stay"
    assert c.exists(foreign), "another connector's blocks stay"
    # Nothing left: a second clear removes nothing and still succeeds.
    assert again.client.purge(again._value_key("clear", 1), conn.LAYOUT_PREFIX + "-")[0] == 0


def test_clear_is_refused_without_the_write_right_and_says_so(server, unique):
    s = attach(storage_config(server), mha_host_pool())
    keys = [f"{unique}-p0"]
    assert s.batch_set_v1(keys, s.mem_pool_host.alloc(PAGE)) == [True]

    class ReadOnly(Wrapped):
        def purge(self, key, layout_prefix=""):
            raise gpucache.RefusedError("forbidden: tenant default lacks the write right")

    s.client = ReadOnly(s.client)
    assert s.clear() is False
    assert s.batch_exists(keys) == 1
