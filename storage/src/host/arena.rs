//! An arena for block payloads, pre-faulted or faulted on first use.
//!
//! [`PayloadArena`] maps one anonymous region with transparent huge pages asked for.
//! [`PayloadArena::new`] makes every page of it resident when it is made (`MAP_POPULATE`), so a
//! block written into it takes no page fault and no kernel zeroing on the write path: those
//! costs are paid once, at start. [`PayloadArena::on_first_use`] leaves the pages to fault in as
//! blocks first land on them, for a large tier that should not cost its size at start. It hands
//! out [`ArenaBuf`]s, page-rounded pieces that go back to the arena when they
//! are dropped. Freed pieces are kept by size and reused for blocks of the same rounded size
//! (KV blocks of one model are all one size); a block for which no piece of its size is free
//! and the untouched rest of the region is too small gets `None`, and its store falls back to
//! the heap.
//!
//! All `unsafe` of the arena lives in this file: each piece is a disjoint range of the mapping,
//! owned by exactly one `ArenaBuf`, which lends it out as an ordinary borrow of itself.

use std::collections::HashMap;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use super::pool::{HugePagePolicy, HugePagePool, Lock, PoolMemoryError, Tier as PageTier};

/// Pieces are whole pages.
pub const ARENA_PAGE_BYTES: usize = 4096;

/// What an arena holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes of the mapping.
    pub bytes: u64,
    /// Bytes of pieces handed out and not yet returned.
    pub lent_bytes: u64,
    /// Bytes of returned pieces waiting for a block of their size.
    pub free_bytes: u64,
    /// Requests for a piece that the arena could not serve.
    pub misses: u64,
}

#[derive(Debug, Default)]
struct Pieces {
    /// Where the untouched rest of the region starts.
    next: usize,
    /// Returned pieces by length: offsets. Bounded by the region (each is a distinct range).
    free: HashMap<usize, Vec<usize>>,
    lent_bytes: usize,
    free_bytes: usize,
    misses: u64,
}

/// What holds an arena's region (kept only so that the mapping lives as long as the arena).
enum Region {
    #[expect(dead_code, reason = "held for its drop, which unmaps the region")]
    Mapped(memmap2::MmapMut),
    /// One slot of a huge-page pool, the whole region.
    Pool(HugePagePool),
}

/// One anonymous mapping carved into page-rounded pieces.
pub struct PayloadArena {
    /// Keeps the mapping alive; never read through after `base` was taken from it.
    region: Region,
    base: NonNull<u8>,
    len: usize,
    pieces: Mutex<Pieces>,
}

// SAFETY: the arena only hands out disjoint ranges of its mapping, each owned by one ArenaBuf;
// the bookkeeping is behind a mutex.
unsafe impl Send for PayloadArena {}
// SAFETY: as above; shared access to the arena only takes or returns pieces under the mutex.
unsafe impl Sync for PayloadArena {}

impl std::fmt::Debug for PayloadArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadArena")
            .field("pages", &self.page_tier())
            .field("stats", &self.stats())
            .finish()
    }
}

impl PayloadArena {
    /// Maps and populates `bytes` (rounded up to whole pages). Fails only when the kernel
    /// refuses the mapping.
    pub fn new(bytes: u64) -> io::Result<Arc<Self>> {
        Self::map(bytes, true)
    }

    /// Maps `bytes` (rounded up to whole pages) without making them resident: each page
    /// faults in when a block is first written there (one fault per huge page where
    /// transparent huge pages are enabled). For a large tier that should not cost its whole
    /// size at start.
    pub fn on_first_use(bytes: u64) -> io::Result<Arc<Self>> {
        Self::map(bytes, false)
    }

    /// `bytes` on a [`HugePagePool`] of one slot: the best page tier the machine offers
    /// (reserved 1 GiB or 2 MiB hugetlb pages, else transparent huge pages, else plain pages),
    /// every page resident from the start, locked when the process may lock that much.
    pub fn on_huge_pages(bytes: u64) -> Result<Arc<Self>, PoolMemoryError> {
        let slot_bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        let policy = HugePagePolicy::default().lock(Lock::Off);
        let bad = || PoolMemoryError::BadSize {
            slot_count: 1,
            slot_bytes,
            bytes_max: super::pool::POOL_BYTES_MAX,
        };
        let mut pool = HugePagePool::new(1, slot_bytes, policy)?;
        let slot = pool.slot_mut(0).ok_or_else(bad)?;
        let len = slot.len() / ARENA_PAGE_BYTES * ARENA_PAGE_BYTES;
        let base = NonNull::new(slot.as_mut_ptr()).ok_or_else(bad)?;
        Ok(Arc::new(Self { region: Region::Pool(pool), base, len, pieces: Mutex::default() }))
    }

    /// The pages under the region, when it is on a huge-page pool.
    pub fn page_tier(&self) -> Option<PageTier> {
        match &self.region {
            Region::Pool(pool) => Some(pool.backing().tier),
            Region::Mapped(_) => None,
        }
    }

    fn map(bytes: u64, populate: bool) -> io::Result<Arc<Self>> {
        let len = usize::try_from(bytes)
            .ok()
            .and_then(|b| b.checked_next_multiple_of(ARENA_PAGE_BYTES))
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("an arena of {bytes} bytes"))
            })?;
        let mut options = memmap2::MmapOptions::new();
        options.len(len);
        if populate {
            options.populate();
        }
        let mut map = options.map_anon()?;
        // Best effort: fewer TLB misses where transparent huge pages are enabled.
        let _ = map.advise(memmap2::Advice::HugePage);
        let base = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| io::Error::other("the kernel mapped the arena at address 0"))?;
        Ok(Arc::new(Self { region: Region::Mapped(map), base, len, pieces: Mutex::default() }))
    }

    fn lock(&self) -> MutexGuard<'_, Pieces> {
        self.pieces.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A piece for `len` bytes (`len` > 0): a returned piece of the same rounded size, or the
    /// next one of the untouched rest. Its bytes are whatever the last block there left (zero
    /// the first time): the caller writes every byte it later reads.
    pub fn take(self: &Arc<Self>, len: usize) -> Option<ArenaBuf> {
        let cap = len.checked_next_multiple_of(ARENA_PAGE_BYTES).filter(|&c| c > 0)?;
        let mut p = self.lock();
        let reused = p.free.get_mut(&cap).and_then(Vec::pop);
        let offset = match reused {
            Some(offset) => {
                p.free_bytes -= cap;
                offset
            }
            None if self.len - p.next >= cap => {
                let offset = p.next;
                p.next += cap;
                offset
            }
            None => {
                p.misses += 1;
                return None;
            }
        };
        p.lent_bytes += cap;
        Some(ArenaBuf { arena: Arc::clone(self), offset, len, cap })
    }

    fn give_back(&self, offset: usize, cap: usize) {
        let mut p = self.lock();
        p.lent_bytes -= cap;
        p.free_bytes += cap;
        p.free.entry(cap).or_default().push(offset);
    }

    pub fn stats(&self) -> ArenaStats {
        let p = self.lock();
        ArenaStats {
            bytes: self.len as u64,
            lent_bytes: p.lent_bytes as u64,
            free_bytes: p.free_bytes as u64,
            misses: p.misses,
        }
    }
}

/// A piece of a [`PayloadArena`], `len` bytes long; returned to the arena when dropped.
pub struct ArenaBuf {
    arena: Arc<PayloadArena>,
    offset: usize,
    len: usize,
    cap: usize,
}

impl std::fmt::Debug for ArenaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaBuf").field("offset", &self.offset).field("len", &self.len).finish()
    }
}

impl std::ops::Deref for ArenaBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `offset..offset + cap` lies inside the live mapping (the Arc keeps it) and
        // belongs to this buffer alone until it is dropped; `len <= cap`. The mapping is
        // initialised memory (anonymous pages read as zero or as what was written).
        unsafe { std::slice::from_raw_parts(self.arena.base.as_ptr().add(self.offset), self.len) }
    }
}

impl std::ops::DerefMut for ArenaBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only borrow of the range.
        unsafe {
            std::slice::from_raw_parts_mut(self.arena.base.as_ptr().add(self.offset), self.len)
        }
    }
}

impl Drop for ArenaBuf {
    fn drop(&mut self) {
        self.arena.give_back(self.offset, self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_disjoint_reused_by_size_and_bounded_by_the_region() {
        let arena = PayloadArena::new(10 * ARENA_PAGE_BYTES as u64).expect("arena");
        let mut a = arena.take(5000).expect("two pages");
        let mut b = arena.take(100).expect("one page");
        assert_eq!((a.len(), b.len()), (5000, 100));
        a.fill(0xA1);
        b.fill(0xB2);
        assert!(a.iter().all(|&x| x == 0xA1) && b.iter().all(|&x| x == 0xB2), "pieces overlap");
        let stats = arena.stats();
        assert_eq!((stats.lent_bytes, stats.free_bytes), (3 * 4096, 0));
        // Seven pages are left: a block of eight is refused and counted, one of seven fits.
        assert!(arena.take(8 * ARENA_PAGE_BYTES).is_none());
        assert_eq!(arena.stats().misses, 1);
        let c = arena.take(7 * ARENA_PAGE_BYTES).expect("the rest");
        assert!(arena.take(1).is_none(), "the region is used up");
        // A returned piece serves the next block of its rounded size, and only that size.
        let at = a.as_ptr();
        drop(a);
        assert_eq!(arena.stats().free_bytes, 2 * 4096);
        assert!(arena.take(3 * ARENA_PAGE_BYTES).is_none());
        let again = arena.take(8000).expect("the freed two pages");
        assert_eq!(again.as_ptr(), at);
        assert_eq!(again.len(), 8000);
        assert!(again[..5000].iter().all(|&x| x == 0xA1), "a reused piece keeps the old bytes");
        drop((b, c, again));
        let stats = arena.stats();
        assert_eq!((stats.lent_bytes, stats.free_bytes), (0, 10 * 4096));
    }

    /// Reads a field of this process's `/proc/self/status` in KiB (resident memory).
    fn status_kib(field: &str) -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with(field))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    #[test]
    fn an_arena_faulted_on_first_use_costs_nothing_resident_until_written() {
        const BYTES: u64 = 256 << 20;
        let before = status_kib("RssAnon:");
        let arena = PayloadArena::on_first_use(BYTES).expect("arena");
        let mapped = status_kib("RssAnon:");
        let mut piece = arena.take(1 << 20).expect("a piece");
        piece.fill(7);
        assert!(piece.iter().all(|&b| b == 7));
        assert_eq!(arena.stats().bytes, BYTES);
        // Another test thread may allocate meanwhile: only a gross difference is asserted.
        if let (Some(before), Some(mapped)) = (before, mapped) {
            assert!(
                mapped.saturating_sub(before) < (BYTES >> 10) / 2,
                "mapping 256 MiB made {} KiB resident",
                mapped - before
            );
        }
    }

    #[test]
    fn an_arena_on_a_huge_page_pool_says_its_pages_and_hands_out_pieces() {
        let arena = PayloadArena::on_huge_pages(4 << 20).expect("some page tier is always there");
        let tier = arena.page_tier().expect("on a pool");
        assert!(arena.stats().bytes >= 4 << 20, "{:?} on {tier}", arena.stats());
        let mut a = arena.take(1 << 20).expect("a piece");
        let mut b = arena.take(1 << 20).expect("another");
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2), "pieces overlap");
        assert_eq!(PayloadArena::new(4096).expect("mapped").page_tier(), None);
    }

    #[test]
    fn an_empty_request_or_arena_is_refused() {
        assert!(PayloadArena::new(0).is_err());
        let arena = PayloadArena::new(1).expect("one page");
        assert_eq!(arena.stats().bytes, 4096);
        assert!(arena.take(0).is_none());
    }
}
