//! Protocol-level failures: what a peer did wrong at the frame or message level, or why a
//! server could not serve a request at all. Store failures are `StoreError`s, carried inside
//! the answers, never here.

use super::Kind;

/// A frame- or protocol-level failure. It is both a local decoding error and the body of an
/// [`super::Response::Error`] frame, so every variant crosses the wire exactly (a `what` that is
/// not in [`super::WHAT_TEXT`] decodes to [`super::REMOTE_TEXT`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The header names a version this peer does not speak. The connection closes after the
    /// error is answered, because a frame of another version cannot be measured.
    #[error("protocol version {found} is not supported (this peer speaks version {supported})")]
    UnsupportedVersion { found: u8, supported: u8 },
    /// The stream does not start a frame where one must start.
    #[error("frame magic is {found:02x?}, expected \"GPCW\"")]
    BadMagic { found: [u8; 4] },
    /// The header does not hash to its checksum: its length field cannot be trusted.
    #[error("header checksum field is {found:08x}, the header hashes to {computed:08x}")]
    HeaderChecksum { found: u32, computed: u32 },
    /// The header announces a body over [`super::BODY_BYTES_MAX`], or an encoder was asked to
    /// build one.
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: u64, max: u64 },
    #[error("frame kind {kind} is unknown")]
    UnknownKind { kind: u8 },
    #[error("op code {op} is unknown for this frame kind")]
    UnknownOp { op: u8 },
    /// Flag bits this version does not define (only bit 0, sealed, is defined).
    #[error("frame flags {flags:#04x} are not supported")]
    UnsupportedFlags { flags: u8 },
    #[error("body checksum field is {found:016x}, the body hashes to {computed:016x}")]
    BodyChecksum { found: u64, computed: u64 },
    #[error("the body ends inside a {what}")]
    Truncated { what: &'static str },
    #[error("{count} bytes follow the end of the message")]
    TrailingBytes { count: u64 },
    #[error("{what} has unknown tag {tag}")]
    UnknownTag { what: &'static str, tag: u8 },
    #[error("{what}: {count} exceeds the limit of {max}")]
    TooMany { what: &'static str, count: u64, max: u64 },
    /// A key inside a body is not a valid GPCK key; `index` is its position in the batch (0 for
    /// single-key messages).
    #[error("key {index} of the message does not decode: {detail}")]
    BadKey { index: u32, detail: String },
    #[error("{what} is malformed")]
    Malformed { what: &'static str },
    /// A request where a response was expected, or the other way round.
    #[error("expected a {expected} frame, got a {found} frame")]
    WrongKind { expected: Kind, found: Kind },
    /// The server's answer would not fit a frame; the request was served but cannot be answered
    /// (split the batch).
    #[error("the response of {len} bytes exceeds the frame limit of {max}")]
    ResponseTooLarge { len: u64, max: u64 },
    /// A request other than HELLO before HELLO.
    #[error("the connection has not said hello")]
    NotAuthenticated,
    /// A HELLO naming a tenant the server has no configuration for. Per frame: the client
    /// may say HELLO again as another tenant.
    #[error("tenant {tenant:?} is not configured on this server")]
    UnknownTenant { tenant: gpucache_dataplane::identity::TenantId },
    /// A second HELLO on one connection: the tenant of a connection never changes.
    #[error("the connection already said hello")]
    AlreadyAuthenticated,
    /// The server is at `connections_max`; the connection closes.
    #[error("the server holds {connections} connections, its limit is {max}")]
    Busy { connections: u32, max: u32 },
    /// The server is stopping; the connection closes.
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("internal server error: {detail}")]
    Internal { detail: String },
    /// HELLO did not prove the tenant: the connection closes. The reason says which check
    /// failed, never which bytes of a secret were wrong.
    #[error("authentication failed: {reason}")]
    AuthFailed { reason: AuthFailure },
    /// An unsealed frame on a session that seals: the connection closes.
    #[error("the frame is not sealed, and this session requires sealed frames")]
    Unsealed,
    /// The frame's seal does not verify under the session key: the connection closes.
    #[error("the frame's seal does not verify")]
    SealMismatch,
    /// A sealed frame whose request id was already used on this connection, or is older than
    /// the replay window (request id 0 is never accepted). The frame is not served; the
    /// connection continues.
    #[error("request id {request_id} was already used or is older than the replay window")]
    Replayed { request_id: u64 },
    /// A shared-memory request the connection cannot serve: no segment attached, a segment
    /// that cannot be mapped (unsealed, too large, no descriptor), or a range outside it.
    #[error("shared memory: {detail}")]
    SharedMemory { detail: String },
    /// A block-staging request refused (NIXL_ATTACH and the stage ops): the typed reason and
    /// the server's account of it. Nothing was staged.
    #[error("staging: {reason}: {detail}")]
    Staging { reason: crate::staging::StagingFailure, detail: String },
    /// A request body of `requested` bytes would take the request bytes in flight past `max`
    /// (`in_flight` were held when it was refused) in `scope`: the server's budget over every
    /// connection, the share of the connection's tenant, or that of its peer address. Nothing of
    /// the body was buffered, and since it cannot be skipped safely the connection closes.
    #[error(
        "a request body of {requested} bytes would exceed the {scope} in-flight request bytes limit of {max} ({in_flight} in flight)"
    )]
    Overloaded { scope: InflightScope, requested: u64, in_flight: u64, max: u64 },
    /// A node of a cluster refused the request under its view (see
    /// [`gpucache_dataplane::shard::NodeFence`]); nothing was served, and the connection
    /// continues.
    #[error("cluster: {0}")]
    Fenced(gpucache_dataplane::shard::FenceRefusal),
}

/// Whose in-flight request bytes an [`WireError::Overloaded`] refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InflightScope {
    /// The server's budget, over every connection.
    Server,
    /// The share of the connection's tenant.
    Tenant,
    /// The share of the connection's peer address.
    Peer,
}

impl InflightScope {
    pub const ALL: [Self; 3] = [Self::Server, Self::Tenant, Self::Peer];

    pub fn code(self) -> u8 {
        match self {
            Self::Server => 0,
            Self::Tenant => 1,
            Self::Peer => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.code() == code)
    }
}

impl std::fmt::Display for InflightScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Server => "server's",
            Self::Tenant => "tenant's",
            Self::Peer => "peer address's",
        })
    }
}

/// Which HELLO check failed ([`WireError::AuthFailed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AuthFailure {
    /// The tenant has a secret and the HELLO offered no proof (or was not sealed).
    SecretRequired,
    /// The key id is not one of the tenant's keys.
    UnknownKey,
    /// The key's `not-after` time has passed.
    KeyExpired,
    /// The HELLO timestamp is further from the server's clock than it allows.
    ClockSkew,
    /// The fingerprint does not match the key.
    BadFingerprint,
    /// The HELLO seal does not verify under the key.
    BadSeal,
    /// The tenant does not accept the proposed seal algorithm.
    SealAlgorithm,
    /// The HELLO offered a key to a tenant that has none (an open tenant).
    TenantOpen,
}

impl AuthFailure {
    /// Every reason, in code order.
    pub const ALL: [Self; 8] = [
        Self::SecretRequired,
        Self::UnknownKey,
        Self::KeyExpired,
        Self::ClockSkew,
        Self::BadFingerprint,
        Self::BadSeal,
        Self::SealAlgorithm,
        Self::TenantOpen,
    ];

    pub fn code(self) -> u8 {
        match self {
            Self::SecretRequired => 0,
            Self::UnknownKey => 1,
            Self::KeyExpired => 2,
            Self::ClockSkew => 3,
            Self::BadFingerprint => 4,
            Self::BadSeal => 5,
            Self::SealAlgorithm => 6,
            Self::TenantOpen => 7,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == code)
    }
}

impl std::fmt::Display for AuthFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::SecretRequired => "the tenant requires a sealed HELLO with a key",
            Self::UnknownKey => "the key id is not one of the tenant's keys",
            Self::KeyExpired => "the key has expired",
            Self::ClockSkew => "the HELLO timestamp is outside the server's clock window",
            Self::BadFingerprint => "the tenant fingerprint does not match the key",
            Self::BadSeal => "the HELLO seal does not verify",
            Self::SealAlgorithm => "the tenant does not accept the proposed seal algorithm",
            Self::TenantOpen => "the tenant has no keys; connect without credentials",
        })
    }
}

impl WireError {
    /// Whether the connection closes after this error: the stream cannot be resynchronised
    /// (unknown version, bad magic, bad header checksum, oversize body), the server is
    /// turning the connection away, or the peer did not prove its tenant (a failed HELLO, an
    /// unsealed frame or a seal that does not verify on a sealed session). Every other error concerns one frame, whose boundary is
    /// known; it is answered and the connection continues.
    pub fn closes_connection(&self) -> bool {
        matches!(
            self,
            Self::UnsupportedVersion { .. }
                | Self::BadMagic { .. }
                | Self::HeaderChecksum { .. }
                | Self::TooLarge { .. }
                | Self::Busy { .. }
                | Self::Overloaded { .. }
                | Self::ShuttingDown
                | Self::AuthFailed { .. }
                | Self::Unsealed
                | Self::SealMismatch
        )
    }
}
