"""Type stubs of the gpucache package (see _native.pyi for the classes)."""

from gpucache._native import (
    BATCH_ITEMS_MAX as BATCH_ITEMS_MAX,
    BATCH_KEYS_MAX as BATCH_KEYS_MAX,
    PAYLOAD_BYTES_MAX as PAYLOAD_BYTES_MAX,
    REGISTERED_BUFFERS_MAX as REGISTERED_BUFFERS_MAX,
    BufferTooSmallError as BufferTooSmallError,
    Client as Client,
    Error as Error,
    Executor as Executor,
    Identity as Identity,
    Key as Key,
    RefusedError as RefusedError,
    SharedBuffer as SharedBuffer,
    UnavailableError as UnavailableError,
    __version__ as __version__,
    plain_key as plain_key,
)

def shared_view(buf: SharedBuffer) -> memoryview: ...
