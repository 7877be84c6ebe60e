"""vLLM's tiered offloading on its CPU platform, so that ``GPUCacheTier`` runs in a CPU engine.

vLLM's ``TieringOffloadingSpec`` keeps a host primary tier that its workers fill from the KV
cache and read back into it; on GPUs those copies are DMA launches on CUDA streams, and the spec
refuses any other platform. On vLLM's CPU platform the KV cache is itself host memory, so the
copy is a plain indexed copy between two host tensors. ``GPUCacheCPUTieringSpec`` is the
tiering spec with only that worker-side copy replaced (the scheduler side, the primary tier, its
shared region and every secondary tier are vLLM's own); on any other platform it is exactly
``TieringOffloadingSpec``. Launch, with ``gpucache serve`` running::

    python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config '{
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "GPUCacheCPUTieringSpec",
            "spec_module_path": "gpucache.connectors.vllm_cpu",
            "cpu_bytes_to_use": 268435456,
            "secondary_tiers": [{"type": "GPUCacheTier",
                "module_path": "gpucache.connectors.vllm",
                "url": "gpucache://127.0.0.1:7470?tenant=default"}]}}'
"""

from __future__ import annotations

import time
from typing import Any, List, Tuple

import numpy as np
import torch

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """Copies KV blocks between the engine's KV cache and this worker's cells of the shared
    offload region, synchronously (on the CPU platform the forward pass has finished writing
    the cache by the time a store is submitted, and nothing writes it while a load runs).

    A primary-tier chunk holds ``blocks_per_chunk`` engine blocks; for each KV cache tensor the
    worker's cell of a chunk row is those blocks' pages back to back. A group of engine blocks
    that starts in the middle of a chunk (its first block's index in the request is not a
    multiple of ``blocks_per_chunk``) starts at that offset in its first chunk.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion):
        self._region = region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        # Per KV cache tensor: (engine pages [blocks, page], host cells [chunks, sub-block, page]).
        self._pages: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            engine = t.tensor.view(torch.int8).view(-1, page)
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._pages.append((engine, host.unflatten(1, (blocks_per_chunk, page))))
        self._finished: List[TransferResult] = []

    def _copy(self, job_id: int, engine_spec: GPULoadStoreSpec, chunk_spec: LoadStoreSpec, store: bool) -> bool:
        start = time.perf_counter()
        blocks = np.asarray(engine_spec.block_ids, dtype=np.int64)
        chunks = np.asarray(chunk_spec.block_ids, dtype=np.int64)
        per = self._blocks_per_chunk
        at_block = at_chunk = moved = 0
        for group, (count, first_index) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices)):
            if count == 0:
                continue
            skip = first_index % per
            slots = skip + np.arange(count, dtype=np.int64)
            group_chunks = -(-(skip + count) // per)
            if at_chunk + group_chunks > len(chunks) or at_block + count > len(blocks):
                raise ValueError(
                    f"job {job_id}: group {group} needs {group_chunks} chunks and {count} blocks "
                    f"past {at_chunk} and {at_block}; the job has {len(chunks)} and {len(blocks)}"
                )
            rows = torch.from_numpy(chunks[at_chunk + slots // per])
            subs = torch.from_numpy(slots % per)
            ids = torch.from_numpy(blocks[at_block : at_block + count])
            for ref in self._refs[group]:
                engine, host = self._pages[ref.tensor_idx]
                size = ref.page_size_bytes
                if store:
                    host[rows, subs, :size] = engine[ids, :size]
                else:
                    engine[ids, :size] = host[rows, subs, :size]
                moved += count * size
            at_block += count
            at_chunk += group_chunks
        if at_block != len(blocks) or at_chunk != len(chunks):
            raise ValueError(
                f"job {job_id}: the groups cover {at_block} blocks and {at_chunk} chunks "
                f"of {len(blocks)} and {len(chunks)}"
            )
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=moved,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> List[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: "set[int]") -> None:
        # Every copy finished before its submit returned.
        return

    def shutdown(self) -> None:
        self._pages.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class GPUCacheCPUTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies on the host on vLLM's CPU platform (see
    the module's doc); unchanged on every other platform."""

    def _host_copies(self) -> bool:
        return current_platform.is_cpu()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        if not self._host_copies():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        if not self._host_copies():
            return super().create_worker(kv_caches)
        if self.config.canonical_layout:
            raise ValueError(
                "canonical_layout is not supported by GPUCacheCPUTieringSpec on the CPU platform; "
                "remove it from kv_connector_extra_config"
            )
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
