//! `SimNic`: a deterministic, seeded, in-process simulated NIC. Two endpoints joined by one
//! simulated link, each with registrations, a send queue and a completion queue, implementing
//! [`NicEndpoint`]. It is a simulation: every endpoint reports
//! [`Implementation::Simulated`] with its seed, and its `Debug` says so.
//!
//! Every access is checked as a real HCA would: the local key and length against this
//! endpoint's registrations, the remote key, bounds and access flags against the peer's. A
//! failed check is an error completion, never a panic.
//!
//! Faults come from a seeded plan ([`FaultRates`], one draw per post) or from a script
//! ([`SimEndpoint::inject`], consumed before the plan): a lost completion (the data moved, the
//! completion never arrives), a duplicated one, a late one (held back for
//! [`SimNicConfig::late_polls`] polls), a remote access error (nothing moved), and link loss
//! (that request ends in `RetryExceeded`, every later post is `Flushed`). The same seed and the
//! same calls give the same completions, so a failing test is replayed from its seed.
//!
//! Data moves at post time; only the completion is delayed, lost or duplicated. The real
//! backend's DMA may run later, which is why a missing completion quarantines the slot.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use gpucache_dataplane::rng::SplitMix64;

use crate::error::NicError;
use crate::verbs::{
    Access, CompletionStatus, Implementation, LocalKey, MemoryRegion, NicEndpoint, Opcode,
    POLL_ENTRIES_MAX, RegisterHostMemory, RemoteKey, WorkCompletion, WorkRequest,
};

/// Parts per million: the unit of every fault rate.
pub const PER_MILLION: u64 = 1_000_000;

/// The most scripted faults one endpoint holds.
pub const SCRIPT_FAULTS_MAX: usize = 1024;

/// What happens to one post, beyond the checks every post gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// The operation runs; its completion is never delivered.
    Lost,
    /// The operation runs; its completion is delivered twice.
    Duplicated,
    /// The operation runs; its completion is held back for `late_polls` polls.
    Late,
    /// The peer refuses the access; nothing moves.
    RemoteAccess,
    /// The link goes down under this request; it and every later post fail.
    LinkLoss,
}

/// Seeded fault rates, in parts per million of posts. Their sum is at most [`PER_MILLION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultRates {
    pub lost_per_million: u32,
    pub duplicated_per_million: u32,
    pub late_per_million: u32,
    pub remote_access_per_million: u32,
    pub link_loss_per_million: u32,
}

impl FaultRates {
    /// No faults at all.
    pub const NONE: Self = Self {
        lost_per_million: 0,
        duplicated_per_million: 0,
        late_per_million: 0,
        remote_access_per_million: 0,
        link_loss_per_million: 0,
    };

    fn table(&self) -> [(u64, Fault); 5] {
        [
            (u64::from(self.lost_per_million), Fault::Lost),
            (u64::from(self.duplicated_per_million), Fault::Duplicated),
            (u64::from(self.late_per_million), Fault::Late),
            (u64::from(self.remote_access_per_million), Fault::RemoteAccess),
            (u64::from(self.link_loss_per_million), Fault::LinkLoss),
        ]
    }

    fn total_per_million(&self) -> u64 {
        self.table().iter().map(|(r, _)| r).sum()
    }
}

/// Builds a [`SimNic`]; [`SimNicConfig::build`] validates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimNicConfig {
    pub seed: u64,
    pub faults: FaultRates,
    /// How many extra polls a late completion waits.
    pub late_polls: NonZeroU32,
    /// Completions waiting in one endpoint's queue before posts are refused.
    pub send_queue_depth: NonZeroUsize,
    /// Registrations per endpoint.
    pub regions_max: NonZeroUsize,
    /// The largest single registration.
    pub region_bytes_max: u64,
}

impl SimNicConfig {
    /// A fault-free link with small default limits.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            faults: FaultRates::NONE,
            late_polls: NonZeroU32::new(8).expect("8 is not zero"),
            send_queue_depth: NonZeroUsize::new(64).expect("64 is not zero"),
            regions_max: NonZeroUsize::new(256).expect("256 is not zero"),
            region_bytes_max: 64 << 20,
        }
    }

    pub fn with_faults(mut self, faults: FaultRates) -> Self {
        self.faults = faults;
        self
    }

    pub fn build(self) -> Result<SimNic, NicError> {
        let total = self.faults.total_per_million();
        if total > PER_MILLION {
            return Err(NicError::FaultRatesTooHigh {
                total_per_million: total,
                max_per_million: PER_MILLION,
            });
        }
        let fabric = Fabric {
            config: self,
            rng: SplitMix64::new(self.seed),
            link_up: true,
            endpoints: [EndpointState::new(Side::A), EndpointState::new(Side::B)],
        };
        Ok(SimNic { fabric: Arc::new(Mutex::new(fabric)) })
    }
}

/// One of the link's two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

impl Side {
    fn index(self) -> usize {
        match self {
            Self::A => 0,
            Self::B => 1,
        }
    }
    fn peer(self) -> Self {
        match self {
            Self::A => Self::B,
            Self::B => Self::A,
        }
    }
}

/// What one endpoint saw, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    pub posted: u64,
    pub polls: u64,
    pub delivered: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub late: u64,
    pub remote_access_errors: u64,
    pub local_protection_errors: u64,
    pub retry_exceeded: u64,
    pub flushed: u64,
}

#[derive(Debug)]
struct SimRegion {
    rkey: RemoteKey,
    len_bytes: u64,
    access: Access,
    /// The bytes a peer reaches; only regions the simulation allocated and opened to peers
    /// have them. Local buffers are the caller's, lent with each post.
    backing: Option<Vec<u8>>,
    /// The caller's memory, for regions made by [`RegisterHostMemory::register_host`]: a post
    /// naming this region must lend a buffer inside it, and a peer with access reaches it.
    host: Option<HostRange>,
}

/// Caller-owned memory a registration covers, kept as an address so the fabric stays `Send`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HostRange {
    addr: usize,
    len: usize,
}

impl HostRange {
    fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr
            && addr.checked_add(len).is_some_and(|end| Some(end) <= self.addr.checked_add(self.len))
    }
    fn overlaps(&self, addr: usize, len: usize) -> bool {
        addr < self.addr.saturating_add(self.len) && self.addr < addr.saturating_add(len)
    }
}

#[derive(Debug)]
struct Pending {
    due_poll: u64,
    completion: WorkCompletion,
}

#[derive(Debug)]
struct EndpointState {
    regions: BTreeMap<LocalKey, SimRegion>,
    by_rkey: BTreeMap<RemoteKey, LocalKey>,
    next_key: u32,
    registered_total: u64,
    queue: VecDeque<Pending>,
    script: VecDeque<Fault>,
    stats: SimStats,
}

impl EndpointState {
    fn new(side: Side) -> Self {
        // Separate key ranges per side, so one side's key is never valid on the other by chance.
        let first = match side {
            Side::A => 1,
            Side::B => 1 << 20,
        };
        Self {
            regions: BTreeMap::new(),
            by_rkey: BTreeMap::new(),
            next_key: first,
            registered_total: 0,
            queue: VecDeque::new(),
            script: VecDeque::new(),
            stats: SimStats::default(),
        }
    }
}

struct Fabric {
    config: SimNicConfig,
    rng: SplitMix64,
    link_up: bool,
    endpoints: [EndpointState; 2],
}

impl Fabric {
    fn draw(&mut self) -> Fault {
        let mut r = self.rng.next_u64() % PER_MILLION;
        for (rate, fault) in self.config.faults.table() {
            if r < rate {
                return fault;
            }
            r -= rate;
        }
        Fault::None
    }

    /// Checks and performs the data movement; returns the completion status.
    fn execute(&mut self, side: Side, request: &WorkRequest, local: &mut [u8]) -> CompletionStatus {
        let me = &self.endpoints[side.index()];
        let local_addr = local.as_ptr() as usize;
        let local_ok = me.regions.get(&request.lkey).is_some_and(|r| {
            local.len() as u64 <= r.len_bytes
                && r.host.is_none_or(|h| h.contains(local_addr, local.len()))
        }) && local.len() as u64 == request.remote.len_bytes;
        if !local_ok {
            return CompletionStatus::LocalProtectionError;
        }
        let peer = &mut self.endpoints[side.peer().index()];
        let Some(region) =
            peer.by_rkey.get(&request.remote.rkey).and_then(|l| peer.regions.get_mut(l))
        else {
            return CompletionStatus::RemoteAccessError;
        };
        let allowed = match request.opcode {
            Opcode::Read => region.access.remote_read,
            Opcode::Write => region.access.remote_write,
        };
        let end = request.remote.offset_bytes.checked_add(request.remote.len_bytes);
        let (true, Some(end)) = (allowed, end) else {
            return CompletionStatus::RemoteAccessError;
        };
        if end > region.len_bytes {
            return CompletionStatus::RemoteAccessError;
        }
        // Both bounds are within a registration whose length fits in memory.
        let (Ok(start), Ok(end)) =
            (usize::try_from(request.remote.offset_bytes), usize::try_from(end))
        else {
            return CompletionStatus::RemoteAccessError;
        };
        match (region.backing.as_mut(), region.host) {
            (Some(backing), _) => match request.opcode {
                Opcode::Read => local.copy_from_slice(&backing[start..end]),
                Opcode::Write => backing[start..end].copy_from_slice(local),
            },
            (None, Some(host)) => {
                // Both sides registering the same bytes would make the copy overlap: refuse
                // it as a real HCA's checks cannot, rather than alias the lent buffer.
                if host.overlaps(local.as_ptr() as usize, local.len()) {
                    return CompletionStatus::RemoteAccessError;
                }
                let at = (host.addr + start) as *mut u8;
                let n = end - start;
                // SAFETY: `start..end` lies inside the registration (checked above), whose
                // bytes `register_host`'s caller keeps valid and unreferenced until it is
                // deregistered; `local` is a distinct live buffer of `n` bytes that does not
                // overlap them (checked just above).
                unsafe {
                    match request.opcode {
                        Opcode::Read => std::ptr::copy_nonoverlapping(at, local.as_mut_ptr(), n),
                        Opcode::Write => std::ptr::copy_nonoverlapping(local.as_ptr(), at, n),
                    }
                }
            }
            (None, None) => return CompletionStatus::RemoteAccessError,
        }
        CompletionStatus::Success
    }
}

/// The simulated link and its two endpoints. Cloning an endpoint shares the same state.
pub struct SimNic {
    fabric: Arc<Mutex<Fabric>>,
}

impl fmt::Debug for SimNic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fabric = lock(&self.fabric);
        write!(
            f,
            "SimNic(simulated, seed {}, link {})",
            fabric.config.seed,
            if fabric.link_up { "up" } else { "down" }
        )
    }
}

fn lock(fabric: &Mutex<Fabric>) -> MutexGuard<'_, Fabric> {
    // A panic elsewhere cannot leave the simulation half-updated in a way tests rely on.
    fabric.lock().unwrap_or_else(|e| e.into_inner())
}

impl SimNic {
    pub fn endpoint(&self, side: Side) -> SimEndpoint {
        SimEndpoint { fabric: Arc::clone(&self.fabric), side }
    }
    pub fn implementation(&self) -> Implementation {
        Implementation::Simulated { seed: lock(&self.fabric).config.seed }
    }
    pub fn link_up(&self) -> bool {
        lock(&self.fabric).link_up
    }
}

/// One end of a [`SimNic`] link.
#[derive(Clone)]
pub struct SimEndpoint {
    fabric: Arc<Mutex<Fabric>>,
    side: Side,
}

impl fmt::Debug for SimEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seed = lock(&self.fabric).config.seed;
        write!(f, "SimEndpoint(simulated, seed {seed}, side {:?})", self.side)
    }
}

impl SimEndpoint {
    pub fn side(&self) -> Side {
        self.side
    }

    /// What this endpoint saw so far.
    pub fn stats(&self) -> SimStats {
        lock(&self.fabric).endpoints[self.side.index()].stats
    }

    /// Makes this endpoint's next posts meet `fault`, ahead of the seeded plan.
    pub fn inject(&self, fault: Fault) -> Result<(), NicError> {
        let mut fabric = lock(&self.fabric);
        let script = &mut fabric.endpoints[self.side.index()].script;
        if script.len() >= SCRIPT_FAULTS_MAX {
            return Err(NicError::QueueFull {
                outstanding: script.len(),
                depth: SCRIPT_FAULTS_MAX,
            });
        }
        script.push_back(fault);
        Ok(())
    }

    /// The bytes of a region open to peers, as this endpoint's host CPU sees them.
    pub fn host_read(&self, lkey: LocalKey) -> Option<Vec<u8>> {
        lock(&self.fabric).endpoints[self.side.index()].regions.get(&lkey)?.backing.clone()
    }

    /// Writes this endpoint's own region from its host CPU; false when out of bounds or local.
    pub fn host_write(&self, lkey: LocalKey, offset_bytes: usize, bytes: &[u8]) -> bool {
        let mut fabric = lock(&self.fabric);
        let backing = fabric.endpoints[self.side.index()]
            .regions
            .get_mut(&lkey)
            .and_then(|r| r.backing.as_mut());
        match (backing, offset_bytes.checked_add(bytes.len())) {
            (Some(b), Some(end)) if end <= b.len() => {
                b[offset_bytes..end].copy_from_slice(bytes);
                true
            }
            _ => false,
        }
    }
}

impl SimEndpoint {
    fn register_with(
        &mut self,
        len_bytes: u64,
        access: Access,
        host: Option<HostRange>,
    ) -> Result<MemoryRegion, NicError> {
        let mut fabric = lock(&self.fabric);
        let config = fabric.config;
        if len_bytes > config.region_bytes_max {
            return Err(NicError::RegionTooLarge { len_bytes, max_bytes: config.region_bytes_max });
        }
        let ep = &mut fabric.endpoints[self.side.index()];
        if ep.regions.len() >= config.regions_max.get() {
            return Err(NicError::RegistrationsFull {
                registered: ep.regions.len(),
                max: config.regions_max.get(),
            });
        }
        let n = ep.next_key;
        let (Some(next), Some(lkey), Some(rkey)) =
            (n.checked_add(1), n.checked_mul(2), n.checked_mul(2).and_then(|k| k.checked_add(1)))
        else {
            return Err(NicError::KeysExhausted { registered: ep.registered_total });
        };
        let backing = if host.is_none() && (access.remote_read || access.remote_write) {
            let len = usize::try_from(len_bytes).map_err(|_| NicError::RegionTooLarge {
                len_bytes,
                max_bytes: config.region_bytes_max,
            })?;
            Some(vec![0; len])
        } else {
            None
        };
        ep.next_key = next;
        ep.registered_total += 1;
        let region = MemoryRegion { lkey: LocalKey(lkey), rkey: RemoteKey(rkey), len_bytes };
        let entry = SimRegion { rkey: region.rkey, len_bytes, access, backing, host };
        ep.regions.insert(region.lkey, entry);
        ep.by_rkey.insert(region.rkey, region.lkey);
        Ok(region)
    }
}

impl RegisterHostMemory for SimEndpoint {
    unsafe fn register_host(
        &mut self,
        addr: NonNull<u8>,
        len_bytes: usize,
        access: Access,
    ) -> Result<MemoryRegion, NicError> {
        let host = HostRange { addr: addr.as_ptr() as usize, len: len_bytes };
        self.register_with(len_bytes as u64, access, Some(host))
    }
}

impl NicEndpoint for SimEndpoint {
    fn implementation(&self) -> Implementation {
        Implementation::Simulated { seed: lock(&self.fabric).config.seed }
    }

    fn register(&mut self, len_bytes: u64, access: Access) -> Result<MemoryRegion, NicError> {
        self.register_with(len_bytes, access, None)
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), NicError> {
        let mut fabric = lock(&self.fabric);
        let ep = &mut fabric.endpoints[self.side.index()];
        let region = ep.regions.remove(&lkey).ok_or(NicError::UnknownKey { key: lkey.0 })?;
        ep.by_rkey.remove(&region.rkey);
        Ok(())
    }

    fn post(&mut self, request: WorkRequest, local: &mut [u8]) -> Result<(), NicError> {
        let mut fabric = lock(&self.fabric);
        let depth = fabric.config.send_queue_depth.get();
        let late_polls = u64::from(fabric.config.late_polls.get());
        let i = self.side.index();
        let outstanding = fabric.endpoints[i].queue.len();
        if outstanding >= depth {
            return Err(NicError::QueueFull { outstanding, depth });
        }
        let scripted = fabric.endpoints[i].script.pop_front();
        let fault = match scripted {
            Some(f) => f,
            None => fabric.draw(),
        };
        let status = if !fabric.link_up {
            CompletionStatus::Flushed
        } else {
            match fault {
                Fault::LinkLoss => {
                    fabric.link_up = false;
                    CompletionStatus::RetryExceeded
                }
                Fault::RemoteAccess => CompletionStatus::RemoteAccessError,
                _ => fabric.execute(self.side, &request, local),
            }
        };
        let ep = &mut fabric.endpoints[i];
        ep.stats.posted += 1;
        match status {
            CompletionStatus::RemoteAccessError => ep.stats.remote_access_errors += 1,
            CompletionStatus::LocalProtectionError => ep.stats.local_protection_errors += 1,
            CompletionStatus::RetryExceeded => ep.stats.retry_exceeded += 1,
            CompletionStatus::Flushed => ep.stats.flushed += 1,
            CompletionStatus::Success => {}
        }
        let moved = if status == CompletionStatus::Success { request.remote.len_bytes } else { 0 };
        let completion =
            WorkCompletion { id: request.id, opcode: request.opcode, status, len_bytes: moved };
        let next_poll = ep.stats.polls + 1;
        // A flushed request never reached the wire, so link-level faults do not apply to it.
        let delivery = if status == CompletionStatus::Flushed { Fault::None } else { fault };
        match delivery {
            Fault::Lost => ep.stats.lost += 1,
            Fault::Duplicated => {
                ep.stats.duplicated += 1;
                ep.queue.push_back(Pending { due_poll: next_poll, completion });
                ep.queue.push_back(Pending { due_poll: next_poll, completion });
            }
            Fault::Late => {
                ep.stats.late += 1;
                ep.queue.push_back(Pending { due_poll: next_poll + late_polls, completion });
            }
            Fault::None | Fault::RemoteAccess | Fault::LinkLoss => {
                ep.queue.push_back(Pending { due_poll: next_poll, completion });
            }
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, entries_max: usize) -> usize {
        let mut fabric = lock(&self.fabric);
        let ep = &mut fabric.endpoints[self.side.index()];
        ep.stats.polls += 1;
        let now = ep.stats.polls;
        let limit = entries_max.min(POLL_ENTRIES_MAX);
        let mut taken = 0;
        let mut kept = VecDeque::with_capacity(ep.queue.len());
        while let Some(p) = ep.queue.pop_front() {
            if taken < limit && p.due_poll <= now {
                out.push(p.completion);
                taken += 1;
            } else {
                kept.push_back(p);
            }
        }
        ep.queue = kept;
        ep.stats.delivered += taken as u64;
        taken
    }

    fn reset(&mut self) {
        let mut fabric = lock(&self.fabric);
        fabric.link_up = true;
        fabric.endpoints[self.side.index()].queue.clear();
    }
}
