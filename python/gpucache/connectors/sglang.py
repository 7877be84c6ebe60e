"""SGLang HiCache storage backend (L3) backed by a GPUCache server.

SGLang loads it as a *dynamic* backend: ``StorageBackendFactory`` imports ``module_path``,
takes ``class_name`` and calls ``GPUCacheHiCacheStorage(storage_config, kwargs)``; the cache
controller then hands it the host KV pool through ``register_mem_pool_host``. With
``"interface_v1": 1`` the controller uses the zero-copy calls ``batch_get_v1`` /
``batch_set_v1``, which move each page straight between the host pool and the server. Launch::

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

``clear()`` (SGLang's clear-storage request) removes the pieces this backend stored, the newest
``CLEAR_TRACKED_KEYS_MAX`` of them: the server keeps no per-engine index, so older pieces and
other processes' pieces stay until it evicts them. ``get_stats()`` hands SGLang its storage
metrics (pages per batch, GB/s) when SGLang's metrics are on (``--enable-metrics``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, List, Optional

import torch

import gpucache
from gpucache.connectors import _url

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

logger = logging.getLogger(__name__)

# Most samples each get_stats list keeps between two calls (older ones are dropped).
STATS_SAMPLES_MAX = 4096
# Most piece keys remembered for clear(); older ones are forgotten (they stay until evicted).
CLEAR_TRACKED_KEYS_MAX = 65536
# The identity layout family of the pages this backend stores.
LAYOUT_PREFIX = "sglang"
LAYOUT_VERSION = 1


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
        self._registered_ptr: Optional[int] = None
        self._piece_sizes: List[int] = []
        # Piece keys this backend stored, newest last, for clear() (bounded).
        self._stored: "collections.OrderedDict[gpucache.Key, None]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._prefetch_pgs: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)
        self._backup_pgs: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)
        self._prefetch_bw: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)
        self._backup_bw: collections.deque = collections.deque(maxlen=STATS_SAMPLES_MAX)

    # ---- identity and keys ------------------------------------------------------------------

    def _shard(self):
        c = self.config
        if c.is_mla_model:
            return 0, 1
        return c.tp_rank, c.tp_size

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        c = self.config
        kind = "mla" if c.is_mla_model else "mha"
        layout = f"{LAYOUT_PREFIX}-{kind}-{mem_pool_host.layout}"
        if c.attn_cp_size > 1:
            # Each context-parallel rank holds its own slice of every page.
            layout += f"-cp{c.attn_cp_rank}of{c.attn_cp_size}"
        tp_rank, tp_size = self._shard()
        self.identity = gpucache.Identity(
            tenant=self.address.tenant,
            model=self.model,
            model_revision=self.model_revision,
            model_config=self.model_config,
            kv_dtype=_url.kv_dtype_name(mem_pool_host.dtype),
            layout=layout,
            layout_version=LAYOUT_VERSION,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=c.pp_rank,
            pp_size=c.pp_size,
            block_tokens=int(mem_pool_host.page_size),
        )
        # The pieces of one page (the pool's fixed geometry), from host page 0.
        _, sizes = mem_pool_host.get_page_buffer_meta(
            torch.arange(int(mem_pool_host.page_size), dtype=torch.int64)
        )
        self._piece_sizes = [int(x) for x in sizes]
        if not self._piece_sizes or min(self._piece_sizes) <= 0:
            raise ValueError(f"the host pool's pages have no pieces ({self._piece_sizes})")
        buf = getattr(mem_pool_host, "kv_buffer", None)
        if isinstance(buf, torch.Tensor) and buf.device.type == "cpu" and buf.numel() > 0:
            if self._registered_ptr is not None:
                self.client.unregister_buffer(self._registered_ptr)
                self._registered_ptr = None
            self.client.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
            self._registered_ptr = buf.data_ptr()

    def _require_pool(self):
        if self.mem_pool_host is None or self.identity is None:
            raise RuntimeError(
                "GPUCacheHiCacheStorage: register_mem_pool_host was not called before a page call"
            )

    def _piece_key(self, page_hash: str, piece: int, pieces: int, size: int) -> gpucache.Key:
        name = f"{page_hash}|{piece}/{pieces}|{size}"
        return self.identity.chain_keys([name])[0]

    def _page_pieces(self, keys: List[str], host_indices: torch.Tensor):
        """(piece keys, addresses, sizes, pieces per page) of the pages at host_indices."""
        self._require_pool()
        page = int(self.mem_pool_host.page_size)
        if host_indices.numel() != len(keys) * page:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * page} host indices, "
                f"got {host_indices.numel()}"
            )
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(self._piece_sizes)
        sizes = [int(s) for s in sizes]
        if len(ptrs) != len(keys) * per or sizes != self._piece_sizes * len(keys):
            raise ValueError(
                f"the host pool described {len(ptrs)} pieces of sizes {sizes[:per]} for "
                f"{len(keys)} pages; its pages have {per} pieces of sizes {self._piece_sizes}"
            )
        return self._keys_of(keys), [int(p) for p in ptrs], sizes, per

    def _keys_of(self, keys: List[str]) -> List[gpucache.Key]:
        """Every piece key of every page, page by page."""
        per = len(self._piece_sizes)
        return [
            self._piece_key(k, j, per, size)
            for k in keys
            for j, size in enumerate(self._piece_sizes)
        ]

    # ---- the v1 (zero-copy) interface -------------------------------------------------------

    def _spans(self, pages: int):
        """[start, end) page ranges whose pieces fit one client call (BATCH_KEYS_MAX keys): a
        request's pages may have many more (a long prompt, one piece per layer)."""
        step = max(1, gpucache.BATCH_KEYS_MAX // len(self._piece_sizes))
        return [(a, min(a + step, pages)) for a in range(0, pages, step)]

    def batch_exists(
        self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        """How many leading pages are stored whole (every piece present)."""
        if not keys:
            return 0
        self._require_pool()
        per = len(self._piece_sizes)
        for a, b in self._spans(len(keys)):
            found = self.client.batch_exists(self._keys_of(keys[a:b]))
            for i in range(b - a):
                if not all(found[i * per : (i + 1) * per]):
                    return a + i
        return len(keys)

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Reads each page's pieces into the host pool; True for a page read whole."""
        if not keys:
            return []
        pkeys, ptrs, sizes, per = self._page_pieces(keys, host_indices)
        start = time.perf_counter()
        ok: List[bool] = []
        for a, b in self._spans(len(keys)):
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
        self._record(self._prefetch_pgs, self._prefetch_bw, ok, sizes, per, start)
        return ok

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Stores each page's pieces from the host pool; True for a page now held whole (a
        piece already held counts: the store is create-only and keeps the first bytes)."""
        if not keys:
            return []
        if not self.config.is_storage_writer:
            # MLA pages are one shared copy: the writer rank stores it.
            return [True] * len(keys)
        pkeys, ptrs, sizes, per = self._page_pieces(keys, host_indices)
        start = time.perf_counter()
        ok = [False] * len(keys)
        for a, b in self._spans(len(keys)):
            lo, hi = a * per, b * per
            try:
                self.client.batch_put_from(pkeys[lo:hi], ptrs[lo:hi], sizes[lo:hi])
                ok[a:b] = [True] * (b - a)
            except gpucache.Error as e:
                # Every piece was answered; a refused one (Busy: another writer holds its
                # reservation; a full store) fails its page only. Without per-piece answers
                # (the call itself failed) the span's pages are not stored.
                each = getattr(e, "results", None)
                if each is None or len(each) != hi - lo:
                    logger.warning("GPUCache batch put of pages %d..%d failed: %s", a, b, e)
                    continue
                for i in range(b - a):
                    ok[a + i] = not any(isinstance(r, BaseException) for r in each[i * per : (i + 1) * per])
                logger.warning("GPUCache stored %d of pages %d..%d: %s", sum(ok[a:b]), a, b, e)
        self._track([k for i, good in enumerate(ok) if good for k in pkeys[i * per : (i + 1) * per]])
        self._record(self._backup_pgs, self._backup_bw, ok, sizes, per, start)
        return ok

    def _track(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._stored[k] = None
                self._stored.move_to_end(k)
            while len(self._stored) > CLEAR_TRACKED_KEYS_MAX:
                self._stored.popitem(last=False)

    def _record(self, pgs, bws, ok, sizes, per, start):
        if not self.config.enable_storage_metrics:
            return
        elapsed = time.perf_counter() - start
        moved = sum(sizes[i * per + j] for i, good in enumerate(ok) if good for j in range(per))
        with self._lock:
            pgs.append(sum(ok))
            bws.append(moved / elapsed / 1e9 if elapsed > 0 else 0.0)

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
        self._track([k])
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
        """Removes what this backend stored (its last CLEAR_TRACKED_KEYS_MAX pieces; GPUCache
        keeps no per-engine index to enumerate, so older pieces, and other processes'
        pieces, stay until the server evicts them). True when every remembered piece was
        removed or already gone."""
        with self._lock:
            keys = list(self._stored)
            self._stored.clear()
        ok = True
        for k in keys:
            try:
                self.client.remove(k)
            except gpucache.Error as e:
                logger.warning("GPUCache clear could not remove a piece: %s", e)
                ok = False
        return ok

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
