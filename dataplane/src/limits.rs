//! Resource limits, the admission ledger every backend charges, and the capped, expiring
//! idempotency table.
//!
//! Admission checks run in one documented order, so a refusal is predictable and its reason
//! carries the numbers: object size, in-flight requests, registrations, tenant table, global
//! retained bytes, tenant retained bytes, tenant in-flight bytes, idempotency table.

use std::collections::{HashMap, VecDeque};

use crate::identity::TenantId;
use crate::key::KeyDigest;

/// Every bound the data plane enforces. Units are last in each name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceLimits {
    /// Largest single block payload.
    pub object_bytes_max: u64,
    /// Requests admitted and not yet finished (open reservations plus reads in progress).
    pub inflight_requests_max: u32,
    /// Registered regions: reservations, committed blocks and quarantined regions together.
    pub registrations_max: u32,
    /// Bytes one tenant may have reserved and not yet committed.
    pub tenant_inflight_bytes_max: u64,
    /// Bytes held by all blocks that are not ABSENT.
    pub retained_bytes_max: u64,
    /// Bytes held by one tenant's blocks that are not ABSENT.
    pub tenant_retained_bytes_max: u64,
    /// Distinct tenants with any usage at once (bounds the per-tenant table).
    pub tenants_max: u32,
    /// Request ids remembered for replay detection.
    pub idempotency_entries_max: u32,
    /// How long a committed request id is remembered.
    pub idempotency_ttl_ms: u64,
    /// How long a writer may hold a reservation before it is quarantined (never freed).
    pub write_lease_ms: u64,
}

impl Default for ResourceLimits {
    fn default() -> Self {
        const MIB: u64 = 1 << 20;
        Self {
            object_bytes_max: 64 * MIB,
            inflight_requests_max: 1024,
            registrations_max: 1 << 20,
            tenant_inflight_bytes_max: 1024 * MIB,
            retained_bytes_max: 4096 * MIB,
            tenant_retained_bytes_max: 4096 * MIB,
            tenants_max: 1024,
            idempotency_entries_max: 1 << 16,
            idempotency_ttl_ms: 600_000,
            write_lease_ms: 30_000,
        }
    }
}

/// A limits record that cannot be enforced as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    #[error("limit {name} is zero")]
    Zero { name: &'static str },
    #[error("limit {smaller} ({smaller_value}) exceeds {larger} ({larger_value})")]
    Inconsistent {
        smaller: &'static str,
        smaller_value: u64,
        larger: &'static str,
        larger_value: u64,
    },
}

impl ResourceLimits {
    /// Checks that every limit is nonzero and that the nested ones nest.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let values: [(&'static str, u64); 10] = [
            ("object_bytes_max", self.object_bytes_max),
            ("inflight_requests_max", self.inflight_requests_max.into()),
            ("registrations_max", self.registrations_max.into()),
            ("tenant_inflight_bytes_max", self.tenant_inflight_bytes_max),
            ("retained_bytes_max", self.retained_bytes_max),
            ("tenant_retained_bytes_max", self.tenant_retained_bytes_max),
            ("tenants_max", self.tenants_max.into()),
            ("idempotency_entries_max", self.idempotency_entries_max.into()),
            ("idempotency_ttl_ms", self.idempotency_ttl_ms),
            ("write_lease_ms", self.write_lease_ms),
        ];
        if let Some((name, _)) = values.iter().find(|(_, v)| *v == 0) {
            return Err(LimitsError::Zero { name });
        }
        let nested: [(&'static str, u64, &'static str, u64); 2] = [
            (
                "tenant_retained_bytes_max",
                self.tenant_retained_bytes_max,
                "retained_bytes_max",
                self.retained_bytes_max,
            ),
            (
                "object_bytes_max",
                self.object_bytes_max,
                "tenant_retained_bytes_max",
                self.tenant_retained_bytes_max,
            ),
        ];
        for (smaller, smaller_value, larger, larger_value) in nested {
            if smaller_value > larger_value {
                return Err(LimitsError::Inconsistent {
                    smaller,
                    smaller_value,
                    larger,
                    larger_value,
                });
            }
        }
        Ok(())
    }
}

/// Why admission refused a request. Refusals are expected outcomes, not failures: nothing was
/// charged and nothing was touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    #[error("object of {bytes} bytes exceeds object_bytes_max {max}")]
    ObjectTooLarge { bytes: u64, max: u64 },
    #[error("{current} requests in flight, inflight_requests_max is {max}")]
    InflightRequests { current: u32, max: u32 },
    #[error("{current} regions registered, registrations_max is {max}")]
    Registrations { current: u32, max: u32 },
    #[error("{current} tenants hold resources, tenants_max is {max}")]
    Tenants { current: u32, max: u32 },
    #[error("{current} bytes retained + {requested} requested exceeds retained_bytes_max {max}")]
    RetainedBytes { current: u64, requested: u64, max: u64 },
    #[error(
        "tenant {tenant} retains {current} bytes + {requested} requested, \
         tenant_retained_bytes_max is {max}"
    )]
    TenantRetainedBytes { tenant: TenantId, current: u64, requested: u64, max: u64 },
    #[error(
        "tenant {tenant} has {current} bytes in flight + {requested} requested, \
         tenant_inflight_bytes_max is {max}"
    )]
    TenantInflightBytes { tenant: TenantId, current: u64, requested: u64, max: u64 },
    #[error("idempotency table holds {entries} live request ids, idempotency_entries_max is {max}")]
    IdempotencyTable { entries: u32, max: u32 },
    #[error("the device has {free_bytes} bytes free, {requested} requested")]
    DiskFull { free_bytes: u64, requested: u64 },
}

/// One tenant's charged usage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantUsage {
    pub inflight_bytes: u64,
    pub retained_bytes: u64,
    pub registrations: u32,
}

/// Current charges; what stats and metrics report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub inflight_requests: u32,
    pub registrations: u32,
    pub retained_bytes: u64,
    pub tenants: u32,
}

/// Admission accounting shared by every backend. Each charge has exactly one matching release;
/// a release without its charge is a bug and trips a debug assertion.
#[derive(Debug, Clone)]
pub struct Ledger {
    limits: ResourceLimits,
    usage: Usage,
    tenants: HashMap<TenantId, TenantUsage>,
}

impl Ledger {
    pub fn new(limits: ResourceLimits) -> Result<Self, LimitsError> {
        limits.validate()?;
        Ok(Self { limits, usage: Usage::default(), tenants: HashMap::new() })
    }

    pub fn limits(&self) -> &ResourceLimits {
        &self.limits
    }
    pub fn usage(&self) -> Usage {
        Usage { tenants: u32::try_from(self.tenants.len()).unwrap_or(u32::MAX), ..self.usage }
    }
    pub fn tenant(&self, tenant: &TenantId) -> TenantUsage {
        self.tenants.get(tenant).copied().unwrap_or_default()
    }

    /// Checks whether a new block of `bytes` for `tenant` would be admitted, without charging.
    pub fn check_block(&self, tenant: &TenantId, bytes: u64) -> Result<(), Refusal> {
        let l = &self.limits;
        let u = &self.usage;
        if bytes > l.object_bytes_max {
            return Err(Refusal::ObjectTooLarge { bytes, max: l.object_bytes_max });
        }
        if u.inflight_requests >= l.inflight_requests_max {
            return Err(Refusal::InflightRequests {
                current: u.inflight_requests,
                max: l.inflight_requests_max,
            });
        }
        if u.registrations >= l.registrations_max {
            return Err(Refusal::Registrations {
                current: u.registrations,
                max: l.registrations_max,
            });
        }
        let t = self.tenants.get(tenant).copied();
        let tenants = u32::try_from(self.tenants.len()).unwrap_or(u32::MAX);
        if t.is_none() && tenants >= l.tenants_max {
            return Err(Refusal::Tenants { current: tenants, max: l.tenants_max });
        }
        let t = t.unwrap_or_default();
        if u.retained_bytes.saturating_add(bytes) > l.retained_bytes_max {
            return Err(Refusal::RetainedBytes {
                current: u.retained_bytes,
                requested: bytes,
                max: l.retained_bytes_max,
            });
        }
        if t.retained_bytes.saturating_add(bytes) > l.tenant_retained_bytes_max {
            return Err(Refusal::TenantRetainedBytes {
                tenant: tenant.clone(),
                current: t.retained_bytes,
                requested: bytes,
                max: l.tenant_retained_bytes_max,
            });
        }
        if t.inflight_bytes.saturating_add(bytes) > l.tenant_inflight_bytes_max {
            return Err(Refusal::TenantInflightBytes {
                tenant: tenant.clone(),
                current: t.inflight_bytes,
                requested: bytes,
                max: l.tenant_inflight_bytes_max,
            });
        }
        Ok(())
    }

    /// Charges a new block: one request in flight, one registration, `bytes` in flight and
    /// retained for `tenant`.
    pub fn admit_block(&mut self, tenant: &TenantId, bytes: u64) -> Result<(), Refusal> {
        self.check_block(tenant, bytes)?;
        self.usage.inflight_requests += 1;
        self.usage.registrations += 1;
        self.usage.retained_bytes += bytes;
        let t = self.tenants.entry(tenant.clone()).or_default();
        t.inflight_bytes += bytes;
        t.retained_bytes += bytes;
        t.registrations += 1;
        Ok(())
    }

    /// The write of an admitted block ended (committed or quarantined): its request and its
    /// in-flight bytes are released; the registration and retained bytes stay.
    pub fn finish_write(&mut self, tenant: &TenantId, bytes: u64) {
        debug_assert!(self.usage.inflight_requests > 0, "finish_write without admit_block");
        self.usage.inflight_requests = self.usage.inflight_requests.saturating_sub(1);
        if let Some(t) = self.tenants.get_mut(tenant) {
            debug_assert!(t.inflight_bytes >= bytes, "tenant in-flight bytes underflow");
            t.inflight_bytes = t.inflight_bytes.saturating_sub(bytes);
        }
    }

    /// A block left the store (evicted, aborted after finish_write, or reclaimed).
    pub fn release_block(&mut self, tenant: &TenantId, bytes: u64) {
        debug_assert!(self.usage.registrations > 0, "release_block without admit_block");
        self.usage.registrations = self.usage.registrations.saturating_sub(1);
        debug_assert!(self.usage.retained_bytes >= bytes, "retained bytes underflow");
        self.usage.retained_bytes = self.usage.retained_bytes.saturating_sub(bytes);
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.retained_bytes = t.retained_bytes.saturating_sub(bytes);
            t.registrations = t.registrations.saturating_sub(1);
            if *t == TenantUsage::default() {
                self.tenants.remove(tenant);
            }
        }
    }

    /// Charges a request that registers nothing (a read).
    pub fn begin_request(&mut self) -> Result<(), Refusal> {
        if self.usage.inflight_requests >= self.limits.inflight_requests_max {
            return Err(Refusal::InflightRequests {
                current: self.usage.inflight_requests,
                max: self.limits.inflight_requests_max,
            });
        }
        self.usage.inflight_requests += 1;
        Ok(())
    }

    pub fn end_request(&mut self) {
        debug_assert!(self.usage.inflight_requests > 0, "end_request without begin_request");
        self.usage.inflight_requests = self.usage.inflight_requests.saturating_sub(1);
    }
}

/// A client-chosen request id, unique per tenant within the idempotency window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What a request id has been seen doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// The same request is still writing.
    InProgress,
    /// The same request already committed; report success again without writing.
    Committed,
}

/// A request id reused for a different key within the window.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("request id {request:?} of tenant {tenant} was already used for another key")]
pub struct ReplayConflict {
    pub tenant: TenantId,
    pub request: RequestId,
}

#[derive(Debug, Clone, Copy)]
enum EntryState {
    Pending,
    Committed { expires_at_ms: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    key: KeyDigest,
    state: EntryState,
}

/// Remembers request ids so that a replayed PUT reports the first outcome instead of writing
/// twice. Capped at `idempotency_entries_max`; committed entries expire after
/// `idempotency_ttl_ms`; pending entries live until their request commits or is forgotten.
#[derive(Debug, Clone)]
pub struct IdempotencyTable {
    entries_max: u32,
    ttl_ms: u64,
    entries: HashMap<(TenantId, RequestId), Entry>,
    /// Committed entries in commit order; expiry is monotone because the ttl is fixed.
    expiry: VecDeque<(u64, TenantId, RequestId)>,
}

impl IdempotencyTable {
    pub fn new(limits: &ResourceLimits) -> Self {
        Self {
            entries_max: limits.idempotency_entries_max,
            ttl_ms: limits.idempotency_ttl_ms,
            entries: HashMap::new(),
            expiry: VecDeque::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn purge(&mut self, now_ms: u64) {
        while let Some((at, _, _)) = self.expiry.front() {
            if *at > now_ms {
                break;
            }
            let Some((at, tenant, req)) = self.expiry.pop_front() else { break };
            let key = (tenant, req);
            if let Some(Entry { state: EntryState::Committed { expires_at_ms }, .. }) =
                self.entries.get(&key)
                && *expires_at_ms == at
            {
                self.entries.remove(&key);
            }
        }
    }

    /// What `request` has done before, for a write of `key`: `None` when it is new or expired.
    pub fn check(
        &mut self,
        tenant: &TenantId,
        request: RequestId,
        key: KeyDigest,
        now_ms: u64,
    ) -> Result<Option<Replay>, ReplayConflict> {
        self.purge(now_ms);
        match self.entries.get(&(tenant.clone(), request)) {
            None => Ok(None),
            Some(e) if e.key != key => Err(ReplayConflict { tenant: tenant.clone(), request }),
            Some(e) => Ok(Some(match e.state {
                EntryState::Pending => Replay::InProgress,
                EntryState::Committed { .. } => Replay::Committed,
            })),
        }
    }

    /// Whether one more request id fits (call after [`Self::check`], which purges).
    pub fn check_capacity(&self) -> Result<(), Refusal> {
        let entries = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        if entries >= self.entries_max {
            return Err(Refusal::IdempotencyTable { entries, max: self.entries_max });
        }
        Ok(())
    }

    /// Starts tracking a new request id as pending.
    pub fn insert_pending(
        &mut self,
        tenant: &TenantId,
        request: RequestId,
        key: KeyDigest,
    ) -> Result<(), Refusal> {
        self.check_capacity()?;
        self.entries.insert((tenant.clone(), request), Entry { key, state: EntryState::Pending });
        Ok(())
    }

    /// The request committed: remember it for the ttl.
    pub fn commit(&mut self, tenant: &TenantId, request: RequestId, now_ms: u64) {
        let id = (tenant.clone(), request);
        if let Some(e) = self.entries.get_mut(&id) {
            let expires_at_ms = now_ms.saturating_add(self.ttl_ms);
            e.state = EntryState::Committed { expires_at_ms };
            self.expiry.push_back((expires_at_ms, id.0, id.1));
            // Forgotten entries leave stale expiry records; keep the queue bounded.
            if self.expiry.len() > 2 * self.entries.len().max(1) {
                let entries = &self.entries;
                self.expiry.retain(|(at, t, r)| {
                    matches!(entries.get(&(t.clone(), *r)),
                        Some(Entry { state: EntryState::Committed { expires_at_ms }, .. }) if expires_at_ms == at)
                });
            }
        }
    }

    /// The request failed or its commit was abandoned: a replay must not report success.
    pub fn forget(&mut self, tenant: &TenantId, request: RequestId) {
        self.entries.remove(&(tenant.clone(), request));
    }
}
