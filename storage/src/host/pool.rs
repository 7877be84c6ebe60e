//! Huge-page backed host memory for registered pools.
//!
//! [`HugePagePool`] maps one anonymous region, carves it into fixed slots and hands them to
//! [`gpucache_dataplane::registry::RegisteredPool`] through [`PoolMemory`]. It owns the mapping,
//! its page tier, residency and locking; it must not own registration, leases or quarantine,
//! which stay in the dataplane's region table.
//!
//! Tiers are tried from the best the policy allows down to the least it accepts:
//! 1 GiB pages (`MAP_HUGETLB | MAP_HUGE_1GB`), 2 MiB pages (`MAP_HUGETLB | MAP_HUGE_2MB`),
//! transparent huge pages (a 2 MiB aligned mapping advised with `MADV_HUGEPAGE`), then plain
//! pages. A tier is only reported once the kernel has really given it: hugetlb mappings fail at
//! `mmap` when too few pages are reserved, and a transparent mapping is checked in
//! `/proc/self/smaps` after it is populated. Every page is made resident up front so the first
//! transfer into a slot does not fault, then locked with `mlock` when the policy asks for it.
//!
//! All `unsafe` lives in this file: the raw mapping never leaves it, and slot bytes are handed
//! out as ordinary borrows of the pool.

use std::fmt;
use std::io;
use std::ptr::NonNull;

use gpucache_dataplane::registry::{BindError, Binding, MemoryKind, PoolMemory};

/// Largest pool one mapping may hold.
pub const POOL_BYTES_MAX: u64 = 1 << 40;
/// Base page size assumed for plain mappings and for touching pages by hand.
pub const BASE_PAGE_BYTES: u64 = 4 << 10;
/// Transparent and 2 MiB hugetlb page size.
pub const HUGE_2M_BYTES: u64 = 2 << 20;
/// 1 GiB hugetlb page size.
pub const HUGE_1G_BYTES: u64 = 1 << 30;

/// The same sizes as `usize`, for pointer arithmetic (checked equal at compile time).
const HUGE_2M_USIZE: usize = 2 << 20;
const BASE_PAGE_USIZE: usize = 4 << 10;
const _: () = assert!(HUGE_2M_USIZE as u64 == HUGE_2M_BYTES);
const _: () = assert!(BASE_PAGE_USIZE as u64 == BASE_PAGE_BYTES);

const THP_ENABLED_PATH: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// A kind of page backing, ordered from least to best.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Ordinary 4 KiB pages (transparent huge pages switched off for the mapping).
    Plain,
    /// Transparent huge pages: 2 MiB pages the kernel assembles on fault.
    Transparent,
    /// Reserved 2 MiB hugetlb pages.
    Huge2M,
    /// Reserved 1 GiB hugetlb pages.
    Huge1G,
}

impl Tier {
    /// Best first.
    pub const ALL: [Tier; 4] = [Tier::Huge1G, Tier::Huge2M, Tier::Transparent, Tier::Plain];

    /// The page size the mapping is rounded to.
    pub fn page_bytes(self) -> u64 {
        match self {
            Tier::Plain => BASE_PAGE_BYTES,
            Tier::Transparent | Tier::Huge2M => HUGE_2M_BYTES,
            Tier::Huge1G => HUGE_1G_BYTES,
        }
    }

    /// What an operator does to make this tier available.
    pub fn how_to_enable(self) -> &'static str {
        match self {
            Tier::Plain => "always available",
            Tier::Transparent => {
                "set /sys/kernel/mm/transparent_hugepage/enabled to madvise or always"
            }
            Tier::Huge2M => {
                "reserve 2 MiB pages: sysctl vm.nr_hugepages=N \
                 (or /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages)"
            }
            Tier::Huge1G => {
                "reserve 1 GiB pages: echo N > \
                 /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages \
                 (the 1 GiB pool of vm.nr_hugepages; at boot: hugepagesz=1G hugepages=N)"
            }
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Plain => "plain 4 KiB pages",
            Tier::Transparent => "transparent 2 MiB huge pages",
            Tier::Huge2M => "2 MiB hugetlb pages",
            Tier::Huge1G => "1 GiB hugetlb pages",
        })
    }
}

/// Whether the pool must be locked in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// Fail with [`PoolMemoryError::LockRefused`] when `mlock` is not allowed.
    Required,
    /// Try `mlock`; when refused, keep the pool unlocked and report why in [`Backing`].
    BestEffort,
    /// Do not lock.
    Off,
}

/// Which tiers to try and what to accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HugePagePolicy {
    /// The best tier to try first.
    pub prefer: Tier,
    /// The least tier accepted; below it creation fails closed instead of falling back.
    pub require: Tier,
    pub lock: Lock,
}

impl Default for HugePagePolicy {
    /// Best available tier, any tier accepted, locked when allowed.
    fn default() -> Self {
        Self { prefer: Tier::Huge1G, require: Tier::Plain, lock: Lock::BestEffort }
    }
}

impl HugePagePolicy {
    /// Exactly one tier, nothing else.
    pub fn only(tier: Tier) -> Self {
        Self { prefer: tier, require: tier, ..Self::default() }
    }
    pub fn require(self, tier: Tier) -> Self {
        Self { require: tier, ..self }
    }
    pub fn prefer(self, tier: Tier) -> Self {
        Self { prefer: tier, ..self }
    }
    pub fn lock(self, lock: Lock) -> Self {
        Self { lock, ..self }
    }

    /// The tiers this policy tries, best first.
    pub fn tiers(&self) -> impl Iterator<Item = Tier> + '_ {
        Tier::ALL.into_iter().filter(|t| *t <= self.prefer && *t >= self.require)
    }
}

/// Why one tier could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierAttempt {
    pub tier: Tier,
    /// What failed (`mmap`, `madvise`, a kernel setting).
    pub what: String,
    /// The OS error number, when a call failed.
    pub errno: Option<i32>,
}

impl fmt::Display for TierAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.tier, self.what)?;
        if let Some(e) = self.errno {
            write!(f, " ({})", io::Error::from_raw_os_error(e))?;
        }
        write!(f, "; to enable, {}", self.tier.how_to_enable())
    }
}

/// Why a pool could not be built or locked. Nothing stays mapped after an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolMemoryError {
    #[error(
        "pool of {slot_count} slots of {slot_bytes} bytes is refused: both must be non-zero and \
         the total at most {bytes_max} bytes"
    )]
    BadSize { slot_count: usize, slot_bytes: usize, bytes_max: u64 },
    #[error("policy prefers {prefer} but requires {require}, which is better")]
    BadPolicy { prefer: Tier, require: Tier },
    #[error("no tier at or above {require} could be mapped for {bytes} bytes: {}", list(.tried))]
    TierUnavailable { require: Tier, bytes: u64, tried: Vec<TierAttempt> },
    #[error(
        "mlock of {bytes} bytes failed ({}); the memlock limit is {}: raise it \
         (`ulimit -l`, LimitMEMLOCK= for a systemd unit, memlock in limits.conf) or grant \
         CAP_IPC_LOCK, or build the pool with Lock::BestEffort",
        io::Error::from_raw_os_error(*.errno), limit(*.limit_bytes)
    )]
    LockRefused { bytes: u64, limit_bytes: Option<u64>, errno: i32 },
    #[error("{op} failed: {}", io::Error::from_raw_os_error(*.errno))]
    Os { op: &'static str, errno: i32 },
}

fn list(tried: &[TierAttempt]) -> String {
    let parts: Vec<String> = tried.iter().map(ToString::to_string).collect();
    parts.join("; ")
}

fn limit(bytes: Option<u64>) -> String {
    match bytes {
        Some(b) => format!("{b} bytes"),
        None => "unlimited".into(),
    }
}

/// What a pool got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backing {
    pub tier: Tier,
    pub page_bytes: u64,
    /// The mapping's length: slots rounded up to the tier's page size.
    pub mapped_bytes: u64,
    pub locked: bool,
    /// Why the pool is not locked, when locking was tried and refused.
    pub lock_refused: Option<PoolMemoryError>,
    /// Better tiers the policy allowed that could not be had, best first.
    pub skipped: Vec<TierAttempt>,
}

/// What the kernel says about the mapping (`/proc/self/smaps`), summed over the areas that
/// overlap it. Adjacent mappings with the same flags may share an area, so these are upper
/// bounds for the pool alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageReport {
    pub kernel_page_bytes: u64,
    pub rss_bytes: u64,
    pub anon_huge_bytes: u64,
    pub hugetlb_bytes: u64,
    pub locked_bytes: u64,
}

/// One anonymous mapping carved into `slot_count` slots of `slot_bytes`.
pub struct HugePagePool {
    base: NonNull<u8>,
    mapped_bytes: usize,
    slot_count: usize,
    slot_bytes: usize,
    backing: Backing,
    binds: u64,
}

// SAFETY: the pool owns its mapping outright (no aliases escape the module except borrows tied
// to `&self`/`&mut self`), so moving it to another thread is like moving a `Vec<u8>`.
unsafe impl Send for HugePagePool {}
// SAFETY: shared access only ever yields `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for HugePagePool {}

impl fmt::Debug for HugePagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HugePagePool")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("slot_count", &self.slot_count)
            .field("slot_bytes", &self.slot_bytes)
            .field("backing", &self.backing)
            .finish()
    }
}

/// A mapping not yet handed to a pool; unmapped on drop.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is exactly one mapping this module made and still owns;
        // nothing borrows it once the owner is dropped.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn round_up(bytes: u64, unit: u64) -> Option<u64> {
    bytes.div_ceil(unit).checked_mul(unit)
}

fn mmap_anon(len: usize, extra_flags: libc::c_int) -> Result<Mapping, i32> {
    // SAFETY: an anonymous private mapping at an address the kernel picks touches no existing
    // memory; the result is checked before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(errno());
    }
    NonNull::new(p.cast::<u8>()).map(|base| Mapping { base, len }).ok_or(libc::ENOMEM)
}

fn madvise(m: &Mapping, advice: libc::c_int) -> Result<(), i32> {
    // SAFETY: the range is exactly a live mapping this module owns; advice does not invalidate
    // Rust references (none exist yet, the mapping is still private to this module).
    let rc = unsafe { libc::madvise(m.base.as_ptr().cast(), m.len, advice) };
    if rc == 0 { Ok(()) } else { Err(errno()) }
}

/// Maps `len` bytes (a multiple of 2 MiB) at a 2 MiB aligned address, so every page can be huge.
fn mmap_aligned_2m(len: usize) -> Result<Mapping, i32> {
    let align = HUGE_2M_USIZE;
    let over = len.checked_add(align).ok_or(libc::ENOMEM)?;
    let m = mmap_anon(over, 0)?;
    let start = m.base.as_ptr() as usize;
    let head = start.next_multiple_of(align) - start;
    let tail = align - head;
    let base = m.base.as_ptr().wrapping_add(head);
    let end = base.wrapping_add(len);
    std::mem::forget(m);
    // SAFETY: `head` and `tail` bytes at the two ends lie inside the mapping just made and
    // owned by nobody else; what stays is `base..base+len`, which the returned Mapping owns.
    unsafe {
        if head > 0 {
            libc::munmap(start as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap(end.cast(), tail);
        }
    }
    NonNull::new(base).map(|base| Mapping { base, len }).ok_or(libc::ENOMEM)
}

/// Makes every page resident now. `MADV_POPULATE_WRITE` (Linux 5.14) first; on older kernels
/// one write per base page.
fn populate(m: &Mapping) {
    if madvise(m, libc::MADV_POPULATE_WRITE).is_ok() {
        return;
    }
    let mut at = 0;
    while at < m.len {
        // SAFETY: `at < len`, so the byte lies in the live, writable mapping; it is zero and
        // stays zero, and no reference to it exists yet.
        unsafe { m.base.as_ptr().add(at).write_volatile(0) };
        at += BASE_PAGE_USIZE;
    }
}

fn thp_mode() -> Option<String> {
    let s = std::fs::read_to_string(THP_ENABLED_PATH).ok()?;
    let start = s.find('[')? + 1;
    let end = s[start..].find(']')? + start;
    Some(s[start..end].to_string())
}

fn try_tier(tier: Tier, len: usize) -> Result<Mapping, TierAttempt> {
    let fail = |what: &str, errno: Option<i32>| TierAttempt { tier, what: what.into(), errno };
    match tier {
        Tier::Huge1G | Tier::Huge2M => {
            let size = if tier == Tier::Huge1G { libc::MAP_HUGE_1GB } else { libc::MAP_HUGE_2MB };
            // Without MAP_NORESERVE the kernel refuses the mapping up front when too few pages
            // are reserved, instead of a SIGBUS on a later fault.
            mmap_anon(len, libc::MAP_HUGETLB | size | libc::MAP_POPULATE).map_err(|e| {
                fail(
                    "mmap MAP_HUGETLB found too few free reserved pages (vm.nr_hugepages)",
                    Some(e),
                )
            })
        }
        Tier::Transparent => {
            match thp_mode().as_deref() {
                Some("never") => {
                    return Err(fail("transparent huge pages are switched off (never)", None));
                }
                None => return Err(fail(&format!("{THP_ENABLED_PATH} is unreadable"), None)),
                Some(_) => {}
            }
            let m = mmap_aligned_2m(len).map_err(|e| fail("mmap", Some(e)))?;
            madvise(&m, libc::MADV_HUGEPAGE).map_err(|e| fail("madvise MADV_HUGEPAGE", Some(e)))?;
            populate(&m);
            match inspect_range(m.base.as_ptr() as usize, m.len) {
                Ok(r) if r.anon_huge_bytes == 0 => Err(fail(
                    "the kernel gave no huge pages (memory too fragmented? see \
                     /sys/kernel/mm/transparent_hugepage/defrag)",
                    None,
                )),
                // Unreadable smaps: trust the advice.
                _ => Ok(m),
            }
        }
        Tier::Plain => {
            let m = mmap_anon(len, libc::MAP_POPULATE).map_err(|e| fail("mmap", Some(e)))?;
            // Keep plain truthful when THP is `always`; a kernel without THP refuses the advice,
            // which is fine.
            let _ = madvise(&m, libc::MADV_NOHUGEPAGE);
            Ok(m)
        }
    }
}

fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the struct we pass and keeps no pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

fn mlock(m: &Mapping) -> Result<(), PoolMemoryError> {
    // SAFETY: the range is a live mapping this module owns; mlock only pins it.
    let rc = unsafe { libc::mlock(m.base.as_ptr().cast(), m.len) };
    if rc == 0 {
        return Ok(());
    }
    Err(PoolMemoryError::LockRefused {
        bytes: m.len as u64,
        limit_bytes: memlock_limit(),
        errno: errno(),
    })
}

impl HugePagePool {
    /// Maps `slot_count * slot_bytes` (rounded up to the chosen tier's page size) on the best
    /// tier `policy` allows, populated and, per the policy, locked.
    pub fn new(
        slot_count: usize,
        slot_bytes: usize,
        policy: HugePagePolicy,
    ) -> Result<Self, PoolMemoryError> {
        let bad = || PoolMemoryError::BadSize { slot_count, slot_bytes, bytes_max: POOL_BYTES_MAX };
        if slot_count == 0 || slot_bytes == 0 {
            return Err(bad());
        }
        let bytes = (slot_count as u64).checked_mul(slot_bytes as u64).ok_or_else(bad)?;
        if bytes > POOL_BYTES_MAX {
            return Err(bad());
        }
        if policy.require > policy.prefer {
            return Err(PoolMemoryError::BadPolicy {
                prefer: policy.prefer,
                require: policy.require,
            });
        }
        let mut skipped = Vec::new();
        for tier in policy.tiers() {
            let len = round_up(bytes, tier.page_bytes()).ok_or_else(bad)?;
            let len = usize::try_from(len).map_err(|_| bad())?;
            match try_tier(tier, len) {
                Ok(m) => return Self::finish(m, tier, slot_count, slot_bytes, policy, skipped),
                Err(attempt) => skipped.push(attempt),
            }
        }
        Err(PoolMemoryError::TierUnavailable { require: policy.require, bytes, tried: skipped })
    }

    fn finish(
        m: Mapping,
        tier: Tier,
        slot_count: usize,
        slot_bytes: usize,
        policy: HugePagePolicy,
        skipped: Vec<TierAttempt>,
    ) -> Result<Self, PoolMemoryError> {
        let (locked, lock_refused) = match policy.lock {
            Lock::Off => (false, None),
            Lock::Required => {
                mlock(&m)?;
                (true, None)
            }
            Lock::BestEffort => match mlock(&m) {
                Ok(()) => (true, None),
                Err(e) => (false, Some(e)),
            },
        };
        let backing = Backing {
            tier,
            page_bytes: tier.page_bytes(),
            mapped_bytes: m.len as u64,
            locked,
            lock_refused,
            skipped,
        };
        tracing::info!(
            tier = %backing.tier,
            mapped_bytes = backing.mapped_bytes,
            locked = backing.locked,
            skipped = backing.skipped.len(),
            "host memory pool mapped"
        );
        if let Some(e) = &backing.lock_refused {
            tracing::warn!(error = %e, "host memory pool is not locked");
        }
        let pool =
            Self { base: m.base, mapped_bytes: m.len, slot_count, slot_bytes, backing, binds: 0 };
        std::mem::forget(m);
        Ok(pool)
    }

    /// The tier, page size, lock state and the tiers that were skipped.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// The mapping's start address (for registration with a NIC, and for inspection).
    pub fn addr(&self) -> usize {
        self.base.as_ptr() as usize
    }

    pub fn mapped_bytes(&self) -> usize {
        self.mapped_bytes
    }

    fn slot_offset(&self, slot: usize) -> Option<usize> {
        (slot < self.slot_count).then(|| slot * self.slot_bytes)
    }

    /// A slot's bytes.
    pub fn slot(&self, slot: usize) -> Option<&[u8]> {
        let at = self.slot_offset(slot)?;
        // SAFETY: `at + slot_bytes <= slot_count * slot_bytes <= mapped_bytes`, so the range is
        // inside the live mapping, which lives as long as `self`; the borrow of `self` keeps
        // every `&mut` slice away for the slice's lifetime.
        Some(unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(at), self.slot_bytes) })
    }

    /// A slot's bytes, writable.
    pub fn slot_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        let at = self.slot_offset(slot)?;
        // SAFETY: in bounds as in `slot`; the exclusive borrow of `self` makes this the only
        // reference into the mapping while it lives.
        Some(unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(at), self.slot_bytes) })
    }

    /// What `/proc/self/smaps` says about the mapping now.
    pub fn inspect(&self) -> Result<PageReport, PoolMemoryError> {
        inspect_range(self.addr(), self.mapped_bytes)
    }
}

impl Drop for HugePagePool {
    fn drop(&mut self) {
        drop(Mapping { base: self.base, len: self.mapped_bytes });
    }
}

impl PoolMemory for HugePagePool {
    fn kind(&self) -> MemoryKind {
        match self.backing.tier {
            Tier::Plain => MemoryKind::Host,
            t => MemoryKind::HostHugePages { page_bytes: t.page_bytes() },
        }
    }
    fn slot_count(&self) -> usize {
        self.slot_count
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        if slot >= self.slot_count {
            return Err(BindError {
                slot,
                kind: self.kind(),
                detail: format!("the pool has {} slots", self.slot_count),
            });
        }
        self.binds += 1;
        Ok(Binding { key: (slot as u64) << 32 | self.binds })
    }
    fn unbind(&mut self, _slot: usize, _binding: Binding) {}
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        self.slot_mut(slot)
    }
}

/// Sums the smaps fields of every area overlapping `start..start+len`.
fn inspect_range(start: usize, len: usize) -> Result<PageReport, PoolMemoryError> {
    let text = std::fs::read_to_string("/proc/self/smaps").map_err(|e| PoolMemoryError::Os {
        op: "read /proc/self/smaps",
        errno: e.raw_os_error().unwrap_or(0),
    })?;
    Ok(parse_smaps(&text, start, start.saturating_add(len)))
}

fn parse_smaps(text: &str, start: usize, end: usize) -> PageReport {
    let mut report = PageReport::default();
    let mut inside = false;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            inside = lo < end && start < hi;
            continue;
        }
        if !inside {
            continue;
        }
        let kib = words.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let bytes = kib.saturating_mul(1024);
        match first {
            "KernelPageSize:" => report.kernel_page_bytes = report.kernel_page_bytes.max(bytes),
            "Rss:" => report.rss_bytes += bytes,
            "AnonHugePages:" => report.anon_huge_bytes += bytes,
            "Private_Hugetlb:" | "Shared_Hugetlb:" => report.hugetlb_bytes += bytes,
            "Locked:" => report.locked_bytes += bytes,
            _ => {}
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_order_is_best_first_and_bounded() {
        let all: Vec<Tier> = HugePagePolicy::default().tiers().collect();
        assert_eq!(all, Tier::ALL.to_vec());
        let mid: Vec<Tier> = HugePagePolicy::default()
            .prefer(Tier::Huge2M)
            .require(Tier::Transparent)
            .tiers()
            .collect();
        assert_eq!(mid, vec![Tier::Huge2M, Tier::Transparent]);
        assert_eq!(
            HugePagePolicy::only(Tier::Plain).tiers().collect::<Vec<_>>(),
            vec![Tier::Plain]
        );
    }

    #[test]
    fn bad_sizes_and_policies_are_refused() {
        let p = HugePagePolicy::only(Tier::Plain);
        assert!(matches!(HugePagePool::new(0, 4096, p), Err(PoolMemoryError::BadSize { .. })));
        assert!(matches!(HugePagePool::new(4, 0, p), Err(PoolMemoryError::BadSize { .. })));
        assert!(matches!(
            HugePagePool::new(usize::MAX, 2, p),
            Err(PoolMemoryError::BadSize { .. })
        ));
        let inverted = HugePagePolicy::default().prefer(Tier::Transparent).require(Tier::Huge2M);
        assert_eq!(
            HugePagePool::new(4, 4096, inverted).unwrap_err(),
            PoolMemoryError::BadPolicy { prefer: Tier::Transparent, require: Tier::Huge2M }
        );
    }

    #[test]
    fn smaps_fields_are_summed_over_overlapping_areas() {
        let text = "\
1000-3000 rw-p 00000000 00:00 0
Rss:                   8 kB
KernelPageSize:        4 kB
AnonHugePages:         0 kB
Locked:                8 kB
3000-5000 rw-p 00000000 00:00 0
Rss:                   4 kB
KernelPageSize:        4 kB
AnonHugePages:      2048 kB
Locked:                0 kB
5000-6000 rw-p 00000000 00:00 0
Rss:                 100 kB
";
        let r = parse_smaps(text, 0x2000, 0x4000);
        assert_eq!(
            r,
            PageReport {
                kernel_page_bytes: 4096,
                rss_bytes: 12 << 10,
                anon_huge_bytes: 2 << 20,
                hugetlb_bytes: 0,
                locked_bytes: 8 << 10,
            }
        );
    }

    #[test]
    fn every_error_names_what_to_configure() {
        let tried = vec![
            TierAttempt { tier: Tier::Huge2M, what: "mmap".into(), errno: Some(libc::ENOMEM) },
            TierAttempt { tier: Tier::Transparent, what: "off".into(), errno: None },
        ];
        let e = PoolMemoryError::TierUnavailable { require: Tier::Transparent, bytes: 10, tried };
        let s = e.to_string();
        assert!(s.contains("vm.nr_hugepages"), "{s}");
        assert!(s.contains("/sys/kernel/mm/transparent_hugepage/enabled"), "{s}");
        let e = PoolMemoryError::LockRefused {
            bytes: 1 << 30,
            limit_bytes: Some(8 << 20),
            errno: libc::ENOMEM,
        };
        let s = e.to_string();
        for needle in ["1073741824", "8388608 bytes", "ulimit -l", "CAP_IPC_LOCK"] {
            assert!(s.contains(needle), "{needle} missing from {s}");
        }
        let s = PoolMemoryError::BadSize { slot_count: 0, slot_bytes: 1, bytes_max: 9 }.to_string();
        assert!(s.contains("0 slots of 1 bytes"), "{s}");
        let s =
            PoolMemoryError::BadPolicy { prefer: Tier::Plain, require: Tier::Huge1G }.to_string();
        assert!(s.contains("1 GiB hugetlb pages"), "{s}");
        let s = PoolMemoryError::Os { op: "mmap", errno: libc::EINVAL }.to_string();
        assert!(s.starts_with("mmap failed"), "{s}");
    }
}
