"""Type stubs of gpucache's native module (the Rust client through PyO3)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

__version__: str
PAYLOAD_BYTES_MAX: int
BATCH_ITEMS_MAX: int
# Most keys one batch call takes (split into frames of BATCH_ITEMS_MAX keys).
BATCH_KEYS_MAX: int
REGISTERED_BUFFERS_MAX: int

class Error(Exception):
    """Every error of gpucache. A miss is never an error."""

class RefusedError(Error):
    """The store refused the call."""

    reason: str
    """A stable snake_case word: too_large, budget, inflight, busy, wrong_tenant, forbidden,
    quarantined, conflict, empty, unknown_tenant, auth, key_file, no_local_socket, not_local,
    registrations, bad_request, ..."""
    detail: str
    index: int
    """In a batch call: the first item that failed (set only by batch calls)."""
    results: List[Any]
    """In a batch call: every item's answer in order, as the call would have returned it, with
    each failed item's exception in its place (the other items still ran)."""
    retired: bool
    """Set on store failures: False when the server may still be writing the call's
    destination (same-host path, a range in the shared segment); do not trust it then."""

class BufferTooSmallError(RefusedError):
    """The destination is smaller than the block."""

    needed: int

class UnavailableError(Error):
    """Unreachable, no answer within the deadline, server gone, or not a GPCW listener."""

    reason: str
    detail: str
    retired: bool
    """Set on failed store calls (see RefusedError.retired)."""

class Key:
    """A physical key: what one block is stored under. Hashable; ``bytes(key)`` is its
    canonical encoding."""

    @staticmethod
    def from_bytes(data: bytes) -> "Key": ...
    def __bytes__(self) -> bytes: ...
    def hex(self) -> str:
        """The first 16 bytes of the key's BLAKE3 digest, as 32 hex digits."""
    @property
    def tenant(self) -> str: ...
    @property
    def blocks(self) -> int:
        """How many blocks of the prefix the key names."""
    def __hash__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...

BlockHash = Union[bytes, str, int]

class Identity:
    """What a model's cached KV depends on, short of the prefix. Two identities that differ in
    any argument never share a key."""

    def __init__(
        self,
        tenant: str,
        model: str,
        model_revision: str = "main",
        model_config: Optional[Union[bytes, str]] = None,
        tokenizer_revision: str = "main",
        adapter: Optional[str] = None,
        adapter_revision: Optional[str] = None,
        kv_dtype: str = "f16",
        layout: str = "gpucache-raw",
        layout_version: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        block_tokens: int = 16,
        rope: Optional[Dict[str, Any]] = None,
        multimodal: Optional[Dict[str, Union[bytes, str]]] = None,
        position: Optional[str] = None,
        quant: Optional[str] = None,
        quant_group: Optional[int] = None,
        trust_domain: str = "default",
    ) -> None: ...
    @property
    def tenant(self) -> str: ...
    @property
    def block_tokens(self) -> int: ...
    def chain_keys(self, block_hashes: Sequence[BlockHash]) -> List[Key]:
        """Key i names the prefix block_hashes[0..=i]."""
    def block_keys(self, block_hashes: Sequence[BlockHash]) -> List[Key]:
        """One key per hash, each naming that block alone (an engine hash that already covers
        its prefix); key i equals chain_keys([block_hashes[i]])[0]. At most BATCH_KEYS_MAX."""
    def token_keys(self, token_ids: Sequence[int]) -> List[Key]:
        """One key per full block of token ids."""

def plain_key(tenant: str, name: Union[str, bytes]) -> Key:
    """The key the RESP front and `gpucache get` use for a plain name of a tenant."""

KeyLike = Union[Key, str, bytes]
# An int address (with size=), a buffer-protocol object, a CPU torch tensor or a SharedBuffer.
Buffer = Any

class SharedBuffer:
    """A range of the segment shared with the server (same-host path)."""

    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    def __len__(self) -> int: ...

class Client:
    @staticmethod
    def cluster(
        etcd: Sequence[str], name: str = "gpucache", tenant: str = "default",
        key_file: Optional[str] = None, key_id: Optional[str] = None,
        timeout_s: float = 30.0, poll_ms: int = 200, client_name: str = "gpucache-python",
        hot_reads: Optional[int] = None, hot_window_ms: int = 1000,
    ) -> "Client":
        """A client of a cluster whose view is in etcd: each key goes to the member that owns
        it, each batch is split per member. A read from a member that is down or behind is a
        miss; a write there raises."""
    def __init__(
        self,
        address: str = "127.0.0.1:7470",
        tenant: str = "default",
        key_file: Optional[str] = None,
        key_id: Optional[str] = None,
        local: Union[str, bool, None] = "auto",
        timeout_s: float = 30.0,
        segment_bytes: int = 268435456,
        client_name: str = "gpucache-python",
    ) -> None: ...
    @property
    def tenant(self) -> str: ...
    @property
    def transport(self) -> str:
        """"local" or "tcp"."""
    def offers(self) -> Dict[str, Any]: ...
    def key(self, name: Union[str, bytes]) -> Key: ...
    def exists(self, key: KeyLike) -> bool: ...
    def batch_exists(self, keys: Sequence[KeyLike]) -> List[bool]: ...
    def batch_tier(self, keys: Sequence[KeyLike]) -> List[Optional[str]]:
        """Per key: "memory" or "file" (a tiered store), "single" (one tier), None (absent)."""
    def prefix_len(self, keys: Sequence[KeyLike]) -> int: ...
    def get(self, key: KeyLike) -> Optional[bytes]: ...
    def put(self, key: KeyLike, data: Buffer) -> bool: ...
    def get_into(self, key: KeyLike, dst: Buffer, size: Optional[int] = None) -> Optional[int]: ...
    def batch_get_into(
        self, keys: Sequence[KeyLike], dsts: Sequence[Buffer],
        sizes: Optional[Sequence[Optional[int]]] = None,
    ) -> List[Optional[int]]: ...
    def put_from(self, key: KeyLike, src: Buffer, size: Optional[int] = None) -> bool: ...
    def batch_put_from(
        self, keys: Sequence[KeyLike], srcs: Sequence[Buffer],
        sizes: Optional[Sequence[Optional[int]]] = None,
    ) -> List[bool]: ...
    def remove(self, key: KeyLike) -> bool: ...
    def purge(self, key: KeyLike, layout_prefix: str = "") -> Tuple[int, int, bool]:
        """Removes every block of key's namespace on the server (same tenant and model fields,
        layout name starting with layout_prefix, any shard, dtype or chain): (removed, busy,
        more). Needs the write right; refused on a client of a cluster."""
    def register_buffer(self, dst_or_ptr: Buffer, size: Optional[int] = None) -> bool:
        """True when the range lies in the shared segment (no copy in this process)."""
    def unregister_buffer(self, ptr: Buffer) -> None: ...
    def registered_buffers(self) -> List[Tuple[int, int, bool]]: ...
    def shared_buffer(self, size: int) -> Optional[SharedBuffer]: ...
    def executor(self, allocation_bytes: int, **kwargs: Any) -> "Executor": ...
    def close(self) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, *exc: object) -> bool: ...

Range = Tuple[int, int]
"""(offset, len) inside the executor's allocation, within one slot."""

class Executor:
    """The data plane's asynchronous executor over a Client's store. Refusals raise
    RefusedError with reason queue_full, outstanding_full, unhealthy, quarantined, closed,
    no_keys, too_many_keys or bad_range (with .index)."""

    def __init__(
        self,
        client: Client,
        allocation_bytes: int,
        slot_bytes: Optional[int] = None,
        queue_depth: int = 256,
        workers_query: int = 1,
        workers_get: int = 2,
        workers_put: int = 2,
        operations_outstanding_max: int = 1024,
        keys_per_job_max: int = 4096,
        cooldown_ms: int = 5000,
    ) -> None: ...
    @property
    def allocation_bytes(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    def submit_query(self, keys: Sequence[KeyLike]) -> int: ...
    def submit_get(self, keys: Sequence[KeyLike], ranges: Sequence[Range]) -> int: ...
    def submit_put(self, keys: Sequence[KeyLike], ranges: Sequence[Range]) -> int: ...
    def cancel(self, operation: int) -> str:
        """"cancelled", "detached" or "not_outstanding"."""
    def poll(self, timeout_s: float = 0.0) -> Dict[str, Any]:
        """{"results": [{"operation", "kind", "ending", "retired", "detached", "keys": [{"ok",
        "result", "bytes" | "reason", "detail"}]}], "pressure": {...}, "health": {"state",
        "epoch", "text"}, "quarantined": [{"operation", "kind", "ranges"}]}"""
    def write(self, offset: int, len: int, data: Buffer) -> None: ...
    def read(self, offset: int, len: int) -> bytes: ...
    def read_into(self, offset: int, len: int, dst: Buffer) -> None:
        """Copies the range's bytes into the front of a writable buffer (no bytes object)."""
    def close(self, join_deadline_s: float = 5.0) -> Dict[str, Any]:
        """{"restart_required", "workers_joined", "workers_stuck", "results", "quarantined",
        "text"}"""
