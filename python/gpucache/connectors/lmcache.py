"""LMCache remote storage plugin backed by a GPUCache server.

LMCache loads it through ``remote_storage_plugins``: for each plugin name it imports
``remote_storage_plugin.<name>.module_path``, takes ``class_name`` (a ``ConnectorAdapter``)
and asks it for a connector for the URL ``plugin://<name>``. The GPUCache address is the
plugin's ``url`` field. LMCache configuration (YAML, e.g. ``LMCACHE_CONFIG_FILE``)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_serde: naive
    remote_storage_plugins: ["gpucache"]
    extra_config:
      remote_storage_plugin.gpucache.module_path: gpucache.connectors.lmcache
      remote_storage_plugin.gpucache.class_name: GPUCacheConnectorAdapter
      remote_storage_plugin.gpucache.url: "gpucache://127.0.0.1:7470?tenant=default"

Keys: one ``gpucache.Identity`` per (model, world size, worker id, dtype) of LMCache's
``CacheEngineKey``, with the chunk's memory format and shapes in its layout and
``chunk_size`` as its tokens per block; the block name is the key's own string (chunk hash
and tags). A chunk is stored as its raw bytes (``remote_serde: naive``); a shorter last chunk
(``save_unfull_chunk``) comes back with its own length. Layerwise keys and other serdes are
refused when the connector is made, with the reason.

A configuration error (a missing or malformed ``url``, a layerwise or non-naive setting) is
raised as LMCache's ``IrrecoverableException``, which LMCache lets stop the engine's start
instead of running on without a remote tier; a server that does not answer yet is an ordinary
error, after which LMCache tries to connect again. Every call to the server finishes within
half of LMCache's ``blocking_timeout_secs`` (the address's ``timeout_s`` is lowered to that),
and a read that LMCache can no longer be waiting for (it gave up on it) allocates nothing and
hands back nothing.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import threading
import time
from typing import List, Optional

import gpucache
from gpucache.connectors import _url

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

logger = logging.getLogger(__name__)

PLUGIN_TYPE = "gpucache"
# Threads that carry blocking GPUCache calls off LMCache's event loop.
IO_THREADS_MAX = 8
# Most identities one connector keeps (one per model, world size, worker and dtype seen).
IDENTITIES_MAX = 64
# Most keys remembered for list() (the newest; older ones are forgotten, not removed).
LISTED_KEYS_MAX = 65536
LAYOUT_VERSION = 1
# LMCache's blocking_timeout_secs when its configuration has none.
LMCACHE_WAIT_S_DEFAULT = 10.0


class IdentityCache:
    """The identities of the keys met lately, each made once: at most ``IDENTITIES_MAX``, the
    least recently used dropped first. Safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: "collections.OrderedDict[tuple, gpucache.Identity]" = collections.OrderedDict()

    def get(self, who: tuple, make) -> gpucache.Identity:
        """The identity of `who`, made by `make()` the first time it is asked for."""
        with self._lock:
            ident = self._made.get(who)
            if ident is not None:
                self._made.move_to_end(who)
                return ident
        ident = make()
        with self._lock:
            self._made[who] = ident
            while len(self._made) > IDENTITIES_MAX:
                self._made.popitem(last=False)
        return ident


class GPUCacheConfigError(IrrecoverableException, ValueError):
    """A configuration the connector cannot run with: LMCache stops its start on it."""


class GPUCacheConnectorAdapter(ConnectorAdapter):
    """Makes ``GPUCacheConnector`` for ``gpucache://...`` and ``plugin://gpucache[.NAME]``."""

    def __init__(self) -> None:
        super().__init__(f"{_url.SCHEME}://")

    def can_parse(self, url: str) -> bool:
        if url.startswith(self.schema) or url.startswith(f"{_url.CLUSTER_SCHEME}://"):
            return True
        if url.startswith("plugin://"):
            return extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE
        return False

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        url = context.url
        if url.startswith("plugin://"):
            name = context.plugin_name or url[len("plugin://") :]
            field = f"remote_storage_plugin.{name}.url"
            extra = (context.config.extra_config if context.config else None) or {}
            if not extra.get(field):
                raise GPUCacheConfigError(
                    f'the LMCache extra_config needs {field}: "gpucache://HOST:PORT"'
                )
            url = extra[field]
        try:
            address = _url.parse(url)
        except ValueError as e:
            raise GPUCacheConfigError(str(e)) from None
        return GPUCacheConnector(address, context)


class GPUCacheConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over a ``gpucache.Client`` (see the module's doc)."""

    def __init__(self, address: _url.Address, context: ConnectorContext):
        backend = context.local_cpu_backend
        config = context.config if context.config is not None else backend.config
        metadata = context.metadata if context.metadata is not None else backend.metadata
        if config.use_layerwise:
            raise GPUCacheConfigError(
                "the gpucache LMCache connector does not store layerwise chunks"
            )
        if config.remote_serde not in (None, "naive"):
            raise GPUCacheConfigError(
                f"the gpucache LMCache connector stores raw chunks: set remote_serde: naive "
                f"(not {config.remote_serde!r})"
            )
        super().__init__(config, metadata)
        # LMCache waits blocking_timeout_secs for a call, then cancels it: every call ends well
        # before, and a read still running then is dropped (see _get_sync).
        waits = float(getattr(config, "blocking_timeout_secs", None) or LMCACHE_WAIT_S_DEFAULT)
        self.call_s = waits / 2
        address = dataclasses.replace(address, timeout_s=min(address.timeout_s, self.call_s))
        self.address = address
        self.loop = context.loop
        self.local_cpu_backend = backend
        self.client = address.connect(client_name="gpucache-lmcache")
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=IO_THREADS_MAX, thread_name_prefix="gpucache-lmcache"
        )
        shapes = ";".join(
            f"{list(s)}:{d}" for s, d in zip(self.meta_shapes, self.meta_dtypes)
        )
        digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
        self._layout = f"lmcache-{self.meta_fmt.name.lower()}-{digest}"
        self._chunk_tokens = int(metadata.chunk_size)
        self._lock = threading.Lock()
        self._identities = IdentityCache()
        self._stored: "collections.OrderedDict[str, None]" = collections.OrderedDict()

    # ---- keys -------------------------------------------------------------------------------

    def _identity(self, key: CacheEngineKey) -> gpucache.Identity:
        who = (key.model_name, key.world_size, key.worker_id, str(key.dtype))
        return self._identities.get(who, lambda: gpucache.Identity(
            tenant=self.address.tenant,
            model=key.model_name,
            kv_dtype=_url.kv_dtype_name(key.dtype),
            layout=self._layout,
            layout_version=LAYOUT_VERSION,
            tp_rank=key.worker_id,
            tp_size=key.world_size,
            block_tokens=self._chunk_tokens,
        ))

    def _key(self, key: CacheEngineKey) -> gpucache.Key:
        return self._identity(key).chain_keys([key.to_string()])[0]

    def _remember(self, keys: List[CacheEngineKey]) -> None:
        with self._lock:
            for k in keys:
                s = k.to_string()
                self._stored[s] = None
                self._stored.move_to_end(s)
            while len(self._stored) > LISTED_KEYS_MAX:
                self._stored.popitem(last=False)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- buffers ----------------------------------------------------------------------------

    def _allocate(self) -> Optional[MemoryObj]:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    @staticmethod
    def _view(memory_obj: MemoryObj) -> memoryview:
        buf = memory_obj.byte_array
        return buf if isinstance(buf, memoryview) else memoryview(buf)

    def _finish(self, memory_obj: MemoryObj, got: Optional[int]) -> Optional[MemoryObj]:
        """The object holding a read of ``got`` bytes, or None (and the object released)
        for a miss or a length that is no whole number of tokens."""
        if got is None:
            memory_obj.ref_count_down()
            return None
        try:
            return self.reshape_partial_chunk(memory_obj, got)
        except ValueError as e:
            logger.warning("GPUCache returned an unusable chunk (%s): treated as a miss", e)
            memory_obj.ref_count_down()
            return None

    # ---- RemoteConnector --------------------------------------------------------------------

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.client.exists(self._key(key))

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._off_loop(self.exists_sync, key)

    def _deadline(self) -> float:
        """When LMCache may stop waiting for a read asked for now (its clock starts first)."""
        return time.monotonic() + self.call_s

    def _late(self, deadline: float, objs) -> bool:
        """Past the deadline: LMCache may have cancelled the read, so nobody would release
        what it allocated. Releases ``objs`` and says so."""
        if time.monotonic() <= deadline:
            return False
        for m in objs:
            if m is not None:
                m.ref_count_down()
        logger.warning("a GPUCache read finished after LMCache's wait: dropped")
        return True

    def _get_sync(self, key: CacheEngineKey, deadline: float) -> Optional[MemoryObj]:
        if self._late(deadline, ()):
            return None
        memory_obj = self._allocate()
        if memory_obj is None:
            logger.warning("LMCache could not allocate a chunk for a GPUCache read")
            return None
        try:
            got = self.client.get_into(self._key(key), self._view(memory_obj))
        except gpucache.Error:
            memory_obj.ref_count_down()
            raise
        out = self._finish(memory_obj, got)
        return None if self._late(deadline, [out]) else out

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return await self._off_loop(self._get_sync, key, self._deadline())

    def _put_sync(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        self.client.batch_put_from(
            [self._key(k) for k in keys], [self._view(m) for m in memory_objs]
        )
        self._remember(keys)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        # LMCache's wrapper releases memory_obj after this returns.
        await self._off_loop(self._put_sync, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        await self._off_loop(self._put_sync, list(keys), list(memory_objs))

    def _batched_get_sync(
        self, keys: List[CacheEngineKey], deadline: float
    ) -> List[Optional[MemoryObj]]:
        if self._late(deadline, ()):
            return [None] * len(keys)
        objs: List[Optional[MemoryObj]] = []
        for _ in keys:
            m = self._allocate()
            if m is None:
                break
            objs.append(m)
        if len(objs) < len(keys):
            logger.warning(
                "LMCache could allocate %d of %d chunks for a GPUCache read", len(objs), len(keys)
            )
        try:
            got = self.client.batch_get_into(
                [self._key(k) for k in keys[: len(objs)]], [self._view(m) for m in objs]
            )
        except gpucache.Error:
            for m in objs:
                m.ref_count_down()
            raise
        out = [self._finish(m, g) for m, g in zip(objs, got)]
        if self._late(deadline, out):
            return [None] * len(keys)
        return out + [None] * (len(keys) - len(out))

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return await self._off_loop(self._batched_get_sync, list(keys), self._deadline())

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: List[CacheEngineKey]
    ) -> List[MemoryObj]:
        """The leading chunks that were read; everything after the first miss is released."""
        objs = await self.batched_get(keys)
        out: List[MemoryObj] = []
        for i, m in enumerate(objs):
            if m is None:
                for rest in objs[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(m)
        return out

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return self.client.prefix_len([self._key(k) for k in keys])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self._off_loop(self.batched_contains, list(keys))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        removed = self.client.remove(self._key(key))
        with self._lock:
            self._stored.pop(key.to_string(), None)
        return removed

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the server answers, 1 when it does not."""
        try:
            await self._off_loop(self.client.offers)
            return 0
        except gpucache.Error as e:
            logger.warning("GPUCache ping failed: %s", e)
            return 1

    async def list(self) -> List[str]:
        """The keys this connector stored (the newest LISTED_KEYS_MAX): GPUCache keeps no
        per-engine index of what other processes stored."""
        with self._lock:
            return list(self._stored)

    async def close(self):
        self._pool.shutdown(wait=True)
        self.client.close()

    def __repr__(self) -> str:
        return f"<GPUCacheConnector {self.address.hostport} tenant={self.address.tenant}>"
