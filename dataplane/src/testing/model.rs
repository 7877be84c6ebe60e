//! Model-based property tests: random operation sequences against a store and a reference
//! model; every answer, every payload byte and every usage counter must agree.
//!
//! The mix includes batch calls: a batch of 1 to [`BATCH_ITEMS_MAX`] items of one kind goes to
//! the store in one call, and its answers are compared with the model applied item by item, in
//! order, as the single-key calls would have been.

use std::collections::HashMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::BlockState;
use crate::caller::{Caller, Rights};
use crate::checksum::Checksum;
use crate::clock::ManualClock;
use crate::key::PhysicalKey;
use crate::limits::{Refusal, RequestId, ResourceLimits, Usage};
use crate::registry::{Epoch, RegionId, RegistryError};
use crate::store::{
    Abort, BatchGet, BatchPut, FullPolicy, Get, Invalidate, Lookup, MissReason, Put, Reservation,
    Reserve, Retirement, StoreError,
};

use super::fixture::{key_pool, payload, tenant};
use super::subject::{MakeSubject, Subject};

/// Which shape of workload a property drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// One tenant, roomy limits: lifecycle, hits and replays dominate.
    SingleTenant,
    /// Three tenants (with room for two), foreign callers and admin attestations.
    MultiTenant,
    /// Small limits so that every refusal reason fires.
    TightLimits,
}

impl Profile {
    pub fn limits(self) -> ResourceLimits {
        match self {
            Profile::SingleTenant | Profile::MultiTenant => ResourceLimits {
                object_bytes_max: 8192,
                inflight_requests_max: 6,
                registrations_max: 12,
                tenant_inflight_bytes_max: 12_000,
                retained_bytes_max: 40_000,
                tenant_retained_bytes_max: 20_000,
                tenants_max: 2,
                idempotency_entries_max: 6,
                idempotency_ttl_ms: 1000,
                write_lease_ms: 500,
            },
            Profile::TightLimits => ResourceLimits {
                object_bytes_max: 4096,
                inflight_requests_max: 2,
                registrations_max: 4,
                tenant_inflight_bytes_max: 5000,
                retained_bytes_max: 9000,
                tenant_retained_bytes_max: 6000,
                tenants_max: 2,
                idempotency_entries_max: 2,
                idempotency_ttl_ms: 300,
                write_lease_ms: 200,
            },
        }
    }

    fn tenants(self) -> usize {
        match self {
            Profile::SingleTenant => 1,
            _ => 3,
        }
    }
}

const LENS: [u64; 6] = [1, 64, 1000, 3000, 5000, 9000];
const KEYS: usize = 6;
/// Most items in one generated batch call.
pub const BATCH_ITEMS_MAX: usize = 8;

/// One item of a generated batch: whose key it names (another tenant's than the caller's when
/// `foreign`) and which.
#[derive(Debug, Clone)]
pub struct Item {
    pub foreign: bool,
    pub key: usize,
}

/// One PUT of a generated batch.
#[derive(Debug, Clone)]
pub struct PutItem {
    pub item: Item,
    pub len: usize,
    pub seed: u64,
    pub request: Option<u8>,
}

/// One step of a generated workload. Indices are reduced modulo what exists when applied.
#[derive(Debug, Clone)]
pub enum Op {
    Put { foreign: bool, tenant: usize, key: usize, len: usize, seed: u64, request: Option<u8> },
    Reserve { tenant: usize, key: usize, len: usize, seed: u64, request: Option<u8> },
    WriteHalf { open: usize },
    WriteRest { open: usize },
    Commit { open: usize },
    Abort { open: usize, retired: bool },
    Get { foreign: bool, tenant: usize, key: usize, dst: u8 },
    Lookup { foreign: bool, tenant: usize, key: usize },
    Invalidate { tenant: usize, key: usize },
    Corrupt { tenant: usize, key: usize },
    Advance { ms: u64 },
    ExpireLeases,
    Attest { caller: usize, admin: bool, target: usize },
    BumpEpoch,
    Reclaim { stale: bool },
    // One batch call each, as `caller`; a GET item's destination is sized as `Op::Get`'s.
    BatchLookup { caller: usize, items: Vec<Item> },
    BatchGet { caller: usize, items: Vec<(Item, u8)> },
    BatchPut { caller: usize, items: Vec<PutItem> },
    BatchInvalidate { caller: usize, items: Vec<Item> },
}

fn op_strategy(tenants: usize) -> impl Strategy<Value = Op> {
    let t = 0..tenants;
    let k = 0..KEYS;
    let len = 0..LENS.len();
    let req = proptest::option::weighted(0.4, 0u8..8);
    let foreign = proptest::bool::weighted(if tenants > 1 { 0.15 } else { 0.0 });
    let item = (foreign, k.clone()).prop_map(|(foreign, key)| Item { foreign, key });
    let put_item = (item.clone(), len.clone(), any::<u64>(), req.clone())
        .prop_map(|(item, len, seed, request)| PutItem { item, len, seed, request });
    prop_oneof![
        6 => (foreign, t.clone(), k.clone(), len.clone(), any::<u64>(), req.clone())
            .prop_map(|(foreign, tenant, key, len, seed, request)| Op::Put { foreign, tenant, key, len, seed, request }),
        4 => (t.clone(), k.clone(), len, any::<u64>(), req)
            .prop_map(|(tenant, key, len, seed, request)| Op::Reserve { tenant, key, len, seed, request }),
        3 => any::<usize>().prop_map(|open| Op::WriteHalf { open }),
        3 => any::<usize>().prop_map(|open| Op::WriteRest { open }),
        3 => any::<usize>().prop_map(|open| Op::Commit { open }),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(open, retired)| Op::Abort { open, retired }),
        6 => (foreign, t.clone(), k.clone(), 0u8..3)
            .prop_map(|(foreign, tenant, key, dst)| Op::Get { foreign, tenant, key, dst }),
        5 => (foreign, t.clone(), k.clone()).prop_map(|(foreign, tenant, key)| Op::Lookup { foreign, tenant, key }),
        2 => (t.clone(), k.clone()).prop_map(|(tenant, key)| Op::Invalidate { tenant, key }),
        1 => (t.clone(), k).prop_map(|(tenant, key)| Op::Corrupt { tenant, key }),
        2 => prop_oneof![Just(50u64), Just(150), Just(400), Just(1200)].prop_map(|ms| Op::Advance { ms }),
        2 => Just(Op::ExpireLeases),
        2 => (t, any::<bool>(), any::<usize>()).prop_map(|(caller, admin, target)| Op::Attest { caller, admin, target }),
        1 => Just(Op::BumpEpoch),
        2 => proptest::bool::weighted(0.2).prop_map(|stale| Op::Reclaim { stale }),
        2 => (0..tenants, batch_of(item.clone()))
            .prop_map(|(caller, items)| Op::BatchLookup { caller, items }),
        3 => (0..tenants, batch_of((item.clone(), 0u8..3)))
            .prop_map(|(caller, items)| Op::BatchGet { caller, items }),
        3 => (0..tenants, batch_of(put_item))
            .prop_map(|(caller, items)| Op::BatchPut { caller, items }),
        1 => (0..tenants, batch_of(item))
            .prop_map(|(caller, items)| Op::BatchInvalidate { caller, items }),
    ]
}

fn batch_of<T: std::fmt::Debug>(item: impl Strategy<Value = T>) -> impl Strategy<Value = Vec<T>> {
    proptest::collection::vec(item, 1..=BATCH_ITEMS_MAX)
}

/// Runs `cases()` generated workloads of `profile` against stores built by `make`.
pub fn run(make: &MakeSubject, profile: Profile) {
    let mut runner = TestRunner::new(Config {
        cases: super::subject::cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = proptest::collection::vec(op_strategy(profile.tenants()), 1..60);
    let result = runner.run(&strategy, |ops| {
        let clock = ManualClock::default();
        let subject = make(profile.limits(), clock.clone());
        let mut world = World::new(subject, clock, profile);
        for (i, op) in ops.iter().enumerate() {
            world.apply(op).map_err(|e| TestCaseError::fail(format!("step {i} {op:?}: {e}")))?;
            world
                .check_usage()
                .map_err(|e| TestCaseError::fail(format!("after step {i} {op:?}: {e}")))?;
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("conformance model ({profile:?}) failed: {e}");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenState {
    Live,
    Quarantined,
    /// Committed, aborted or reclaimed: the handle is dead.
    Gone,
}

#[derive(Debug)]
struct Open {
    handle: Option<Reservation>,
    tenant: usize,
    key: usize,
    len: u64,
    seed: u64,
    region: RegionId,
    epoch: u64,
    deadline_ms: u64,
    request: Option<u64>,
    lo: bool,
    hi: bool,
    any_write: bool,
    state: OpenState,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    len: u64,
    seed: u64,
    /// Commit order: the eviction age.
    seq: u64,
    region: Option<RegionId>,
    corrupt: bool,
}

#[derive(Debug, Clone, Copy)]
struct Quarantined {
    region: RegionId,
    tenant: usize,
    len: u64,
    epoch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdemState {
    Pending,
    Committed { expires_at_ms: u64 },
}

struct World {
    subject: Subject,
    clock: ManualClock,
    limits: ResourceLimits,
    now_ms: u64,
    epoch: u64,
    keys: Vec<Vec<PhysicalKey>>,
    committed: HashMap<(usize, usize), Block>,
    opens: Vec<Open>,
    quarantined: Vec<Quarantined>,
    idem: HashMap<(usize, u64), (usize, IdemState)>,
    last_region: u64,
    policy: FullPolicy,
    next_seq: u64,
    /// Blocks a policy-driven store reported evicting that the model has not matched yet.
    victims: std::collections::VecDeque<PhysicalKey>,
}

type Step = Result<(), String>;

/// The first answer to a put or a reserve, common to both calls.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Admission {
    /// The request id was used for another key.
    Conflict,
    Busy,
    AlreadyCommitted,
    Refused(Refusal),
    /// The write goes ahead.
    Proceeds,
    /// Anything else, described.
    Other(String),
}

impl Admission {
    fn of_error(e: &StoreError) -> Self {
        match e {
            StoreError::Replay(_) if e.retirement() == Retirement::Retired => Admission::Conflict,
            other => Admission::Other(format!("{other} ({:?})", other.retirement())),
        }
    }

    fn of_put(got: &Result<Put, StoreError>) -> Self {
        match got {
            Ok(Put::Committed(_)) => Admission::Proceeds,
            Ok(Put::AlreadyCommitted) => Admission::AlreadyCommitted,
            Ok(Put::Busy) => Admission::Busy,
            Ok(Put::Refused(r)) => Admission::Refused(r.clone()),
            Err(e) => Self::of_error(e),
        }
    }

    fn of_reserve(got: &Result<Reserve, StoreError>) -> Self {
        match got {
            Ok(Reserve::Reserved(_)) => Admission::Proceeds,
            Ok(Reserve::AlreadyCommitted) => Admission::AlreadyCommitted,
            Ok(Reserve::Busy) => Admission::Busy,
            Ok(Reserve::Refused(r)) => Admission::Refused(r.clone()),
            Err(e) => Self::of_error(e),
        }
    }
}

/// Who calls, and whose key (tenant and pool index) the call names.
#[derive(Debug, Clone, Copy)]
struct At {
    caller: usize,
    owner: usize,
    key: usize,
}

impl At {
    /// A batch item of `caller`: its own key, or the next tenant's when foreign.
    fn of(caller: usize, item: &Item) -> Self {
        let owner = if item.foreign { (caller + 1) % 3 } else { caller };
        Self { caller, owner, key: item.key }
    }
}

fn expect<T: std::fmt::Debug + PartialEq>(what: &str, got: T, want: T) -> Step {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: store said {got:?}, model expects {want:?}"))
    }
}

fn retired_err<T: std::fmt::Debug>(
    what: &str,
    got: Result<T, StoreError>,
) -> Result<StoreError, String> {
    match got {
        Err(e) => {
            if e.retirement() != Retirement::Retired {
                return Err(format!("{what}: refusal {e} did not retire"));
            }
            Ok(e)
        }
        Ok(v) => Err(format!("{what}: store said Ok({v:?}), model expects an error")),
    }
}

impl World {
    fn new(subject: Subject, clock: ManualClock, profile: Profile) -> Self {
        Self {
            clock,
            limits: profile.limits(),
            now_ms: 0,
            epoch: 1,
            keys: (0..3).map(key_pool).collect(),
            committed: HashMap::new(),
            opens: Vec::new(),
            quarantined: Vec::new(),
            idem: HashMap::new(),
            last_region: 0,
            policy: subject.store.info().full_policy,
            next_seq: 1,
            victims: Default::default(),
            subject,
        }
    }

    fn caller(&self, t: usize) -> Caller {
        Caller::new(tenant(t), Rights::READ_WRITE)
    }

    fn key(&self, t: usize, k: usize) -> PhysicalKey {
        self.keys[t][k].clone()
    }

    fn live_open(&self, t: usize, k: usize) -> Option<&Open> {
        self.opens.iter().find(|o| o.state == OpenState::Live && o.tenant == t && o.key == k)
    }

    // ----- usage, mirrored from the ledger's definitions -----

    fn usage(&self) -> (Usage, HashMap<usize, (u64, u64)>) {
        let mut per: HashMap<usize, (u64, u64)> = HashMap::new(); // (inflight, retained)
        let mut u = Usage::default();
        for o in self.opens.iter().filter(|o| o.state == OpenState::Live) {
            u.inflight_requests += 1;
            u.registrations += 1;
            u.retained_bytes += o.len;
            let e = per.entry(o.tenant).or_default();
            e.0 += o.len;
            e.1 += o.len;
        }
        for ((t, _), b) in &self.committed {
            u.registrations += 1;
            u.retained_bytes += b.len;
            per.entry(*t).or_default().1 += b.len;
        }
        for q in &self.quarantined {
            u.registrations += 1;
            u.retained_bytes += q.len;
            per.entry(q.tenant).or_default().1 += q.len;
        }
        u.tenants = u32::try_from(per.len()).unwrap_or(u32::MAX);
        (u, per)
    }

    fn check_usage(&mut self) -> Step {
        self.take_victims();
        if let Some(extra) = self.victims.front() {
            return Err(format!("the store evicted a block no admission needed: {extra:?}"));
        }
        let stats = self.subject.store.stats();
        let (u, _) = self.usage();
        expect("usage", stats.usage, u)?;
        expect("quarantined regions", stats.regions.quarantined, self.quarantined.len())?;
        expect("committed blocks", stats.committed_blocks, self.committed.len() as u64)?;
        expect("epoch", self.subject.store.epoch(), Epoch(self.epoch))
    }

    fn predict_refusal(&self, t: usize, len: u64, request: bool) -> Option<Refusal> {
        let l = &self.limits;
        let (u, per) = self.usage();
        let tn = tenant(t);
        if len > l.object_bytes_max {
            return Some(Refusal::ObjectTooLarge { bytes: len, max: l.object_bytes_max });
        }
        if u.inflight_requests >= l.inflight_requests_max {
            return Some(Refusal::InflightRequests {
                current: u.inflight_requests,
                max: l.inflight_requests_max,
            });
        }
        if u.registrations >= l.registrations_max {
            return Some(Refusal::Registrations {
                current: u.registrations,
                max: l.registrations_max,
            });
        }
        let mine = per.get(&t).copied();
        if mine.is_none() && u.tenants >= l.tenants_max {
            return Some(Refusal::Tenants { current: u.tenants, max: l.tenants_max });
        }
        let (inflight, retained) = mine.unwrap_or_default();
        if u.retained_bytes + len > l.retained_bytes_max {
            return Some(Refusal::RetainedBytes {
                current: u.retained_bytes,
                requested: len,
                max: l.retained_bytes_max,
            });
        }
        if retained + len > l.tenant_retained_bytes_max {
            return Some(Refusal::TenantRetainedBytes {
                tenant: tn,
                current: retained,
                requested: len,
                max: l.tenant_retained_bytes_max,
            });
        }
        if inflight + len > l.tenant_inflight_bytes_max {
            return Some(Refusal::TenantInflightBytes {
                tenant: tn,
                current: inflight,
                requested: len,
                max: l.tenant_inflight_bytes_max,
            });
        }
        if request {
            let entries = u32::try_from(self.idem.len()).unwrap_or(u32::MAX);
            if entries >= l.idempotency_entries_max {
                return Some(Refusal::IdempotencyTable { entries, max: l.idempotency_entries_max });
            }
        }
        None
    }

    /// What a put or reserve of `len` bytes under `(t, k)` must answer before it writes.
    fn predict_admission(
        &mut self,
        t: usize,
        k: usize,
        len: u64,
        request: Option<u64>,
    ) -> Admission {
        if let Some(r) = request {
            let now = self.now_ms;
            self.idem.retain(|_, (_, s)| {
                !matches!(s, IdemState::Committed { expires_at_ms } if *expires_at_ms <= now)
            });
            if let Some((key, state)) = self.idem.get(&(t, r)) {
                return match (*key == k, state) {
                    (false, _) => Admission::Conflict,
                    (true, IdemState::Pending) => Admission::Busy,
                    (true, IdemState::Committed { .. }) => Admission::AlreadyCommitted,
                };
            }
        }
        if self.live_open(t, k).is_some() {
            return Admission::Busy;
        }
        if self.committed.contains_key(&(t, k)) {
            return Admission::AlreadyCommitted;
        }
        // A store that evicts drops the oldest committed block (the tenant's own for a tenant
        // quota) while only a retained-byte quota stands in the way.
        loop {
            let Some(refusal) = self.predict_refusal(t, len, request.is_some()) else {
                return Admission::Proceeds;
            };
            let victim = match (&refusal, self.policy) {
                (Refusal::RetainedBytes { .. }, FullPolicy::EvictOldest) => self.oldest(None),
                (Refusal::TenantRetainedBytes { .. }, FullPolicy::EvictOldest) => {
                    self.oldest(Some(t))
                }
                // The model cannot rank blocks as the store's policy does; it takes the block
                // the store gave up, which must be an eligible one: a block of another tenant
                // under a tenant quota is never found here, so the admission then mismatches.
                (Refusal::RetainedBytes { .. }, FullPolicy::Evict) => self.given_up(None),
                (Refusal::TenantRetainedBytes { .. }, FullPolicy::Evict) => self.given_up(Some(t)),
                _ => None,
            };
            match victim {
                Some(v) => {
                    self.committed.remove(&v);
                }
                None => return Admission::Refused(refusal),
            }
        }
    }

    /// The next block a policy-driven store evicted, when the model holds it as committed (and
    /// it is tenant `t`'s, for a tenant quota); `None` otherwise, so that the admission the
    /// model predicts then differs from the store's answer (or the victim is left over).
    fn given_up(&mut self, t: Option<usize>) -> Option<(usize, usize)> {
        self.take_victims();
        let key = self.victims.front()?;
        let found = (0..self.keys.len())
            .flat_map(|bt| (0..self.keys[bt].len()).map(move |k| (bt, k)))
            .find(|&(bt, k)| self.keys[bt][k] == *key)?;
        // A victim that does not fit this admission stays queued: it may belong to a later
        // item of the same batch, and one that fits none is reported after the step.
        if !self.committed.contains_key(&found) || t.is_some_and(|t| found.0 != t) {
            return None;
        }
        self.victims.pop_front();
        Some(found)
    }

    fn take_victims(&mut self) {
        if self.policy != FullPolicy::Evict {
            return;
        }
        let log = self
            .subject
            .evicted
            .as_ref()
            .expect("a store that evicts by policy gives the suite its eviction log");
        self.victims.extend(log());
    }

    /// The oldest committed block, of tenant `t` when given.
    fn oldest(&self, t: Option<usize>) -> Option<(usize, usize)> {
        self.committed
            .iter()
            .filter(|((bt, _), _)| t.is_none_or(|t| *bt == t))
            .min_by_key(|(_, b)| b.seq)
            .map(|(k, _)| *k)
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    fn note_region(&mut self, region: RegionId) -> Step {
        if region.0 <= self.last_region {
            return Err(format!(
                "region id {region} is not above the last one r{}",
                self.last_region
            ));
        }
        self.last_region = region.0;
        Ok(())
    }

    fn idem_commit(&mut self, t: usize, k: usize, request: Option<u64>) {
        if let Some(r) = request {
            let expires_at_ms = self.now_ms + self.limits.idempotency_ttl_ms;
            self.idem.insert((t, r), (k, IdemState::Committed { expires_at_ms }));
        }
    }

    fn idem_forget(&mut self, t: usize, request: Option<u64>) {
        if let Some(r) = request {
            self.idem.remove(&(t, r));
        }
    }

    fn quarantine_open(&mut self, i: usize) {
        let o = &mut self.opens[i];
        o.state = OpenState::Quarantined;
        let (region, tenant, len, epoch, request) = (o.region, o.tenant, o.len, o.epoch, o.request);
        self.quarantined.push(Quarantined { region, tenant, len, epoch });
        self.idem_forget(tenant, request);
    }

    fn reclaimed(&mut self, region: RegionId) {
        self.quarantined.retain(|q| q.region != region);
        for o in &mut self.opens {
            if o.region == region {
                o.state = OpenState::Gone;
            }
        }
    }

    fn apply(&mut self, op: &Op) -> Step {
        let store = &*self.subject.store;
        match *op {
            Op::Put { foreign, tenant: t, key: k, len, seed, request } => {
                let at = At { caller: if foreign { (t + 1) % 3 } else { t }, owner: t, key: k };
                let (len, request) = (LENS[len], request.map(u64::from));
                let data = payload(seed, usize::try_from(len).unwrap_or(0));
                let got = store.put(
                    &self.caller(at.caller),
                    &self.key(t, k),
                    &data,
                    request.map(RequestId),
                );
                self.check_put(at, len, seed, request, got)
            }
            Op::Reserve { tenant: t, key: k, len, seed, request } => {
                let len = LENS[len];
                let key = self.key(t, k);
                let request = request.map(u64::from);
                let got = store.reserve(&self.caller(t), &key, len, request.map(RequestId));
                let want = self.predict_admission(t, k, len, request);
                expect("reserve admission", Admission::of_reserve(&got), want.clone())?;
                if want != Admission::Proceeds {
                    return Ok(());
                }
                let r = match got {
                    Ok(Reserve::Reserved(r)) => r,
                    other => {
                        return Err(format!(
                            "reserve: store said {other:?}, model expects Reserved"
                        ));
                    }
                };
                expect("reservation length", r.len, len)?;
                expect("reservation epoch", r.epoch, Epoch(self.epoch))?;
                self.note_region(r.region)?;
                if let Some(req) = request {
                    self.idem.insert((t, req), (k, IdemState::Pending));
                }
                self.opens.push(Open {
                    region: r.region,
                    handle: Some(r),
                    tenant: t,
                    key: k,
                    len,
                    seed,
                    epoch: self.epoch,
                    deadline_ms: self.now_ms + self.limits.write_lease_ms,
                    request,
                    lo: false,
                    hi: false,
                    any_write: false,
                    state: OpenState::Live,
                });
                Ok(())
            }
            Op::WriteHalf { open } | Op::WriteRest { open } => {
                if self.opens.is_empty() {
                    return Ok(());
                }
                let i = open % self.opens.len();
                let rest = matches!(op, Op::WriteRest { .. });
                let o = &self.opens[i];
                let Some(handle) = o.handle.as_ref() else { return Ok(()) };
                let data = payload(o.seed, usize::try_from(o.len).unwrap_or(0));
                let half = data.len() / 2;
                let (offset, piece) = if rest { (half, &data[half..]) } else { (0, &data[..half]) };
                let got = store.write(&self.caller(o.tenant), handle, offset as u64, piece);
                match o.state {
                    OpenState::Live => {
                        expect("write", got, Ok(()))?;
                        let o = &mut self.opens[i];
                        o.any_write = true;
                        if rest {
                            o.hi = true
                        } else {
                            o.lo = true
                        }
                        Ok(())
                    }
                    OpenState::Quarantined => {
                        let e = retired_err("write to a quarantined reservation", got)?;
                        expect("write", e, StoreError::ReservationQuarantined { region: o.region })
                    }
                    OpenState::Gone => {
                        let e = retired_err("write to a dead reservation", got)?;
                        expect("write", e, StoreError::UnknownReservation { region: o.region })
                    }
                }
            }
            Op::Commit { open } => {
                if self.opens.is_empty() {
                    return Ok(());
                }
                let i = open % self.opens.len();
                let o = &self.opens[i];
                let Some(handle) = o.handle.as_ref() else { return Ok(()) };
                let got = store.commit(&self.caller(o.tenant), handle);
                let half = o.len / 2;
                let written = if o.lo { half } else { 0 } + if o.hi { o.len - half } else { 0 };
                match o.state {
                    OpenState::Live if written == o.len => {
                        let data = payload(o.seed, usize::try_from(o.len).unwrap_or(0));
                        let c = got.map_err(|e| format!("commit: store failed with {e}"))?;
                        expect("commit checksum", c.checksum, Checksum::of(&data))?;
                        let (t, k, len, seed, region, request) =
                            (o.tenant, o.key, o.len, o.seed, o.region, o.request);
                        self.opens[i].state = OpenState::Gone;
                        let seq = self.take_seq();
                        self.committed.insert(
                            (t, k),
                            Block { len, seed, seq, region: Some(region), corrupt: false },
                        );
                        self.idem_commit(t, k, request);
                        Ok(())
                    }
                    OpenState::Live => {
                        let e = retired_err("incomplete commit", got)?;
                        expect("commit", e, StoreError::Incomplete { written, expected: o.len })
                    }
                    OpenState::Quarantined => {
                        let e = retired_err("commit of a quarantined reservation", got)?;
                        expect("commit", e, StoreError::ReservationQuarantined { region: o.region })
                    }
                    OpenState::Gone => {
                        let e = retired_err("commit of a dead reservation", got)?;
                        expect("commit", e, StoreError::UnknownReservation { region: o.region })
                    }
                }
            }
            Op::Abort { open, retired } => {
                if self.opens.is_empty() {
                    return Ok(());
                }
                let i = open % self.opens.len();
                let Some(handle) = self.opens[i].handle.take() else { return Ok(()) };
                let o = &self.opens[i];
                let outcome = if retired { Retirement::Retired } else { Retirement::Unknown };
                let got = store.abort(&self.caller(o.tenant), handle, outcome);
                let (state, region, t, request) = (o.state, o.region, o.tenant, o.request);
                let step = match (state, retired) {
                    (OpenState::Live, true) => {
                        expect("abort", got, Ok(Abort::Released))?;
                        self.idem_forget(t, request);
                        Ok(())
                    }
                    (OpenState::Live, false) => {
                        expect("abort", got, Ok(Abort::Quarantined))?;
                        self.quarantine_open(i);
                        Ok(())
                    }
                    (OpenState::Quarantined, _) => expect("abort", got, Ok(Abort::Quarantined)),
                    (OpenState::Gone, _) => {
                        let e = retired_err("abort of a dead reservation", got)?;
                        expect("abort", e, StoreError::UnknownReservation { region })
                    }
                };
                self.opens.remove(i);
                step
            }
            Op::Get { foreign, tenant: t, key: k, dst } => {
                let at = At { caller: if foreign { (t + 1) % 3 } else { t }, owner: t, key: k };
                let mut buf = vec![0xEEu8; self.get_size(t, k, dst)];
                let got = store.get_into(&self.caller(at.caller), &self.key(t, k), &mut buf);
                self.check_get(at, &buf, got)
            }
            Op::Lookup { foreign, tenant: t, key: k } => {
                let at = At { caller: if foreign { (t + 1) % 3 } else { t }, owner: t, key: k };
                let got = store.lookup(&self.caller(at.caller), &self.key(t, k));
                self.check_lookup(at, got)
            }
            Op::Invalidate { tenant: t, key: k } => {
                let got = store.invalidate(&self.caller(t), &self.key(t, k));
                self.check_invalidate(At { caller: t, owner: t, key: k }, got)
            }
            Op::BatchLookup { caller: c, ref items } => {
                let ats: Vec<At> = items.iter().map(|i| At::of(c, i)).collect();
                let keys: Vec<PhysicalKey> = ats.iter().map(|a| self.key(a.owner, a.key)).collect();
                let refs: Vec<&PhysicalKey> = keys.iter().collect();
                let answers = store.lookup_batch(&self.caller(c), &refs);
                self.check_batch("lookup_batch", answers, &ats, |w, i, got| {
                    w.check_lookup(ats[i], got)
                })
            }
            Op::BatchGet { caller: c, ref items } => {
                let ats: Vec<At> = items.iter().map(|(i, _)| At::of(c, i)).collect();
                let keys: Vec<PhysicalKey> = ats.iter().map(|a| self.key(a.owner, a.key)).collect();
                let mut bufs: Vec<Vec<u8>> = items
                    .iter()
                    .zip(&ats)
                    .map(|((_, dst), a)| vec![0xEEu8; self.get_size(a.owner, a.key, *dst)])
                    .collect();
                let mut batch: Vec<BatchGet<'_>> = keys
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|(key, buf)| BatchGet { key, dst: buf.as_mut_slice() })
                    .collect();
                let answers = store.get_batch(&self.caller(c), &mut batch);
                drop(batch);
                self.check_batch("get_batch", answers, &ats, |w, i, got| {
                    w.check_get(ats[i], &bufs[i], got)
                })
            }
            Op::BatchPut { caller: c, ref items } => {
                let ats: Vec<At> = items.iter().map(|p| At::of(c, &p.item)).collect();
                let keys: Vec<PhysicalKey> = ats.iter().map(|a| self.key(a.owner, a.key)).collect();
                let datas: Vec<Vec<u8>> = items
                    .iter()
                    .map(|p| payload(p.seed, usize::try_from(LENS[p.len]).unwrap_or(0)))
                    .collect();
                let batch: Vec<BatchPut<'_>> = items
                    .iter()
                    .zip(keys.iter().zip(&datas))
                    .map(|(p, (key, src))| BatchPut {
                        key,
                        src,
                        request: p.request.map(|r| RequestId(u64::from(r))),
                    })
                    .collect();
                let answers = store.put_batch(&self.caller(c), &batch);
                self.check_batch("put_batch", answers, &ats, |w, i, got| {
                    let p = &items[i];
                    w.check_put(ats[i], LENS[p.len], p.seed, p.request.map(u64::from), got)
                })
            }
            Op::BatchInvalidate { caller: c, ref items } => {
                let ats: Vec<At> = items.iter().map(|i| At::of(c, i)).collect();
                let keys: Vec<PhysicalKey> = ats.iter().map(|a| self.key(a.owner, a.key)).collect();
                let refs: Vec<&PhysicalKey> = keys.iter().collect();
                let answers = store.invalidate_batch(&self.caller(c), &refs);
                self.check_batch("invalidate_batch", answers, &ats, |w, i, got| {
                    w.check_invalidate(ats[i], got)
                })
            }
            Op::Corrupt { tenant: t, key: k } => {
                let key = self.key(t, k);
                let hit = (self.subject.corrupt)(&key);
                let block = self.committed.get_mut(&(t, k));
                expect("corrupt found a committed block", hit, block.is_some())?;
                if let Some(b) = block {
                    b.corrupt = true;
                }
                Ok(())
            }
            Op::Advance { ms } => {
                self.clock.advance_ms(ms);
                self.now_ms += ms;
                Ok(())
            }
            Op::ExpireLeases => {
                let got = store.expire_leases();
                let now = self.now_ms;
                let due: Vec<usize> = (0..self.opens.len())
                    .filter(|i| {
                        self.opens[*i].state == OpenState::Live && self.opens[*i].deadline_ms <= now
                    })
                    .collect();
                expect("expired leases", got, Ok(due.len()))?;
                for i in due {
                    self.quarantine_open(i);
                }
                Ok(())
            }
            Op::Attest { caller: c, admin, target } => {
                let who =
                    Caller::new(tenant(c), if admin { Rights::ALL } else { Rights::READ_WRITE });
                // Mostly a quarantined region; sometimes a committed one or one that never was.
                let committed: Vec<(usize, RegionId)> = self
                    .committed
                    .iter()
                    .filter_map(|((t, _), b)| b.region.map(|r| (*t, r)))
                    .collect();
                if !self.quarantined.is_empty() && target % 4 != 0 {
                    let q = self.quarantined[target % self.quarantined.len()];
                    let got = store.attest_drained(&who, q.region);
                    if q.tenant != c && !admin {
                        let e = retired_err("attest by another tenant", got)?;
                        return match e {
                            StoreError::Registry(RegistryError::NotAuthorized {
                                region, ..
                            }) if region == q.region => Ok(()),
                            other => Err(format!("attest: expected NotAuthorized, got {other}")),
                        };
                    }
                    expect("attest", got.map(|r| (r.region, r.bytes)), Ok((q.region, q.len)))?;
                    self.reclaimed(q.region);
                    Ok(())
                } else if !committed.is_empty() && target % 8 == 0 {
                    let (owner, region) = committed[target % committed.len()];
                    let got = store.attest_drained(&who, region);
                    let e = retired_err("attest of a committed block", got)?;
                    let authorized = owner == c || admin;
                    match e {
                        StoreError::Registry(RegistryError::WrongState { .. }) if authorized => {
                            Ok(())
                        }
                        StoreError::Registry(RegistryError::NotAuthorized { .. })
                            if !authorized =>
                        {
                            Ok(())
                        }
                        other => Err(format!("attest of a committed region: unexpected {other}")),
                    }
                } else {
                    let region = RegionId(self.last_region + 1_000_000);
                    let got = store.attest_drained(&who, region);
                    let e = retired_err("attest of an unknown region", got)?;
                    expect("attest", e, StoreError::Registry(RegistryError::Unknown(region)))
                }
            }
            Op::BumpEpoch => {
                let got = store.bump_epoch();
                self.epoch += 1;
                expect("bump_epoch", got, Ok(Epoch(self.epoch)))?;
                let live: Vec<usize> = (0..self.opens.len())
                    .filter(|i| self.opens[*i].state == OpenState::Live)
                    .collect();
                for i in live {
                    self.quarantine_open(i);
                }
                Ok(())
            }
            Op::Reclaim { stale } => {
                if stale {
                    let given = Epoch(self.epoch - 1);
                    let got = store.reclaim_fenced(given);
                    let e = retired_err("stale reclaim_fenced", got)?;
                    return expect(
                        "reclaim_fenced",
                        e,
                        StoreError::Registry(RegistryError::StaleEpoch {
                            given,
                            current: Epoch(self.epoch),
                        }),
                    );
                }
                let got = store.reclaim_fenced(Epoch(self.epoch));
                let fenced: Vec<RegionId> = self
                    .quarantined
                    .iter()
                    .filter(|q| q.epoch < self.epoch)
                    .map(|q| q.region)
                    .collect();
                expect("reclaim_fenced", got, Ok(fenced.len()))?;
                for r in fenced {
                    self.reclaimed(r);
                }
                Ok(())
            }
        }
    }

    /// Compares a batch's answers, in order, with the model applied item by item.
    fn check_batch<T>(
        &mut self,
        what: &str,
        answers: Vec<Result<T, StoreError>>,
        ats: &[At],
        mut check: impl FnMut(&mut Self, usize, Result<T, StoreError>) -> Step,
    ) -> Step {
        expect(&format!("{what} answer count"), answers.len(), ats.len())?;
        for (i, got) in answers.into_iter().enumerate() {
            check(self, i, got).map_err(|e| format!("{what} item {i} {:?}: {e}", ats[i]))?;
        }
        Ok(())
    }

    /// A store refused `at.caller` another tenant's key.
    fn check_foreign<T: std::fmt::Debug>(what: &str, at: At, got: Result<T, StoreError>) -> Step {
        let e = retired_err(what, got)?;
        expect(
            what,
            e,
            StoreError::WrongTenant { caller: tenant(at.caller), owner: tenant(at.owner) },
        )
    }

    /// The destination size a GET of `(t, k)` uses: the block's length (64 for no block), 17
    /// bytes more, or one byte less.
    fn get_size(&self, t: usize, k: usize, dst: u8) -> usize {
        let len = self.committed.get(&(t, k)).map_or(64, |b| b.len);
        let size = match dst {
            0 => len,
            1 => len + 17,
            _ => len.saturating_sub(1),
        };
        usize::try_from(size).unwrap_or(0)
    }

    /// Checks a PUT of `len` bytes of `payload(seed)` and applies it to the model.
    fn check_put(
        &mut self,
        at: At,
        len: u64,
        seed: u64,
        request: Option<u64>,
        got: Result<Put, StoreError>,
    ) -> Step {
        if at.caller != at.owner {
            return Self::check_foreign("foreign put", at, got);
        }
        let (t, k) = (at.owner, at.key);
        let data = payload(seed, usize::try_from(len).unwrap_or(0));
        let want = self.predict_admission(t, k, len, request);
        expect("put admission", Admission::of_put(&got), want.clone())?;
        if want != Admission::Proceeds {
            return Ok(());
        }
        expect("put", got, Ok(Put::Committed(Checksum::of(&data))))?;
        let seq = self.take_seq();
        self.committed.insert((t, k), Block { len, seed, seq, region: None, corrupt: false });
        self.idem_commit(t, k, request);
        // Put registers a region we do not see; later ids must still be larger.
        Ok(())
    }

    /// Checks a GET into `buf` (filled with 0xEE before the call) and applies it to the model.
    fn check_get(&mut self, at: At, buf: &[u8], got: Result<Get, StoreError>) -> Step {
        if at.caller != at.owner {
            return Self::check_foreign("foreign get", at, got);
        }
        let (t, k) = (at.owner, at.key);
        let size = buf.len() as u64;
        if let Some(b) = self.committed.get(&(t, k)).copied() {
            if size < b.len {
                let e = retired_err("get into a short buffer", got)?;
                return expect(
                    "get",
                    e,
                    StoreError::BufferTooSmall { needed: b.len, provided: size },
                );
            }
            if b.corrupt {
                expect("get of a corrupt block", got, Ok(Get::Miss(MissReason::Corrupt)))?;
                if buf[..usize::try_from(b.len).unwrap_or(0)].iter().any(|x| *x != 0) {
                    return Err("a corrupt read left payload in the destination".into());
                }
                self.committed.remove(&(t, k));
                return Ok(());
            }
            let data = payload(b.seed, usize::try_from(b.len).unwrap_or(0));
            expect("get", got, Ok(Get::Hit { len: b.len, checksum: Checksum::of(&data) }))?;
            if buf[..data.len()] != data[..] {
                return Err("get returned bytes that differ from the committed payload".into());
            }
            if buf[data.len()..].iter().any(|x| *x != 0xEE) {
                return Err("get wrote past the payload length".into());
            }
            return Ok(());
        }
        let want = self.miss_for(t, k);
        expect("get", got, Ok(Get::Miss(want)))?;
        if buf.iter().any(|x| *x != 0xEE) {
            return Err("a missed get touched the destination".into());
        }
        Ok(())
    }

    fn check_lookup(&self, at: At, got: Result<Lookup, StoreError>) -> Step {
        if at.caller != at.owner {
            return Self::check_foreign("foreign lookup", at, got);
        }
        expect("lookup", got, Ok(self.predict_lookup(at.owner, at.key)))
    }

    /// Checks an invalidation and applies it to the model.
    fn check_invalidate(&mut self, at: At, got: Result<Invalidate, StoreError>) -> Step {
        if at.caller != at.owner {
            return Self::check_foreign("foreign invalidate", at, got);
        }
        let (t, k) = (at.owner, at.key);
        if self.committed.remove(&(t, k)).is_some() {
            expect("invalidate", got, Ok(Invalidate::Removed))
        } else if self.live_open(t, k).is_some() {
            expect("invalidate", got, Ok(Invalidate::Busy))
        } else {
            expect("invalidate", got, Ok(Invalidate::Absent))
        }
    }

    fn miss_for(&self, t: usize, k: usize) -> MissReason {
        if let Some(o) = self.live_open(t, k) {
            return MissReason::NotReadable(if o.any_write {
                BlockState::Writing
            } else {
                BlockState::Reserved
            });
        }
        let logical = self.keys[t][k].logical();
        let incompatible = self
            .committed
            .keys()
            .any(|(bt, bk)| *bt == t && *bk != k && self.keys[t][*bk].logical() == logical);
        if incompatible { MissReason::Incompatible } else { MissReason::Absent }
    }

    fn predict_lookup(&self, t: usize, k: usize) -> Lookup {
        if let Some(b) = self.committed.get(&(t, k)) {
            return Lookup::Hit { len: b.len };
        }
        if self.live_open(t, k).is_none() {
            let want = self.keys[t][k].identity();
            let best = self
                .committed
                .iter()
                .filter(|((bt, bk), _)| {
                    let have = self.keys[*bt][*bk].identity();
                    *bt == t && have.same_shape(want) && have.chain_is_strict_prefix_of(want)
                })
                .max_by_key(|((bt, bk), _)| self.keys[*bt][*bk].identity().chain().len());
            if let Some(((bt, bk), b)) = best {
                return Lookup::PrefixHit {
                    key: Box::new(self.keys[*bt][*bk].clone()),
                    len: b.len,
                };
            }
        }
        Lookup::Miss(self.miss_for(t, k))
    }
}
