"""A vLLM KV connector (``KVConnectorBase_V1``) backed by a GPUCache server.

vLLM loads it by module path; nothing of vLLM is patched. Launch (one line of JSON)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "GPUCacheConnector",
        "kv_connector_module_path": "gpucache.connectors.vllm_native",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "gpucache://127.0.0.1:7470?tenant=default"}}'

``kv_load_failure_policy`` must be ``recompute``: a block the server no longer has, or holds
damaged, is found only when it is read, and vLLM then recomputes it instead of failing the
request. The connector refuses to start under vLLM's default, ``fail``.

``kv_connector_extra_config`` fields: ``url`` (required; ``gpucache://`` or
``gpucache+etcd://``, see ``gpucache.connectors._url``), ``model`` (the name in the identity;
vLLM's model name or path by default), ``staging_bytes`` (each worker's host staging area,
``STAGING_BYTES_DEFAULT``), ``lookup_wait_s`` (how long a request may wait for its lookup
before it is scheduled as a miss, ``LOOKUP_WAIT_S_DEFAULT``) and ``load_wait_s`` (how long a
request may wait for its blocks before the missing ones are recomputed,
``LOAD_WAIT_S_DEFAULT``). Any other field is refused, and so is a server that cannot be
reached when the engine starts (the start fails with the address and the reason).

How it works. One object per engine block per worker: the block's bytes in every attention
layer of that worker, layer after layer in name order, under the key of the block's hash (vLLM's
hash already covers the whole prefix before the block) and one ``gpucache.Identity`` per worker:
the model, its revision and a digest of its configuration, the KV cache dtype exactly as vLLM
names it, the attention spec's geometry, the block size, and the worker's TP and PP rank.

- Scheduler side (never waits on the network): a new request's blocks are asked about in
  QUERYs through a ``gpucache.Executor`` (one key per block per worker, a block counts only when
  every worker has it); until the answer is in, ``get_num_new_matched_tokens`` answers ``None``
  and vLLM asks again on its next step. The executor's health monitor turns lookups into misses
  while the server is down (one probe per cooldown). The hit is loaded asynchronously, and the
  blocks a step makes full are handed to the workers to save.
- Worker side: loads are GETs into a bounded staging area (``staging_bytes``), copied into the
  engine's own KV tensors between steps, and reported finished to vLLM; a block that did not
  come back whole is reported as a load error, so vLLM recomputes it. Saves copy their blocks
  out of the KV tensors right after the step's forward and PUT them in the background; they may
  use at most half of the staging area, so saves never starve loads, and a save that finds no
  room is dropped (a later miss, never a stall).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Set, Tuple

import torch

import gpucache
from gpucache.connectors import _url
from gpucache.connectors.vllm import kv_dtype_of

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 1
# Each worker's host staging area for loads and saves (one slot per block in flight).
STAGING_BYTES_DEFAULT = 256 << 20
# The scheduler's executor: its queue of QUERYs, most keys per QUERY, and the cooldown after the
# server failed one (lookups are misses until it ends).
QUERY_QUEUE_DEPTH = 64
QUERY_KEYS_MAX = 4096
HEALTH_COOLDOWN_MS = 5_000
# Most requests whose lookup is remembered at once; a request past it is a miss.
LOOKUPS_MAX = 4096
# Liveness limits a request can be held to: its lookup, then its load.
LOOKUP_WAIT_S_DEFAULT = 5.0
LOAD_WAIT_S_DEFAULT = 30.0
# The worker's executor: queue depth and threads per operation kind (a step's loads are split
# over the GET threads).
TRANSFER_QUEUE_DEPTH = 256
TRANSFER_WORKERS = 4
# Most blocks one GET or PUT job carries.
TRANSFER_KEYS_MAX = 256


def _dtype_name(vllm_config: "VllmConfig") -> str:
    """The KV cache dtype as vLLM names it (``--kv-cache-dtype``; the model's dtype for
    ``auto``)."""
    name = str(vllm_config.cache_config.cache_dtype)
    if name == "auto":
        name = str(vllm_config.model_config.dtype)
    return name.removeprefix("torch.")


def _identities(vllm_config: "VllmConfig", kv_cache_config: Any, tenant: str, model: str
                ) -> Dict[Tuple[int, int], gpucache.Identity]:
    """Every worker's identity, by (TP rank, PP rank)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    dtype = _dtype_name(vllm_config)
    geometry = "-".join(
        f"{field}{getattr(spec, field)}"
        for field in ("num_kv_heads", "head_size", "page_size_bytes")
        if hasattr(spec, field)
    )
    layout = (
        f"vllm-native-kv.{dtype}-{type(spec).__name__}-{geometry}"
        f"-layers{len(group.layer_names)}"
        f"-pcp{getattr(pc, 'prefill_context_parallel_size', 1)}"
        f"-dcp{getattr(pc, 'decode_context_parallel_size', 1)}"
    )
    try:
        config_text = mc.hf_config.to_json_string()
    except Exception:  # a config that does not serialise still has a repr
        config_text = repr(mc.hf_config)
    digest = hashlib.sha256(config_text.encode()).hexdigest()
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    return {
        (t, p): gpucache.Identity(
            tenant=tenant,
            model=model,
            model_revision=str(mc.revision or "main"),
            model_config=digest,
            tokenizer_revision=str(getattr(mc, "tokenizer_revision", None) or "main"),
            kv_dtype=kv_dtype_of(dtype),
            layout=layout,
            layout_version=LAYOUT_VERSION,
            tp_rank=t,
            tp_size=tp,
            pp_rank=p,
            pp_size=pp,
            block_tokens=int(vllm_config.cache_config.block_size),
        )
        for t in range(tp)
        for p in range(pp)
    }


@dataclasses.dataclass
class GPUCacheConnectorMetadata(KVConnectorMetadata):
    """What the scheduler hands the workers for one step: per request, the (block id, block
    hash) pairs to load; the pairs whose blocks this step makes full, to save."""

    loads: Dict[str, List[Tuple[int, bytes]]] = dataclasses.field(default_factory=dict)
    saves: List[Tuple[int, bytes]] = dataclasses.field(default_factory=list)


class _Asked:
    """One request's lookup: its QUERYs in flight and the blocks' answers."""

    __slots__ = ("since", "ops", "found", "blocks")

    def __init__(self, blocks: int) -> None:
        self.since = time.monotonic()
        self.ops: Set[int] = set()
        self.blocks = blocks
        self.found: List[bool] = [False] * blocks


class _Tracked:
    """A request the scheduler side follows: its block ids and how far its blocks are saved."""

    __slots__ = ("request", "block_ids", "saved", "local", "load")

    def __init__(self, request: "Request") -> None:
        self.request = request
        self.block_ids: List[int] = []
        # Blocks saved (or known stored), and the blocks vLLM had locally at the lookup.
        self.saved = 0
        self.local = 0
        self.load: List[Tuple[int, bytes]] = []


class GPUCacheConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a GPUCache server (see the module's doc)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        known = {"url", "model", "staging_bytes", "lookup_wait_s", "load_wait_s"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"GPUCacheConnector: unknown kv_connector_extra_config field(s) "
                             f"{unknown}; known: {sorted(known)}")
        if not extra.get("url"):
            raise ValueError('GPUCacheConnector needs kv_connector_extra_config "url": '
                             '"gpucache://HOST:PORT?tenant=NAME"')
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ValueError(
                f'GPUCacheConnector needs "kv_load_failure_policy": "recompute" in '
                f"--kv-transfer-config (it is {policy!r}): a block found missing or damaged "
                "when it is read must be recomputed, not fail its request")
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
            groups = None if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)
            raise ValueError(
                f"GPUCacheConnector supports models with one KV cache group; this one has "
                f"{groups} (hybrid attention, sliding windows or state layers)")
        self.block_tokens = int(vllm_config.cache_config.block_size)
        self.address = _url.parse(str(extra["url"]))
        model = str(extra.get("model") or vllm_config.model_config.model)
        self.identities = _identities(vllm_config, kv_cache_config, self.address.tenant, model)
        self.lookup_wait_s = float(extra.get("lookup_wait_s", LOOKUP_WAIT_S_DEFAULT))
        self.load_wait_s = float(extra.get("load_wait_s", LOAD_WAIT_S_DEFAULT))
        staging = int(extra.get("staging_bytes", STAGING_BYTES_DEFAULT))
        try:
            self.client = self.address.connect(client_name="gpucache-vllm-native")
        except gpucache.Error as e:
            raise ValueError(f"GPUCacheConnector: cannot reach the GPUCache server of "
                             f"{extra['url']!r} ({type(e).__name__}: {e})") from e
        try:
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler: Optional[_SchedulerSide] = _SchedulerSide(self)
                self._worker: Optional[_WorkerSide] = None
            else:
                self._scheduler = None
                self._worker = _WorkerSide(self, vllm_config, kv_cache_config, staging)
        except BaseException:
            self.client.close()
            raise

    @property
    def requires_kv_delivery(self) -> bool:
        # A save is best effort (one dropped is a later miss), and every save copies its blocks
        # before the step ends: a preempted request owes nothing.
        return False

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.step(scheduler_output)

    def request_finished(self, request: "Request", block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        if self._scheduler is not None:
            self._scheduler.forget(request.request_id)
        # Saves copy their blocks before the step returns, so the blocks are free at once.
        return False, None

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, GPUCacheConnectorMetadata)
        self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish before their request is scheduled (they are asynchronous).
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Saved whole, after the forward (wait_for_save).
        return

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, GPUCacheConnectorMetadata)
        self._worker.save(meta.saves)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        assert self._worker is not None
        return None, self._worker.finished_loads()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def stats(self) -> Dict[str, int]:
        """Counters of this side: lookups and hits (scheduler); blocks loaded, failed, saved,
        dropped (workers)."""
        side = self._scheduler or self._worker
        return dict(side.counts) if side is not None else {}

    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        if side is not None:
            side.close()
            logger.info("GPUCacheConnector (%s) shut down: %s", self.role.name, dict(side.counts))
        self._scheduler = self._worker = None
        self.client.close()


class _SchedulerSide:
    """Lookups through QUERYs that never hold the scheduler, and the per-step plans of loads and
    saves."""

    def __init__(self, c: GPUCacheConnector) -> None:
        self.c = c
        self.ranks = list(c.identities.values())
        self.executor = c.client.executor(
            allocation_bytes=4096,
            queue_depth=QUERY_QUEUE_DEPTH,
            workers_get=1,
            workers_put=1,
            keys_per_job_max=QUERY_KEYS_MAX,
            cooldown_ms=HEALTH_COOLDOWN_MS,
        )
        self.asked: Dict[str, _Asked] = {}
        # QUERY operation -> (request, first block, blocks).
        self.queries: Dict[int, Tuple[str, int, int]] = {}
        self.tracked: Dict[str, _Tracked] = {}
        self.counts: collections.Counter = collections.Counter()

    def _keys(self, hashes: List[bytes]) -> List[gpucache.Key]:
        """Every worker's key of each block, worker after worker."""
        return [k for ident in self.ranks for k in ident.block_keys(hashes)]

    def _collect(self) -> None:
        if not self.queries:
            return
        try:
            polled = self.executor.poll()
        except gpucache.Error as e:
            logger.warning("GPUCacheConnector: lookup poll failed: %s", e)
            return
        for result in polled["results"]:
            asked_for = self.queries.pop(result["operation"], None)
            if asked_for is None:
                continue
            req_id, first, n = asked_for
            asked = self.asked.get(req_id)
            if asked is None:
                continue
            asked.ops.discard(result["operation"])
            answers = result["keys"]
            for i in range(n):
                mine = answers[i::n] if len(answers) == n * len(self.ranks) else []
                asked.found[first + i] = bool(mine) and all(a.get("result") == "found" for a in mine)

    def _ask(self, request: "Request", blocks: int) -> Optional[_Asked]:
        """Sends the QUERYs of a request's first `blocks` blocks; None when they cannot go (a
        full table or queue, or the server cooling off): the request is then a miss."""
        if len(self.asked) >= LOOKUPS_MAX:
            return None
        asked = _Asked(blocks)
        hashes = [bytes(h) for h in request.block_hashes[:blocks]]
        per = max(1, QUERY_KEYS_MAX // len(self.ranks))
        for first in range(0, blocks, per):
            part = hashes[first:first + per]
            try:
                op = self.executor.submit_query(self._keys(part))
            except gpucache.Error as e:
                logger.debug("GPUCacheConnector: lookup not sent (%s): a miss", e)
                for pending in asked.ops:
                    self.executor.cancel(pending)
                    self.queries.pop(pending, None)
                return None
            asked.ops.add(op)
            self.queries[op] = (request.request_id, first, len(part))
        self.asked[request.request_id] = asked
        return asked

    def matched(self, request: "Request", num_computed: int) -> Tuple[Optional[int], bool]:
        # A restore leaves at least the prompt's last token to compute.
        blocks = min(len(request.block_hashes), max(0, request.num_tokens - 1) // self.c.block_tokens)
        start = num_computed // self.c.block_tokens
        tracked = self.tracked.setdefault(request.request_id, _Tracked(request))
        tracked.saved = max(tracked.saved, start)
        tracked.local = start
        if blocks <= start:
            return 0, False
        self._collect()
        asked = self.asked.get(request.request_id)
        if asked is None or asked.blocks < blocks:
            self.counts["lookups"] += 1
            asked = self._ask(request, blocks)
            if asked is None:
                return 0, False
        if asked.ops:
            if time.monotonic() - asked.since < self.c.lookup_wait_s:
                return None, False
            self.counts["lookups_late"] += 1
            return 0, False
        hit = 0
        for found in asked.found[start:blocks]:
            if not found:
                break
            hit += 1
        if hit == 0:
            return 0, False
        self.counts["hit_blocks"] += hit
        return hit * self.c.block_tokens, True

    def allocated(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        tracked = self.tracked.setdefault(request.request_id, _Tracked(request))
        if num_external_tokens <= 0:
            return
        ids = list(blocks.get_block_ids()[0])
        start = tracked.local
        end = start + num_external_tokens // self.c.block_tokens
        tracked.load = [(ids[i], bytes(request.block_hashes[i])) for i in range(start, min(end, len(ids)))]
        tracked.saved = max(tracked.saved, end)
        self.asked.pop(request.request_id, None)

    def step(self, out: "SchedulerOutput") -> GPUCacheConnectorMetadata:
        self._collect()
        meta = GPUCacheConnectorMetadata()
        for tracked_id, tracked in self.tracked.items():
            if tracked.load:
                meta.loads[tracked_id] = tracked.load
                tracked.load = []
        spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        for new in out.scheduled_new_reqs:
            tracked = self.tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan_saves(meta, tracked, new.num_computed_tokens, out.num_scheduled_tokens.get(new.req_id, 0),
                             len(spec.get(new.req_id, ())))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            self._plan_saves(meta, tracked, cached.num_computed_tokens[i],
                             out.num_scheduled_tokens.get(req_id, 0), len(spec.get(req_id, ())))
        return meta

    def _plan_saves(self, meta: GPUCacheConnectorMetadata, tracked: _Tracked, computed: int,
                    scheduled: int, speculative: int) -> None:
        """Adds the blocks this step makes full (draft tokens are not KV until accepted)."""
        hashes = tracked.request.block_hashes
        full = min((computed + scheduled - speculative) // self.c.block_tokens, len(hashes),
                   len(tracked.block_ids))
        for i in range(tracked.saved, full):
            meta.saves.append((tracked.block_ids[i], bytes(hashes[i])))
        tracked.saved = max(tracked.saved, full)

    def forget(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        asked = self.asked.pop(req_id, None)
        if asked is not None:
            for op in asked.ops:
                self.queries.pop(op, None)
                self.executor.cancel(op)

    def close(self) -> None:
        self.executor.close()


class _Load:
    """One request's load: its blocks not yet back, those that failed, and its deadline."""

    __slots__ = ("waiting", "deadline")

    def __init__(self, blocks: int, deadline: float) -> None:
        self.waiting = blocks
        self.deadline = deadline


class _WorkerSide:
    """Loads and saves between the engine's KV tensors and the server, through a staging area
    cut in one slot per block."""

    def __init__(self, c: GPUCacheConnector, vllm_config: "VllmConfig", kv_cache_config: Any,
                 staging_bytes: int) -> None:
        self.c = c
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        rank = (get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
        self.identity = c.identities[rank]
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.staging_bytes = staging_bytes
        self.layers: List[Tuple[str, torch.Tensor, int]] = []
        # Each layer's blocks as rows of bytes, when every layer is a contiguous host tensor:
        # blocks then move between the staging slots and the KV cache in one copy.
        self.rows: Optional[List[torch.Tensor]] = None
        self.block_bytes = 0
        self.executor: Any = None
        self.free: List[int] = []
        self.slots = 0
        # Loads waiting for a slot: (request, block id, block hash).
        self.pending: Deque[Tuple[str, int, bytes]] = collections.deque()
        self.loads: Dict[str, _Load] = {}
        # Operation -> (kind, [(request or "", block id, slot)]).
        self.ops: Dict[int, Tuple[str, List[Tuple[str, int, int]]]] = {}
        # Requests whose load ended early (deadline): their operations' bytes are dropped.
        self.abandoned: Set[str] = set()
        self.errors: Set[int] = set()
        self.done: Set[str] = set()
        self.counts: collections.Counter = collections.Counter()

    def register(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        layers = []
        for name in sorted(kv_caches):
            t = group_kernel_blocks(kv_caches[name], self.num_blocks)
            per = t[0].numel() * t.element_size()
            layers.append((name, t, per))
        self.layers = layers
        if all(t.device.type == "cpu" and t.is_contiguous() for _, t, _ in layers):
            self.rows = [t.view(t.shape[0], -1).view(torch.uint8) for _, t, _ in layers]
        self.block_bytes = sum(per for _, _, per in layers)
        if self.block_bytes <= 0:
            raise ValueError("GPUCacheConnector: the engine registered no KV cache bytes")
        limit = self.c.client.offers().get("object_bytes_max")
        if limit and self.block_bytes > int(limit):
            raise ValueError(
                f"GPUCacheConnector: one block of this worker is {self.block_bytes} bytes, over "
                f"the server's object_bytes_max of {limit}: raise the server's "
                "limits.object_bytes_max or use a smaller --block-size")
        self.slots = self.staging_bytes // self.block_bytes
        if self.slots < 2:
            raise ValueError(
                f"GPUCacheConnector: staging_bytes {self.staging_bytes} holds fewer than two "
                f"blocks of {self.block_bytes} bytes")
        self.executor = self.c.client.executor(
            allocation_bytes=self.slots * self.block_bytes,
            slot_bytes=self.block_bytes,
            queue_depth=TRANSFER_QUEUE_DEPTH,
            workers_query=1,
            workers_get=TRANSFER_WORKERS,
            workers_put=TRANSFER_WORKERS,
            keys_per_job_max=TRANSFER_KEYS_MAX,
            cooldown_ms=HEALTH_COOLDOWN_MS,
        )
        self.free = list(range(self.slots))
        logger.info("GPUCacheConnector worker: %d layers, %d bytes per block, %d staging slots, "
                    "%s copies", len(layers), self.block_bytes, self.slots,
                    "direct" if self.rows is not None else "staged")

    def _range(self, slot: int) -> Tuple[int, int]:
        return slot * self.block_bytes, self.block_bytes

    # ---- loads ----------------------------------------------------------------------------

    def start_loads(self, loads: Dict[str, List[Tuple[int, bytes]]]) -> None:
        now = time.monotonic()
        for req_id, blocks in loads.items():
            self.loads[req_id] = _Load(len(blocks), now + self.c.load_wait_s)
            self.pending.extend((req_id, block_id, h) for block_id, h in blocks)
        self._pump()

    def _pump(self) -> None:
        """Sends waiting loads while slots are free (all fail before the KV cache is
        registered)."""
        if self.executor is None:
            while self.pending:
                req_id, block_id, _ = self.pending.popleft()
                self._loaded(req_id, block_id, ok=False)
            return
        per_op = max(1, min(TRANSFER_KEYS_MAX, -(-len(self.pending) // TRANSFER_WORKERS)))
        while self.pending and self.free:
            batch = []
            while self.pending and self.free and len(batch) < per_op:
                req_id, block_id, h = self.pending.popleft()
                if req_id in self.abandoned:
                    continue
                batch.append((req_id, block_id, h, self.free.pop()))
            if not batch:
                return
            try:
                op = self.executor.submit_get(
                    self.identity.block_keys([h for _, _, h, _ in batch]),
                    [self._range(slot) for *_, slot in batch])
            except gpucache.Error as e:
                logger.debug("GPUCacheConnector: load not sent (%s)", e)
                for req_id, block_id, _, slot in batch:
                    self.free.append(slot)
                    self._loaded(req_id, block_id, ok=False)
                continue
            self.ops[op] = ("get", [(r, b, s) for r, b, _, s in batch])

    def _loaded(self, req_id: str, block_id: int, ok: bool) -> None:
        load = self.loads.get(req_id)
        if load is None:
            return
        if not ok:
            self.errors.add(block_id)
            self.counts["load_failed_blocks"] += 1
        else:
            self.counts["loaded_blocks"] += 1
        load.waiting -= 1
        if load.waiting <= 0:
            del self.loads[req_id]
            self.done.add(req_id)

    def _copy_in(self, blocks: List[Tuple[int, int]]) -> None:
        """Copies (block id, slot) pairs from the staging area into the KV tensors."""
        if self.rows is not None:
            for block_id, slot in blocks:
                at = slot * self.block_bytes
                for rows, (_, _, per) in zip(self.rows, self.layers):
                    self.executor.read_into(at, per, rows[block_id])
                    at += per
            return
        n = len(blocks)
        host = torch.empty((n, self.block_bytes), dtype=torch.uint8)
        for i, (_, slot) in enumerate(blocks):
            self.executor.read_into(*self._range(slot), host[i])
        at = 0
        for _, t, per in self.layers:
            idx = torch.tensor([b for b, _ in blocks], dtype=torch.long, device=t.device)
            part = host[:, at:at + per].contiguous().view(t.dtype).view(n, *t.shape[1:])
            t.index_copy_(0, idx, part.to(t.device))
            at += per

    # ---- saves ----------------------------------------------------------------------------

    def save(self, saves: List[Tuple[int, bytes]]) -> None:
        self._collect()
        if not saves or self.executor is None:
            return
        room = max(0, len(self.free) - self.slots // 2)
        if room < len(saves):
            self.counts["save_dropped_blocks"] += len(saves) - room
            saves = saves[:room]
        for first in range(0, len(saves), TRANSFER_KEYS_MAX):
            part = saves[first:first + TRANSFER_KEYS_MAX]
            slots = [self.free.pop() for _ in part]
            self._copy_out([b for b, _ in part], slots)
            try:
                op = self.executor.submit_put(self.identity.block_keys([h for _, h in part]),
                                              [self._range(s) for s in slots])
            except gpucache.Error as e:
                logger.debug("GPUCacheConnector: save not sent (%s)", e)
                self.free.extend(slots)
                self.counts["save_dropped_blocks"] += len(part)
                continue
            self.ops[op] = ("put", [("", b, s) for (b, _), s in zip(part, slots)])

    def _copy_out(self, block_ids: List[int], slots: List[int]) -> None:
        """Copies blocks from the KV tensors into staging slots, layer after layer."""
        if self.rows is not None:
            for block_id, slot in zip(block_ids, slots):
                at = slot * self.block_bytes
                for rows, (_, _, per) in zip(self.rows, self.layers):
                    self.executor.write(at, per, rows[block_id])
                    at += per
            return
        pieces = []
        for _, t, per in self.layers:
            idx = torch.tensor(block_ids, dtype=torch.long, device=t.device)
            pieces.append(t.index_select(0, idx).contiguous().cpu().reshape(len(block_ids), -1)
                          .view(torch.uint8))
        rows = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        for i, slot in enumerate(slots):
            self.executor.write(*self._range(slot), rows[i])

    # ---- completions ----------------------------------------------------------------------

    def _collect(self) -> None:
        """Applies every finished operation (never waits) and ends loads past their deadline."""
        if self.executor is None:
            return
        if self.ops:
            try:
                polled = self.executor.poll()
            except gpucache.Error as e:
                logger.warning("GPUCacheConnector: poll failed: %s", e)
                polled = {"results": []}
            for result in polled["results"]:
                entry = self.ops.pop(result["operation"], None)
                if entry is None:
                    continue
                kind, blocks = entry
                answers = result["keys"]
                if kind == "put":
                    for i, (_, _, slot) in enumerate(blocks):
                        ok = i < len(answers) and answers[i].get("ok")
                        self.counts["saved_blocks" if ok else "save_failed_blocks"] += 1
                        self.free.append(slot)
                    continue
                good: List[Tuple[int, int]] = []
                for i, (req_id, block_id, slot) in enumerate(blocks):
                    a = answers[i] if i < len(answers) else {}
                    whole = a.get("result") == "read" and a.get("bytes") == self.block_bytes
                    if req_id in self.abandoned:
                        continue
                    if whole:
                        good.append((block_id, slot))
                    self._loaded(req_id, block_id, ok=bool(whole))
                if good:
                    self._copy_in(good)
                for *_, slot in blocks:
                    self.free.append(slot)
        now = time.monotonic()
        for req_id, load in list(self.loads.items()):
            if now >= load.deadline:
                self._abandon(req_id)
        if not self.ops:
            self.abandoned.clear()
        self._pump()

    def _abandon(self, req_id: str) -> None:
        """Ends a load past its deadline: every block not back is a load error, and whatever
        comes back later for it is dropped (vLLM may give its blocks to another request)."""
        load = self.loads.pop(req_id)
        waiting = [b for r, b, _ in self.pending if r == req_id]
        for _, blocks in self.ops.values():
            waiting.extend(b for r, b, _ in blocks if r == req_id)
        self.errors.update(waiting)
        self.counts["load_late_blocks"] += load.waiting
        self.abandoned.add(req_id)
        self.pending = collections.deque(p for p in self.pending if p[0] != req_id)
        self.done.add(req_id)

    def finished_loads(self) -> Optional[Set[str]]:
        self._collect()
        if not self.done:
            return None
        done, self.done = self.done, set()
        return done

    def take_load_errors(self) -> Set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None
