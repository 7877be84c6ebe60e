"""GPUCache for Python: KV-cache blocks stored under keys that name the model, its exact
configuration, the layout, the shard and the token prefix, in a running ``gpucache serve``.

>>> import gpucache
>>> c = gpucache.Client("127.0.0.1:7470", tenant="default")
>>> c.put("greeting", b"hello")      # a plain name: redis-cli GET greeting reads it
True
>>> c.get("greeting")
b'hello'

Keys are ``gpucache.Key`` objects built by an ``Identity`` (``chain_keys``, ``token_keys``) or
plain names (``str``/``bytes``), mapped into the tenant's namespace exactly as the RESP front
and ``gpucache put/get`` map them. A miss is a value (``None``, ``False``); a refusal raises
``RefusedError`` (with ``.reason``); a transport failure raises ``UnavailableError``.

Buffers are int addresses (with ``size=``), objects with the buffer protocol (bytearray,
memoryview, numpy arrays) or CPU torch tensors (duck-typed, no torch dependency). Every call
that waits on the server releases the GIL.

``Executor`` (or ``Client.executor``) runs the data plane's asynchronous executor: submit
QUERY/GET/PUT jobs with ranges of its own host allocation, ``poll()`` their per-key results,
retirement facts, pressure and health, and ``close()`` for the restart report.
"""

from __future__ import annotations

import ctypes

from gpucache._native import (
    BATCH_ITEMS_MAX,
    BATCH_KEYS_MAX,
    PAYLOAD_BYTES_MAX,
    REGISTERED_BUFFERS_MAX,
    BufferTooSmallError,
    Client,
    Error,
    Executor,
    Identity,
    Key,
    RefusedError,
    SharedBuffer,
    UnavailableError,
    __version__,
    plain_key,
)

__all__ = [
    "BATCH_ITEMS_MAX",
    "BATCH_KEYS_MAX",
    "PAYLOAD_BYTES_MAX",
    "REGISTERED_BUFFERS_MAX",
    "BufferTooSmallError",
    "Client",
    "Error",
    "Executor",
    "Identity",
    "Key",
    "RefusedError",
    "SharedBuffer",
    "UnavailableError",
    "__version__",
    "plain_key",
    "shared_view",
]


def shared_view(buf: SharedBuffer) -> memoryview:
    """A writable memoryview of a ``SharedBuffer`` (e.g. for ``numpy.frombuffer`` or
    ``torch.frombuffer``). The view keeps the buffer alive."""
    array = (ctypes.c_char * buf.size).from_address(buf.ptr)
    # The ctypes array does not own the memory: tie the buffer's lifetime to it.
    array._gpucache_owner = buf  # type: ignore[attr-defined]
    return memoryview(array).cast("B")
