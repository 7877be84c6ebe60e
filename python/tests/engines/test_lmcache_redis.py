"""LMCache's own redis:// connector, unchanged, against GPUCache's RESP front: LMCache's
RemoteBackend with its built-in "redis" plugin (redis-py's asyncio client, HELLO 3) stores
and reads chunks, and the native client reads the same bytes under the same plain names."""

from __future__ import annotations

import pytest
from engine_require import require

torch = require("torch")
lm_config = require("lmcache.v1.config")
lm_metadata = require("lmcache.v1.metadata")
lm_utils = require("lmcache.utils")
local_cpu = require("lmcache.v1.storage_backend.local_cpu_backend")
remote_backend = require("lmcache.v1.storage_backend.remote_backend")
import gpucache  # noqa: E402

LAYERS, CHUNK, HEADS, HEAD_DIM = 2, 16, 2, 8
MODEL = "org/lmcache-redis-model"
WAIT_S = 30.0
# The configuration lines the README gives for this setup, with the test server's port.
CONFIG = """\
chunk_size: 16
local_cpu: true
max_local_cpu_size: 0.032
remote_serde: naive
remote_storage_plugins: ["redis"]
extra_config:
  remote_storage_plugin.redis.redis_url: "redis://{resp}"
"""


def test_lmcache_redis_connector_against_the_resp_front(tmp_path, server, loop, unique):
    path = tmp_path / "lmcache-redis.yaml"
    path.write_text(CONFIG.format(resp=server.resp))
    config = lm_config.LMCacheEngineConfig.from_file(str(path))
    md = lm_metadata.LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK,
    )
    local = local_cpu.LocalCPUBackend(config, md, dst_device="cpu")
    backend = remote_backend.RemoteBackend(
        config, md, loop, local, dst_device="cpu", plugin_name="redis")
    assert backend.connection is not None, "LMCache made no redis connector"
    assert "RedisConnector" in repr(backend.connection._connector)

    h = abs(hash(unique)) % (1 << 40)
    keys = [lm_utils.CacheEngineKey(MODEL, 1, 0, h + i, torch.float16) for i in range(2)]
    obj = local.allocate(md.get_shapes(), md.get_dtypes(), None)
    g = torch.Generator().manual_seed(h % 1000)
    obj.tensor.copy_(torch.randn(obj.tensor.numel(), generator=g).reshape(obj.tensor.shape))
    assert not backend.contains(keys[0])
    backend.submit_put_task(keys[0], obj).result(WAIT_S)
    assert backend.contains(keys[0]) and not backend.contains(keys[1])
    got = backend.get_blocking(keys[0])
    assert got is not None and torch.equal(got.tensor, obj.tensor)

    # The same plain names through the native protocol: LMCache's chunk bytes, unchanged.
    c = gpucache.Client(server.native, tenant="default", local=False)
    raw = c.get(keys[0].to_string() + "kv_bytes")
    assert raw is not None
    assert raw == bytes(obj.byte_array)
    assert c.exists(keys[0].to_string() + "metadata")
    got.ref_count_down()
    obj.ref_count_down()
