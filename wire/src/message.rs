//! Typed requests and responses, and their bodies.

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::shard::{
    FillLease, FillNotice, FillRefusal, FillStart, FillTicket, NodeId, NotAdmitting,
};
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchPut, Committed, FullPolicy, Get, Implementation, Invalidate, Located,
    Lookup, MissReason, PurgeScope, Purged, Put, Reclaimed, Reservation, Reserve, Retirement,
    StoreCondition, StoreError, StoreInfo, StoreStats,
};

use super::codec::{Reader, Writer, wide};
use super::frame::{Frame, FrameHeader, finish_frame, trailer_start, write_frame};
use super::values::{
    get_abort, get_full_policy, get_implementation, get_invalidate, get_located, get_lookup,
    get_miss, get_put, get_reclaimed, get_request_id, get_reservation, get_reserve, get_result,
    get_retirement, get_stats, get_wire_error, put_abort, put_full_policy, put_implementation,
    put_invalidate, put_located, put_lookup, put_miss, put_put, put_reclaimed, put_request_id,
    put_reservation, put_reserve, put_result, put_retirement, put_stats, put_wire_error,
};
use gpucache_dataplane::caller::Rights;

use crate::staging::{
    AGENT_METADATA_BYTES_MAX, DESCRIPTOR_BYTES_MAX, StageId, StagedGet, StagedSlot, StagingStats,
};

use super::seal::{FINGERPRINT_BYTES, NONCE_BYTES, SealAlgorithm, SealKey};
use super::{
    FLAG_SOLE_HIT, FLAG_TRAILER, HEADER_BYTES, Kind, Op, PAYLOAD_BYTES_MAX, WireError, text,
};

/// The proof a HELLO carries for a tenant with a secret (`docs/PROTOCOL.md` section 6). The
/// HELLO frame itself is sealed with the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloAuth {
    /// Which of the tenant's keys signs (`k2026-11`).
    pub key_id: String,
    /// [`super::seal::fingerprint`] of that key and the tenant.
    pub fingerprint: [u8; FINGERPRINT_BYTES],
    /// Fresh random bytes from the client, mixed into the session key.
    pub client_nonce: [u8; NONCE_BYTES],
    /// The client's clock, in milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// The seal algorithm the client proposes for the session.
    pub seal: SealAlgorithm,
}

/// What HELLO's answer adds for a sealed session: the answer is sealed with the session key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloSession {
    /// Fresh random bytes from the server, mixed into the session key.
    pub server_nonce: [u8; NONCE_BYTES],
    /// The seal algorithm the session uses (the one the client proposed).
    pub seal: SealAlgorithm,
}

/// One key of a batch GET and the most bytes the caller will take for it (the size of its
/// destination buffer). The capacities of one batch add up to at most [`PAYLOAD_BYTES_MAX`], so
/// the answer always fits a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetItem {
    pub key: PhysicalKey,
    pub capacity: u64,
}

/// One block of a batch PUT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutItem {
    pub key: PhysicalKey,
    pub request: Option<RequestId>,
    pub data: Vec<u8>,
}

/// One key of a batch GET through the connection's shared segment: the server writes the block
/// at `offset`, at most `capacity` bytes, and answers with its length and checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedGetItem {
    pub key: PhysicalKey,
    pub offset: u64,
    pub capacity: u64,
}

/// One block of a batch PUT whose `len` bytes lie at `offset` of the connection's shared
/// segment. `checksum` is the client's checksum of them: a block the server stored under
/// another checksum (the bytes changed while it copied them) is invalidated and refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPutItem {
    pub key: PhysicalKey,
    pub request: Option<RequestId>,
    pub offset: u64,
    pub len: u64,
    pub checksum: Checksum,
}

/// The answer to one GET item: the block's bytes on a hit. The client checks
/// `Checksum::of(&data) == checksum` before using them (the frame checksum only covers the
/// transfer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    Hit { checksum: Checksum, data: Vec<u8> },
    Miss(MissReason),
}

/// [`StoreInfo`] as it crosses the wire: the name is owned text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteInfo {
    pub name: String,
    pub implementation: Implementation,
    pub failures_retire: bool,
    pub full_policy: FullPolicy,
}

/// What a LIMITS answer says of the server's limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerLimits {
    /// The largest value the store admits (`limits.object_bytes_max`), when the server states
    /// it; a larger PUT is refused with `ObjectTooLarge`.
    pub object_bytes_max: Option<u64>,
}

impl From<StoreInfo> for RemoteInfo {
    fn from(info: StoreInfo) -> Self {
        Self {
            name: info.name.to_owned(),
            implementation: info.implementation,
            failures_retire: info.failures_retire,
            full_policy: info.full_policy,
        }
    }
}

/// What a client asks. Each variant is one op; the batch variants answer per item, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// Opens a session as `tenant`: claimed for an open tenant, proven by `auth` (and the
    /// frame's seal) for a tenant with a secret.
    Hello {
        tenant: TenantId,
        client_name: String,
        /// The rights this connection asks for; the server grants those its configuration
        /// allows the tenant.
        rights: Rights,
        auth: Option<HelloAuth>,
    },
    Info,
    Epoch,
    Stats,
    /// Batch QUERY: [`gpucache_dataplane::store::Store::lookup`] per key.
    Lookup {
        keys: Vec<PhysicalKey>,
    },
    /// Batch GET: `get_into` per item, into a buffer of `capacity` bytes.
    Get {
        items: Vec<GetItem>,
    },
    /// Batch PUT: `put` per item.
    Put {
        items: Vec<PutItem>,
    },
    /// Batch INVALIDATE.
    Invalidate {
        keys: Vec<PhysicalKey>,
    },
    /// The key is boxed as in `Lookup::PrefixHit`: a key is large and this enum is not.
    Reserve {
        key: Box<PhysicalKey>,
        len: u64,
        request: Option<RequestId>,
    },
    Write {
        reservation: Reservation,
        offset: u64,
        data: Vec<u8>,
    },
    Commit {
        reservation: Reservation,
    },
    Abort {
        reservation: Reservation,
        outcome: Retirement,
    },
    ExpireLeases,
    /// `attest_drained` of a region.
    Attest {
        region: RegionId,
    },
    BumpEpoch,
    ReclaimFenced {
        epoch: Epoch,
    },
    /// Hands over the shared segment whose descriptor arrives with this frame (`SCM_RIGHTS`
    /// on a Unix socket); `len` is its size as the client mapped it.
    ShmAttach {
        len: u64,
    },
    GetShared {
        items: Vec<SharedGetItem>,
    },
    PutShared {
        items: Vec<SharedPutItem>,
    },
    /// The client's NIXL agent metadata (at most [`AGENT_METADATA_BYTES_MAX`] bytes).
    NixlAttach {
        metadata: Vec<u8>,
    },
    /// Stages each key's block in a slot the client reads itself; `capacity` is the client's
    /// destination size, as in GET (a larger block answers `BufferTooSmall`).
    StageGet {
        items: Vec<GetItem>,
    },
    /// Leases an empty slot for a block of `len` bytes hashing to `checksum`.
    ReservePut {
        key: Box<PhysicalKey>,
        len: u64,
        checksum: Checksum,
        request: Option<RequestId>,
    },
    CommitPut {
        stage: StageId,
    },
    Release {
        stages: Vec<StageId>,
    },
    StageStats,
    Limits,
    /// Batch lookup: [`gpucache_dataplane::store::Store::locate`] of the keys.
    Locate {
        keys: Vec<PhysicalKey>,
    },
    /// The cluster epoch this connection's requests are routed by, from now on. A node of a
    /// cluster serves a request only at its own view's epoch (a connection that never said
    /// one is at epoch 0, older than any view).
    Cluster {
        epoch: u64,
    },
    /// Leads or joins the fill of `key` (the caller needs the write right on it).
    FillBegin {
        key: Box<PhysicalKey>,
    },
    /// The leader's outcome: stored or gave up.
    FillFinish {
        lease: FillLease,
        stored: bool,
    },
    /// The fill's outcome, waiting up to `wait_ms` while it is pending (the server caps it).
    FillWait {
        ticket: FillTicket,
        wait_ms: u64,
    },
    /// Removes the committed blocks of `scope` (the caller needs the write right on its
    /// tenant), at most [`gpucache_dataplane::store::PURGE_BLOCKS_MAX`] of them. Boxed: a key
    /// is large.
    Purge {
        scope: Box<PurgeScope>,
    },
    /// The store's own view of whether it can serve
    /// ([`gpucache_dataplane::store::Store::condition`]); no body.
    Condition,
}

/// Why a node did not begin a fill (the wire's form of the directory's refusal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FillRefused {
    #[error("fill of epoch {asked}, the node's fills are at epoch {current}")]
    Epoch { asked: u64, current: u64 },
    #[error("the node is draining and begins no fill")]
    Draining,
    #[error("{max} fills are in flight already")]
    TooMany { max: u64 },
    #[error("no credits for a fill: {detail}")]
    Credits { detail: String },
    /// The caller may not write the key (another tenant's, or no write right).
    #[error("fill refused: {detail}")]
    Forbidden { detail: String },
}

impl From<&FillRefusal> for FillRefused {
    fn from(r: &FillRefusal) -> Self {
        match r {
            FillRefusal::Epoch { asked, current } => {
                Self::Epoch { asked: asked.0, current: current.0 }
            }
            FillRefusal::Draining => Self::Draining,
            FillRefusal::TooMany { max } => Self::TooMany { max: *max as u64 },
            FillRefusal::Credits(c) => Self::Credits { detail: c.to_string() },
        }
    }
}

/// A node's standing in its cluster, as CLUSTER answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeStatus {
    pub node: NodeId,
    /// The epoch of the view the node serves under.
    pub epoch: u64,
    /// Why it takes no new blocks now, if it takes none.
    pub not_admitting: Option<NotAdmitting>,
}

/// What a server answers, with the op of the request (or [`Op::Error`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Response {
    /// The server's protocol version and name, and the session's nonce for a sealed session.
    Hello {
        version: u8,
        server: String,
        session: Option<HelloSession>,
        /// The server's Unix socket for the same-host path, offered to clients that connected
        /// from this host (empty text on the wire when there is none).
        local: Option<String>,
    },
    Info(RemoteInfo),
    Epoch(Epoch),
    Stats(StoreStats),
    Lookup(Vec<Result<Lookup, StoreError>>),
    Get(Vec<Result<Fetched, StoreError>>),
    Put(Vec<Result<Put, StoreError>>),
    Invalidate(Vec<Result<Invalidate, StoreError>>),
    Reserve(Result<Reserve, StoreError>),
    Write(Result<(), StoreError>),
    Commit(Result<Committed, StoreError>),
    Abort(Result<Abort, StoreError>),
    ExpireLeases(Result<u64, StoreError>),
    Attest(Result<Reclaimed, StoreError>),
    BumpEpoch(Result<Epoch, StoreError>),
    ReclaimFenced(Result<u64, StoreError>),
    /// The segment is mapped; its length as the server sees it.
    ShmAttach(u64),
    GetShared(Vec<Result<Get, StoreError>>),
    PutShared(Vec<Result<Put, StoreError>>),
    /// The server's NIXL agent metadata.
    NixlAttach(Vec<u8>),
    StageGet(Vec<Result<StagedGet, StoreError>>),
    ReservePut(Result<StagedSlot, StoreError>),
    CommitPut(Result<Put, StoreError>),
    /// Per stage, whether it was open.
    Release(Vec<bool>),
    Limits(ServerLimits),
    StageStats(StagingStats),
    Locate(Vec<Result<Located, StoreError>>),
    /// The node's standing; none for a server that runs alone (no cluster).
    Cluster(Option<NodeStatus>),
    FillBegin(Result<FillStart, FillRefused>),
    FillFinish(FillNotice),
    FillWait(FillNotice),
    Purge(Result<Purged, StoreError>),
    Condition(StoreCondition),
    /// The request could not be served at the protocol level.
    Error(WireError),
}

/// Rights on the wire: bit 0 read, bit 1 write, bit 2 admin; other bits are malformed.
fn rights_bits(r: Rights) -> u8 {
    u8::from(r.read) | u8::from(r.write) << 1 | u8::from(r.admin) << 2
}

fn rights_from_bits(bits: u8) -> Result<Rights, WireError> {
    if bits & !0b111 != 0 {
        return Err(WireError::Malformed { what: text::RIGHTS });
    }
    Ok(Rights { read: bits & 1 != 0, write: bits & 2 != 0, admin: bits & 4 != 0 })
}

fn get_seal_algorithm(r: &mut Reader<'_>) -> Result<SealAlgorithm, WireError> {
    let tag = r.u8(text::SEAL_ALGORITHM)?;
    SealAlgorithm::from_code(tag).ok_or(WireError::UnknownTag { what: text::SEAL_ALGORITHM, tag })
}

fn get_capacity_error(total: u64) -> WireError {
    WireError::TooMany { what: text::GET_CAPACITY, count: total, max: PAYLOAD_BYTES_MAX }
}

impl Request {
    pub fn op(&self) -> Op {
        match self {
            Self::Hello { .. } => Op::Hello,
            Self::Info => Op::Info,
            Self::Epoch => Op::Epoch,
            Self::Stats => Op::Stats,
            Self::Lookup { .. } => Op::Lookup,
            Self::Get { .. } => Op::Get,
            Self::Put { .. } => Op::Put,
            Self::Invalidate { .. } => Op::Invalidate,
            Self::Reserve { .. } => Op::Reserve,
            Self::Write { .. } => Op::Write,
            Self::Commit { .. } => Op::Commit,
            Self::Abort { .. } => Op::Abort,
            Self::ExpireLeases => Op::ExpireLeases,
            Self::Attest { .. } => Op::Attest,
            Self::BumpEpoch => Op::BumpEpoch,
            Self::ReclaimFenced { .. } => Op::ReclaimFenced,
            Self::ShmAttach { .. } => Op::ShmAttach,
            Self::GetShared { .. } => Op::GetShared,
            Self::PutShared { .. } => Op::PutShared,
            Self::NixlAttach { .. } => Op::NixlAttach,
            Self::StageGet { .. } => Op::StageGet,
            Self::ReservePut { .. } => Op::ReservePut,
            Self::CommitPut { .. } => Op::CommitPut,
            Self::Release { .. } => Op::Release,
            Self::StageStats => Op::StageStats,
            Self::Limits => Op::Limits,
            Self::Locate { .. } => Op::Locate,
            Self::Cluster { .. } => Op::Cluster,
            Self::FillBegin { .. } => Op::FillBegin,
            Self::FillFinish { .. } => Op::FillFinish,
            Self::FillWait { .. } => Op::FillWait,
            Self::Purge { .. } => Op::Purge,
            Self::Condition => Op::Condition,
        }
    }

    /// Appends the body. Refuses (appending nothing) what a decoder would refuse: a batch over
    /// [`super::BATCH_ITEMS_MAX`], GET capacities over [`PAYLOAD_BYTES_MAX`].
    pub fn encode_body(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        let start = out.len();
        let mut w = Writer::new(out);
        self.write_body(&mut w);
        let result = w.finish();
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    fn write_body(&self, w: &mut Writer<'_>) {
        match self {
            Self::Hello { tenant, client_name, rights, auth } => {
                w.tenant(tenant);
                w.text(client_name);
                w.u8(rights_bits(*rights));
                match auth {
                    None => w.u8(0),
                    Some(a) => {
                        w.u8(1);
                        w.text(&a.key_id);
                        w.raw(&a.fingerprint);
                        w.raw(&a.client_nonce);
                        w.u64(a.timestamp_ms);
                        w.u8(a.seal.code());
                    }
                }
            }
            Self::Info
            | Self::Epoch
            | Self::Stats
            | Self::ExpireLeases
            | Self::BumpEpoch
            | Self::StageStats
            | Self::Limits
            | Self::Condition => {}
            Self::Lookup { keys } | Self::Invalidate { keys } | Self::Locate { keys } => {
                w.count(keys.len());
                for key in keys {
                    w.key(key);
                }
            }
            Self::Get { items } => {
                w.count(items.len());
                let total = items.iter().fold(0u64, |t, i| t.saturating_add(i.capacity));
                if total > PAYLOAD_BYTES_MAX {
                    w.fail(get_capacity_error(total));
                }
                for item in items {
                    w.key(&item.key);
                    w.u64(item.capacity);
                }
            }
            Self::Put { items } => {
                let sources = items.iter().map(|i| (&i.key, i.request, &i.data[..], None));
                write_put_body(w, items.len(), sources);
            }
            Self::Reserve { key, len, request } => {
                w.key(key);
                w.u64(*len);
                put_request_id(w, *request);
            }
            Self::Write { reservation, offset, data } => {
                put_reservation(w, reservation);
                w.u64(*offset);
                w.bytes(data);
            }
            Self::Commit { reservation } => put_reservation(w, reservation),
            Self::Abort { reservation, outcome } => {
                put_reservation(w, reservation);
                put_retirement(w, *outcome);
            }
            Self::Attest { region } => w.u64(region.0),
            Self::ReclaimFenced { epoch } => w.u64(epoch.0),
            Self::ShmAttach { len } => w.u64(*len),
            Self::GetShared { items } => {
                w.count(items.len());
                for item in items {
                    w.key(&item.key);
                    w.u64(item.offset);
                    w.u64(item.capacity);
                }
            }
            Self::PutShared { items } => {
                w.count(items.len());
                for item in items {
                    w.key(&item.key);
                    put_request_id(w, item.request);
                    w.u64(item.offset);
                    w.u64(item.len);
                    w.u64(item.checksum.0);
                }
            }
            Self::NixlAttach { metadata } => {
                if metadata.len() > AGENT_METADATA_BYTES_MAX {
                    w.fail(metadata_error(metadata.len()));
                }
                w.bytes(metadata);
            }
            Self::ReservePut { key, len, checksum, request } => {
                w.key(key);
                w.u64(*len);
                w.u64(checksum.0);
                put_request_id(w, *request);
            }
            Self::CommitPut { stage } => w.u64(stage.0),
            Self::Cluster { epoch } => w.u64(*epoch),
            Self::FillBegin { key } => w.key(key),
            Self::FillFinish { lease, stored } => {
                put_fill_lease(w, lease);
                w.bool(*stored);
            }
            Self::FillWait { ticket, wait_ms } => {
                put_fill_ticket(w, ticket);
                w.u64(*wait_ms);
            }
            Self::Purge { scope } => {
                w.key(scope.sample());
                w.text(scope.layout_prefix());
            }
            Self::StageGet { items } => {
                w.count(items.len());
                for item in items {
                    w.key(&item.key);
                    w.u64(item.capacity);
                }
            }
            Self::Release { stages } => {
                w.count(stages.len());
                for stage in stages {
                    w.u64(stage.0);
                }
            }
        }
    }

    /// Strictly decodes the body of a request frame of `op`.
    pub fn decode_body(op: Op, body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let request = Self::read_body(op, &mut r)?;
        r.finish()?;
        Ok(request)
    }

    fn read_body(op: Op, r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(match op {
            Op::Hello => Self::Hello {
                tenant: r.tenant()?,
                client_name: r.text(text::TEXT)?,
                rights: rights_from_bits(r.u8(text::RIGHTS)?)?,
                auth: match r.u8(text::HELLO_AUTH)? {
                    0 => None,
                    1 => Some(HelloAuth {
                        key_id: r.text(text::TEXT)?,
                        fingerprint: r.array(text::HELLO_AUTH)?,
                        client_nonce: r.array(text::HELLO_AUTH)?,
                        timestamp_ms: r.u64(text::INTEGER)?,
                        seal: get_seal_algorithm(r)?,
                    }),
                    tag => return Err(WireError::UnknownTag { what: text::HELLO_AUTH, tag }),
                },
            },
            Op::Info => Self::Info,
            Op::Epoch => Self::Epoch,
            Op::Stats => Self::Stats,
            Op::ExpireLeases => Self::ExpireLeases,
            Op::BumpEpoch => Self::BumpEpoch,
            Op::StageStats => Self::StageStats,
            Op::Limits => Self::Limits,
            Op::Condition => Self::Condition,
            Op::NixlAttach => Self::NixlAttach { metadata: get_metadata(r)? },
            Op::StageGet => {
                let n = r.count()?;
                let mut items = r.batch(n);
                for index in 0..n {
                    items.push(GetItem { key: r.key(index)?, capacity: r.u64(text::INTEGER)? });
                }
                Self::StageGet { items }
            }
            Op::ReservePut => Self::ReservePut {
                key: Box::new(r.key(0)?),
                len: r.u64(text::INTEGER)?,
                checksum: Checksum(r.u64(text::INTEGER)?),
                request: get_request_id(r)?,
            },
            Op::CommitPut => Self::CommitPut { stage: StageId(r.u64(text::INTEGER)?) },
            Op::Cluster => Self::Cluster { epoch: r.u64(text::INTEGER)? },
            Op::FillBegin => Self::FillBegin { key: Box::new(r.key(0)?) },
            Op::FillFinish => {
                Self::FillFinish { lease: get_fill_lease(r)?, stored: r.bool(text::BOOL)? }
            }
            Op::FillWait => {
                Self::FillWait { ticket: get_fill_ticket(r)?, wait_ms: r.u64(text::INTEGER)? }
            }
            Op::Release => {
                let n = r.count()?;
                let mut stages = r.batch(n);
                for _ in 0..n {
                    stages.push(StageId(r.u64(text::INTEGER)?));
                }
                Self::Release { stages }
            }
            Op::Lookup => Self::Lookup { keys: read_keys(r)? },
            Op::Locate => Self::Locate { keys: read_keys(r)? },
            Op::Invalidate => Self::Invalidate { keys: read_keys(r)? },
            Op::Get => {
                let n = r.count()?;
                let mut items = r.batch(n);
                let mut total = 0u64;
                for index in 0..n {
                    let key = r.key(index)?;
                    let capacity = r.u64(text::INTEGER)?;
                    total = total.saturating_add(capacity);
                    if total > PAYLOAD_BYTES_MAX {
                        return Err(get_capacity_error(total));
                    }
                    items.push(GetItem { key, capacity });
                }
                Self::Get { items }
            }
            Op::Put => Self::Put {
                items: read_put_refs(r.take_rest())?
                    .into_iter()
                    .map(|p| {
                        let computed = Checksum::of(p.data);
                        if computed == p.checksum {
                            Ok(PutItem { key: p.key, request: p.request, data: p.data.to_vec() })
                        } else {
                            Err(WireError::BodyChecksum {
                                found: p.checksum.0,
                                computed: computed.0,
                            })
                        }
                    })
                    .collect::<Result<_, _>>()?,
            },
            Op::Reserve => Self::Reserve {
                key: Box::new(r.key(0)?),
                len: r.u64(text::INTEGER)?,
                request: get_request_id(r)?,
            },
            Op::Write => Self::Write {
                reservation: get_reservation(r)?,
                offset: r.u64(text::INTEGER)?,
                data: r.bytes()?,
            },
            Op::Commit => Self::Commit { reservation: get_reservation(r)? },
            Op::Abort => {
                Self::Abort { reservation: get_reservation(r)?, outcome: get_retirement(r)? }
            }
            Op::Attest => Self::Attest { region: RegionId(r.u64(text::INTEGER)?) },
            Op::ReclaimFenced => Self::ReclaimFenced { epoch: Epoch(r.u64(text::INTEGER)?) },
            Op::ShmAttach => Self::ShmAttach { len: r.u64(text::INTEGER)? },
            Op::GetShared => {
                let n = r.count()?;
                let mut items = r.batch(n);
                for index in 0..n {
                    items.push(SharedGetItem {
                        key: r.key(index)?,
                        offset: r.u64(text::INTEGER)?,
                        capacity: r.u64(text::INTEGER)?,
                    });
                }
                Self::GetShared { items }
            }
            Op::PutShared => {
                let n = r.count()?;
                let mut items = r.batch(n);
                for index in 0..n {
                    items.push(SharedPutItem {
                        key: r.key(index)?,
                        request: get_request_id(r)?,
                        offset: r.u64(text::INTEGER)?,
                        len: r.u64(text::INTEGER)?,
                        checksum: Checksum(r.u64(text::INTEGER)?),
                    });
                }
                Self::PutShared { items }
            }
            Op::Purge => {
                let sample = r.key(0)?;
                let prefix = r.text(text::PURGE_SCOPE)?;
                let scope = PurgeScope::new(sample, &prefix).map_err(|e| WireError::TooMany {
                    what: text::PURGE_SCOPE,
                    count: wide(e.len),
                    max: wide(e.max),
                })?;
                Self::Purge { scope: Box::new(scope) }
            }
            Op::Error => return Err(WireError::UnknownOp { op: op.code() }),
        })
    }
}

/// One block of a batch PUT, its bytes borrowed from the frame body.
#[derive(Debug, PartialEq, Eq)]
pub struct PutRef<'a> {
    pub key: PhysicalKey,
    pub request: Option<RequestId>,
    pub data: &'a [u8],
    /// The writer's checksum of `data`, which the frame checksum does not cover: the store
    /// compares it with what it copied ([`Store::put_batch_checked`]).
    ///
    /// [`Store::put_batch_checked`]: gpucache_dataplane::store::Store::put_batch_checked
    pub checksum: Checksum,
}

/// Reads a PUT request body: the trailer at its end (located by [`trailer_start`]) names each
/// item's key, request id, checksum and length, and the payload part before it holds the items'
/// bytes back to back, in order. Both parts must be used up exactly.
fn read_put_refs(body: &[u8]) -> Result<Vec<PutRef<'_>>, WireError> {
    let start = trailer_start(body).ok_or(WireError::Malformed { what: text::TRAILER })?;
    let (payloads, rest) = body.split_at(start);
    let trailer = rest.get(..rest.len().saturating_sub(4)).unwrap_or_default();
    let (mut r, mut bulk) = (Reader::new(trailer), Reader::new(payloads));
    let n = r.count()?;
    let mut items = r.batch(n);
    for index in 0..n {
        let key = r.key(index)?;
        let request = get_request_id(&mut r)?;
        let checksum = Checksum(r.u64(text::INTEGER)?);
        let len = usize::try_from(r.u32(text::BYTES)?)
            .map_err(|_| WireError::Truncated { what: text::PAYLOADS })?;
        items.push(PutRef { key, request, data: bulk.take(len, text::PAYLOADS)?, checksum });
    }
    r.finish()?;
    bulk.finish()?;
    Ok(items)
}

/// The items of a PUT request body, strictly decoded, their bytes borrowed from `body`: what
/// a server stores from without copying them out of the frame first. Their checksums are the
/// writer's and are not checked here: the store checks them as it copies.
pub fn decode_put_request(body: &[u8]) -> Result<Vec<PutRef<'_>>, WireError> {
    read_put_refs(body)
}

/// A WRITE request body's fields, its data borrowed from `body`: what a server writes from
/// without copying the data out of the frame first. Decoded as strictly as
/// [`Request::decode_body`] decodes a WRITE.
pub fn decode_write_request(body: &[u8]) -> Result<(Reservation, u64, &[u8]), WireError> {
    let mut r = Reader::new(body);
    let reservation = get_reservation(&mut r)?;
    let offset = r.u64(text::INTEGER)?;
    let data = r.bytes_ref()?;
    r.finish()?;
    Ok((reservation, offset, data))
}

/// A WRITE request frame without its data, for a sender that writes the data from where it
/// lies instead of copying it into a frame: `out` gets the frame header then the body's fields
/// before the data, and the header, those fields, then `data` are the bytes
/// `Request::Write { .. }` encodes to under the same request id. The header's checksum covers
/// the whole body, data included (one pass over `data` here). Unsealed frames only: a seal
/// covers the data too.
pub fn write_request_parts(
    request_id: u64,
    reservation: &Reservation,
    offset: u64,
    data: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    out.clear();
    out.extend_from_slice(&[0; HEADER_BYTES]);
    let mut w = Writer::new(out);
    put_reservation(&mut w, reservation);
    w.u64(offset);
    w.len(data.len());
    w.finish()?;
    let fields = out.get(HEADER_BYTES..).unwrap_or_default();
    let body = fields.len() + data.len();
    if body > super::BODY_BYTES_MAX {
        return Err(WireError::TooLarge { len: wide(body), max: wide(super::BODY_BYTES_MAX) });
    }
    let mut sum = gpucache_dataplane::checksum::ChecksumBuilder::default();
    sum.update(fields);
    sum.update(data);
    let header =
        FrameHeader::with_checksum(Kind::Request, Op::Write, request_id, body, 0, sum.finish().0);
    out[..HEADER_BYTES].copy_from_slice(&header.to_bytes());
    Ok(())
}

/// A PUT body: each item's bytes, copied and hashed in one pass unless its checksum is given,
/// then the trailer that describes them ([`read_put_refs`]).
fn write_put_body<'a>(
    w: &mut Writer<'_>,
    n: usize,
    items: impl Iterator<Item = (&'a PhysicalKey, Option<RequestId>, &'a [u8], Option<Checksum>)>,
) {
    let mut trailer = Vec::new();
    let mut t = Writer::new(&mut trailer);
    t.count(n);
    for (key, request, data, checksum) in items {
        let checksum = match checksum {
            Some(sum) => {
                w.raw(data);
                sum
            }
            None => w.raw_hashed(data),
        };
        t.key(key);
        put_request_id(&mut t, request);
        t.u64(checksum.0);
        t.len(data.len());
    }
    finish_trailer(w, t.finish(), &trailer);
}

/// Appends a PUT request frame whose keys and payloads are written straight from the caller's
/// batch items (no owned [`PutItem`]s); the same bytes as [`Request::Put`]. With `checksums`
/// (one per item, the caller's own), the bytes are sent under them without being hashed here.
pub fn encode_put_request(
    request_id: u64,
    seal: Option<&SealKey>,
    items: &[BatchPut<'_>],
    checksums: Option<&[Checksum]>,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    write_frame(Kind::Request, Op::Put, request_id, seal, out, |w| {
        let sums = (0..items.len()).map(|i| checksums.and_then(|c| c.get(i).copied()));
        let sources = items.iter().zip(sums).map(|(i, sum)| (i.key, i.request, i.src, sum));
        write_put_body(w, items.len(), sources);
    })
}

/// The two parts around the payload of a GET answer to one item that hit with `len` bytes
/// hashing to `checksum`, for a sender that writes the payload from where it lies instead of
/// copying it into a frame: `head` gets the frame header, `tail` the trailer, and `head`, the
/// payload and `tail`, in that order, are the bytes [`finish_get_response`] writes for the same
/// answer. Unsealed frames only: a seal covers the payload too.
pub fn get_hit_frame_parts(
    request_id: u64,
    len: usize,
    checksum: Checksum,
    head: &mut Vec<u8>,
    tail: &mut Vec<u8>,
) -> Result<(), WireError> {
    if wide(len) > PAYLOAD_BYTES_MAX {
        return Err(get_capacity_error(wide(len)));
    }
    tail.clear();
    let mut trailer = Vec::new();
    let mut t = Writer::new(&mut trailer);
    t.count(1);
    t.u8(0);
    t.u8(0);
    t.u64(checksum.0);
    t.len(len);
    let mut w = Writer::new(tail);
    finish_trailer(&mut w, t.finish(), &trailer);
    w.finish()?;
    let header = FrameHeader::with_checksum(
        Kind::Response,
        Op::Get,
        request_id,
        len + tail.len(),
        FLAG_TRAILER | FLAG_SOLE_HIT,
        Checksum::of(tail).0,
    );
    head.clear();
    head.extend_from_slice(&header.to_bytes());
    Ok(())
}

/// A PUT request frame without its payloads, for a sender that writes each item's bytes from
/// where they lie instead of copying them into a frame: `out` gets the frame header then the
/// trailer, and the header, every item's bytes in order, then the trailer are the bytes
/// [`encode_put_request`] writes for the same items and checksums. Unsealed frames only: a seal
/// covers the payloads too.
pub fn put_request_parts(
    request_id: u64,
    items: &[BatchPut<'_>],
    checksums: &[Checksum],
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    if checksums.len() != items.len() {
        return Err(WireError::Internal {
            detail: format!("{} checksums for {} PUT items", checksums.len(), items.len()),
        });
    }
    let payload = items.iter().try_fold(0u64, |n, i| n.checked_add(wide(i.src.len())));
    let payload = match payload.filter(|&n| n <= PAYLOAD_BYTES_MAX).map(usize::try_from) {
        Some(Ok(n)) => n,
        _ => return Err(put_payload_error(payload.unwrap_or(u64::MAX))),
    };
    out.clear();
    out.extend_from_slice(&[0; HEADER_BYTES]);
    let mut w = Writer::new(out);
    let mut trailer = Vec::new();
    let mut t = Writer::new(&mut trailer);
    t.count(items.len());
    for (item, sum) in items.iter().zip(checksums) {
        t.key(item.key);
        put_request_id(&mut t, item.request);
        t.u64(sum.0);
        t.len(item.src.len());
    }
    finish_trailer(&mut w, t.finish(), &trailer);
    w.finish()?;
    let tail = out.get(HEADER_BYTES..).unwrap_or_default();
    let header = FrameHeader::with_checksum(
        Kind::Request,
        Op::Put,
        request_id,
        payload + tail.len(),
        FLAG_TRAILER,
        Checksum::of(tail).0,
    );
    out[..HEADER_BYTES].copy_from_slice(&header.to_bytes());
    Ok(())
}

fn put_payload_error(total: u64) -> WireError {
    WireError::TooLarge { len: total, max: PAYLOAD_BYTES_MAX }
}

/// Bytes of a GET response's trailer beyond its items: the item count, the trailer's own
/// framing and a seal.
const GET_TRAILER_ROOM_BYTES: usize = 128;
/// Bytes of one hit's entry in a GET response's trailer, with room to spare (a miss or an error
/// may need more; the buffer then grows once).
const GET_TRAILER_ITEM_BYTES: usize = 32;

/// Lays out a GET response frame answering `items` in `out`, replacing what `out` held: room
/// for the header, then one destination per item, in order, each `capacity` bytes of the
/// frame's payload part, which it returns. The caller reads each block into its destination
/// (as [`gpucache_dataplane::store::Store::get_batch`] does), then calls
/// [`finish_get_response`] with the answers. The wire crate reads no store itself.
///
/// The destinations are not zeroed first: they reuse the bytes `out` already holds (a server
/// passes the buffer of the last frame it sent on the connection, so a read overwrites that
/// connection's own earlier answer), and only what is grown past them is zero-filled. That is
/// safe because nothing but the front `len` bytes of a hit, which the reader reports it wrote,
/// goes into the frame; a miss or error contributes no bytes, and a hit longer than its
/// destination is answered as an error. On error `out` is left empty.
pub fn begin_get_response<'o>(
    items: &[GetItem],
    out: &'o mut Vec<u8>,
) -> Result<Vec<&'o mut [u8]>, WireError> {
    let total = items.iter().try_fold(0u64, |sum, item| sum.checked_add(item.capacity));
    let total = match total.filter(|t| *t <= PAYLOAD_BYTES_MAX).map(usize::try_from) {
        Some(Ok(t)) => t,
        _ => {
            out.clear();
            return Err(get_capacity_error(total.unwrap_or(u64::MAX)));
        }
    };
    let frame_len = HEADER_BYTES + total;
    // Room for the trailer `finish_get_response` appends, so that appending it never grows the
    // buffer (growing doubles it: a 4 MiB response would come to 8 MiB and more, past what a
    // connection keeps between responses, and every GET would map and zero a new one).
    let trailer_room = GET_TRAILER_ROOM_BYTES + GET_TRAILER_ITEM_BYTES * items.len();
    out.reserve_exact((frame_len + trailer_room).saturating_sub(out.len()));
    if out.len() < frame_len {
        out.resize(frame_len, 0);
    } else {
        out.truncate(frame_len);
    }
    let (_, mut rest) = out.split_at_mut(HEADER_BYTES);
    let mut slots = Vec::with_capacity(items.len());
    for item in items {
        // Within `total`, which fits a usize.
        let capacity = usize::try_from(item.capacity).unwrap_or(usize::MAX);
        let at = capacity.min(rest.len());
        let (dst, tail) = std::mem::take(&mut rest).split_at_mut(at);
        slots.push(dst);
        rest = tail;
    }
    Ok(slots)
}

/// Finishes the GET response frame [`begin_get_response`] laid out in `out` for `items`, given
/// one answer per item: the hits are moved together, back to back in item order, and the
/// trailer written after them, giving the same bytes as [`Response::Get`]. An item without an
/// answer is answered as a failed read.
pub fn finish_get_response(
    request_id: u64,
    seal: Option<&SealKey>,
    items: &[GetItem],
    mut answers: BatchAnswers<Get>,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    answers.truncate(items.len());
    // Move each hit's bytes down to the end of the hits before it.
    let (mut slot, mut packed) = (HEADER_BYTES, HEADER_BYTES);
    for (i, item) in items.iter().enumerate() {
        let capacity = usize::try_from(item.capacity).unwrap_or(usize::MAX);
        let answer = match answers.get_mut(i) {
            Some(a) => a,
            None => {
                answers.push(Err(get_unanswered(answers.len(), items.len())));
                continue;
            }
        };
        if let Ok(Get::Hit { len, .. }) = answer {
            match usize::try_from(*len) {
                Ok(n) if n <= capacity && slot + n <= out.len() => {
                    if slot != packed {
                        out.copy_within(slot..slot + n, packed);
                    }
                    packed += n;
                }
                _ => *answer = Err(get_overlong(*len, item.capacity)),
            }
        }
        slot += capacity;
    }
    out.truncate(packed);
    finish_frame(Kind::Response, Op::Get, request_id, seal, out, 0, |w| {
        let mut trailer = Vec::new();
        let mut t = Writer::new(&mut trailer);
        t.count(items.len());
        for answer in &answers {
            match answer {
                Ok(Get::Hit { len, checksum }) => {
                    t.u8(0);
                    t.u8(0);
                    t.u64(checksum.0);
                    t.len(usize::try_from(*len).unwrap_or(usize::MAX));
                }
                Ok(Get::Miss(reason)) => {
                    put_result(&mut t, &Ok(Fetched::Miss(*reason)), put_fetched_meta)
                }
                Err(e) => put_result(&mut t, &Err::<Fetched, _>(e.clone()), put_fetched_meta),
            }
        }
        finish_trailer(w, t.finish(), &trailer);
    })
}

/// The error of an item the store's batch left without an answer.
fn get_unanswered(answered: usize, items: usize) -> StoreError {
    StoreError::Backend {
        operation: "get",
        detail: format!("the store answered {answered} of {items} items"),
        retirement: Retirement::Retired,
    }
}

/// The error of a hit longer than the destination the store was given.
fn get_overlong(len: u64, capacity: u64) -> StoreError {
    StoreError::Backend {
        operation: "get",
        detail: format!("the store reported {len} bytes written into a {capacity}-byte buffer"),
        retirement: Retirement::Retired,
    }
}

/// One GET answer, its bytes borrowed from the frame body.
#[derive(Debug, PartialEq, Eq)]
pub enum FetchedRef<'a> {
    Hit { checksum: Checksum, data: &'a [u8] },
    Miss(MissReason),
}

/// The answers of a GET response body, strictly decoded, their bytes borrowed from `body`:
/// what a client lands in the caller's buffers without an owned copy first.
pub fn decode_get_response(
    body: &[u8],
) -> Result<Vec<Result<FetchedRef<'_>, StoreError>>, WireError> {
    read_get_answers(body)
}

fn read_keys(r: &mut Reader<'_>) -> Result<Vec<PhysicalKey>, WireError> {
    let n = r.count()?;
    let mut keys = r.batch(n);
    for index in 0..n {
        keys.push(r.key(index)?);
    }
    Ok(keys)
}

fn write_batch<T>(
    w: &mut Writer<'_>,
    items: &[Result<T, StoreError>],
    ok: impl Fn(&mut Writer<'_>, &T) -> Result<(), super::values::Unrepresentable>,
) {
    w.count(items.len());
    for item in items {
        put_result(w, item, &ok);
    }
}

fn read_batch<T>(
    r: &mut Reader<'_>,
    ok: impl Fn(&mut Reader<'_>, usize) -> Result<T, WireError>,
) -> Result<Vec<Result<T, StoreError>>, WireError> {
    let n = r.count()?;
    let mut items = r.batch(n);
    for index in 0..n {
        items.push(get_result(r, |r| ok(r, index))?);
    }
    Ok(items)
}

/// A GET answer's entry in the trailer: for a hit, its checksum and length (its bytes are in
/// the payload part before the trailer).
fn put_fetched_meta(w: &mut Writer<'_>, f: &Fetched) -> Result<(), super::values::Unrepresentable> {
    match f {
        Fetched::Hit { checksum, data } => {
            w.u8(0);
            w.u64(checksum.0);
            w.len(data.len());
        }
        Fetched::Miss(m) => {
            w.u8(1);
            put_miss(w, *m);
        }
    }
    Ok(())
}

fn metadata_error(len: usize) -> WireError {
    WireError::TooMany {
        what: text::AGENT_METADATA,
        count: len as u64,
        max: AGENT_METADATA_BYTES_MAX as u64,
    }
}

fn get_metadata(r: &mut Reader<'_>) -> Result<Vec<u8>, WireError> {
    let metadata = r.bytes()?;
    if metadata.len() > AGENT_METADATA_BYTES_MAX {
        return Err(metadata_error(metadata.len()));
    }
    Ok(metadata)
}

fn put_staged_slot(w: &mut Writer<'_>, slot: &StagedSlot) {
    w.u64(slot.stage.0);
    if slot.descriptor.len() > DESCRIPTOR_BYTES_MAX {
        w.fail(WireError::TooMany {
            what: text::DESCRIPTOR,
            count: slot.descriptor.len() as u64,
            max: DESCRIPTOR_BYTES_MAX as u64,
        });
    }
    w.bytes(&slot.descriptor);
    w.u64(slot.lease_ms);
}

fn get_staged_slot(r: &mut Reader<'_>) -> Result<StagedSlot, WireError> {
    let stage = StageId(r.u64(text::INTEGER)?);
    let descriptor = r.bytes()?;
    if descriptor.len() > DESCRIPTOR_BYTES_MAX {
        return Err(WireError::TooMany {
            what: text::DESCRIPTOR,
            count: descriptor.len() as u64,
            max: DESCRIPTOR_BYTES_MAX as u64,
        });
    }
    Ok(StagedSlot { stage, descriptor, lease_ms: r.u64(text::INTEGER)? })
}

fn put_staged_get(w: &mut Writer<'_>, g: &StagedGet) -> Result<(), super::values::Unrepresentable> {
    match g {
        StagedGet::Staged { slot, len, checksum } => {
            w.u8(0);
            put_staged_slot(w, slot);
            w.u64(*len);
            w.u64(checksum.0);
        }
        StagedGet::Miss(m) => {
            w.u8(1);
            put_miss(w, *m);
        }
    }
    Ok(())
}

fn get_staged_get(r: &mut Reader<'_>) -> Result<StagedGet, WireError> {
    match r.u8(text::STAGED_GET)? {
        0 => Ok(StagedGet::Staged {
            slot: get_staged_slot(r)?,
            len: r.u64(text::INTEGER)?,
            checksum: Checksum(r.u64(text::INTEGER)?),
        }),
        1 => Ok(StagedGet::Miss(get_miss(r)?)),
        tag => Err(WireError::UnknownTag { what: text::STAGED_GET, tag }),
    }
}

fn put_get(w: &mut Writer<'_>, g: &Get) -> Result<(), super::values::Unrepresentable> {
    match g {
        Get::Hit { len, checksum } => {
            w.u8(0);
            w.u64(*len);
            w.u64(checksum.0);
        }
        Get::Miss(m) => {
            w.u8(1);
            put_miss(w, *m);
        }
    }
    Ok(())
}

fn get_get(r: &mut Reader<'_>) -> Result<Get, WireError> {
    match r.u8(text::FETCHED)? {
        0 => Ok(Get::Hit { len: r.u64(text::INTEGER)?, checksum: Checksum(r.u64(text::INTEGER)?) }),
        1 => Ok(Get::Miss(get_miss(r)?)),
        tag => Err(WireError::UnknownTag { what: text::FETCHED, tag }),
    }
}

/// Appends `trailer` and its length, passing on an error the trailer's writer recorded.
fn finish_trailer(w: &mut Writer<'_>, written: Result<(), WireError>, trailer: &[u8]) {
    if let Err(e) = written {
        w.fail(e);
    }
    w.raw(trailer);
    w.len(trailer.len());
}

/// Reads a GET answer body: the trailer at its end (located by [`trailer_start`]), and each
/// hit's bytes from the payload part, in order. Both parts must be used up exactly.
fn read_get_answers(body: &[u8]) -> Result<Vec<Result<FetchedRef<'_>, StoreError>>, WireError> {
    let start = trailer_start(body).ok_or(WireError::Malformed { what: text::TRAILER })?;
    let (payloads, rest) = body.split_at(start);
    let trailer = rest.get(..rest.len().saturating_sub(4)).unwrap_or_default();
    let mut r = Reader::new(trailer);
    let mut bulk = Reader::new(payloads);
    let n = r.count()?;
    let mut items = r.batch(n);
    for _ in 0..n {
        items.push(match r.u8(text::RESULT)? {
            0 => Ok(match r.u8(text::FETCHED)? {
                0 => {
                    let checksum = Checksum(r.u64(text::INTEGER)?);
                    let len = usize::try_from(r.u32(text::BYTES)?)
                        .map_err(|_| WireError::Truncated { what: text::PAYLOADS })?;
                    FetchedRef::Hit { checksum, data: bulk.take(len, text::PAYLOADS)? }
                }
                1 => FetchedRef::Miss(get_miss(&mut r)?),
                tag => return Err(WireError::UnknownTag { what: text::FETCHED, tag }),
            }),
            1 => Err(super::values::get_store_error(&mut r)?),
            tag => return Err(WireError::UnknownTag { what: text::RESULT, tag }),
        });
    }
    r.finish()?;
    bulk.finish()?;
    Ok(items)
}

impl Response {
    pub fn op(&self) -> Op {
        match self {
            Self::Hello { .. } => Op::Hello,
            Self::Info(_) => Op::Info,
            Self::Epoch(_) => Op::Epoch,
            Self::Stats(_) => Op::Stats,
            Self::Lookup(_) => Op::Lookup,
            Self::Get(_) => Op::Get,
            Self::Put(_) => Op::Put,
            Self::Invalidate(_) => Op::Invalidate,
            Self::Reserve(_) => Op::Reserve,
            Self::Write(_) => Op::Write,
            Self::Commit(_) => Op::Commit,
            Self::Abort(_) => Op::Abort,
            Self::ExpireLeases(_) => Op::ExpireLeases,
            Self::Attest(_) => Op::Attest,
            Self::BumpEpoch(_) => Op::BumpEpoch,
            Self::ReclaimFenced(_) => Op::ReclaimFenced,
            Self::ShmAttach(_) => Op::ShmAttach,
            Self::GetShared(_) => Op::GetShared,
            Self::PutShared(_) => Op::PutShared,
            Self::NixlAttach(_) => Op::NixlAttach,
            Self::StageGet(_) => Op::StageGet,
            Self::ReservePut(_) => Op::ReservePut,
            Self::CommitPut(_) => Op::CommitPut,
            Self::Release(_) => Op::Release,
            Self::StageStats(_) => Op::StageStats,
            Self::Limits(_) => Op::Limits,
            Self::Locate(_) => Op::Locate,
            Self::Cluster(_) => Op::Cluster,
            Self::FillBegin(_) => Op::FillBegin,
            Self::FillFinish(_) => Op::FillFinish,
            Self::FillWait(_) => Op::FillWait,
            Self::Purge(_) => Op::Purge,
            Self::Condition(_) => Op::Condition,
            Self::Error(_) => Op::Error,
        }
    }

    /// Appends the body. Refuses (appending nothing) a batch over [`super::BATCH_ITEMS_MAX`].
    pub fn encode_body(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        let start = out.len();
        let mut w = Writer::new(out);
        self.write_body(&mut w);
        let result = w.finish();
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    fn write_body(&self, w: &mut Writer<'_>) {
        match self {
            Self::Hello { version, server, session, local } => {
                w.u8(*version);
                w.text(server);
                match session {
                    None => w.u8(0),
                    Some(s) => {
                        w.u8(1);
                        w.raw(&s.server_nonce);
                        w.u8(s.seal.code());
                    }
                }
                w.text(local.as_deref().unwrap_or_default());
            }
            Self::Info(info) => {
                w.text(&info.name);
                put_implementation(w, info.implementation);
                w.bool(info.failures_retire);
                put_full_policy(w, info.full_policy);
            }
            Self::Epoch(epoch) => w.u64(epoch.0),
            Self::Stats(stats) => put_stats(w, stats),
            Self::Lookup(items) => write_batch(w, items, put_lookup),
            Self::Locate(items) => write_batch(w, items, put_located),
            Self::FillBegin(begun) => put_fill_begun(w, begun),
            Self::FillFinish(notice) | Self::FillWait(notice) => put_fill_notice(w, *notice),
            Self::Cluster(status) => match status {
                None => w.u8(0),
                Some(s) => {
                    w.u8(1);
                    w.u64(s.node.0);
                    w.u64(s.epoch);
                    w.u8(s.not_admitting.map_or(0, |r| r.code() + 1));
                }
            },
            Self::Get(items) => {
                // Payloads first, then the trailer that describes them (FLAG_TRAILER).
                let mut trailer = Vec::new();
                let mut t = Writer::new(&mut trailer);
                t.count(items.len());
                for item in items {
                    if let Ok(Fetched::Hit { data, .. }) = item {
                        w.raw(data);
                    }
                    put_result(&mut t, item, put_fetched_meta);
                }
                finish_trailer(w, t.finish(), &trailer);
            }
            Self::Put(items) => write_batch(w, items, put_put),
            Self::Invalidate(items) => write_batch(w, items, put_invalidate),
            Self::Reserve(result) => put_result(w, result, put_reserve),
            Self::Write(result) => put_result(w, result, |_, ()| Ok(())),
            Self::Commit(result) => put_result(w, result, |w, c| {
                w.u64(c.checksum.0);
                Ok(())
            }),
            Self::Abort(result) => put_result(w, result, put_abort),
            Self::ExpireLeases(result) | Self::ReclaimFenced(result) => {
                put_result(w, result, |w, n| {
                    w.u64(*n);
                    Ok(())
                });
            }
            Self::Attest(result) => put_result(w, result, put_reclaimed),
            Self::Purge(result) => put_result(w, result, |w, p| {
                w.u64(p.removed);
                w.u64(p.busy);
                w.bool(p.more);
                Ok(())
            }),
            Self::BumpEpoch(result) => put_result(w, result, |w, e| {
                w.u64(e.0);
                Ok(())
            }),
            Self::ShmAttach(len) => w.u64(*len),
            Self::GetShared(items) => write_batch(w, items, put_get),
            Self::PutShared(items) => write_batch(w, items, put_put),
            Self::NixlAttach(metadata) => {
                if metadata.len() > AGENT_METADATA_BYTES_MAX {
                    w.fail(metadata_error(metadata.len()));
                }
                w.bytes(metadata);
            }
            Self::StageGet(items) => write_batch(w, items, put_staged_get),
            Self::ReservePut(result) => put_result(w, result, |w, slot| {
                put_staged_slot(w, slot);
                Ok(())
            }),
            Self::CommitPut(result) => put_result(w, result, put_put),
            Self::Release(open) => {
                w.count(open.len());
                for o in open {
                    w.bool(*o);
                }
            }
            Self::Limits(l) => w.option_u64(l.object_bytes_max),
            Self::Condition(c) => {
                // 0: the store tracks no I/O; 1: its last I/O succeeded; 2: it failed, and why.
                match &c.io_failure {
                    None => w.u8(0),
                    Some(None) => w.u8(1),
                    Some(Some(why)) => {
                        w.u8(2);
                        w.text(why);
                    }
                }
                w.option_u64(c.free_bytes);
                w.u64(c.block_overhead_bytes);
            }
            Self::StageStats(s) => {
                for n in [
                    s.staged,
                    s.committed,
                    s.released,
                    s.quarantined,
                    s.fenced,
                    s.open,
                    s.free_slots,
                    s.quarantined_slots,
                    s.peers,
                    s.slot_bytes,
                ] {
                    w.u64(n);
                }
            }
            Self::Error(e) => put_wire_error(w, e),
        }
    }

    /// Strictly decodes the body of a response frame of `op`.
    pub fn decode_body(op: Op, body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let response = Self::read_body(op, &mut r)?;
        r.finish()?;
        Ok(response)
    }

    fn read_body(op: Op, r: &mut Reader<'_>) -> Result<Self, WireError> {
        const N: &str = text::INTEGER;
        Ok(match op {
            Op::Hello => Self::Hello {
                version: r.u8(N)?,
                server: r.text(text::TEXT)?,
                session: match r.u8(text::HELLO_AUTH)? {
                    0 => None,
                    1 => Some(HelloSession {
                        server_nonce: r.array(text::HELLO_AUTH)?,
                        seal: get_seal_algorithm(r)?,
                    }),
                    tag => return Err(WireError::UnknownTag { what: text::HELLO_AUTH, tag }),
                },
                local: Some(r.text(text::TEXT)?).filter(|p| !p.is_empty()),
            },
            Op::Info => Self::Info(RemoteInfo {
                name: r.text(text::TEXT)?,
                implementation: get_implementation(r)?,
                failures_retire: r.bool(text::BOOL)?,
                full_policy: get_full_policy(r)?,
            }),
            Op::Epoch => Self::Epoch(Epoch(r.u64(N)?)),
            Op::Stats => Self::Stats(get_stats(r)?),
            Op::Lookup => Self::Lookup(read_batch(r, get_lookup)?),
            Op::Locate => Self::Locate(read_batch(r, get_located)?),
            Op::FillBegin => Self::FillBegin(get_fill_begun(r)?),
            Op::FillFinish => Self::FillFinish(get_fill_notice(r)?),
            Op::FillWait => Self::FillWait(get_fill_notice(r)?),
            Op::Cluster => Self::Cluster(match r.u8(text::NODE_STATUS)? {
                0 => None,
                1 => Some(NodeStatus {
                    node: NodeId(r.u64(N)?),
                    epoch: r.u64(N)?,
                    not_admitting: match r.u8(text::NOT_ADMITTING)? {
                        0 => None,
                        tag => Some(
                            NotAdmitting::from_code(tag - 1)
                                .ok_or(WireError::UnknownTag { what: text::NOT_ADMITTING, tag })?,
                        ),
                    },
                }),
                tag => return Err(WireError::UnknownTag { what: text::NODE_STATUS, tag }),
            }),
            Op::Get => Self::Get(
                read_get_answers(r.take_rest())?
                    .into_iter()
                    .map(|a| {
                        a.map(|f| match f {
                            FetchedRef::Hit { checksum, data } => {
                                Fetched::Hit { checksum, data: data.to_vec() }
                            }
                            FetchedRef::Miss(m) => Fetched::Miss(m),
                        })
                    })
                    .collect(),
            ),
            Op::Put => Self::Put(read_batch(r, |r, _| get_put(r))?),
            Op::Invalidate => Self::Invalidate(read_batch(r, |r, _| get_invalidate(r))?),
            Op::Reserve => Self::Reserve(get_result(r, get_reserve)?),
            Op::Write => Self::Write(get_result(r, |_| Ok(()))?),
            Op::Commit => {
                Self::Commit(get_result(r, |r| Ok(Committed { checksum: Checksum(r.u64(N)?) }))?)
            }
            Op::Abort => Self::Abort(get_result(r, get_abort)?),
            Op::ExpireLeases => Self::ExpireLeases(get_result(r, |r| r.u64(N))?),
            Op::Attest => Self::Attest(get_result(r, get_reclaimed)?),
            Op::BumpEpoch => Self::BumpEpoch(get_result(r, |r| Ok(Epoch(r.u64(N)?)))?),
            Op::ReclaimFenced => Self::ReclaimFenced(get_result(r, |r| r.u64(N))?),
            Op::ShmAttach => Self::ShmAttach(r.u64(N)?),
            Op::GetShared => Self::GetShared(read_batch(r, |r, _| get_get(r))?),
            Op::PutShared => Self::PutShared(read_batch(r, |r, _| get_put(r))?),
            Op::NixlAttach => Self::NixlAttach(get_metadata(r)?),
            Op::StageGet => Self::StageGet(read_batch(r, |r, _| get_staged_get(r))?),
            Op::ReservePut => Self::ReservePut(get_result(r, get_staged_slot)?),
            Op::CommitPut => Self::CommitPut(get_result(r, get_put)?),
            Op::Release => {
                let n = r.count()?;
                let mut open = r.batch(n);
                for _ in 0..n {
                    open.push(r.bool(text::BOOL)?);
                }
                Self::Release(open)
            }
            Op::StageStats => {
                const S: &str = text::STAGE_STATS;
                Self::StageStats(StagingStats {
                    staged: r.u64(S)?,
                    committed: r.u64(S)?,
                    released: r.u64(S)?,
                    quarantined: r.u64(S)?,
                    fenced: r.u64(S)?,
                    open: r.u64(S)?,
                    free_slots: r.u64(S)?,
                    quarantined_slots: r.u64(S)?,
                    peers: r.u64(S)?,
                    slot_bytes: r.u64(S)?,
                })
            }
            Op::Limits => {
                Self::Limits(ServerLimits { object_bytes_max: r.option_u64(text::INTEGER)? })
            }
            Op::Condition => {
                let io_failure = match r.u8(text::OPTION)? {
                    0 => None,
                    1 => Some(None),
                    2 => Some(Some(r.text(text::TEXT)?)),
                    _ => return Err(WireError::Malformed { what: "condition's I/O state" }),
                };
                Self::Condition(StoreCondition {
                    io_failure,
                    free_bytes: r.option_u64(text::INTEGER)?,
                    block_overhead_bytes: r.u64(text::INTEGER)?,
                })
            }
            Op::Purge => Self::Purge(get_result(r, |r| {
                Ok(Purged { removed: r.u64(N)?, busy: r.u64(N)?, more: r.bool(text::BOOL)? })
            })?),
            Op::Error => Self::Error(get_wire_error(r)?),
        })
    }
}

/// The frame methods requests and responses share: `$kind` is the frame kind they travel in.
/// (A server whose answer does not fit, [`WireError::TooLarge`], sends
/// [`WireError::ResponseTooLarge`] instead.)
macro_rules! frame_codec {
    ($message:ty, $kind:expr) => {
        impl $message {
            /// Appends a whole frame (header and body) for `request_id`; appends nothing on
            /// error.
            pub fn encode_frame(
                &self,
                request_id: u64,
                out: &mut Vec<u8>,
            ) -> Result<(), WireError> {
                self.encode_sealed_frame(request_id, None, out)
            }

            /// [`Self::encode_frame`], sealed with `seal` when given.
            pub fn encode_sealed_frame(
                &self,
                request_id: u64,
                seal: Option<&SealKey>,
                out: &mut Vec<u8>,
            ) -> Result<(), WireError> {
                write_frame($kind, self.op(), request_id, seal, out, |w| self.write_body(w))
            }

            /// A whole frame for `request_id`.
            pub fn to_frame_bytes(&self, request_id: u64) -> Result<Vec<u8>, WireError> {
                let mut out = Vec::new();
                self.encode_frame(request_id, &mut out)?;
                Ok(out)
            }

            /// Decodes a frame the [`super::FrameDecoder`] produced.
            pub fn from_frame(frame: &Frame) -> Result<Self, WireError> {
                if frame.kind != $kind {
                    return Err(WireError::WrongKind { expected: $kind, found: frame.kind });
                }
                Self::decode_body(frame.op, &frame.body)
            }
        }
    };
}

frame_codec!(Request, Kind::Request);
frame_codec!(Response, Kind::Response);

fn put_fill_ticket(w: &mut Writer<'_>, t: &FillTicket) {
    w.u64(t.fill);
    w.u64(t.epoch.0);
}

fn get_fill_ticket(r: &mut Reader<'_>) -> Result<FillTicket, WireError> {
    Ok(FillTicket { fill: r.u64(text::INTEGER)?, epoch: Epoch(r.u64(text::INTEGER)?) })
}

fn put_fill_lease(w: &mut Writer<'_>, l: &FillLease) {
    put_fill_ticket(w, &l.ticket);
    w.u64(l.deadline_ms);
}

fn get_fill_lease(r: &mut Reader<'_>) -> Result<FillLease, WireError> {
    Ok(FillLease { ticket: get_fill_ticket(r)?, deadline_ms: r.u64(text::INTEGER)? })
}

/// 0 Pending, 1 Finished, 2 Failed, 3 Fenced.
fn put_fill_notice(w: &mut Writer<'_>, n: FillNotice) {
    w.u8(match n {
        FillNotice::Pending => 0,
        FillNotice::Finished => 1,
        FillNotice::Failed => 2,
        FillNotice::Fenced => 3,
    });
}

fn get_fill_notice(r: &mut Reader<'_>) -> Result<FillNotice, WireError> {
    Ok(match r.u8(text::FILL_NOTICE)? {
        0 => FillNotice::Pending,
        1 => FillNotice::Finished,
        2 => FillNotice::Failed,
        3 => FillNotice::Fenced,
        tag => return Err(WireError::UnknownTag { what: text::FILL_NOTICE, tag }),
    })
}

/// 0 Lead `lease`; 1 Join `ticket`; 2 refused for its epoch `asked`, `current`; 3 draining;
/// 4 too many `max`; 5 no credits `detail`; 6 forbidden `detail`.
fn put_fill_begun(w: &mut Writer<'_>, begun: &Result<FillStart, FillRefused>) {
    match begun {
        Ok(FillStart::Lead(lease)) => {
            w.u8(0);
            put_fill_lease(w, lease);
        }
        Ok(FillStart::Join(ticket)) => {
            w.u8(1);
            put_fill_ticket(w, ticket);
        }
        Err(FillRefused::Epoch { asked, current }) => {
            w.u8(2);
            w.u64(*asked);
            w.u64(*current);
        }
        Err(FillRefused::Draining) => w.u8(3),
        Err(FillRefused::TooMany { max }) => {
            w.u8(4);
            w.u64(*max);
        }
        Err(FillRefused::Credits { detail }) => {
            w.u8(5);
            w.text(detail);
        }
        Err(FillRefused::Forbidden { detail }) => {
            w.u8(6);
            w.text(detail);
        }
    }
}

fn get_fill_begun(r: &mut Reader<'_>) -> Result<Result<FillStart, FillRefused>, WireError> {
    const N: &str = text::INTEGER;
    Ok(match r.u8(text::FILL_START)? {
        0 => Ok(FillStart::Lead(get_fill_lease(r)?)),
        1 => Ok(FillStart::Join(get_fill_ticket(r)?)),
        2 => Err(FillRefused::Epoch { asked: r.u64(N)?, current: r.u64(N)? }),
        3 => Err(FillRefused::Draining),
        4 => Err(FillRefused::TooMany { max: r.u64(N)? }),
        5 => Err(FillRefused::Credits { detail: r.text(text::TEXT)? }),
        6 => Err(FillRefused::Forbidden { detail: r.text(text::TEXT)? }),
        tag => return Err(WireError::UnknownTag { what: text::FILL_START, tag }),
    })
}
