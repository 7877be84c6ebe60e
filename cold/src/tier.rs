//! [`ColdTier`]: packs on an object store, the index that finds a block in them, refill under
//! a budget, retention, reclaim and retired tenants.
//!
//! The object store is the record. The index (block digest to manifest and range) lives in
//! memory and is rebuilt at open by listing the manifests, fetching and validating each:
//! a legacy or damaged manifest is counted and never indexed. Nothing is read on the strength
//! of the index alone: a refill fetches the manifest again, proves it matches its name, is of
//! this build's version and binds the range to the very key asked for, and only then fetches
//! the range and checks its bytes against the manifest's checksum. Anything short of that is
//! a miss, with its reason counted.
//!
//! A refill failing to reach the object store (an error or no answer within the budget)
//! marks the tier degraded for `degrade_ms`: refills in that window are misses at once, with
//! no call to the object store, so a slow or absent store costs the read path nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::store::{StoreError, authorize};

use crate::manifest::{
    self, Manifest, ManifestError, SealedPack, manifest_folder, name_digest, retired_name,
    tenant_of_segment,
};
use crate::objects::{ColdError, ColdObjects};

/// Invalidated keys the tier remembers at most (each also recorded in the bucket).
pub const FORGOTTEN_MAX: usize = 1 << 20;

/// Blocks the index holds at most unless configured otherwise.
pub const INDEX_ENTRIES_MAX_DEFAULT: usize = 1 << 24;
/// Bytes one refill call may bring down unless configured otherwise.
pub const REFILL_BYTES_MAX_DEFAULT: u64 = 64 << 20;
/// How long one refill call may take unless configured otherwise.
pub const REFILL_WITHIN_MS_DEFAULT: u64 = 2_000;
/// How long refills stay misses after the object store failed one, unless configured otherwise.
pub const DEGRADE_MS_DEFAULT: u64 = 1_000;

/// What one refill call may spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefillBudget {
    pub bytes_max: u64,
    pub within: Duration,
}

impl Default for RefillBudget {
    fn default() -> Self {
        Self {
            bytes_max: REFILL_BYTES_MAX_DEFAULT,
            within: Duration::from_millis(REFILL_WITHIN_MS_DEFAULT),
        }
    }
}

/// How the tier names its objects, how long it keeps them and what it may spend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColdConfig {
    /// The folder of every object the tier writes (so a bucket can be shared).
    pub prefix: String,
    /// Blocks are kept this long after their pack is written, unless a tenant's retention
    /// says otherwise; zero keeps them until reclaimed by hand.
    pub retention_s: u64,
    pub degrade_ms: u64,
    pub index_entries_max: usize,
    pub refill: RefillBudget,
}

impl Default for ColdConfig {
    fn default() -> Self {
        Self {
            prefix: "gpucache".into(),
            retention_s: 0,
            degrade_ms: DEGRADE_MS_DEFAULT,
            index_entries_max: INDEX_ENTRIES_MAX_DEFAULT,
            refill: RefillBudget::default(),
        }
    }
}

/// How many reasons a refill can miss for ([`ColdMiss::ALL`]).
pub const COLD_MISS_REASONS: usize = 8;

/// The least time opening the tier gives each manifest fetch (a listing of thousands of
/// manifests at start is not held to one GET's refill budget).
pub const OPEN_FETCH_WITHIN_MIN: Duration = Duration::from_secs(30);

/// Why a refill found nothing to serve. Every one is a clean miss: the engine recomputes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ColdMiss {
    /// The index holds no block under this key.
    Absent,
    /// The call's byte budget was spent before this block.
    OverBudget,
    /// The call's time budget ran out before this block.
    Deadline,
    /// The object store failed a refill moments ago; it was not asked.
    Degraded,
    /// The object store failed or did not answer this time.
    Unavailable,
    /// The manifest is of an older version; nothing was downloaded from its pack.
    Legacy,
    /// The manifest does not bind this range to this key, or does not match its name.
    Mismatch,
    /// The range's bytes came back short or do not match their checksum.
    Corrupt,
}

impl ColdMiss {
    pub const ALL: [ColdMiss; COLD_MISS_REASONS] = [
        Self::Absent,
        Self::OverBudget,
        Self::Deadline,
        Self::Degraded,
        Self::Unavailable,
        Self::Legacy,
        Self::Mismatch,
        Self::Corrupt,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Absent => "absent",
            Self::OverBudget => "over_budget",
            Self::Deadline => "deadline",
            Self::Degraded => "degraded",
            Self::Unavailable => "unavailable",
            Self::Legacy => "legacy_manifest",
            Self::Mismatch => "mismatch",
            Self::Corrupt => "corrupt",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|m| *m == self).unwrap_or(0)
    }
}

/// One block's refill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refilled {
    Hit { bytes: Vec<u8>, checksum: Checksum },
    Miss(ColdMiss),
}

/// A refill the tier will not attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RefillRefused {
    /// The caller may not read this key (another tenant's, or no read right).
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("tenant {0} is retired from the cold tier")]
    Retired(TenantId),
}

/// Where a block lies, as the index last saw it.
#[derive(Debug, Clone)]
struct Located {
    manifest: Arc<ManifestRef>,
    len: u64,
}

/// A manifest the index holds.
#[derive(Debug)]
struct ManifestRef {
    name: String,
    bytes: u64,
    tenant: TenantId,
    pack_name: String,
    pack_len: u64,
    created_ms: u64,
    expires_ms: u64,
    keys: Vec<KeyDigest>,
}

#[derive(Debug, Default)]
struct Index {
    blocks: HashMap<KeyDigest, Located>,
    manifests: BTreeMap<String, Arc<ManifestRef>>,
    /// Manifests (by name) that reference each pack.
    packs: HashMap<String, HashSet<String>>,
}

impl Index {
    /// Indexes a manifest's blocks, except those invalidated at or after its pack was written.
    fn insert(
        &mut self,
        name: &str,
        bytes: u64,
        m: &Manifest,
        prefix: &str,
        forgotten: &HashMap<KeyDigest, u64>,
    ) {
        if self.manifests.contains_key(name) {
            return;
        }
        let r = Arc::new(ManifestRef {
            name: name.to_owned(),
            bytes,
            tenant: m.tenant.clone(),
            pack_name: manifest::pack_name(prefix, &m.pack_digest),
            pack_len: m.pack_len,
            created_ms: m.created_ms,
            expires_ms: m.expires_ms,
            keys: m.entries.iter().map(|e| e.key.digest()).collect(),
        });
        for e in &m.entries {
            if forgotten.get(&e.key.digest()).is_some_and(|&at| at >= m.created_ms) {
                continue;
            }
            let newer = match self.blocks.get(&e.key.digest()) {
                Some(old) => {
                    (old.manifest.created_ms, &old.manifest.name) <= (r.created_ms, &r.name)
                }
                None => true,
            };
            if newer {
                self.blocks
                    .insert(e.key.digest(), Located { manifest: Arc::clone(&r), len: e.len });
            }
        }
        self.packs.entry(r.pack_name.clone()).or_default().insert(name.to_owned());
        self.manifests.insert(name.to_owned(), r);
    }

    /// Drops a manifest and the blocks it indexes; the pack's name when no manifest left
    /// references it.
    fn remove(&mut self, name: &str) -> Option<String> {
        let r = self.manifests.remove(name)?;
        for k in &r.keys {
            if self.blocks.get(k).is_some_and(|l| l.manifest.name == r.name) {
                self.blocks.remove(k);
            }
        }
        let refs = self.packs.get_mut(&r.pack_name)?;
        refs.remove(name);
        if refs.is_empty() {
            self.packs.remove(&r.pack_name);
            return Some(r.pack_name.clone());
        }
        None
    }
}

/// What the tier did since it opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ColdStats {
    pub manifests: u64,
    pub blocks: u64,
    pub refill_hits: u64,
    /// Refill misses by reason, in [`ColdMiss::ALL`] order.
    pub refill_misses: [u64; COLD_MISS_REASONS],
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub packs_stored: u64,
    pub reclaimed_manifests: u64,
    pub reclaimed_packs: u64,
    pub degraded: bool,
}

#[derive(Debug, Default)]
struct Counters {
    refill_hits: AtomicU64,
    refill_misses: [AtomicU64; COLD_MISS_REASONS],
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    packs_stored: AtomicU64,
    reclaimed_manifests: AtomicU64,
    reclaimed_packs: AtomicU64,
}

/// What opening found in the bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    pub manifests: u64,
    pub blocks: u64,
    /// Manifests of an older version, never indexed.
    pub legacy: u64,
    /// Manifests that did not match their names or did not decode.
    pub damaged: u64,
    pub retired_tenants: u64,
}

/// What one reclaim did.
#[derive(Debug, Default)]
pub struct ReclaimReport {
    pub manifests: u64,
    pub packs: u64,
    /// Objects a delete did not remove (a head still found them), or whose calls failed;
    /// they stay indexed and are tried again by the next reclaim.
    pub failed: Vec<(String, ColdError)>,
}

/// The cold tier (see the module documentation).
pub struct ColdTier {
    objects: Arc<dyn ColdObjects>,
    config: ColdConfig,
    clock: Arc<dyn Clock>,
    index: RwLock<Index>,
    retired: RwLock<HashSet<TenantId>>,
    /// Invalidated keys, with when: a pack written before that time never serves them.
    forgotten: RwLock<HashMap<KeyDigest, u64>>,
    retention: Mutex<HashMap<TenantId, u64>>,
    degraded_until: Mutex<Option<Instant>>,
    counters: Counters,
}

impl std::fmt::Debug for ColdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColdTier").field("prefix", &self.config.prefix).finish_non_exhaustive()
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}
fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}
fn lock<T>(l: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a create-only PUT's error means the object is there (this very object, since its
/// name is its contents' digest).
fn stored_or_there(r: Result<(), ColdError>) -> Result<(), ColdError> {
    match r {
        Err(ColdError::AlreadyExists { .. }) => Ok(()),
        other => other,
    }
}

/// The key digest and time a `forgotten/` marker's name records.
fn forgotten_of(tail: &str) -> Option<(KeyDigest, u64)> {
    let (digest, at) = tail.split_once('-')?;
    let digest = name_digest(digest)?;
    Some((KeyDigest(digest), at.parse().ok()?))
}

impl ColdTier {
    /// Opens the tier on `objects`: reads the retired tenants and indexes every valid
    /// manifest under the prefix.
    pub fn open(
        objects: Arc<dyn ColdObjects>,
        config: ColdConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<(Self, OpenReport), ColdError> {
        let tier = Self {
            objects,
            config,
            clock,
            index: RwLock::default(),
            retired: RwLock::default(),
            forgotten: RwLock::default(),
            retention: Mutex::default(),
            degraded_until: Mutex::new(None),
            counters: Counters::default(),
        };
        let report = tier.load()?;
        Ok((tier, report))
    }

    fn load(&self) -> Result<OpenReport, ColdError> {
        let prefix = &self.config.prefix;
        let mut report = OpenReport::default();
        for (name, _) in self.objects.list(&format!("{prefix}/retired/"))? {
            if let Some(t) = name.rsplit('/').next().and_then(tenant_of_segment) {
                write(&self.retired).insert(t);
                report.retired_tenants += 1;
            }
        }
        for (name, _) in self.objects.list(&format!("{prefix}/forgotten/"))? {
            let Some((digest, at)) = name.rsplit('/').next().and_then(forgotten_of) else {
                continue;
            };
            let mut forgotten = write(&self.forgotten);
            let at = forgotten.get(&digest).map_or(at, |&old| old.max(at));
            forgotten.insert(digest, at);
        }
        let within = self.config.refill.within.max(OPEN_FETCH_WITHIN_MIN);
        for (name, size) in self.objects.list(&format!("{prefix}/manifests/"))? {
            let Some(digest) = name_digest(&name) else {
                report.damaged += 1;
                continue;
            };
            let folder_tenant = name.rsplit('/').nth(1).and_then(tenant_of_segment);
            let bytes = self.objects.get_range(&name, 0..size, within)?;
            match Manifest::decode(&bytes, &digest) {
                Ok(m) if folder_tenant.as_ref() == Some(&m.tenant) => {
                    if self.index_full(m.entries.len()) {
                        return Err(ColdError::Config(format!(
                            "the bucket holds more blocks than index_entries_max ({})",
                            self.config.index_entries_max
                        )));
                    }
                    report.manifests += 1;
                    report.blocks += m.entries.len() as u64;
                    write(&self.index).insert(&name, size, &m, prefix, &read(&self.forgotten));
                }
                Err(ManifestError::Legacy { .. }) => report.legacy += 1,
                _ => report.damaged += 1,
            }
        }
        Ok(report)
    }

    fn index_full(&self, more: usize) -> bool {
        read(&self.index).blocks.len() + more > self.config.index_entries_max
    }

    pub fn config(&self) -> &ColdConfig {
        &self.config
    }

    pub fn objects(&self) -> &Arc<dyn ColdObjects> {
        &self.objects
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Records how long `tenant`'s blocks are kept from now on (zero: until reclaimed by hand).
    /// Each pack carries the expiry its tenant's retention gave it when it was written.
    pub fn record_retention(&self, tenant: &TenantId, retention_s: u64) {
        lock(&self.retention).insert(tenant.clone(), retention_s);
    }

    /// The retention `tenant`'s new packs get.
    pub fn retention_s(&self, tenant: &TenantId) -> u64 {
        lock(&self.retention).get(tenant).copied().unwrap_or(self.config.retention_s)
    }

    /// The expiry of a pack of `tenant` written at `now_ms`.
    pub fn expiry_ms(&self, tenant: &TenantId, now_ms: u64) -> u64 {
        match self.retention_s(tenant) {
            0 => u64::MAX,
            s => now_ms.saturating_add(s.saturating_mul(1000)),
        }
    }

    pub fn is_retired(&self, tenant: &TenantId) -> bool {
        read(&self.retired).contains(tenant)
    }

    /// Retires `tenant` for good: a marker object records it (so a restart still refuses it),
    /// its blocks are refused from now on, and the next reclaim deletes its packs.
    pub fn retire(&self, tenant: &TenantId) -> Result<(), ColdError> {
        let name = retired_name(&self.config.prefix, tenant);
        stored_or_there(self.objects.put_new(&name, tenant.as_str().as_bytes()))?;
        write(&self.retired).insert(tenant.clone());
        Ok(())
    }

    /// Whether the index holds a block under `key`.
    pub fn contains(&self, key: &PhysicalKey) -> bool {
        read(&self.index).blocks.contains_key(&key.digest())
    }

    /// The length of the block the index holds under `key`.
    pub fn len_of(&self, key: &PhysicalKey) -> Option<u64> {
        read(&self.index).blocks.get(&key.digest()).map(|l| l.len)
    }

    /// Stores a sealed pack: the pack object first, then its manifest, then the index learns
    /// it. A name that is taken already holds these very bytes (names are digests), so a
    /// retried PUT whose first try landed succeeds. A failure deletes nothing: a manifest
    /// whose PUT failed ambiguously may be visible, and then so must its pack be.
    pub fn store_pack(&self, sealed: &SealedPack) -> Result<(), ColdError> {
        let tenant = &sealed.manifest.tenant;
        if self.is_retired(tenant) {
            return Err(ColdError::Permanent {
                operation: "put",
                key: sealed.manifest_name.clone(),
                detail: format!("tenant {tenant} is retired"),
            });
        }
        if self.index_full(sealed.manifest.entries.len()) {
            return Err(ColdError::Permanent {
                operation: "put",
                key: sealed.manifest_name.clone(),
                detail: format!("the index is full ({} blocks)", self.config.index_entries_max),
            });
        }
        stored_or_there(self.objects.put_new(&sealed.pack_name, &sealed.pack))?;
        stored_or_there(self.objects.put_new(&sealed.manifest_name, &sealed.manifest_bytes))?;
        let bytes = (sealed.pack.len() + sealed.manifest_bytes.len()) as u64;
        self.counters.bytes_up.fetch_add(bytes, Ordering::Relaxed);
        self.counters.packs_stored.fetch_add(1, Ordering::Relaxed);
        write(&self.index).insert(
            &sealed.manifest_name,
            sealed.manifest_bytes.len() as u64,
            &sealed.manifest,
            &self.config.prefix,
            &read(&self.forgotten),
        );
        Ok(())
    }

    /// Forgets `key` after an invalidation: the index drops it now, and a marker in the bucket
    /// keeps every pack written before this moment from serving it after a restart (a pack
    /// written later, after the key was stored again, serves it). Whether the index held it.
    pub fn forget(&self, key: &PhysicalKey) -> Result<bool, ColdError> {
        let at = self.clock.now_ms();
        let held = {
            let mut index = write(&self.index);
            index.blocks.remove(&key.digest()).is_some()
        };
        {
            let mut forgotten = write(&self.forgotten);
            if forgotten.len() < FORGOTTEN_MAX || forgotten.contains_key(&key.digest()) {
                forgotten.insert(key.digest(), at);
            }
        }
        let name = format!(
            "{}/forgotten/{}/{}-{at}",
            self.config.prefix,
            manifest::hex(key.tenant().as_str().as_bytes()),
            manifest::hex(&key.digest().0)
        );
        stored_or_there(self.objects.put_new(&name, &[]))?;
        Ok(held)
    }

    fn degraded(&self) -> bool {
        lock(&self.degraded_until).is_some_and(|t| Instant::now() < t)
    }

    fn degrade(&self) {
        *lock(&self.degraded_until) =
            Some(Instant::now() + Duration::from_millis(self.config.degrade_ms));
    }

    fn miss(&self, why: ColdMiss) -> Result<Refilled, RefillRefused> {
        self.counters.refill_misses[why.index()].fetch_add(1, Ordering::Relaxed);
        Ok(Refilled::Miss(why))
    }

    /// Refills `keys` for `caller` within `budget` (see the module documentation). A key the
    /// caller may not read, or of a retired tenant, is refused before anything is downloaded.
    pub fn refill(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
        budget: RefillBudget,
    ) -> Vec<Result<Refilled, RefillRefused>> {
        let start = Instant::now();
        let mut answers: Vec<Option<Result<Refilled, RefillRefused>>> = vec![None; keys.len()];
        // Manifest name -> (the manifest, and the items wanting it).
        let mut groups: Vec<(Arc<ManifestRef>, Vec<usize>)> = Vec::new();
        let mut spent = 0u64;
        let degraded = self.degraded();
        for (i, key) in keys.iter().enumerate() {
            if let Err(e) = authorize(caller, key, Right::Read) {
                answers[i] = Some(Err(e.into()));
                continue;
            }
            if self.is_retired(key.tenant()) {
                answers[i] = Some(Err(RefillRefused::Retired(key.tenant().clone())));
                continue;
            }
            let Some(at) = read(&self.index).blocks.get(&key.digest()).cloned() else {
                answers[i] = Some(self.miss(ColdMiss::Absent));
                continue;
            };
            if degraded {
                answers[i] = Some(self.miss(ColdMiss::Degraded));
                continue;
            }
            if spent.saturating_add(at.len) > budget.bytes_max {
                answers[i] = Some(self.miss(ColdMiss::OverBudget));
                continue;
            }
            spent += at.len;
            match groups.iter_mut().find(|(m, _)| m.name == at.manifest.name) {
                Some((_, items)) => items.push(i),
                None => groups.push((at.manifest, vec![i])),
            }
        }
        for (m, items) in groups {
            for (i, a) in self.refill_group(keys, &m, &items, start, budget.within) {
                answers[i] = Some(a);
            }
        }
        answers.into_iter().map(|a| a.unwrap_or_else(|| self.miss(ColdMiss::Absent))).collect()
    }

    /// The time left of a call that started at `start` and may take `within`.
    fn left(start: Instant, within: Duration) -> Option<Duration> {
        within.checked_sub(start.elapsed()).filter(|d| !d.is_zero())
    }

    /// Refills the items of one manifest: the manifest is fetched and validated, then each
    /// run of adjacent ranges is fetched in one call and every block checked.
    fn refill_group(
        &self,
        keys: &[&PhysicalKey],
        m: &ManifestRef,
        items: &[usize],
        start: Instant,
        within: Duration,
    ) -> Vec<(usize, Result<Refilled, RefillRefused>)> {
        let all = |why: ColdMiss| items.iter().map(|&i| (i, self.miss(why))).collect::<Vec<_>>();
        if self.degraded() {
            return all(ColdMiss::Degraded);
        }
        let Some(left) = Self::left(start, within) else { return all(ColdMiss::Deadline) };
        let bytes = match self.objects.get_range(&m.name, 0..m.bytes, left) {
            Ok(b) => b,
            Err(ColdError::NotFound { .. }) => {
                write(&self.index).remove(&m.name);
                return all(ColdMiss::Absent);
            }
            Err(_) => {
                self.degrade();
                return all(ColdMiss::Unavailable);
            }
        };
        self.counters.bytes_down.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let Some(digest) = name_digest(&m.name) else { return all(ColdMiss::Mismatch) };
        let manifest = match Manifest::decode(&bytes, &digest) {
            Ok(manifest) if manifest.tenant == m.tenant => manifest,
            Ok(_) | Err(ManifestError::NameMismatch | ManifestError::Malformed(_)) => {
                return all(ColdMiss::Mismatch);
            }
            Err(ManifestError::Legacy { .. } | ManifestError::Unsupported { .. }) => {
                return all(ColdMiss::Legacy);
            }
        };
        // Each item's entry, bound to its key; runs of ranges that follow one another.
        let mut out = Vec::with_capacity(items.len());
        let mut wanted: Vec<(usize, &manifest::PackEntry)> = Vec::new();
        for &i in items {
            match manifest.entry(keys[i]) {
                Some(e) => wanted.push((i, e)),
                None => out.push((i, self.miss(ColdMiss::Mismatch))),
            }
        }
        wanted.sort_by_key(|(_, e)| e.offset);
        let mut runs: Vec<Vec<(usize, &manifest::PackEntry)>> = Vec::new();
        for w in wanted {
            match runs.last_mut() {
                Some(run) if run.last().is_some_and(|(_, e)| e.offset + e.len == w.1.offset) => {
                    run.push(w)
                }
                _ => runs.push(vec![w]),
            }
        }
        for run in runs {
            let (first, last) = (run[0].1, run[run.len() - 1].1);
            let range = first.offset..last.offset + last.len;
            let Some(left) = Self::left(start, within) else {
                out.extend(run.iter().map(|(i, _)| (*i, self.miss(ColdMiss::Deadline))));
                continue;
            };
            let got = match self.objects.get_range(&m.pack_name, range.clone(), left) {
                Ok(b) => b,
                Err(ColdError::NotFound { .. }) => {
                    write(&self.index).remove(&m.name);
                    out.extend(run.iter().map(|(i, _)| (*i, self.miss(ColdMiss::Absent))));
                    continue;
                }
                Err(_) => {
                    self.degrade();
                    out.extend(run.iter().map(|(i, _)| (*i, self.miss(ColdMiss::Unavailable))));
                    continue;
                }
            };
            self.counters.bytes_down.fetch_add(got.len() as u64, Ordering::Relaxed);
            for (i, e) in run {
                let from = usize::try_from(e.offset - range.start).unwrap_or(usize::MAX);
                let to = from.saturating_add(usize::try_from(e.len).unwrap_or(usize::MAX));
                let answer = match got.get(from..to) {
                    Some(b) if Checksum::of(b) == e.checksum => {
                        self.counters.refill_hits.fetch_add(1, Ordering::Relaxed);
                        Ok(Refilled::Hit { bytes: b.to_vec(), checksum: e.checksum })
                    }
                    _ => self.miss(ColdMiss::Corrupt),
                };
                out.push((i, answer));
            }
        }
        out
    }

    /// Deletes every manifest whose retention ran out by now, and every manifest of a retired
    /// tenant, then each pack no remaining manifest references. Each delete is proven by a
    /// head that finds the object absent; an object still found stays indexed, reported.
    pub fn reclaim(&self) -> ReclaimReport {
        let now = self.clock.now_ms();
        let due: Vec<String> = {
            let retired = read(&self.retired);
            read(&self.index)
                .manifests
                .values()
                .filter(|m| m.expires_ms <= now || retired.contains(&m.tenant))
                .map(|m| m.name.clone())
                .collect()
        };
        let mut report = ReclaimReport::default();
        for name in due {
            if let Err(e) = self.delete_proven(&name) {
                report.failed.push((name, e));
                continue;
            }
            report.manifests += 1;
            self.counters.reclaimed_manifests.fetch_add(1, Ordering::Relaxed);
            let orphan = write(&self.index).remove(&name);
            if let Some(pack) = orphan {
                match self.delete_proven(&pack) {
                    Ok(()) => {
                        report.packs += 1;
                        self.counters.reclaimed_packs.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => report.failed.push((pack, e)),
                }
            }
        }
        report
    }

    /// Deletes `name` and proves it gone with a head.
    fn delete_proven(&self, name: &str) -> Result<(), ColdError> {
        self.objects.delete(name)?;
        match self.objects.head(name)? {
            None => Ok(()),
            Some(size) => Err(ColdError::Permanent {
                operation: "delete",
                key: name.to_owned(),
                detail: format!("a head after the delete still finds {size} bytes"),
            }),
        }
    }

    /// The manifests of `tenant` the index holds, by name.
    pub fn manifests_of(&self, tenant: &TenantId) -> Vec<String> {
        let folder = manifest_folder(&self.config.prefix, tenant);
        read(&self.index).manifests.keys().filter(|n| n.starts_with(&folder)).cloned().collect()
    }

    /// The pack objects the index references.
    pub fn packs(&self) -> Vec<String> {
        read(&self.index).packs.keys().cloned().collect()
    }

    pub fn stats(&self) -> ColdStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let index = read(&self.index);
        let mut misses = [0u64; COLD_MISS_REASONS];
        for (m, a) in misses.iter_mut().zip(&c.refill_misses) {
            *m = get(a);
        }
        ColdStats {
            manifests: index.manifests.len() as u64,
            blocks: index.blocks.len() as u64,
            refill_hits: get(&c.refill_hits),
            refill_misses: misses,
            bytes_up: get(&c.bytes_up),
            bytes_down: get(&c.bytes_down),
            packs_stored: get(&c.packs_stored),
            reclaimed_manifests: get(&c.reclaimed_manifests),
            reclaimed_packs: get(&c.reclaimed_packs),
            degraded: self.degraded(),
        }
    }

    /// The pack bytes the index references (for a test that damages a stored range).
    pub fn pack_of(&self, key: &PhysicalKey) -> Option<(String, u64)> {
        read(&self.index)
            .blocks
            .get(&key.digest())
            .map(|l| (l.manifest.pack_name.clone(), l.manifest.pack_len))
    }
}
