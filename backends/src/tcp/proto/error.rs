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
    /// Flag bits version 1 does not accept (bit 0, sealed, is reserved for the HMAC seal).
    #[error("frame flags {flags:#04x} are not supported (sealing is reserved)")]
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
    /// A shared-memory request the connection cannot serve: no segment attached, a segment
    /// that cannot be mapped (unsealed, too large, no descriptor), or a range outside it.
    #[error("shared memory: {detail}")]
    SharedMemory { detail: String },
}

impl WireError {
    /// Whether the connection closes after this error: the stream cannot be resynchronised
    /// (unknown version, bad magic, bad header checksum, oversize body), or the server is
    /// turning the connection away. Every other error concerns one frame, whose boundary is
    /// known; it is answered and the connection continues.
    pub fn closes_connection(&self) -> bool {
        matches!(
            self,
            Self::UnsupportedVersion { .. }
                | Self::BadMagic { .. }
                | Self::HeaderChecksum { .. }
                | Self::TooLarge { .. }
                | Self::Busy { .. }
                | Self::ShuttingDown
        )
    }
}
