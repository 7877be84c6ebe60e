//! The `&'static str` fields that cross the wire.
//!
//! Several error fields are `&'static str` (an operation name, a region state, a lifecycle
//! transition, the field a decoder choked on). The wire carries them as text, and the decoder
//! maps the text back onto the same static string through the tables here. Text that is in no
//! table (a newer peer, a string added without updating this file) decodes to [`REMOTE_TEXT`],
//! or to [`REMOTE_DETAIL`] for `IllegalTransition::detail`, which is a suffix of its message.

/// What an unknown static name decodes to.
pub const REMOTE_TEXT: &str = "remote";
/// What an unknown `IllegalTransition::detail` decodes to (it is appended to the message).
pub const REMOTE_DETAIL: &str = " (remote)";

/// Every static string the dataplane and the stores put into a `StoreError` (found by
/// grepping `operation:`, `state_name`, `Transition::name` and `illegal(` in `dataplane/` and
/// the store crates), plus the names of the store operations and the transport steps the TCP service
/// and client will report failures of. Add to it when a new one appears; a test in
/// `wire/tests/proto.rs` lists the ones in use today.
pub const DATAPLANE_TEXT: &[&str] = &[
    // Store operations (StoreError::Backend.operation).
    "info",
    "epoch",
    "lookup",
    "get",
    "get_into",
    "reserve",
    "write",
    "commit",
    "abort",
    "put",
    "invalidate",
    "expire_leases",
    "attest",
    "attest_drained",
    "bump_epoch",
    "reclaim_fenced",
    "stats",
    "purge",
    // File-system steps (StoreError::Storage.step).
    "unlink",
    "directory sync",
    "group flush",
    "block read",
    "block write",
    // Registry operations (RegistryError::WrongState.operation).
    "settle",
    "complete",
    "release",
    "be attested",
    // Region states (RegistryError::WrongState.state).
    "lent",
    "held",
    "quarantined",
    // Lifecycle transitions (IllegalTransition.transition); "reserve", "commit", "abort" and
    // "release" are listed above.
    "begin_write",
    "quarantine",
    "evict",
    "reclaim",
    // Lifecycle details (IllegalTransition.detail).
    "",
    " (the proof names another region)",
    // Transport steps of the TCP service and client.
    "connect",
    "hello",
    "send",
    "receive",
    "encode",
    "decode",
    "admission",
    REMOTE_TEXT,
    REMOTE_DETAIL,
];

macro_rules! whats {
    ($($name:ident = $text:literal,)*) => {
        $(pub(super) const $name: &str = $text;)*
        /// Every `what` a decoder of this module puts into a [`super::WireError`].
        pub const WHAT_TEXT: &[&str] = &[$($text,)*];
    };
}

whats! {
    SEAL = "seal slot",
    TRAILER = "trailer",
    PAYLOADS = "payload bytes",
    BOOL = "bool",
    OPTION = "option",
    RESULT = "result",
    INTEGER = "integer",
    TEXT = "text",
    BYTES = "byte string",
    KEY = "key",
    KEY_BYTES = "key bytes",
    BATCH = "batch",
    GET_CAPACITY = "get capacity bytes",
    TENANT = "tenant",
    STORE_ERROR = "store error",
    REGISTRY_ERROR = "registry error",
    EPOCH_ERROR = "epoch error",
    REFUSAL = "refusal",
    RIGHT = "right",
    RIGHTS = "rights",
    RETIREMENT = "retirement",
    BLOCK_STATE = "block state",
    MISS_REASON = "miss reason",
    LOOKUP = "lookup answer",
    TIER = "tier",
    FETCHED = "get answer",
    PUT = "put answer",
    RESERVE = "reserve answer",
    INVALIDATE = "invalidate answer",
    ABORT = "abort answer",
    IMPLEMENTATION = "implementation",
    FULL_POLICY = "full policy",
    REGION_COUNT = "region count",
    WIRE_ERROR = "wire error",
    KIND = "frame kind",
    AUTH_FAILURE = "auth failure",
    HELLO_AUTH = "hello credentials",
    SEAL_ALGORITHM = "seal algorithm",
    STAGING_FAILURE = "staging failure",
    STAGED_GET = "staged get answer",
    STAGE_STATS = "stage stats",
    CORRUPT_DROPS = "corrupt drop counts",
    CORRUPT_PHASE = "corrupt phase",
    CORRUPT_REASON = "corrupt reason",
    IO_KIND = "io error kind",
    STORAGE_EFFECT = "storage effect",
    AGENT_METADATA = "agent metadata",
    DESCRIPTOR = "block descriptor",
    INFLIGHT_SCOPE = "in-flight scope",
    FENCE_REFUSAL = "cluster refusal",
    NODE_STATUS = "node status",
    FILL_NOTICE = "fill notice",
    FILL_START = "fill start",
    NOT_ADMITTING = "not-admitting reason",
    PURGE_SCOPE = "purge scope",
}

/// The static string equal to `text`, if it is in [`DATAPLANE_TEXT`] or [`WHAT_TEXT`].
pub fn intern(text: &str) -> Option<&'static str> {
    DATAPLANE_TEXT.iter().chain(WHAT_TEXT).copied().find(|known| *known == text)
}
