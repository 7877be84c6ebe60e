"""SGLang HiCache storage backend (L3) backed by a GPUCache server.

SGLang loads it as a *dynamic* backend: ``StorageBackendFactory`` imports ``module_path``,
takes ``class_name`` and calls ``GPUCacheHiCacheStorage(storage_config, kwargs)``; the cache
controller then hands it the host KV pool through ``register_mem_pool_host``. With
``"interface_v1": 1`` the controller uses ``batch_get_v1`` / ``batch_set_v1``, which name the
page's pieces by their addresses in the host pool: no page is gathered into a staging tensor
in Python. The bytes still cross one copy each way in this process (the client copies between
the pool and its socket or shared-segment buffers), because SGLang allocated the pool itself,
outside the segment the server shares with a same-host client. Launch::

    python -m sglang.launch_server --model-path MODEL \\
        --enable-hierarchical-cache --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "gpucache",
            "module_path": "gpucache.connectors.sglang",
            "class_name": "GPUCacheHiCacheStorage", "interface_v1": 1,
            "url": "gpucache://127.0.0.1:7470?tenant=default"}'

Extra-config fields read here: ``url`` (required, see ``gpucache.connectors._url``),
``model`` (the model name when SGLang passes none), ``model_revision`` and
``model_config_file`` (a file, e.g. the model's config.json, whose bytes go into the
identity). The other fields belong to SGLang.

Keys: one ``gpucache.Identity`` per host pool, from the storage config (model name, TP rank
and size, PP rank and size; MLA pools are one shared copy, so every TP rank uses shard 0 of 1
and only the writer rank stores) and the pool (its dtype, layout and tokens per page). Each
page is stored as the pieces ``get_page_buffer_meta`` names (K and V, or one per layer), each
piece under the key of ``(page hash, piece index, piece count, piece bytes)``: another model,
shard, dtype, layout or geometry never reads these bytes. A page counts as present only when
all its pieces are, and a piece read back with another size is a miss.

Hybrid models (SWA, Mamba state, a DSA indexer, draft sidecars) go through SGLang's v2 calls:
the hybrid cache controller registers each extra host pool with
``register_mem_host_pool_v2(pool, name)``, asks ``batch_exists_v2`` which prefixes every pool
can restore (each pool's hit policy: all pages, a trailing window, or block groups), and moves
the extra pools' pages with ``batch_get_v2`` / ``batch_set_v2``; the KV pool itself still goes
through the v1 calls. Each extra pool has an identity of its own (its name, dtype, layout and
tokens per page go into the layout and the key), so two pools never share a key. Pools an MLA
model keeps as one shared copy (the KV, a DSA indexer, an MLA draft) are written by the writer
rank only; Mamba state and MHA pools are per TP rank.

Every client call carries at most ``gpucache.BATCH_KEYS_MAX`` keys: a request's pages are split
into spans (a long prompt with ``layer_first`` names one piece per layer and per K and V).

A piece another writer is storing right now (the server answers Busy) does not fail the
backup: the backend waits for that writer's commit until ``BUSY_RETRY_DEADLINE_S`` and then
tries the still-absent pieces once more; a page still busy after that is skipped (reported
stored: the other writer stores the same bytes under the same key, and a page that never
lands is only a miss later), so the pages after it are still backed up.

``clear()`` (SGLang's clear-storage request) asks the server once to purge this backend's
namespace: every block of this tenant, model and model configuration whose layout is one of
this connector's (``sglang-...``), from every TP/PP rank, every pool and every instance. The
pages other ranks are still writing at that moment may survive it. ``get_stats()`` hands SGLang
its storage metrics (pages per batch, GB/s) when SGLang's metrics are on (``--enable-metrics``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Dict, List, Optional

import torch

import gpucache
from gpucache.connectors import _url

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

logger = logging.getLogger(__name__)

# Most samples each get_stats list keeps between two calls (older ones are dropped).
STATS_SAMPLES_MAX = 4096
# The identity layout family of the pages this backend stores; clear() purges every layout
# that begins with it.
LAYOUT_PREFIX = "sglang"
LAYOUT_VERSION = 1
# How long one batch store waits for pieces another writer holds (Busy) to be committed before
# it tries the still-absent ones once more, and how often it looks meanwhile.
BUSY_RETRY_DEADLINE_S = 1.0
BUSY_POLL_S = 0.01


def _is_busy(answer) -> bool:
    return isinstance(answer, gpucache.RefusedError) and getattr(answer, "reason", None) == "busy"


@dataclasses.dataclass
class _Pool:
    """One registered host pool: the identity its pages are stored under and its geometry."""

    name: str
    host: Any
    identity: gpucache.Identity
    # Bytes of each piece of one page (get_page_buffer_meta's order); one flat piece when the
    # pool cannot describe its pages by address (then pages are copied through a tensor).
    piece_sizes: List[int]
    flat: bool
    # One copy shared by every TP rank (MLA): only the writer rank stores it.
    shared: bool
    page_size: int


class GPUCacheHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` whose pages live in a GPUCache server (see the module's doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        if storage_config is None:
            raise ValueError("GPUCacheHiCacheStorage needs SGLang's HiCacheStorageConfig")
        extra = dict(storage_config.extra_config or {})
        if "url" not in extra:
            raise ValueError(
                'the hicache extra config needs "url": "gpucache://HOST:PORT?tenant=NAME"'
            )
        if not bool(extra.get("interface_v1", 0)):
            # Without it the controller stores flat pages through batch_set while looking
            # pages up through batch_exists: the two would name different keys.
            raise ValueError(
                'GPUCacheHiCacheStorage needs "interface_v1": 1 in the hicache extra config'
            )
        if storage_config.dcp_size > 1:
            raise ValueError("GPUCacheHiCacheStorage does not store DCP-sharded MLA pages")
        if storage_config.should_split_heads:
            raise ValueError(
                "GPUCacheHiCacheStorage does not split heads across TP sizes (tp_lcm_size)"
            )
        self.address = _url.parse(extra["url"])
        self.config = storage_config
        self.model = storage_config.model_name or extra.get("model")
        if not self.model:
            raise ValueError(
                'SGLang passed no model name: set "model" in the hicache extra config'
            )
        self.model_revision = str(extra.get("model_revision", "main"))
        self.model_config = b""
        if extra.get("model_config_file"):
            with open(extra["model_config_file"], "rb") as f:
                self.model_config = f.read()
        self.client = self.address.connect(client_name="gpucache-sglang")
        self.mem_pool_host = None
        self.identity: Optional[gpucache.Identity] = None
        self._kv: Optional[_Pool] = None
        # Extra pools of the v2 interface, by pool name.
        self._pools: Dict[str, _Pool] = {}
        self._registered_ptr: Optional[int] = None
        self._piece_sizes: List[int] = []
        # Pages a Busy answer made the backend skip (another writer held a piece throughout).
        self.busy_skipped_pages = 0
        self._lock = threading.Lock()
        self._prefetch_pgs: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)
        self._backup_pgs: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)
        self._prefetch_bw: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)
        self._backup_bw: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)

    # ---- identity and keys ------------------------------------------------------------------

    def _pool_identity(self, layout: str, host, sharded: bool) -> gpucache.Identity:
        c = self.config
        if c.attn_cp_size > 1:
            # Each context-parallel rank holds its own slice of every page.
            layout += f"-cp{c.attn_cp_rank}of{c.attn_cp_size}"
        tp_rank, tp_size = (c.tp_rank, c.tp_size) if sharded else (0, 1)
        return gpucache.Identity(
            tenant=self.address.tenant,
            model=self.model,
            model_revision=self.model_revision,
            model_config=self.model_config,
            kv_dtype=_url.kv_dtype_name(host.dtype),
            layout=layout,
            layout_version=LAYOUT_VERSION,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=c.pp_rank,
            pp_size=c.pp_size,
            block_tokens=int(host.page_size),
        )

    @staticmethod
    def _geometry(host):
        """(piece sizes of one page, flat): the pool's own page description from host page
        0, or one flat piece when the pool has none."""
        page = int(host.page_size)
        try:
            _, sizes = host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
            sizes = [int(x) for x in sizes]
            if sizes and min(sizes) > 0:
                return sizes, False
        except (NotImplementedError, ValueError, AssertionError, AttributeError):
            pass
        dummy = host.get_dummy_flat_data_page()
        return [int(dummy.numel() * dummy.element_size())], True

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        kind = "mla" if self.config.is_mla_model else "mha"
        layout = f"{LAYOUT_PREFIX}-{kind}-{mem_pool_host.layout}"
        self.identity = self._pool_identity(
            layout, mem_pool_host, sharded=not self.config.is_mla_model
        )
        sizes, flat = self._geometry(mem_pool_host)
        if flat:
            raise ValueError(f"the host pool cannot describe its pages by address ({sizes})")
        self._piece_sizes = sizes
        self._kv = _Pool(
            name=str(PoolName.KV), host=mem_pool_host, identity=self.identity,
            piece_sizes=sizes, flat=False, shared=self.config.is_mla_model,
            page_size=int(mem_pool_host.page_size),
        )
        buf = getattr(mem_pool_host, "kv_buffer", None)
        if isinstance(buf, torch.Tensor) and buf.device.type == "cpu" and buf.numel() > 0:
            if self._registered_ptr is not None:
                self.client.unregister_buffer(self._registered_ptr)
                self._registered_ptr = None
            self.client.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
            self._registered_ptr = buf.data_ptr()

    def _is_sharded(self, name: str, host) -> bool:
        """Whether each TP rank stores its own copy of this extra pool."""
        if not self.config.is_mla_model:
            return True
        if name == str(PoolName.MAMBA):
            # Mamba state is split over TP ranks even when the model's MLA KV is one copy.
            return True
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        # An MHA pool (an MHA draft over an MLA target) holds each rank's own heads.
        return isinstance(host, MHATokenToKVPoolHost)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Registers an extra host pool of a hybrid model (SWA, Mamba, indexer, draft...)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            # The anchor's own entry: its pages go through the v1 calls.
            return
        sharded = self._is_sharded(name, host_pool)
        layout = f"{LAYOUT_PREFIX}-{name}-{getattr(host_pool, 'layout', 'flat')}"
        sizes, flat = self._geometry(host_pool)
        if flat:
            layout += "-flat"
        self._pools[name] = _Pool(
            name=name, host=host_pool,
            identity=self._pool_identity(layout, host_pool, sharded),
            piece_sizes=sizes, flat=flat, shared=not sharded,
            page_size=max(1, int(getattr(host_pool, "page_size", 1) or 1)),
        )

    def on_host_pools_registered(self) -> None:
        """Every pool of the attach is known: the KV anchor must be among them."""
        self._require_pool()
        logger.info(
            "GPUCache HiCache storage: KV pool plus %d extra pools (%s)",
            len(self._pools), ", ".join(sorted(self._pools)) or "none",
        )

    def _require_pool(self):
        if self.mem_pool_host is None or self.identity is None:
            raise RuntimeError(
                "GPUCacheHiCacheStorage: register_mem_pool_host was not called before a page call"
            )

    def _pool(self, name) -> _Pool:
        self._require_pool()
        name = str(name)
        if name == str(PoolName.KV):
            return self._kv
        pool = self._pools.get(name)
        if pool is None:
            raise ValueError(f"the host pool {name!r} was never registered (register_mem_host_pool_v2)")
        return pool

    def _piece_key(self, page_hash: str, piece: int, pieces: int, size: int,
                   identity: Optional[gpucache.Identity] = None) -> gpucache.Key:
        name = f"{page_hash}|{piece}/{pieces}|{size}"
        return (identity or self.identity).chain_keys([name])[0]

    def _keys_of(self, keys: List[str], pool: Optional[_Pool] = None) -> List[gpucache.Key]:
        """Every piece key of every page, page by page (the same keys as ``_piece_key``,
        derived in one native call per BATCH_KEYS_MAX pieces, outside the GIL)."""
        pool = pool or self._kv
        per = len(pool.piece_sizes)
        names = [f"{k}|{j}/{per}|{size}" for k in keys for j, size in enumerate(pool.piece_sizes)]
        span = gpucache.BATCH_KEYS_MAX
        return [key for at in range(0, len(names), span)
                for key in pool.identity.block_keys(names[at:at + span])]

    def _page_pieces(self, keys: List[str], host_indices: torch.Tensor,
                     pool: Optional[_Pool] = None):
        """(piece keys, addresses, sizes, pieces per page) of the pages at host_indices."""
        self._require_pool()
        pool = pool or self._kv
        page = pool.page_size
        if host_indices is None or host_indices.numel() != len(keys) * page:
            got = 0 if host_indices is None else host_indices.numel()
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * page} host indices, got {got}"
            )
        per = len(pool.piece_sizes)
        if pool.flat:
            return self._keys_of(keys, pool), None, pool.piece_sizes * len(keys), per
        ptrs, sizes = pool.host.get_page_buffer_meta(host_indices)
        sizes = [int(s) for s in sizes]
        if len(ptrs) != len(keys) * per or sizes != pool.piece_sizes * len(keys):
            raise ValueError(
                f"the host pool described {len(ptrs)} pieces of sizes {sizes[:per]} for "
                f"{len(keys)} pages; its pages have {per} pieces of sizes {pool.piece_sizes}"
            )
        return self._keys_of(keys, pool), [int(p) for p in ptrs], sizes, per

    # ---- batched client calls, split under BATCH_KEYS_MAX -----------------------------------

    def _spans(self, pages: int, per: Optional[int] = None):
        """[start, end) page ranges whose pieces fit one client call (BATCH_KEYS_MAX keys): a
        request's pages may have many more (a long prompt, one piece per layer)."""
        per = per or len(self._piece_sizes)
        step = max(1, gpucache.BATCH_KEYS_MAX // per)
        return [(a, min(a + step, pages)) for a in range(0, pages, step)]

    def _exists_pages(self, keys: List[str], pool: _Pool, stop_at_miss: bool) -> List[bool]:
        """Per page, whether every piece is stored; with stop_at_miss the list ends at the
        first page that is not (no later span is asked)."""
        per = len(pool.piece_sizes)
        out: List[bool] = []
        for a, b in self._spans(len(keys), per):
            found = self.client.batch_exists(self._keys_of(keys[a:b], pool))
            for i in range(b - a):
                whole = all(found[i * per : (i + 1) * per])
                out.append(whole)
                if stop_at_miss and not whole:
                    return out
        return out

    def _get_pages(self, keys: List[str], host_indices, pool: _Pool) -> List[bool]:
        """Reads each page's pieces into the pool; True for a page read whole."""
        pkeys, ptrs, sizes, per = self._page_pieces(keys, host_indices, pool)
        if pool.flat:
            return [self._get_flat(pkeys[i], pool, host_indices[i * pool.page_size])
                    for i in range(len(keys))]
        ok: List[bool] = []
        for a, b in self._spans(len(keys), per):
            lo, hi = a * per, b * per
            try:
                got = self.client.batch_get_into(pkeys[lo:hi], ptrs[lo:hi], sizes[lo:hi])
            except gpucache.Error as e:
                logger.warning("GPUCache batch get of pages %d..%d failed: %s", a, b, e)
                ok += [False] * (b - a)
                continue
            ok += [
                all(got[i * per + j] == sizes[lo + i * per + j] for j in range(per))
                for i in range(b - a)
            ]
        return ok

    def _get_flat(self, key, pool: _Pool, index) -> bool:
        page = pool.host.get_dummy_flat_data_page().contiguous()
        try:
            n = self.client.get_into(key, page)
        except gpucache.Error as e:
            logger.warning("GPUCache get of a %s page failed: %s", pool.name, e)
            return False
        if n != pool.piece_sizes[0]:
            return False
        pool.host.set_from_flat_data_page(int(index), page)
        return True

    def _put_span(self, pkeys, srcs, sizes) -> list:
        """One batch put: per piece None (stored, or already held) or its exception."""
        try:
            self.client.batch_put_from(pkeys, srcs, sizes)
            return [None] * len(pkeys)
        except gpucache.Error as e:
            each = getattr(e, "results", None)
            if each is None or len(each) != len(pkeys):
                # The call failed as a whole: every piece carries its error.
                return [e] * len(pkeys)
            return [r if isinstance(r, BaseException) else None for r in each]

    def _put_pieces(self, pkeys, srcs, sizes, per: int) -> list:
        """Stores the pieces in spans under BATCH_KEYS_MAX; per piece None (held now),
        "busy" (another writer held it throughout; skipped) or the exception that failed it.

        A Busy piece is waited for (its writer commits the same bytes) until
        BUSY_RETRY_DEADLINE_S, then put once more if still absent."""
        out: list = []
        pages = len(pkeys) // per
        for a, b in self._spans(pages, per):
            lo, hi = a * per, b * per
            out += self._put_span(pkeys[lo:hi], srcs[lo:hi], sizes[lo:hi])
        busy = [i for i, r in enumerate(out) if _is_busy(r)]
        if not busy:
            return out
        deadline = time.monotonic() + BUSY_RETRY_DEADLINE_S
        while busy:
            found = self._exists_many([pkeys[i] for i in busy])
            for i, f in zip(busy, found):
                if f:
                    out[i] = None
            busy = [i for i, f in zip(busy, found) if not f]
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(BUSY_POLL_S)
        if busy:
            # One more try for the pieces still absent: their writer may have given up.
            for a in range(0, len(busy), gpucache.BATCH_KEYS_MAX):
                part = busy[a : a + gpucache.BATCH_KEYS_MAX]
                again = self._put_span([pkeys[i] for i in part], [srcs[i] for i in part],
                                       [sizes[i] for i in part])
                for i, r in zip(part, again):
                    out[i] = "busy" if _is_busy(r) else r
        return out

    def _exists_many(self, pkeys) -> List[bool]:
        found: List[bool] = []
        for a in range(0, len(pkeys), gpucache.BATCH_KEYS_MAX):
            found += self.client.batch_exists(pkeys[a : a + gpucache.BATCH_KEYS_MAX])
        return found

    def _set_pages(self, keys: List[str], host_indices, pool: _Pool) -> List[bool]:
        """Stores each page's pieces from the pool; True for a page now held whole (a piece
        already held counts: the store is create-only and keeps the first bytes), or skipped
        because another writer held one of its pieces throughout (module doc)."""
        pkeys, ptrs, sizes, per = self._page_pieces(keys, host_indices, pool)
        if pool.flat:
            srcs = [
                pool.host.get_data_page(int(host_indices[i * pool.page_size]), flat=True)
                .contiguous()
                for i in range(len(keys))
            ]
        else:
            srcs = ptrs
        answers = self._put_pieces(pkeys, srcs, sizes, per)
        ok: List[bool] = []
        skipped = 0
        for i in range(len(keys)):
            mine = answers[i * per : (i + 1) * per]
            failed = [r for r in mine if r is not None and r != "busy"]
            if failed:
                logger.warning("GPUCache could not store %s page %d: %s", pool.name, i, failed[0])
                ok.append(False)
                continue
            if "busy" in mine:
                skipped += 1
            ok.append(True)
        if skipped:
            logger.warning(
                "GPUCache skipped %d %s pages another writer held past the busy deadline",
                skipped, pool.name,
            )
            with self._lock:
                self.busy_skipped_pages += skipped
        return ok

    # ---- the v1 interface (the KV pool) -----------------------------------------------------

    def batch_exists(
        self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        """How many leading pages are stored whole (every piece present)."""
        if not keys:
            return 0
        self._require_pool()
        found = self._exists_pages(keys, self._kv, stop_at_miss=True)
        return found.index(False) if False in found else len(keys)

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Reads each page's pieces into the host pool; True for a page read whole."""
        if not keys:
            return []
        self._require_pool()
        start = time.perf_counter()
        ok = self._get_pages(keys, host_indices, self._kv)
        self._record(self._prefetch_pgs, self._prefetch_bw, ok, self._kv, start)
        return ok

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Stores each page's pieces from the host pool (see ``_set_pages``)."""
        if not keys:
            return []
        if not self.config.is_storage_writer:
            # MLA pages are one shared copy: the writer rank stores it.
            return [True] * len(keys)
        self._require_pool()
        start = time.perf_counter()
        ok = self._set_pages(keys, host_indices, self._kv)
        self._record(self._backup_pgs, self._backup_bw, ok, self._kv, start)
        return ok

    def _record(self, pgs, bws, ok, pool: _Pool, start):
        if not self.config.enable_storage_metrics:
            return
        elapsed = time.perf_counter() - start
        moved = sum(ok) * sum(pool.piece_sizes)
        with self._lock:
            pgs.append(sum(ok))
            bws.append(moved / elapsed / 1e9 if elapsed > 0 else 0.0)

    # ---- the v2 interface (hybrid models' extra pools) --------------------------------------

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        """The longest KV prefix every pool can restore, per the pools' hit policies.

        ALL_PAGES: each of the prefix's pages must be in the pool. TRAILING_PAGES: only the
        window of the last ``len(transfer.keys)`` pages before a stop point must be, so the
        restorable stop points may have holes (``restorable_prefix_pages`` lists them all).
        BLOCK_GROUPS: the pool's verdict is the pages its leading complete groups of
        ``group_pages`` pages cover; it never shortens the KV hit."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: Dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            pool = self._pool(transfer.name)
            present = self._exists_pages(keys[:kv_pages], pool, stop_at_miss=False)
            policy = transfer.hit_policy
            if policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                allowed = set(range(1, boundary + 1))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                allowed = {
                    end for end in range(1, kv_pages + 1)
                    if all(present[max(0, end - window) : end])
                }
                boundary = max(allowed, default=0)
            elif policy == PoolHitPolicy.BLOCK_GROUPS:
                group = int(transfer.group_pages or 0)
                boundary = 0
                if group > 0:
                    while boundary + group <= kv_pages and all(present[boundary : boundary + group]):
                        boundary += group
                if boundary:
                    hits[transfer.name] = boundary
                continue
            else:
                raise ValueError(f"unknown pool hit policy {policy!r}")
            if boundary:
                hits[transfer.name] = boundary
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def _io_v2(self, transfers: List[PoolTransfer], store: bool) -> Dict[Any, List[bool]]:
        results: Dict[Any, List[bool]] = {}
        for transfer in transfers or []:
            keys = list(transfer.keys or [])
            if not keys:
                results[transfer.name] = []
                continue
            pool = self._pool(transfer.name)
            if store and pool.shared and not self.config.is_storage_writer:
                # One shared copy (MLA): the writer rank stores it.
                results[transfer.name] = [True] * len(keys)
                continue
            start = time.perf_counter()
            try:
                if store:
                    ok = self._set_pages(keys, transfer.host_indices, pool)
                else:
                    ok = self._get_pages(keys, transfer.host_indices, pool)
            except ValueError as e:
                logger.error("GPUCache %s of pool %s refused: %s",
                             "store" if store else "read", pool.name, e)
                ok = [False] * len(keys)
            if store:
                self._record(self._backup_pgs, self._backup_bw, ok, pool, start)
            else:
                self._record(self._prefetch_pgs, self._prefetch_bw, ok, pool, start)
            results[transfer.name] = ok
        return results

    def batch_get_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> Dict[Any, List[bool]]:
        """Reads each transfer's pages into its pool: per pool, True for a page read whole."""
        return self._io_v2(transfers, store=False)

    def batch_set_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> Dict[Any, List[bool]]:
        """Stores each transfer's pages from its pool: per pool, True for a page held."""
        return self._io_v2(transfers, store=True)

    # ---- the generic interface (one page or tensor at a time) -------------------------------

    def _value_key(self, key: str, size: int) -> gpucache.Key:
        self._require_pool()
        return self._piece_key(key, 0, 1, size)

    @staticmethod
    def _target(target_location, target_sizes):
        """(address, size, tensor or None) of a destination: a tensor, or an address with
        its size."""
        if isinstance(target_location, torch.Tensor):
            t = target_location
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("the target tensor must be a contiguous CPU tensor")
            return t.data_ptr(), t.numel() * t.element_size(), t
        if isinstance(target_location, int) and isinstance(target_sizes, int):
            return target_location, target_sizes, None
        raise ValueError(
            "get/set need a contiguous CPU tensor, or an int address with an int size"
        )

    def get(
        self,
        key: str,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ):
        """Reads one value into target_location: the tensor (or True for an address) on a
        hit, None on a miss or a value of another size."""
        ptr, size, tensor = self._target(target_location, target_sizes)
        try:
            n = self.client.get_into(self._value_key(key, size), ptr, size)
        except gpucache.BufferTooSmallError:
            return None
        if n != size:
            return None
        return tensor if tensor is not None else True

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[Any]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get needs one target location per key")
        sizes = target_sizes if target_sizes is not None else [None] * len(keys)
        return [self.get(k, t, s) for k, t, s in zip(keys, target_locations, sizes)]

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Stores one value (a tensor, or the bytes at an address): True once held."""
        src = value if value is not None else target_location
        ptr, size, tensor = self._target(src, target_sizes)
        k = self._value_key(key, size)
        try:
            self.client.put_from(k, ptr, size)
        except gpucache.Error as e:
            logger.warning("GPUCache set of %s failed: %s", key, e)
            return False
        return True

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        srcs = values if values is not None else target_locations
        if srcs is None or len(srcs) != len(keys):
            raise ValueError("batch_set needs one value per key")
        sizes = target_sizes if target_sizes is not None else [None] * len(keys)
        return all(self.set(k, v, None, s) for k, v, s in zip(keys, srcs, sizes))

    def exists(self, key: str) -> bool:
        """Whether the page ``key`` is stored whole (the v1 layout of the host pool)."""
        return self.batch_exists([key]) == 1

    # ---- housekeeping -----------------------------------------------------------------------

    def clear(self) -> bool:
        """Purges this backend's namespace on the server, in one client call: every block of
        this tenant and model (and model configuration and revision) stored under one of this
        connector's layouts, by any TP/PP rank, any pool and any instance. True when the server
        removed all of it (a block a reader or writer held at that moment stays, and makes
        this False)."""
        self._require_pool()
        try:
            removed, busy, more = self.client.purge(self._value_key("clear", 1), LAYOUT_PREFIX + "-")
        except gpucache.Error as e:
            logger.warning("GPUCache clear (purge) failed: %s", e)
            return False
        logger.info("GPUCache clear removed %d blocks (%d busy, more=%s)", removed, busy, more)
        return busy == 0 and not more

    def get_stats(self):
        """SGLang's StorageMetrics since the last call (pages per batch and GB/s), or None
        when SGLang's storage metrics are off."""
        if not self.config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            for d in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
                d.clear()
        return m

    def close(self) -> None:
        if self._registered_ptr is not None:
            self.client.unregister_buffer(self._registered_ptr)
            self._registered_ptr = None
        self.client.close()
