"""CPU torch tensors as sources and destinations (duck-typed: the package does not import
torch). Skipped when torch does not import, unless GPUCACHE_REQUIRE_TORCH=1."""

from __future__ import annotations

import os

import pytest

if os.environ.get("GPUCACHE_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")


def test_tensor_round_trip_and_views_of_one_pool(client, unique):
    src = torch.randn(4, 256, dtype=torch.float16)
    assert client.put_from(unique, src) is True
    dst = torch.zeros(4, 256, dtype=torch.float16)
    assert client.get_into(unique, dst) == src.numel() * src.element_size()
    assert torch.equal(src, dst)
    # Pages of one KV pool: contiguous row views at their own offsets.
    pool = torch.zeros(8, 1024, dtype=torch.uint8)
    names = [f"{unique}-{i}" for i in range(3)]
    blocks = [torch.randint(0, 255, (1024,), dtype=torch.uint8) for _ in names]
    assert client.batch_put_from(names, blocks) == [True] * 3
    assert client.batch_get_into(names, [pool[5], pool[1], pool[7]]) == [1024] * 3
    assert torch.equal(pool[5], blocks[0]) and torch.equal(pool[1], blocks[1])
    assert torch.equal(pool[7], blocks[2]) and int(pool[0].sum()) == 0


def test_non_contiguous_and_device_tensors_are_refused(client, unique):
    t = torch.zeros(16, 16, dtype=torch.float32).t()
    with pytest.raises(ValueError, match="contiguous"):
        client.put_from(unique, t)
    meta = torch.empty(16, device="meta")
    with pytest.raises(ValueError, match="not host memory"):
        client.get_into(unique, meta)
