//! GPUCache's wire formats, with no I/O: the GPCW protocol, version 2 (frames, typed messages and
//! the incremental decoder), the block-staging contract its stage ops speak of ([`staging`]),
//! the tenant key-file lines ([`keys`]) and the RESP codec of the Redis-protocol front
//! ([`resp`]: RESP2 requests, RESP2 and RESP3 replies). The client, the service and the fuzz targets build on this crate.
//!
//! `docs/PROTOCOL.md` is the specification; this module is its implementation and must agree
//! with it byte for byte. In short:
//!
//! - A frame is a fixed [`HEADER_BYTES`]-byte little-endian header (magic `GPCW`, version, kind,
//!   op, flags, request id, body length, XXH3-64 of the body, a seal slot and a 32-bit
//!   header checksum) followed by the body. A sealed frame carries a MAC in the seal slot
//!   ([`seal`]).
//! - [`FrameDecoder`] takes bytes as they arrive and yields whole, checksum-verified [`Frame`]s.
//!   It refuses an oversize body before allocating for it, never holds more than one frame, and
//!   says whether an error leaves the stream in sync ([`FrameError::resync_impossible`]).
//! - [`Request`] and [`Response`] cover every [`Store`] operation, batched for the hot ones
//!   (lookup, get, put, invalidate). Every store value and error crosses the wire exactly,
//!   including [`StoreError::Backend`]'s retirement.
//! - Every decoder is strict: truncation, trailing bytes, unknown tags, counts over the limits
//!   and invalid keys or names are typed [`WireError`]s. Nothing here panics on input.
//!
//! [`Store`]: gpucache_dataplane::store::Store
//! [`StoreError::Backend`]: gpucache_dataplane::store::StoreError::Backend

mod codec;
mod error;
mod frame;
pub mod keys;
mod message;
pub mod namespace;
pub mod resp;
pub mod seal;
pub mod staging;
mod text;
mod values;

use std::fmt;

pub use error::{AuthFailure, InflightScope, WireError};
pub use frame::{
    Frame, FrameDecoder, FrameError, FrameHeader, RECYCLE_BYTES_MAX, SEALED_HEADER_BYTES,
    header_checksum, sole_hit, write_all_vectored,
};
pub use message::{
    Fetched, FetchedRef, FillRefused, GetItem, HelloAuth, HelloSession, NodeStatus, PutItem,
    PutRef, RemoteInfo, Request, Response, ServerLimits, SharedGetItem, SharedPutItem,
    begin_get_response, decode_get_response, decode_put_request, decode_write_request,
    encode_put_request, finish_get_response, get_hit_frame_parts, put_request_parts,
    write_request_parts,
};
pub use seal::{SealAlgorithm, SealKey};
pub use text::{DATAPLANE_TEXT, REMOTE_DETAIL, REMOTE_TEXT, WHAT_TEXT, intern};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"GPCW";
/// The protocol version this build speaks (and the only one it accepts). Version 2 added
/// authenticated sessions and the seal (ADR 0012).
pub const VERSION: u8 = 2;
/// Size of the fixed frame header.
pub const HEADER_BYTES: usize = 64;
/// Size of the seal slot in the header: the MAC of a sealed frame, zero otherwise.
pub const SEAL_BYTES: usize = 32;
/// Largest payload a batch may carry: one block at the default `object_bytes_max`.
pub const PAYLOAD_BYTES_MAX: u64 = 64 << 20;
/// Largest frame body: [`PAYLOAD_BYTES_MAX`] plus 1 MiB for keys and other metadata.
pub const BODY_BYTES_MAX: usize = (64 << 20) + (1 << 20);
/// Most items in one batch (lookup, get, put, invalidate), in a request or in its response.
pub const BATCH_ITEMS_MAX: usize = 1024;
/// Longest text field (names, diagnostic details). Encoders clip longer text at a character
/// boundary; decoders refuse it.
pub const TEXT_BYTES_MAX: usize = 4096;

/// Header flag bit 0: the frame is sealed; its seal slot holds the MAC (`docs/PROTOCOL.md`
/// section 8).
pub const FLAG_SEALED: u8 = 0x01;
/// Header flag bit 1: the body ends with a trailer, and the body checksum covers only the
/// trailer. The body's last 4 bytes are the trailer's length `t` (little-endian `u32`); the
/// checksum is XXH3-64 of the last `t + 4` bytes. The bytes before the trailer are payloads,
/// each covered by its own checksum carried in the trailer, which the receiver checks; so
/// they are not hashed twice. GET answers and PUT requests use it.
pub const FLAG_TRAILER: u8 = 0x02;
/// Header flag bit 2, with [`FLAG_TRAILER`] on a GET answer only: the body is one hit, its
/// payload then a trailer of [`SOLE_HIT_TAIL_BYTES`] (so the payload is the first
/// `body_len - SOLE_HIT_TAIL_BYTES` bytes). A receiver may read that payload straight into
/// its destination before the trailer arrives; the decoder refuses a frame whose body does
/// not match the flag.
pub const FLAG_SOLE_HIT: u8 = 0x04;
/// The flag bits this version accepts.
pub const FLAGS_ACCEPTED: u8 = FLAG_SEALED | FLAG_TRAILER | FLAG_SOLE_HIT;
/// The end of a [`FLAG_SOLE_HIT`] body after its payload: the trailer (`count` 1, the result
/// and hit tags, `checksum: u64`, `len: u32`) and the trailer's length.
pub const SOLE_HIT_TAIL_BYTES: usize = 4 + 1 + 1 + 8 + 4 + 4;

/// Byte offsets of the header fields (see the table in `docs/PROTOCOL.md`).
pub mod offset {
    /// `magic [4]`.
    pub const MAGIC: usize = 0;
    /// `version u8`.
    pub const VERSION: usize = 4;
    /// `kind u8`.
    pub const KIND: usize = 5;
    /// `op u8`.
    pub const OP: usize = 6;
    /// `flags u8`.
    pub const FLAGS: usize = 7;
    /// `request_id u64`.
    pub const REQUEST_ID: usize = 8;
    /// `body_len u32`.
    pub const BODY_LEN: usize = 16;
    /// `body_checksum u64`.
    pub const BODY_CHECKSUM: usize = 20;
    /// `seal [32]`: the MAC of a sealed frame.
    pub const SEAL: usize = 28;
    /// `header_checksum u32`: the low 32 bits of XXH3-64 of bytes `0..HEADER_CHECKSUM`.
    pub const HEADER_CHECKSUM: usize = 60;
}

/// Whether a frame asks or answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Request,
    Response,
}

impl Kind {
    pub fn code(self) -> u8 {
        match self {
            Self::Request => 1,
            Self::Response => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::Request),
            2 => Some(Self::Response),
            _ => None,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Request => "request",
            Self::Response => "response",
        })
    }
}

/// The operation a frame carries. A response uses the op of the request it answers, or
/// [`Op::Error`] when the request could not be served at the protocol level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Hello,
    Info,
    Epoch,
    Stats,
    Lookup,
    Get,
    Put,
    Invalidate,
    Reserve,
    Write,
    Commit,
    Abort,
    ExpireLeases,
    Attest,
    BumpEpoch,
    ReclaimFenced,
    /// Hands the server a shared-memory segment (the descriptor rides with the frame).
    ShmAttach,
    /// Batch GET into the connection's shared segment.
    GetShared,
    /// Batch PUT from the connection's shared segment.
    PutShared,
    /// Exchanges NIXL agent metadata (block staging, ADR 0018).
    NixlAttach,
    /// Batch GET into leased staging slots the client then reads itself.
    StageGet,
    /// Leases an empty staging slot the client then writes itself.
    ReservePut,
    /// Stores a written staging slot.
    CommitPut,
    /// Returns staging slots.
    Release,
    /// The staging counters.
    StageStats,
    /// The server's limits a client can check before it sends (the largest value).
    Limits,
    /// Batch lookup with the tier that holds each block found.
    Locate,
    /// Says the cluster epoch the connection routes by; answers the node's own view.
    Cluster,
    /// Leads or joins the single-flight fill of a key.
    FillBegin,
    /// The leader's outcome of its fill.
    FillFinish,
    /// Waits (bounded) for the outcome of a fill.
    FillWait,
    /// Removes the committed blocks of one namespace (a model's keys over every shard),
    /// at most `PURGE_BLOCKS_MAX` per request.
    Purge,
    /// The store's own view of whether it can serve: its last I/O failure and free space.
    Condition,
    /// Response only: a [`WireError`].
    Error,
}

impl Op {
    /// Every op, in code order.
    pub const ALL: [Op; 34] = [
        Self::Hello,
        Self::Info,
        Self::Epoch,
        Self::Stats,
        Self::Lookup,
        Self::Get,
        Self::Put,
        Self::Invalidate,
        Self::Reserve,
        Self::Write,
        Self::Commit,
        Self::Abort,
        Self::ExpireLeases,
        Self::Attest,
        Self::BumpEpoch,
        Self::ReclaimFenced,
        Self::ShmAttach,
        Self::GetShared,
        Self::PutShared,
        Self::NixlAttach,
        Self::StageGet,
        Self::ReservePut,
        Self::CommitPut,
        Self::Release,
        Self::StageStats,
        Self::Limits,
        Self::Locate,
        Self::Cluster,
        Self::FillBegin,
        Self::FillFinish,
        Self::FillWait,
        Self::Purge,
        Self::Condition,
        Self::Error,
    ];

    pub fn code(self) -> u8 {
        match self {
            Self::Hello => 1,
            Self::Info => 2,
            Self::Epoch => 3,
            Self::Stats => 4,
            Self::Lookup => 5,
            Self::Get => 6,
            Self::Put => 7,
            Self::Invalidate => 8,
            Self::Reserve => 9,
            Self::Write => 10,
            Self::Commit => 11,
            Self::Abort => 12,
            Self::ExpireLeases => 13,
            Self::Attest => 14,
            Self::BumpEpoch => 15,
            Self::ReclaimFenced => 16,
            Self::ShmAttach => 17,
            Self::GetShared => 18,
            Self::PutShared => 19,
            Self::NixlAttach => 20,
            Self::StageGet => 21,
            Self::ReservePut => 22,
            Self::CommitPut => 23,
            Self::Release => 24,
            Self::StageStats => 25,
            Self::Limits => 26,
            Self::Locate => 27,
            Self::Cluster => 28,
            Self::FillBegin => 29,
            Self::FillFinish => 30,
            Self::FillWait => 31,
            Self::Purge => 32,
            Self::Condition => 33,
            Self::Error => 255,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.code() == code)
    }

    /// Whether a frame of `kind` may carry this op.
    pub fn valid_for(self, kind: Kind) -> bool {
        kind == Kind::Response || self != Self::Error
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Hello => "HELLO",
            Self::Info => "INFO",
            Self::Epoch => "EPOCH",
            Self::Stats => "STATS",
            Self::Lookup => "LOOKUP",
            Self::Get => "GET",
            Self::Put => "PUT",
            Self::Invalidate => "INVALIDATE",
            Self::Reserve => "RESERVE",
            Self::Write => "WRITE",
            Self::Commit => "COMMIT",
            Self::Abort => "ABORT",
            Self::ExpireLeases => "EXPIRE_LEASES",
            Self::Attest => "ATTEST",
            Self::BumpEpoch => "BUMP_EPOCH",
            Self::ReclaimFenced => "RECLAIM_FENCED",
            Self::ShmAttach => "SHM_ATTACH",
            Self::GetShared => "GET_SHARED",
            Self::PutShared => "PUT_SHARED",
            Self::NixlAttach => "NIXL_ATTACH",
            Self::StageGet => "STAGE_GET",
            Self::ReservePut => "RESERVE_PUT",
            Self::CommitPut => "COMMIT_PUT",
            Self::Release => "RELEASE",
            Self::StageStats => "STAGE_STATS",
            Self::Limits => "LIMITS",
            Self::Locate => "LOCATE",
            Self::Cluster => "CLUSTER",
            Self::FillBegin => "FILL_BEGIN",
            Self::FillFinish => "FILL_FINISH",
            Self::FillWait => "FILL_WAIT",
            Self::Purge => "PURGE",
            Self::Condition => "CONDITION",
            Self::Error => "ERROR",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
