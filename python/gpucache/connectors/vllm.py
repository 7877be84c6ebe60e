"""vLLM OffloadingConnector secondary tier backed by a GPUCache server.

vLLM's ``TieringOffloadingSpec`` keeps offloaded KV chunks in a CPU primary tier and cascades
them to secondary tiers; an out-of-tree tier is named by class and module in
``secondary_tiers``. Launch (one line of JSON for ``--kv-transfer-config``)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "GPUCacheTier",
                "module_path": "gpucache.connectors.vllm",
                "url": "gpucache://127.0.0.1:7470?tenant=default"}]}}'

On vLLM's CPU platform, name ``"spec_name": "GPUCacheCPUTieringSpec", "spec_module_path":
"gpucache.connectors.vllm_cpu"`` instead (see that module). The tier entry also takes
``"locality": "LOCAL"`` or ``"REMOTE"`` (where the server is, for vLLM's tier filters) and
``"enable_kv_events": true`` (a stored event for every chunk the tier stores, handed to vLLM's
KV event publisher when its KV cache events are on). vLLM's metrics of the tier come from each
job's transfer time and bytes, which every result carries.

The tier runs in vLLM's scheduler process and sees whole chunks of the primary tier (every
worker's bytes of a chunk, in rank order, or the one replicated copy). Keys: one
``gpucache.Identity`` from the offloading config (model name, the KV cache dtype exactly as vLLM
names it, the KV cache layout, direct or canonical, the chunk's bytes and tokens, and, unless
vLLM says the chunk's bytes are the same under any parallelism, the TP, PP and context-parallel
sizes and the worker count), and the chunk's ``OffloadKey`` (block hash and group) as the block
name. A chunk larger than the server's ``object_bytes_max`` is stored as several objects, each
named by its index, and loads only when every piece comes back whole.

Nothing here blocks vLLM's scheduler on the network. ``lookup`` answers RETRY for a chunk it
has not asked about yet; at the end of the scheduler step the chunks asked about are queried in
one QUERY through a ``gpucache.Executor`` (bounded queue, a health monitor whose cooldown turns
lookups into misses while the server is down, so a dead server costs one probe), and the next
step's lookups see the answers. Stores and loads run on a bounded pool of threads
(``IO_THREADS_MAX``) straight between the primary tier's rows and the server, and are reported by
``get_finished_jobs``; a chunk read back with another length is a failed load, never a partial
one, and a failed load makes its chunks misses for the requests that asked.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import struct
import threading
import time
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Set

import numpy as np

import gpucache
from gpucache.connectors import _url

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

logger = logging.getLogger(__name__)

# Threads that carry stores and loads to the server.
IO_THREADS_MAX = 8
# Most jobs submitted and not yet reported; one more fails at once (vLLM retries later).
JOBS_IN_FLIGHT_MAX = 256
# Most chunks whose lookup is remembered (asked, in flight or answered); a lookup past it is a
# miss, which is always safe.
LOOKUPS_MAX = 65_536
# Most chunks one QUERY asks about (the rest of a step's lookups go in the next QUERY).
QUERY_KEYS_MAX = 4_096
# The executor's queue of QUERY jobs, and its cooldown after the server failed one.
QUERY_QUEUE_DEPTH = 64
HEALTH_COOLDOWN_MS = 5_000
LAYOUT_VERSION = 2
# Most stored events kept until vLLM takes them; the oldest are dropped past it.
EVENTS_MAX = 65_536

# vLLM's KV cache dtype names (its --kv-cache-dtype, or the model dtype for "auto") and the
# element type GPUCache records for each. Any other name, and the ones here whose bytes are not
# one plain element type (scaled or packed formats), are recorded as raw bytes ("u8"); the
# exact name is always part of the layout too, so every name vLLM passes is its own identity
# and no name can stop the engine from starting.
_PLAIN_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "half": "f16",
    "bfloat16": "bf16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "int8": "i8",
    "uint8": "u8",
}


def kv_dtype_of(vllm_dtype: str) -> str:
    """The ``Identity`` element type of a vLLM KV cache dtype name (see ``_PLAIN_DTYPES``)."""
    return _PLAIN_DTYPES.get(str(vllm_dtype).removeprefix("torch."), "u8")


class _Lookup:
    """What the tier knows of one chunk: nothing yet (asked), in flight, or the answer; and the
    requests that asked."""

    __slots__ = ("found", "in_flight", "requests")

    def __init__(self) -> None:
        self.found: Optional[bool] = None
        self.in_flight = False
        self.requests: Set[str] = set()


class GPUCacheTier(SecondaryTierManager):
    """A vLLM ``SecondaryTierManager`` over a ``gpucache.Client`` (see the module's doc)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str = "",
        locality: Optional[str] = None,
        enable_kv_events: bool = False,
        backpressure_detector: Any = None,
        **unknown: Any,
    ):
        if unknown:
            raise ValueError(
                f"GPUCacheTier: unknown field(s) {sorted(unknown)} in its secondary_tiers entry; "
                "known: url, locality, enable_kv_events"
            )
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        if not url:
            raise ValueError('the GPUCacheTier entry of secondary_tiers needs "url": "gpucache://..."')
        if locality is not None:
            known = [m.value for m in Locality]
            if str(locality).upper() not in known:
                raise ValueError(f"GPUCacheTier: locality {locality!r}; known: {known}")
            self.locality = Locality(str(locality).upper())
        self.address = _url.parse(url)
        cfg = offloading_spec.config
        par = cfg.parallel
        replicated = bool(getattr(offloading_spec, "replicated_layout", False))
        canonical = bool(getattr(cfg, "canonical_layout", False))
        agnostic = bool(getattr(par, "is_parallelism_agnostic", False))
        # The bytes of a chunk that hold KV: a direct layout's row is every worker's page (or
        # the one replicated copy) and then padding to a memory page, which is not stored; a
        # canonical row is stored whole.
        page = int(getattr(offloading_spec, "cpu_page_size_per_worker", 0) or 0)
        copies = 1 if replicated else par.world_size
        self.chunk_bytes = (
            self.block_size_bytes
            if canonical or page <= 0 or page * copies > self.block_size_bytes
            else page * copies
        )
        tokens = offloading_spec.tokens_per_block[0] * offloading_spec.blocks_per_chunk
        self.client = self.address.connect(client_name="gpucache-vllm")
        try:
            self.piece_bytes = self._piece_bytes()
            # Byte lengths of a chunk's pieces, in order (the last may be shorter).
            self.piece_lens = [
                min(self.piece_bytes, self.chunk_bytes - at)
                for at in range(0, self.chunk_bytes, self.piece_bytes)
            ]
            self.pieces = len(self.piece_lens)
            if self.pieces > gpucache.BATCH_KEYS_MAX:
                raise ValueError(
                    f"GPUCacheTier: a chunk of {self.chunk_bytes} bytes needs {self.pieces} "
                    f"objects of at most {self.piece_bytes} bytes (the server's object_bytes_max); "
                    f"at most {gpucache.BATCH_KEYS_MAX} fit one batch: raise the server's "
                    "limits.object_bytes_max or use fewer blocks per chunk"
                )
            dtype = str(cfg.model.dtype).removeprefix("torch.")
            topology = (
                "any-parallelism"
                if agnostic
                else f"w{par.world_size}-pcp{par.pcp_size}-dcp{par.dcp_size}"
                f"-{'replicated' if replicated else 'ranks'}"
            )
            layout = (
                f"vllm-offload-{cfg.kv_cache_layout or 'default'}"
                f"-{'canonical' if canonical else 'direct'}-kv.{dtype}-{topology}"
                f"-b{self.chunk_bytes}-p{self.piece_bytes if self.pieces > 1 else 0}"
            )
            self.identity = gpucache.Identity(
                tenant=self.address.tenant,
                model=cfg.model.name,
                kv_dtype=kv_dtype_of(dtype),
                layout=layout,
                layout_version=LAYOUT_VERSION,
                tp_rank=0,
                tp_size=1 if agnostic else par.tp_size,
                pp_rank=0,
                pp_size=1 if agnostic else par.pp_size,
                block_tokens=int(tokens),
            )
            self._executor = self.client.executor(
                allocation_bytes=4096,
                queue_depth=QUERY_QUEUE_DEPTH,
                workers_get=1,
                workers_put=1,
                keys_per_job_max=QUERY_KEYS_MAX,
                cooldown_ms=HEALTH_COOLDOWN_MS,
            )
        except BaseException:
            self.client.close()
            raise
        self._rows: Optional[np.ndarray] = np.asarray(primary_kv_view)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=IO_THREADS_MAX, thread_name_prefix="gpucache-vllm"
        )
        self._lock = threading.Lock()
        self._pending: "set[concurrent.futures.Future]" = set()
        self._done: "collections.deque[JobResult]" = collections.deque()
        # Lookups: scheduler-thread state only (vLLM calls every method below from its
        # scheduler thread), so no lock.
        self._lookups: Dict[Any, _Lookup] = {}
        self._by_request: Dict[str, Set[Any]] = {}
        self._unasked: List[Any] = []
        self._queries: Dict[int, List[Any]] = {}
        # Each load job's chunks until its result is handed to vLLM.
        self._loads: Dict[int, List[Any]] = {}
        # Stored events, and each store job's chunks while they are kept (events on only).
        self._events: "Optional[collections.deque[OffloadingEvent]]" = None
        self._stores: Dict[int, List[Any]] = {}
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = collections.deque(maxlen=EVENTS_MAX)
            else:
                logger.warning("GPUCacheTier: enable_kv_events is set but vLLM's KV cache events "
                               "are off; the tier emits none")

    def _piece_bytes(self) -> int:
        """The most bytes one object may hold: the server's object_bytes_max (the wire's
        payload limit when the server states none)."""
        stated = self.client.offers().get("object_bytes_max")
        limit = int(stated) if stated else gpucache.PAYLOAD_BYTES_MAX
        return max(1, min(limit, gpucache.PAYLOAD_BYTES_MAX, self.chunk_bytes))

    def _keys(self, keys) -> List[gpucache.Key]:
        """Every object's key of each chunk, chunk after chunk (``pieces`` per chunk)."""
        if self.pieces == 1:
            names = [bytes(k) for k in keys]
        else:
            names = [bytes(k) + struct.pack(">I", i) for k in keys for i in range(self.pieces)]
        span = gpucache.BATCH_KEYS_MAX
        return [k for at in range(0, len(names), span)
                for k in self.identity.block_keys(names[at:at + span])]

    def _views(self, chunk_ids) -> List[memoryview]:
        """Each chunk's row cut into its pieces, in the order of ``_keys``."""
        assert self._rows is not None, "the tier is shut down"
        out = []
        for c in chunk_ids:
            row = memoryview(self._rows[int(c)])[: self.chunk_bytes]
            out.extend(row[i : i + self.piece_bytes] for i in range(0, self.chunk_bytes, self.piece_bytes))
        return out

    # ---- lookups --------------------------------------------------------------------------

    def _collect(self) -> None:
        """Applies every finished QUERY's answers (never waits)."""
        if not self._queries:
            return
        try:
            polled = self._executor.poll()
        except gpucache.Error as e:
            logger.warning("GPUCache lookup poll failed: %s", e)
            return
        for result in polled["results"]:
            chunks = self._queries.pop(result["operation"], None)
            if chunks is None:
                continue
            answers = result["keys"]
            for i, chunk in enumerate(chunks):
                state = self._lookups.get(chunk)
                if state is None:
                    continue
                mine = answers[i * self.pieces : (i + 1) * self.pieces]
                found = len(mine) == self.pieces and all(a.get("result") == "found" for a in mine)
                if not state.requests:
                    del self._lookups[chunk]
                    continue
                state.found = found
                state.in_flight = False

    def _ask(self) -> None:
        """Sends the chunks asked about since the last call in QUERYs (never waits): a refused
        QUERY (a full queue, or the server down and cooling off) makes its chunks misses."""
        per_query = max(1, QUERY_KEYS_MAX // self.pieces)
        while self._unasked:
            batch, self._unasked = self._unasked[:per_query], self._unasked[per_query:]
            batch = [c for c in batch if c in self._lookups]
            if not batch:
                continue
            try:
                op = self._executor.submit_query(self._keys(batch))
            except gpucache.Error as e:
                logger.debug("GPUCache lookup not sent (%s): %d chunks miss", e, len(batch))
                for chunk in batch:
                    state = self._lookups[chunk]
                    state.found, state.in_flight = False, False
                continue
            for chunk in batch:
                self._lookups[chunk].in_flight = True
            self._queries[op] = batch

    def lookup(self, key, req_context: ReqContext) -> LookupResult:
        self._collect()
        state = self._lookups.get(key)
        if state is None:
            if len(self._lookups) >= LOOKUPS_MAX:
                return LookupResult.MISS
            state = self._lookups[key] = _Lookup()
            self._unasked.append(key)
        state.requests.add(req_context.req_id)
        self._by_request.setdefault(req_context.req_id, set()).add(key)
        if state.found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if state.found else LookupResult.MISS

    def on_schedule_end(self, context: Any) -> None:
        self._collect()
        self._ask()

    def on_request_finished(self, req_context: ReqContext) -> None:
        for chunk in self._by_request.pop(req_context.req_id, ()):
            state = self._lookups.get(chunk)
            if state is None:
                continue
            state.requests.discard(req_context.req_id)
            # An answer still on its way is dropped when it comes (see _collect).
            if not state.requests and not state.in_flight:
                del self._lookups[chunk]

    # ---- stores and loads -----------------------------------------------------------------

    def _submit(self, job: TransferJob, work) -> None:
        with self._lock:
            self._prune()
            if len(self._pending) >= JOBS_IN_FLIGHT_MAX:
                self._done.append(JobResult(job_id=job.job_id, success=False))
                return
            self._pending.add(self._pool.submit(self._run, work, job))

    def _run(self, work, job: TransferJob) -> None:
        """Runs one job on a pool thread and files its result before the job counts as
        done (drain_jobs relies on that order)."""
        try:
            result = work(job)
        except Exception as e:  # a job's failure is its result, never the poller's
            logger.warning("GPUCache job %d failed: %s", job.job_id, e)
            result = JobResult(job_id=job.job_id, success=False)
        with self._lock:
            self._done.append(result)

    def _store(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"{len(keys)} keys but {len(job.chunk_ids)} chunks")
        start = time.perf_counter()
        self.client.batch_put_from(self._keys(keys), self._views(job.chunk_ids))
        return JobResult(
            job_id=job.job_id,
            success=True,
            transfer_time=time.perf_counter() - start,
            transfer_bytes=len(keys) * self.chunk_bytes,
        )

    def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"{len(keys)} keys but {len(job.chunk_ids)} chunks")
        start = time.perf_counter()
        got = self.client.batch_get_into(self._keys(keys), self._views(job.chunk_ids))
        whole = [
            k
            for i, k in enumerate(keys)
            if list(got[i * self.pieces : (i + 1) * self.pieces]) == self.piece_lens
        ]
        return JobResult(
            job_id=job.job_id,
            success=len(whole) == len(keys),
            successful_keys=None if len(whole) == len(keys) else whole,
            transfer_time=time.perf_counter() - start,
            transfer_bytes=len(whole) * self.chunk_bytes,
        )

    def submit_store(self, job_metadata: TransferJob) -> None:
        if self._events is not None:
            self._stores[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loads[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(job_metadata, self._load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            out = list(self._done)
            self._done.clear()
        for r in out:
            stored = self._stores.pop(r.job_id, None)
            if stored and r.success and self._events is not None:
                self._events.append(OffloadingEvent(
                    keys=stored, medium=self.medium, removed=False, locality=self.locality))
            asked = self._loads.pop(r.job_id, None)
            if asked is None or r.success:
                continue
            # The chunks that did not load are misses from now on for the requests that asked,
            # so the scheduler does not ask to load them again and again.
            kept = set(r.successful_keys or ())
            for chunk in asked:
                state = self._lookups.get(chunk)
                if chunk not in kept and state is not None:
                    state.found = False
        return out

    def take_events(self) -> Iterable[OffloadingEvent]:
        while self._events:
            yield self._events.popleft()

    def _prune(self) -> None:
        self._pending = {f for f in self._pending if not f.done()}

    def has_pending_work(self) -> bool:
        with self._lock:
            self._prune()
            busy = bool(self._pending) or bool(self._done)
        return busy or bool(self._queries) or bool(self._unasked)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Waits for every submitted job (each server call is bounded by the address's
        timeout_s, so this returns); their results are then in get_finished_jobs."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        with self._lock:
            self._prune()

    def shutdown(self) -> None:
        """Finishes every job, stops the lookups and the client, and lets go of the primary
        tier's memory (vLLM releases that view next)."""
        self._pool.shutdown(wait=True)
        try:
            self._executor.close()
        except gpucache.Error as e:
            logger.warning("GPUCache lookup executor did not close cleanly: %s", e)
        self.client.close()
        self._rows = None
