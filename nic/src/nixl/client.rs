//! [`NixlClient`]: a GPUCache client whose block payloads move over NIXL while the GPCW
//! connection ([`TcpStore`]) carries control: the server stages a block in its registered
//! memory and this side READs it into its own registered slot (GET), or this side WRITEs its
//! slot into a slot the server leased (PUT).
//!
//! A GET's bytes reach the caller only after their checksum verifies in this side's slot; a
//! mismatch is a miss, never a wrong hit. The caller's buffer is never registered or handed to
//! NIXL, so every failure leaves it untouched (`failures_retire`). A transfer whose outcome is
//! unknown quarantines this side's slot until [`NixlClient::fence`].

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use gpucache_client::TcpStore;
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{Refusal, RequestId};
use gpucache_dataplane::registry::{RegionCounts, RegionId, RegisteredPool, SlotLease};
use gpucache_dataplane::store::{
    BatchAnswers, Get, Invalidate, Lookup, MissReason, Put, Retirement, Store, StoreError,
    StoreInfo, StoreLayer,
};
use gpucache_storage::host::pool::HugePagePolicy;
use gpucache_wire::GetItem;
use gpucache_wire::staging::{StageCallError, StageId, StagedGet, StagedSlot, StagingFailure};

use super::agent::{NixlAgent, NixlBackend};
use super::memory::NixlSlots;
use super::wire::RemoteBlock;
use super::xfer::{NixlCounters, NixlLimits, NixlOutcome, NixlTransfers};
use crate::error::NicError;

/// How to build a [`NixlClient`].
#[derive(Debug, Clone)]
pub struct NixlClientConfig {
    pub agent_name: String,
    /// Bytes per slot of this side's pool: the largest block it moves.
    pub slot_bytes: usize,
    /// Slots of this side's pool: the transfers in flight at once, plus quarantined ones.
    pub slots: usize,
    /// Wall-clock deadline of one READ or WRITE.
    pub deadline: Duration,
    pub huge_pages: HugePagePolicy,
}

/// Why a NIXL GET or PUT failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NixlClientError {
    #[error(transparent)]
    Nic(#[from] NicError),
    #[error(transparent)]
    Stage(#[from] StageCallError),
    /// The transfer's outcome is unknown: this side's slot is quarantined until a fence.
    #[error("the NIXL transfer for {region} has an unknown outcome; its slot is quarantined")]
    Unknown { region: RegionId },
    #[error("the server's block descriptor does not decode: {detail}")]
    Descriptor { detail: String },
    #[error("the client is not attached to the server's NIXL agent (call attach)")]
    NotAttached,
}

impl From<StoreError> for NixlClientError {
    fn from(e: StoreError) -> Self {
        Self::Stage(StageCallError::Store(e))
    }
}

/// What the client's transfers did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NixlClientCounters {
    pub gets: u64,
    pub hits: u64,
    pub puts: u64,
    /// Blocks READ whose bytes did not match the server's checksum (answered as misses).
    pub checksum_mismatches: u64,
    /// Transfers whose outcome is unknown.
    pub unknown: u64,
    /// Attaches made again because the server's or this side's fence re-registered memory.
    pub reattached: u64,
    pub transfers: NixlCounters,
}

#[derive(Debug)]
struct Inner {
    agent: NixlAgent,
    pool: RegisteredPool<NixlSlots>,
    xfers: NixlTransfers,
    /// The server's agent, once attached.
    server: Option<String>,
    /// This side's fence re-registered the pool: the server must load its metadata again.
    reattach_due: bool,
    counters: NixlClientCounters,
}

/// A NIXL-capable client of one `gpucache serve`.
#[derive(Debug)]
pub struct NixlClient {
    store: TcpStore,
    inner: Mutex<Inner>,
}

fn transport(operation: &'static str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend { operation, detail: e.to_string(), retirement: Retirement::Retired }
}

impl NixlClient {
    /// Creates this side's agent (UCX) and registered pool; attach before moving blocks.
    pub fn new(store: TcpStore, config: NixlClientConfig) -> Result<Self, NicError> {
        let mut agent = NixlAgent::new(&config.agent_name)?;
        agent.enable(NixlBackend::Ucx)?;
        let pool = NixlSlots::pool(&agent, config.slots, config.slot_bytes, config.huge_pages)?;
        let limits = NixlLimits { deadline: config.deadline, ..NixlLimits::default() };
        Ok(Self {
            store,
            inner: Mutex::new(Inner {
                agent,
                pool,
                xfers: NixlTransfers::new(limits),
                server: None,
                reattach_due: false,
                counters: NixlClientCounters::default(),
            }),
        })
    }

    /// Moves the control channel to `store`, keeping this side's agent, its registered pool and
    /// the server agent it attached to. Over the new connection the server must serve the same
    /// staging agent, or [`Self::attach`] must run again (a server restarted with a new agent).
    pub fn reconnect(self, store: TcpStore) -> Self {
        Self { store, inner: self.inner }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Exchanges metadata with the server's agent (NIXL_ATTACH) as `caller`.
    pub fn attach(&self, caller: &Caller) -> Result<String, NixlClientError> {
        let mut inner = self.lock();
        self.attach_locked(&mut inner, caller)
    }

    fn attach_locked(&self, inner: &mut Inner, caller: &Caller) -> Result<String, NixlClientError> {
        let ours = inner.agent.local_metadata()?;
        let theirs = self.store.nixl_attach(caller, &ours)?;
        let server = inner.agent.load_peer(&theirs)?;
        inner.server = Some(server.clone());
        inner.reattach_due = false;
        Ok(server)
    }

    /// Attaches again when this side's fence asked for it.
    fn ready(&self, inner: &mut Inner, caller: &Caller) -> Result<(), NixlClientError> {
        if inner.server.is_none() {
            return Err(NixlClientError::NotAttached);
        }
        if inner.reattach_due {
            self.attach_locked(inner, caller)?;
            inner.counters.reattached += 1;
        }
        Ok(())
    }

    /// Runs a stage op; when the server answers that a fence re-registered its memory since
    /// this side attached, attaches again (new metadata both ways) and runs it once more.
    fn staged<T>(
        &self,
        inner: &mut Inner,
        caller: &Caller,
        op: impl Fn() -> Result<T, StageCallError>,
    ) -> Result<T, NixlClientError> {
        match op() {
            Err(e) if e.refusal() == Some(StagingFailure::Reattach) => {
                self.attach_locked(inner, caller)?;
                inner.counters.reattached += 1;
                Ok(op()?)
            }
            other => Ok(other?),
        }
    }

    pub fn counters(&self) -> NixlClientCounters {
        let inner = self.lock();
        NixlClientCounters { transfers: inner.xfers.counters(), ..inner.counters }
    }

    /// This side's pool regions by state.
    pub fn region_counts(&self) -> RegionCounts {
        self.lock().pool.table().counts()
    }

    pub fn free_slots(&self) -> usize {
        self.lock().pool.free_slots()
    }

    /// Unknown-outcome transfers not yet fenced.
    pub fn abandoned(&self) -> usize {
        self.lock().xfers.abandoned()
    }

    /// Expires this side's slot leases at `now_ms` (they carry none: nothing is freed).
    pub fn expire_leases(&self, now_ms: u64) -> usize {
        self.lock().pool.expire_leases(now_ms).len()
    }

    /// The client's fence: releases abandoned requests, drops the metadata of the peers they
    /// targeted, advances the pool's epoch, reclaims every slot lent before it and registers
    /// the pool anew. The next GET or PUT attaches again (the server must load the new
    /// metadata); if the server's metadata was dropped, call [`Self::attach`].
    pub fn fence(&self) -> Result<usize, NicError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let proofs = inner.xfers.fence(&mut inner.agent, &mut inner.pool)?;
        inner.reattach_due = true;
        if let Some(server) = &inner.server
            && !inner.agent.knows_peer(server)
        {
            inner.server = None;
        }
        Ok(proofs.len())
    }

    /// STAGE_GET, READ into this side's slot, verify, copy into `dst`, RELEASE.
    pub fn get(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, NixlClientError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        inner.counters.gets += 1;
        self.ready(inner, caller)?;
        let item = GetItem { key: key.clone(), capacity: dst.len() as u64 };
        let mut staged = self
            .staged(inner, caller, || self.store.stage_get(caller, std::slice::from_ref(&item)))?;
        let (slot, len, checksum) = match staged.pop() {
            Some(Ok(StagedGet::Staged { slot, len, checksum })) => (slot, len, checksum),
            Some(Ok(StagedGet::Miss(m))) => {
                if m == MissReason::Corrupt {
                    // As the store does: nothing of a corrupt block stays in the caller's buffer.
                    dst.fill(0);
                }
                return Ok(Get::Miss(m));
            }
            Some(Err(e)) => return Err(e.into()),
            None => return Err(transport("get", "no answer for the key").into()),
        };
        let stage = slot.stage;
        let result = read_verified(inner, caller, &slot.descriptor, len, checksum, dst);
        match &result {
            // The server's slot may still be read by our abandoned request: it must not hear
            // "done" from us; its lease running out (or our connection's close) quarantines it.
            Err(NixlClientError::Unknown { .. }) => inner.counters.unknown += 1,
            _ => {
                let _ = self.store.release_stages(caller, &[stage]);
            }
        }
        match result {
            Ok(true) => {
                inner.counters.hits += 1;
                Ok(Get::Hit { len, checksum })
            }
            Ok(false) => {
                inner.counters.checksum_mismatches += 1;
                dst.fill(0);
                Ok(Get::Miss(MissReason::Corrupt))
            }
            Err(e) => Err(e),
        }
    }

    /// Copy into this side's slot, RESERVE_PUT, WRITE, COMMIT_PUT.
    pub fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, NixlClientError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        inner.counters.puts += 1;
        self.ready(inner, caller)?;
        if src.is_empty() {
            return Err(StoreError::EmptyObject.into());
        }
        let checksum = Checksum::of(src);
        let lease = checkout(inner, &caller.tenant)?;
        let reserve = || self.store.reserve_put(caller, key, src.len() as u64, checksum, request);
        let staged: StagedSlot = match self.staged(inner, caller, reserve) {
            Ok(s) => s,
            Err(e) => {
                let _ = inner.xfers.release(&mut inner.pool, &lease);
                return Err(e);
            }
        };
        let remote = match RemoteBlock::decode(&staged.descriptor) {
            Ok(r) => r,
            Err(e) => {
                let _ = inner.xfers.release(&mut inner.pool, &lease);
                let _ = self.store.release_stages(caller, &[staged.stage]);
                return Err(NixlClientError::Descriptor { detail: e.to_string() });
            }
        };
        let written = (|| {
            let slot = inner
                .pool
                .slot_bytes_mut(&lease)
                .ok_or(NicError::LeaseNotUsable { region: lease.region })?;
            let slot_bytes = slot.len() as u64;
            slot.get_mut(..src.len())
                .ok_or(NicError::TooLong { len_bytes: src.len() as u64, slot_bytes })?
                .copy_from_slice(src);
            inner.xfers.write(&inner.agent, &mut inner.pool, &lease, &remote)
        })();
        match written {
            Ok(NixlOutcome::Done { .. }) => {
                let _ = inner.xfers.release(&mut inner.pool, &lease);
                Ok(self.store.commit_put(caller, staged.stage)?)
            }
            Ok(NixlOutcome::Unknown { region, .. }) => {
                inner.counters.unknown += 1;
                // Never commit: the server's lease quarantines its slot.
                Err(NixlClientError::Unknown { region })
            }
            Err(e) => {
                let _ = inner.xfers.release(&mut inner.pool, &lease);
                // Nothing was posted: the server's slot is untouched.
                let _ = self.store.release_stages(caller, &[staged.stage]);
                Err(e.into())
            }
        }
    }

    /// RELEASE of stages this side opened by hand (tests, tools).
    pub fn release(
        &self,
        caller: &Caller,
        stages: &[StageId],
    ) -> Result<Vec<bool>, StageCallError> {
        self.store.release_stages(caller, stages)
    }
}

fn checkout(inner: &mut Inner, owner: &TenantId) -> Result<SlotLease, NicError> {
    let leases = inner.pool.checkout(owner, 1, None).map_err(|e| NicError::QueueFull {
        outstanding: inner.pool.table().len(),
        depth: match e {
            gpucache_dataplane::registry::PoolError::Exhausted { total, .. } => total,
            _ => 0,
        },
    })?;
    Ok(leases[0])
}

/// READs the described block into a fresh slot of this side, checks it against `checksum`
/// and copies it into `dst`. `Ok(false)`: the bytes did not match (nothing copied).
fn read_verified(
    inner: &mut Inner,
    caller: &Caller,
    descriptor: &[u8],
    len: u64,
    checksum: Checksum,
    dst: &mut [u8],
) -> Result<bool, NixlClientError> {
    let remote = RemoteBlock::decode(descriptor)
        .map_err(|e| NixlClientError::Descriptor { detail: e.to_string() })?;
    if remote.len_bytes != len {
        return Err(NixlClientError::Descriptor {
            detail: format!("describes {} bytes, the answer says {len}", remote.len_bytes),
        });
    }
    let n = usize::try_from(len).unwrap_or(usize::MAX);
    if n > dst.len() {
        return Err(StoreError::BufferTooSmall { needed: len, provided: dst.len() as u64 }.into());
    }
    let lease = checkout(inner, &caller.tenant)?;
    match inner.xfers.read(&inner.agent, &mut inner.pool, &lease, &remote) {
        Ok(NixlOutcome::Done { .. }) => {}
        Ok(NixlOutcome::Unknown { region, .. }) => return Err(NixlClientError::Unknown { region }),
        Err(e) => {
            let _ = inner.xfers.release(&mut inner.pool, &lease);
            return Err(e.into());
        }
    }
    let slot = inner.pool.slot_bytes_mut(&lease).map(|s| &s[..n]);
    let ok = slot.is_some_and(|bytes| {
        let matches = Checksum::of(bytes) == checksum;
        if matches {
            dst[..n].copy_from_slice(bytes);
        }
        matches
    });
    let _ = inner.xfers.release(&mut inner.pool, &lease);
    Ok(ok)
}

fn store_error(operation: &'static str, e: NixlClientError) -> StoreError {
    match e {
        NixlClientError::Stage(StageCallError::Store(e)) => e,
        // The caller's buffer is never handed to NIXL: every failure is retired for it.
        other => transport(operation, other),
    }
}

/// The store contract over NIXL: GET and PUT move payloads over NIXL, everything else is the
/// plain GPCW call.
impl StoreLayer for NixlClient {
    type Inner = TcpStore;

    fn inner(&self) -> &TcpStore {
        &self.store
    }
}

impl Store for NixlClient {
    fn info(&self) -> StoreInfo {
        StoreInfo { name: "nixl", ..self.store.info() }
    }
    // Lookups and removals carry no payload: they are the GPCW batch calls. GET and PUT batches
    // go item by item through the NIXL paths above (the layer's defaults).
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        self.store.lookup_batch(caller, keys)
    }
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        self.store.invalidate_batch(caller, keys)
    }
    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        self.get(caller, key, dst).map_err(|e| store_error("get", e))
    }
    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        match NixlClient::put(self, caller, key, src, request) {
            Ok(put) => Ok(put),
            Err(NixlClientError::Stage(e)) if e.refusal() == Some(StagingFailure::TooLarge) => {
                too_large_for_a_slot(&self.store, caller, key, src.len() as u64, e)
            }
            Err(e) => Err(store_error("put", e)),
        }
    }
    gpucache_dataplane::forward_store!(
        fences, reports, lookup, reserve, write, commit, abort, invalidate, scope_keys
    );
}

/// A PUT the server's staging slots cannot hold. A block over the store's own limit gets the
/// contract's answer (the key's committed block first, then the refusal with its numbers); one
/// the store would take but a slot cannot stays a failure of the NIXL path, which does not fall
/// back to another transport.
fn too_large_for_a_slot(
    store: &TcpStore,
    caller: &Caller,
    key: &PhysicalKey,
    len: u64,
    refused: StageCallError,
) -> Result<Put, StoreError> {
    let max = store.limits()?.object_bytes_max;
    match max {
        Some(max) if len > max => match store.lookup(caller, key)? {
            Lookup::Hit { .. } => Ok(Put::AlreadyCommitted),
            _ => Ok(Put::Refused(Refusal::ObjectTooLarge { bytes: len, max })),
        },
        _ => Err(store_error("put", NixlClientError::Stage(refused))),
    }
}
