//! [`MooncakeStore`]: the [`Store`] contract over one sidecar.
//!
//! Owns the key mapping, the object header check, the staging of multi-piece PUTs and the
//! decision to stop moving payload after an unproven result. Result codes mean what
//! [`super::results`] says, nothing else.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Mutex, MutexGuard};

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::store::{
    Abort, Committed, FullPolicy, Get, Implementation, Invalidate, Lookup, MissReason, Put,
    Reclaimed, Reservation, Reserve, Retirement, Store, StoreError, StoreInfo, StoreStats,
    WrittenRanges, authorize,
};
use gpucache_dataplane::{Checksum, PhysicalKey, RequestId, TenantId};

use super::MooncakeError;
use super::results::{self, Call, GetResult, MooncakeFailure, PutResult, Raw, RemoveResult};
use super::sidecar::{Sidecar, SidecarConfig};
use super::wire::{self, Op};

/// A [`MooncakeStore`]'s settings; [`MooncakeConfig::build`] starts the sidecar.
#[derive(Debug, Clone)]
pub struct MooncakeConfig {
    pub sidecar: SidecarConfig,
    /// Most PUTs staged between reserve and commit at once.
    pub reservations_max: NonZeroUsize,
    /// Prefix of every object key (empty: none), so that several stores share one cluster
    /// without seeing each other's objects: ASCII letters and digits, at most
    /// [`wire::NAMESPACE_BYTES_MAX`].
    pub namespace: String,
}

impl MooncakeConfig {
    /// Starts the sidecar and connects to it.
    pub fn build(self) -> Result<MooncakeStore, MooncakeError> {
        if self.sidecar.buffer_bytes.get() <= wire::OBJECT_HEADER_BYTES {
            return Err(MooncakeError::Config {
                detail: format!(
                    "buffer_bytes {} must exceed the {}-byte object header",
                    self.sidecar.buffer_bytes,
                    wire::OBJECT_HEADER_BYTES
                ),
            });
        }
        if !wire::valid_namespace(&self.namespace) {
            return Err(MooncakeError::Config {
                detail: format!(
                    "namespace {:?} must be at most {} ASCII letters and digits",
                    self.namespace,
                    wire::NAMESPACE_BYTES_MAX
                ),
            });
        }
        let sidecar = Sidecar::start(&self.sidecar)?;
        tracing::info!(pid = sidecar.pid(), master = %self.sidecar.master, "mooncake sidecar ready");
        Ok(MooncakeStore {
            payload_bytes_max: (self.sidecar.buffer_bytes.get() - wire::OBJECT_HEADER_BYTES) as u64,
            reservations_max: self.reservations_max.get(),
            namespace: self.namespace,
            inner: Mutex::new(Inner {
                sidecar,
                broken: None,
                payload_halted: None,
                // The first epoch is 1, as in every store: `reclaim_fenced(Epoch(0))` names
                // an epoch that never was current and is refused.
                epoch: 1,
                next_region: 1,
                staged: HashMap::new(),
                quarantined: HashMap::new(),
            }),
        })
    }
}

struct Staged {
    tenant: TenantId,
    key: String,
    epoch: u64,
    bytes: Vec<u8>,
    written: WrittenRanges,
}

struct Inner {
    sidecar: Sidecar,
    /// Set when the socket fell out of step: nothing is sent again.
    broken: Option<String>,
    /// Set after an unretired PUT or GET: the sidecar's buffer may still be in use by the SDK,
    /// so no payload moves again (queries and removes still run).
    payload_halted: Option<String>,
    epoch: u64,
    next_region: u64,
    staged: HashMap<RegionId, Staged>,
    /// Reservations aborted with an unknown outcome, with their owner and size.
    quarantined: HashMap<RegionId, (TenantId, u64, u64)>,
}

/// A GPUCache store over a live Mooncake Store, through a Python sidecar.
pub struct MooncakeStore {
    payload_bytes_max: u64,
    reservations_max: usize,
    namespace: String,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for MooncakeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeStore").field("payload_bytes_max", &self.payload_bytes_max).finish()
    }
}

fn refused(operation: &'static str, detail: String) -> StoreError {
    StoreError::Backend { operation, detail, retirement: Retirement::Retired }
}

impl MooncakeStore {
    /// The largest payload one object may hold (the sidecar buffer less the header).
    pub fn payload_bytes_max(&self) -> u64 {
        self.payload_bytes_max
    }

    /// The Mooncake key this store uses for `key` (within its namespace).
    pub fn object_key(&self, key: &PhysicalKey) -> String {
        wire::object_key_in(&self.namespace, key)
    }

    /// The sidecar's process id.
    pub fn sidecar_pid(&self) -> u32 {
        self.lock().sidecar.pid()
    }

    /// One SDK call with its raw answer, for validation and diagnostics: it bypasses the
    /// result mapping but not the halts (a broken socket, halted payload). A GET's bytes are
    /// dropped.
    pub fn raw_call(
        &self,
        op: Op,
        key: &str,
        argument: u64,
        payload: &[u8],
    ) -> Result<Raw, StoreError> {
        let call = match op {
            Op::Put => Call::Put,
            Op::Get => Call::Get,
            Op::Size => Call::Size,
            Op::Exists => Call::Exists,
            Op::Remove => Call::Remove,
        };
        let mut inner = self.lock();
        Self::exchange(&mut inner, call, op, key, argument, &[payload]).map(|(raw, _)| raw)
    }

    /// The native PUT without the existence check: a duplicate is answered `0` by Mooncake
    /// 0.3.13 and reported as [`Put::Committed`] although the first value stays (results.rs).
    pub fn put_unchecked(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
    ) -> Result<Put, StoreError> {
        authorize(caller, key, Right::Write)?;
        self.check_len("mooncake put", src.len() as u64)?;
        let name = self.object_key(key);
        let mut inner = self.lock();
        let (result, checksum) = self.put_object(&mut inner, &name, src)?;
        Ok(result.into_put(checksum))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One exchange, mapped: a broken socket or halted payload path refuses before sending;
    /// a transport failure breaks the socket and is as unproven as the call it interrupted.
    fn exchange(
        inner: &mut Inner,
        call: Call,
        op: Op,
        key: &str,
        argument: u64,
        payload: &[&[u8]],
    ) -> Result<(Raw, Vec<u8>), StoreError> {
        if let Some(why) = &inner.broken {
            return Err(refused(call.name(), format!("sidecar unusable: {why}")));
        }
        let moves_payload = matches!(op, Op::Put | Op::Get);
        if let (true, Some(why)) = (moves_payload, &inner.payload_halted) {
            return Err(refused(
                call.name(),
                format!("payload halted after an unproven result ({why}); restart required"),
            ));
        }
        match inner.sidecar.call(op, key, argument, payload) {
            Ok(answer) => Ok(answer),
            Err(e) => {
                let detail = e.to_string();
                let kind = e.io_kind();
                inner.broken = Some(detail.clone());
                // Whether the sidecar entered the SDK call is unknown: treat it as raised.
                let failure = match call {
                    Call::Put => results::put_result(Raw::Raised).err(),
                    Call::Get => results::get_result(Raw::Raised, argument).err(),
                    Call::Size => results::size_result(Raw::Raised).err(),
                    Call::Exists => results::exists_result(Raw::Raised).err(),
                    Call::Remove => results::remove_result(Raw::Raised).err(),
                };
                let retirement = failure.map_or(Retirement::Unknown, |f| f.retirement);
                if retirement == Retirement::Unknown {
                    inner.payload_halted = Some(detail.clone());
                }
                let operation = call.name();
                Err(match kind {
                    Some(kind) => StoreError::Io { operation, kind, detail, retirement },
                    None => StoreError::Backend { operation, detail, retirement },
                })
            }
        }
    }

    fn fail(inner: &mut Inner, f: MooncakeFailure) -> StoreError {
        if f.retirement == Retirement::Unknown {
            inner.payload_halted = Some(f.to_string());
        }
        f.into()
    }

    fn exists(inner: &mut Inner, key: &str) -> Result<bool, StoreError> {
        let (raw, _) = Self::exchange(inner, Call::Exists, Op::Exists, key, 0, &[])?;
        results::exists_result(raw).map_err(|f| Self::fail(inner, f))
    }

    /// The stored object's size (header included), or `None` when absent.
    fn size(inner: &mut Inner, key: &str) -> Result<Option<u64>, StoreError> {
        let (raw, _) = Self::exchange(inner, Call::Size, Op::Size, key, 0, &[])?;
        results::size_result(raw).map_err(|f| Self::fail(inner, f))
    }

    /// The create-only PUT of a whole payload under an object key.
    fn put_object(
        &self,
        inner: &mut Inner,
        key: &str,
        payload: &[u8],
    ) -> Result<(PutResult, Checksum), StoreError> {
        let header = wire::object_header(payload);
        let (raw, _) = Self::exchange(inner, Call::Put, Op::Put, key, 0, &[&header, payload])?;
        let result = results::put_result(raw).map_err(|f| Self::fail(inner, f))?;
        Ok((result, Checksum::of(payload)))
    }

    fn check_len(&self, operation: &'static str, len: u64) -> Result<(), StoreError> {
        if len == 0 {
            return Err(StoreError::EmptyObject);
        }
        if len > self.payload_bytes_max {
            return Err(refused(
                operation,
                format!(
                    "{len} bytes exceed the sidecar's {}-byte payload limit",
                    self.payload_bytes_max
                ),
            ));
        }
        Ok(())
    }
}

impl Store for MooncakeStore {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            name: "mooncake",
            implementation: Implementation::Real,
            // Some Mooncake failures do not prove the transfer stopped (results.rs).
            failures_retire: false,
            full_policy: FullPolicy::Refuse,
        }
    }

    fn epoch(&self) -> Epoch {
        Epoch(self.lock().epoch)
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        authorize(caller, key, Right::Read)?;
        let name = self.object_key(key);
        let mut inner = self.lock();
        if !Self::exists(&mut inner, &name)? {
            return Ok(Lookup::Miss(MissReason::Absent));
        }
        Ok(match Self::size(&mut inner, &name)? {
            None => Lookup::Miss(MissReason::Absent),
            Some(n) if n <= wire::OBJECT_HEADER_BYTES as u64 => Lookup::Miss(MissReason::Corrupt),
            Some(n) => Lookup::Hit { len: n - wire::OBJECT_HEADER_BYTES as u64 },
        })
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        authorize(caller, key, Right::Read)?;
        let name = self.object_key(key);
        let mut inner = self.lock();
        let Some(object_bytes) = Self::size(&mut inner, &name)? else {
            return Ok(Get::Miss(MissReason::Absent));
        };
        let header = wire::OBJECT_HEADER_BYTES as u64;
        if object_bytes <= header || object_bytes - header > self.payload_bytes_max {
            // Not an object this adapter wrote (or one too large for the buffer to carry).
            return Ok(Get::Miss(MissReason::Corrupt));
        }
        let len = object_bytes - header;
        if len > dst.len() as u64 {
            return Err(StoreError::BufferTooSmall { needed: len, provided: dst.len() as u64 });
        }
        let (raw, object) =
            Self::exchange(&mut inner, Call::Get, Op::Get, &name, object_bytes, &[])?;
        match results::get_result(raw, object_bytes).map_err(|f| Self::fail(&mut inner, f))? {
            GetResult::Missing => return Ok(Get::Miss(MissReason::Absent)),
            GetResult::Read => {}
        }
        let Some((found, payload)) = wire::parse_object(&object) else {
            return Ok(Get::Miss(MissReason::Corrupt));
        };
        // Paired with the checksum written into the header at PUT.
        if Checksum::of(payload) != found.checksum {
            return Ok(Get::Miss(MissReason::Corrupt));
        }
        dst[..payload.len()].copy_from_slice(payload);
        Ok(Get::Hit { len: found.len, checksum: found.checksum })
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        authorize(caller, key, Right::Write)?;
        self.check_len("mooncake reserve", len)?;
        let name = self.object_key(key);
        let mut inner = self.lock();
        if inner.staged.len() >= self.reservations_max {
            return Err(refused(
                "mooncake reserve",
                format!("{} reservations already staged", self.reservations_max),
            ));
        }
        // Create-only: a key being written under another reservation is busy until that one
        // commits or aborts.
        let epoch = inner.epoch;
        if inner.staged.values().any(|s| s.key == name && s.epoch == epoch) {
            return Ok(Reserve::Busy);
        }
        if Self::exists(&mut inner, &name)? {
            return Ok(Reserve::AlreadyCommitted);
        }
        let region = RegionId(inner.next_region);
        inner.next_region += 1;
        let bytes = vec![0_u8; usize::try_from(len).unwrap_or(usize::MAX)];
        inner.staged.insert(
            region,
            Staged {
                tenant: caller.tenant.clone(),
                key: name,
                epoch,
                bytes,
                written: WrittenRanges::default(),
            },
        );
        Ok(Reserve::Reserved(Reservation { region, epoch: Epoch(epoch), len, request }))
    }

    fn write(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let epoch = inner.epoch;
        let staged = inner
            .staged
            .get_mut(&reservation.region)
            .filter(|s| s.epoch == epoch)
            .ok_or(StoreError::UnknownReservation { region: reservation.region })?;
        if staged.tenant != caller.tenant {
            return Err(StoreError::WrongTenant {
                caller: caller.tenant.clone(),
                owner: staged.tenant.clone(),
            });
        }
        let capacity = staged.bytes.len() as u64;
        let end = offset
            .checked_add(src.len() as u64)
            .filter(|&e| e <= capacity)
            .ok_or(StoreError::WriteOutOfBounds { offset, len: src.len() as u64, capacity })?;
        // Both ends are within a buffer that exists, so they fit usize.
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let stop = start + src.len();
        staged.written.add(offset, end)?;
        staged.bytes[start..stop].copy_from_slice(src);
        Ok(())
    }

    fn commit(&self, caller: &Caller, reservation: &Reservation) -> Result<Committed, StoreError> {
        let mut inner = self.lock();
        let epoch = inner.epoch;
        let region = reservation.region;
        match inner.staged.get(&region) {
            Some(s) if s.tenant == caller.tenant && s.epoch == epoch => {
                let written = s.written.covered();
                let expected = s.bytes.len() as u64;
                if written != expected {
                    return Err(StoreError::Incomplete { written, expected });
                }
            }
            _ => return Err(StoreError::UnknownReservation { region }),
        }
        let staged =
            inner.staged.remove(&region).ok_or(StoreError::UnknownReservation { region })?;
        let (_, checksum) = self.put_object(&mut inner, &staged.key, &staged.bytes)?;
        // A duplicate answered 0 or -705 is success too: create-only keeps the first value.
        Ok(Committed { checksum })
    }

    fn abort(
        &self,
        caller: &Caller,
        reservation: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        let mut inner = self.lock();
        let region = reservation.region;
        let staged = match inner.staged.remove(&region) {
            Some(s) if s.tenant == caller.tenant => s,
            Some(s) => {
                inner.staged.insert(region, s);
                return Err(StoreError::UnknownReservation { region });
            }
            // Commit already consumed it; its failure may still leave the outcome unknown.
            None if outcome == Retirement::Unknown => {
                let epoch = reservation.epoch.0;
                inner.quarantined.insert(region, (caller.tenant.clone(), reservation.len, epoch));
                return Ok(Abort::Quarantined);
            }
            None => return Err(StoreError::UnknownReservation { region }),
        };
        match outcome {
            Retirement::Retired => Ok(Abort::Released),
            Retirement::Unknown => {
                let bytes = staged.bytes.len() as u64;
                inner.quarantined.insert(region, (staged.tenant, bytes, staged.epoch));
                Ok(Abort::Quarantined)
            }
        }
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        authorize(caller, key, Right::Write)?;
        let name = self.object_key(key);
        let mut inner = self.lock();
        let (raw, _) = Self::exchange(&mut inner, Call::Remove, Op::Remove, &name, 0, &[])?;
        Ok(match results::remove_result(raw).map_err(|f| Self::fail(&mut inner, f))? {
            RemoveResult::Removed => Invalidate::Removed,
            RemoveResult::Absent => Invalidate::Absent,
            RemoveResult::Leased => Invalidate::Busy,
        })
    }

    /// Staged reservations hold only adapter memory and have no lease clock.
    fn expire_leases(&self) -> Result<usize, StoreError> {
        Ok(0)
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        let mut inner = self.lock();
        let Some((owner, bytes, _)) = inner.quarantined.get(&region).cloned() else {
            return Err(StoreError::UnknownReservation { region });
        };
        if owner != caller.tenant && !caller.rights.has(Right::Admin) {
            return Err(StoreError::WrongTenant { caller: caller.tenant.clone(), owner });
        }
        inner.quarantined.remove(&region);
        Ok(Reclaimed { region, bytes })
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        let mut inner = self.lock();
        inner.epoch += 1;
        Ok(Epoch(inner.epoch))
    }

    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        let mut inner = self.lock();
        if epoch.0 != inner.epoch {
            return Err(refused(
                "mooncake reclaim_fenced",
                format!("epoch {} is not the current epoch {}", epoch.0, inner.epoch),
            ));
        }
        let before = inner.staged.len() + inner.quarantined.len();
        inner.staged.retain(|_, s| s.epoch >= epoch.0);
        inner.quarantined.retain(|_, q| q.2 >= epoch.0);
        Ok(before - inner.staged.len() - inner.quarantined.len())
    }

    fn stats(&self) -> StoreStats {
        StoreStats::default()
    }

    /// Create-only PUT in one exchange, without staging: an existing key is
    /// [`Put::AlreadyCommitted`] before any payload moves.
    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        _request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        authorize(caller, key, Right::Write)?;
        self.check_len("mooncake put", src.len() as u64)?;
        let name = self.object_key(key);
        let mut inner = self.lock();
        if Self::exists(&mut inner, &name)? {
            return Ok(Put::AlreadyCommitted);
        }
        let (result, checksum) = self.put_object(&mut inner, &name, src)?;
        Ok(result.into_put(checksum))
    }
}
