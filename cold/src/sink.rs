//! [`ColdSink`]: the queue that carries blocks down to the cold tier, off the request path.
//!
//! Blocks arrive one at a time (a demotion from the tier above, or a backfill) and gather in
//! one open pack per tenant. A drain round seals into jobs the packs that reached the target
//! size or block count and those open for `pack_open_ms_max` (the stop seals them all), so the
//! caller that offers a block never pays for it: sealing builds and validates the pack and its
//! manifest once, so every attempt stores the same two objects.
//!
//! A drain round takes a snapshot of at most `drain_jobs_max` jobs from the front of the queue
//! and tries each once. A temporary failure sends the job to the back of the queue until it
//! has had [`SINK_ATTEMPTS_MAX`] tries; a permanent failure, or the last try's, moves it to
//! the failed queue, where each job can be looked at, tried again or taken out. Open packs,
//! queued jobs and failed jobs together stay within `jobs_max` jobs and `bytes_max` bytes: a
//! block that would go over is refused at once (the tier above then drops it, a clean miss).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;

use crate::manifest::{PACK_BLOCKS_MAX, PACK_BYTES_MAX, PackBuilder, SealedPack};
use crate::objects::ColdError;
use crate::tier::ColdTier;

/// Tries a job gets before it goes to the failed queue.
pub const SINK_ATTEMPTS_MAX: u32 = 3;
pub const SINK_JOBS_MAX_DEFAULT: usize = 1024;
pub const SINK_BYTES_MAX_DEFAULT: u64 = 1 << 30;
pub const DRAIN_JOBS_MAX_DEFAULT: usize = 64;
pub const PACK_BYTES_TARGET_DEFAULT: u64 = 8 << 20;
pub const PACK_BLOCKS_TARGET_DEFAULT: usize = 256;

/// The sink's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkLimits {
    /// Open packs, queued jobs and failed jobs, together.
    pub jobs_max: usize,
    /// Their bytes, together.
    pub bytes_max: u64,
    /// Jobs one drain round tries at most.
    pub drain_jobs_max: usize,
    /// A pack is sealed once it holds this many bytes...
    pub pack_bytes_target: u64,
    /// ... or this many blocks.
    pub pack_blocks_target: usize,
    /// A drain round seals an open pack only once it has been open this long (0: every open
    /// pack at every round), so that packs fill up between rounds.
    pub pack_open_ms_max: u64,
}

impl Default for SinkLimits {
    fn default() -> Self {
        Self {
            jobs_max: SINK_JOBS_MAX_DEFAULT,
            bytes_max: SINK_BYTES_MAX_DEFAULT,
            drain_jobs_max: DRAIN_JOBS_MAX_DEFAULT,
            pack_bytes_target: PACK_BYTES_TARGET_DEFAULT,
            pack_blocks_target: PACK_BLOCKS_TARGET_DEFAULT,
            pack_open_ms_max: 0,
        }
    }
}

/// Why a block was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkRefused {
    #[error(
        "the cold sink is full ({jobs} jobs, {bytes} bytes held; limits {jobs_max} jobs, {bytes_max} bytes)"
    )]
    Full { jobs: usize, bytes: u64, jobs_max: usize, bytes_max: u64 },
    #[error("a block of {len} bytes does not fit a pack (at most {PACK_BYTES_MAX})")]
    TooLarge { len: u64 },
    #[error("tenant {0} is retired from the cold tier")]
    Retired(TenantId),
}

/// One sealed pack on its way down.
#[derive(Debug, Clone)]
pub struct Job {
    pub id: u64,
    pub sealed: SealedPack,
    pub attempts: u32,
    pub last_error: Option<ColdError>,
}

impl Job {
    fn bytes(&self) -> u64 {
        self.sealed.pack.len() as u64
    }
}

/// A failed job, as [`ColdSink::failed`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedJob {
    pub id: u64,
    pub tenant: TenantId,
    pub blocks: usize,
    pub bytes: u64,
    pub attempts: u32,
    pub error: ColdError,
}

/// What one drain round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Jobs tried this round.
    pub attempted: usize,
    /// Jobs stored (their blocks are in the cold tier's index).
    pub stored: usize,
    pub blocks_stored: usize,
    pub bytes_stored: u64,
    /// Jobs sent to the back of the queue after a temporary failure.
    pub retried: usize,
    /// Jobs moved to the failed queue this round.
    pub failed: usize,
    /// Jobs still queued after the round.
    pub pending: usize,
    /// The first failure of the round, with its job.
    pub first_error: Option<(u64, ColdError)>,
}

/// A drain round that met a failure: what it did, and the first error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cold sink drain: {error} ({} of {} jobs stored)", .report.stored, .report.attempted)]
pub struct DrainFailed {
    pub report: DrainReport,
    pub error: ColdError,
}

/// What the sink holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkDepth {
    /// Packs filling, and full ones waiting for the next round to seal them.
    pub open_packs: usize,
    pub pending: usize,
    pub failed: usize,
    pub bytes: u64,
}

/// What the sink did since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkCounters {
    pub blocks_taken: u64,
    pub blocks_refused: u64,
    pub jobs_stored: u64,
    pub jobs_retried: u64,
    pub jobs_failed: u64,
}

/// How a backfill ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillReport {
    pub blocks: usize,
    pub bytes: u64,
    /// Why it stopped before the blocks ran out, if it did.
    pub stopped: Option<BackfillStop>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackfillStop {
    /// The next block would have gone over the byte budget.
    Budget {
        budget: u64,
    },
    Refused(SinkRefused),
}

#[derive(Debug, Default)]
struct State {
    open: BTreeMap<TenantId, PackBuilder>,
    /// Packs that filled up, waiting for the next drain round to seal them (sealing hashes
    /// and checks the whole pack, which is no work for the offering caller's path).
    full: VecDeque<PackBuilder>,
    /// When each open pack took its first block.
    opened_at: BTreeMap<TenantId, Instant>,
    pending: VecDeque<Job>,
    failed: BTreeMap<u64, Job>,
    bytes: u64,
    next_id: u64,
    counters: SinkCounters,
}

impl State {
    fn jobs(&self) -> usize {
        self.open.len() + self.full.len() + self.pending.len() + self.failed.len()
    }
}

/// The sink (see the module documentation).
#[derive(Debug)]
pub struct ColdSink {
    limits: SinkLimits,
    state: Mutex<State>,
}

impl ColdSink {
    pub fn new(limits: SinkLimits) -> Self {
        let limits = SinkLimits {
            pack_bytes_target: limits.pack_bytes_target.clamp(1, PACK_BYTES_MAX),
            pack_blocks_target: limits.pack_blocks_target.clamp(1, PACK_BLOCKS_MAX),
            drain_jobs_max: limits.drain_jobs_max.max(1),
            ..limits
        };
        Self { limits, state: Mutex::default() }
    }

    pub fn limits(&self) -> SinkLimits {
        self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one block for `tier`. A block already in the open pack of its tenant is taken
    /// once.
    pub fn offer(
        &self,
        tier: &ColdTier,
        key: &PhysicalKey,
        payload: &[u8],
        checksum: Checksum,
    ) -> Result<(), SinkRefused> {
        let tenant = key.tenant();
        let len = payload.len() as u64;
        let mut s = self.lock();
        let refuse = |s: &mut State, why: SinkRefused| {
            s.counters.blocks_refused += 1;
            Err(why)
        };
        if tier.is_retired(tenant) {
            return refuse(&mut s, SinkRefused::Retired(tenant.clone()));
        }
        if len > PACK_BYTES_MAX {
            return refuse(&mut s, SinkRefused::TooLarge { len });
        }
        if s.open.get(tenant).is_some_and(|p| p.holds(key)) {
            return Ok(());
        }
        // A full open pack is sealed first; the block then starts a new one.
        let full = s.open.get(tenant).is_some_and(|p| {
            p.bytes() + len > self.limits.pack_bytes_target
                || p.len() >= self.limits.pack_blocks_target
        });
        if full && let Some(pack) = s.open.remove(tenant) {
            s.opened_at.remove(tenant);
            s.full.push_back(pack);
        }
        let new_pack = !s.open.contains_key(tenant);
        let jobs = s.jobs() + usize::from(new_pack);
        if jobs > self.limits.jobs_max || s.bytes + len > self.limits.bytes_max {
            let why = SinkRefused::Full {
                jobs: s.jobs(),
                bytes: s.bytes,
                jobs_max: self.limits.jobs_max,
                bytes_max: self.limits.bytes_max,
            };
            return refuse(&mut s, why);
        }
        if new_pack {
            s.opened_at.insert(tenant.clone(), Instant::now());
        }
        s.open.entry(tenant.clone()).or_insert_with(|| PackBuilder::new(tenant.clone())).push(
            key.clone(),
            payload,
            checksum,
        );
        s.bytes += len;
        s.counters.blocks_taken += 1;
        Ok(())
    }

    /// Seals `pack` into a queued job. A pack that fails its own validation (which a correct
    /// build never makes) goes to the failed queue with that error.
    fn seal_into(&self, s: &mut State, tier: &ColdTier, pack: PackBuilder) {
        let id = s.next_id;
        s.next_id += 1;
        let bytes = pack.bytes();
        let tenant = pack.tenant().clone();
        let now = tier.now_ms();
        match pack.seal(&tier.config().prefix, now, tier.expiry_ms(&tenant, now)) {
            Ok(sealed) => s.pending.push_back(Job { id, sealed, attempts: 0, last_error: None }),
            Err(e) => {
                s.bytes -= bytes;
                s.counters.jobs_failed += 1;
                tracing::error!(tenant = %tenant, error = %e, "a pack failed its own validation and was dropped");
            }
        }
    }

    /// Seals every open pack into a job.
    pub fn seal_open(&self, tier: &ColdTier) {
        self.seal_older_than(tier, Duration::ZERO);
    }

    /// Seals the open packs that took their first block at least `age` ago.
    fn seal_older_than(&self, tier: &ColdTier, age: Duration) {
        let mut s = self.lock();
        while let Some(pack) = s.full.pop_front() {
            self.seal_into(&mut s, tier, pack);
        }
        let due: Vec<TenantId> = s
            .opened_at
            .iter()
            .filter(|(_, at)| at.elapsed() >= age)
            .map(|(t, _)| t.clone())
            .collect();
        for tenant in due {
            s.opened_at.remove(&tenant);
            if let Some(pack) = s.open.remove(&tenant) {
                self.seal_into(&mut s, tier, pack);
            }
        }
    }

    /// One drain round (see the module documentation). The object store is called with no
    /// lock held.
    pub fn drain_round(&self, tier: &ColdTier) -> DrainReport {
        self.drain_round_until(tier, None)
    }

    /// A drain round that tries no job after `deadline`: the jobs of its snapshot it did not
    /// reach go back to the front of the queue, untried and in order.
    pub fn drain_round_until(&self, tier: &ColdTier, deadline: Option<Instant>) -> DrainReport {
        self.seal_older_than(tier, Duration::from_millis(self.limits.pack_open_ms_max));
        let snapshot: Vec<Job> = {
            let mut s = self.lock();
            let n = s.pending.len().min(self.limits.drain_jobs_max);
            s.pending.drain(..n).collect()
        };
        let mut report = DrainReport::default();
        let mut jobs = snapshot.into_iter();
        while let Some(mut job) = jobs.next() {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let mut s = self.lock();
                for untried in std::iter::once(job).chain(jobs).rev() {
                    s.pending.push_front(untried);
                }
                break;
            }
            report.attempted += 1;
            job.attempts += 1;
            let result = tier.store_pack(&job.sealed);
            let mut s = self.lock();
            match result {
                Ok(()) => {
                    report.stored += 1;
                    report.blocks_stored += job.sealed.manifest.entries.len();
                    report.bytes_stored += job.bytes();
                    s.bytes -= job.bytes();
                    s.counters.jobs_stored += 1;
                }
                Err(e) => {
                    if report.first_error.is_none() {
                        report.first_error = Some((job.id, e.clone()));
                    }
                    let again = e.is_transient() && job.attempts < SINK_ATTEMPTS_MAX;
                    job.last_error = Some(e);
                    if again {
                        report.retried += 1;
                        s.counters.jobs_retried += 1;
                        s.pending.push_back(job);
                    } else {
                        report.failed += 1;
                        s.counters.jobs_failed += 1;
                        s.failed.insert(job.id, job);
                    }
                }
            }
        }
        report.pending = self.lock().pending.len();
        report
    }

    /// A drain round that answers its first failure as an error, after the round (the
    /// report still tells what the round got done).
    pub fn drain(&self, tier: &ColdTier) -> Result<DrainReport, Box<DrainFailed>> {
        let report = self.drain_round(tier);
        match report.first_error.clone() {
            Some((_, error)) => Err(Box::new(DrainFailed { report, error })),
            None => Ok(report),
        }
    }

    /// Offers `blocks` in order until the next would take the total over `budget` bytes, or
    /// the sink refuses one.
    pub fn backfill<'a>(
        &self,
        tier: &ColdTier,
        blocks: impl IntoIterator<Item = (&'a PhysicalKey, &'a [u8], Checksum)>,
        budget: u64,
    ) -> BackfillReport {
        let mut report = BackfillReport { blocks: 0, bytes: 0, stopped: None };
        for (key, payload, checksum) in blocks {
            let len = payload.len() as u64;
            if report.bytes + len > budget {
                report.stopped = Some(BackfillStop::Budget { budget });
                break;
            }
            if let Err(e) = self.offer(tier, key, payload, checksum) {
                report.stopped = Some(BackfillStop::Refused(e));
                break;
            }
            report.blocks += 1;
            report.bytes += len;
        }
        report
    }

    /// Takes `key` out of its tenant's open pack (an invalidation). A sealed job still holds
    /// it; [`ColdTier::forget`] keeps that copy from serving. Whether the open pack held it.
    pub fn forget(&self, key: &PhysicalKey) -> bool {
        let mut s = self.lock();
        let tenant = key.tenant();
        if let Some(freed) = s.open.get_mut(tenant).and_then(|p| p.remove(key)) {
            if s.open.get(tenant).is_some_and(PackBuilder::is_empty) {
                s.open.remove(tenant);
                s.opened_at.remove(tenant);
            }
            s.bytes -= freed;
            return true;
        }
        let Some(i) = s.full.iter().position(|p| p.tenant() == tenant && p.holds(key)) else {
            return false;
        };
        let freed = s.full[i].remove(key).unwrap_or(0);
        if s.full[i].is_empty() {
            s.full.remove(i);
        }
        s.bytes -= freed;
        true
    }

    /// Whether a sealed job (queued or failed) holds `key`.
    pub fn may_hold(&self, key: &PhysicalKey) -> bool {
        let s = self.lock();
        let holds =
            |j: &Job| j.sealed.manifest.entries.iter().any(|e| e.key.digest() == key.digest());
        s.pending.iter().any(holds) || s.failed.values().any(holds)
    }

    /// The failed jobs, oldest first.
    pub fn failed(&self) -> Vec<FailedJob> {
        self.lock()
            .failed
            .values()
            .map(|j| FailedJob {
                id: j.id,
                tenant: j.sealed.manifest.tenant.clone(),
                blocks: j.sealed.manifest.entries.len(),
                bytes: j.bytes(),
                attempts: j.attempts,
                error: j
                    .last_error
                    .clone()
                    .unwrap_or(ColdError::Config("no error recorded".into())),
            })
            .collect()
    }

    /// Takes failed job `id` out of the sink (its bytes no longer count against the limits).
    pub fn take_failed(&self, id: u64) -> Option<Job> {
        let mut s = self.lock();
        let job = s.failed.remove(&id)?;
        s.bytes -= job.bytes();
        Some(job)
    }

    /// Queues failed job `id` again with a fresh set of tries.
    pub fn retry_failed(&self, id: u64) -> bool {
        let mut s = self.lock();
        let Some(mut job) = s.failed.remove(&id) else { return false };
        job.attempts = 0;
        s.pending.push_back(job);
        true
    }

    pub fn depth(&self) -> SinkDepth {
        let s = self.lock();
        SinkDepth {
            open_packs: s.open.len() + s.full.len(),
            pending: s.pending.len(),
            failed: s.failed.len(),
            bytes: s.bytes,
        }
    }

    pub fn counters(&self) -> SinkCounters {
        self.lock().counters
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpucache_dataplane::clock::UnixClock;
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::testing::fixture;

    use super::*;
    use crate::memory::MemoryObjects;
    use crate::tier::ColdConfig;

    fn tier() -> ColdTier {
        let objects = Arc::new(MemoryObjects::new(1 << 30));
        ColdTier::open(objects, ColdConfig::default(), Arc::new(UnixClock)).expect("open").0
    }

    fn offer(sink: &ColdSink, tier: &ColdTier, n: u8) {
        let key = fixture::key(0, &[n], KvDtype::F16, 16);
        let bytes = fixture::payload(u64::from(n), 100);
        sink.offer(tier, &key, &bytes, Checksum::of(&bytes)).expect("offer");
    }

    #[test]
    fn a_round_past_its_deadline_puts_its_untried_jobs_back_in_order() {
        let tier = tier();
        let sink = ColdSink::new(SinkLimits { pack_blocks_target: 1, ..SinkLimits::default() });
        for n in 0..4 {
            offer(&sink, &tier, n);
        }
        sink.seal_open(&tier);
        let order = |s: &ColdSink| s.lock().pending.iter().map(|j| j.id).collect::<Vec<_>>();
        let before = order(&sink);
        assert_eq!(before.len(), 4);
        let r = sink.drain_round_until(&tier, Some(Instant::now()));
        assert_eq!((r.attempted, r.stored, r.pending), (0, 0, 4));
        assert_eq!(order(&sink), before, "untried, in the same order");
        let r = sink.drain_round(&tier);
        assert_eq!((r.attempted, r.stored, r.pending), (4, 4, 0));
        assert_eq!(sink.depth(), SinkDepth::default());
    }

    #[test]
    fn a_round_seals_full_packs_and_those_open_long_enough() {
        let tier = tier();
        let limits = SinkLimits {
            pack_blocks_target: 2,
            pack_open_ms_max: 3_600_000,
            ..SinkLimits::default()
        };
        let sink = ColdSink::new(limits);
        for n in 0..3 {
            offer(&sink, &tier, n);
        }
        // Blocks 0 and 1 filled a pack; block 2 opened the next, young.
        assert_eq!(sink.depth().open_packs, 2);
        let r = sink.drain_round(&tier);
        assert_eq!((r.attempted, r.stored, r.blocks_stored), (1, 1, 2));
        assert_eq!(sink.depth().open_packs, 1, "the young pack waits");
        assert!(!tier.contains(&fixture::key(0, &[2], KvDtype::F16, 16)));
        sink.seal_open(&tier);
        assert_eq!(sink.drain_round(&tier).blocks_stored, 1);
        assert_eq!(sink.depth(), SinkDepth::default());
    }

    #[test]
    fn forgetting_a_block_takes_it_out_of_its_open_pack() {
        let tier = tier();
        let sink = ColdSink::new(SinkLimits::default());
        for n in 0..3 {
            offer(&sink, &tier, n);
        }
        assert_eq!(sink.depth().bytes, 300);
        assert!(sink.forget(&fixture::key(0, &[1], KvDtype::F16, 16)));
        assert_eq!(sink.depth().bytes, 200);
        let r = sink.drain_round(&tier);
        assert_eq!(r.blocks_stored, 2);
        assert!(!tier.contains(&fixture::key(0, &[1], KvDtype::F16, 16)));
        let k2 = fixture::key(0, &[2], KvDtype::F16, 16);
        let got = tier.refill(&fixture::caller(0), &[&k2], crate::tier::RefillBudget::default());
        let want = fixture::payload(2, 100);
        assert!(
            matches!(&got[0], Ok(crate::tier::Refilled::Hit { bytes, .. }) if *bytes == want),
            "the block after the removed one kept its bytes: {got:?}"
        );
    }
}
