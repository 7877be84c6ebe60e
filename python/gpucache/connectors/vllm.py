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

The tier runs in vLLM's scheduler process and sees whole chunks of the primary tier (every
worker's bytes of a chunk, in rank order, or the one replicated copy). Keys: one
``gpucache.Identity`` from the offloading config (model name and KV dtype, TP and PP sizes,
the worker count, context-parallel sizes, the KV cache layout, whether the copy is
replicated, the chunk's bytes and tokens), and the chunk's ``OffloadKey`` (block hash and
group) as the block name. Stores and loads run on a bounded pool of threads
(``IO_THREADS_MAX``) and are reported by ``get_finished_jobs``; ``lookup`` asks the server
directly. A chunk read back with another length is a failed load, never a partial one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Any, ClassVar, Iterable, List

import numpy as np

import gpucache
from gpucache.connectors import _url

from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

logger = logging.getLogger(__name__)

# Threads that carry stores and loads to the server.
IO_THREADS_MAX = 8
# Most jobs submitted and not yet reported; one more fails at once (vLLM retries later).
JOBS_IN_FLIGHT_MAX = 256
LAYOUT_VERSION = 1


class GPUCacheTier(SecondaryTierManager):
    """A vLLM ``SecondaryTierManager`` over a ``gpucache.Client`` (see the module's doc)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str = "",
        backpressure_detector: Any = None,
    ):
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        if not url:
            raise ValueError('the GPUCacheTier entry of secondary_tiers needs "url": "gpucache://..."')
        self.address = _url.parse(url)
        cfg = offloading_spec.config
        par = cfg.parallel
        replicated = bool(getattr(offloading_spec, "replicated_layout", False))
        tokens = offloading_spec.tokens_per_block[0] * offloading_spec.blocks_per_chunk
        layout = (
            f"vllm-offload-{cfg.kv_cache_layout or 'default'}"
            f"-{'replicated' if replicated else 'ranks'}"
            f"-w{par.world_size}-pcp{par.pcp_size}-dcp{par.dcp_size}-b{self.block_size_bytes}"
        )
        self.identity = gpucache.Identity(
            tenant=self.address.tenant,
            model=cfg.model.name,
            kv_dtype=_url.kv_dtype_name(cfg.model.dtype),
            layout=layout,
            layout_version=LAYOUT_VERSION,
            tp_rank=0,
            tp_size=par.tp_size,
            pp_rank=0,
            pp_size=par.pp_size,
            block_tokens=int(tokens),
        )
        self.client = self.address.connect(client_name="gpucache-vllm")
        self._rows = np.asarray(primary_kv_view)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=IO_THREADS_MAX, thread_name_prefix="gpucache-vllm"
        )
        self._lock = threading.Lock()
        self._pending: "set[concurrent.futures.Future]" = set()
        self._done: "collections.deque[JobResult]" = collections.deque()

    def _keys(self, keys) -> List[gpucache.Key]:
        return [self.identity.chain_keys([bytes(k)])[0] for k in keys]

    def _chunk(self, chunk_id) -> np.ndarray:
        return self._rows[int(chunk_id)]

    # ---- SecondaryTierManager ---------------------------------------------------------------

    def lookup(self, key, req_context: ReqContext) -> LookupResult:
        try:
            found = self.client.exists(self._keys([key])[0])
        except gpucache.Error as e:
            logger.warning("GPUCache lookup failed: %s", e)
            return LookupResult.MISS
        return LookupResult.HIT if found else LookupResult.MISS

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
        self.client.batch_put_from(self._keys(keys), [self._chunk(c) for c in job.chunk_ids])
        return JobResult(
            job_id=job.job_id,
            success=True,
            transfer_time=time.perf_counter() - start,
            transfer_bytes=len(keys) * self.block_size_bytes,
        )

    def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"{len(keys)} keys but {len(job.chunk_ids)} chunks")
        start = time.perf_counter()
        got = self.client.batch_get_into(
            self._keys(keys), [self._chunk(c) for c in job.chunk_ids]
        )
        whole = [k for k, g in zip(keys, got) if g == self.block_size_bytes]
        return JobResult(
            job_id=job.job_id,
            success=len(whole) == len(keys),
            successful_keys=None if len(whole) == len(keys) else whole,
            transfer_time=time.perf_counter() - start,
            transfer_bytes=len(whole) * self.block_size_bytes,
        )

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def _prune(self) -> None:
        self._pending = {f for f in self._pending if not f.done()}

    def has_pending_work(self) -> bool:
        with self._lock:
            self._prune()
            return bool(self._pending) or bool(self._done)

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
        self._pool.shutdown(wait=True)
        self.client.close()
