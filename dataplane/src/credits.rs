//! Operation and Host-block credits: the two budgets every storage operation is charged against.
//!
//! Reads and queries may take a whole budget; backups (the PUT of a backup candidate) may hold at
//! most half of each budget, rounded down, so slow PUTs cannot starve a new prefetch. A grant is
//! a [`CreditGrant`] guard whose drop returns what it took. The accounting is lock-free: each
//! budget is one atomic word holding the charged total and the backup share, so both bounds are
//! checked and charged in one compare-and-swap and can never be seen exceeded.
//!
//! Two owners charge them: a shard's fill directory ([`crate::shard`]) for each fill it leads,
//! and the admission of the engine-facing path (`gpucache_executor::admission`) for each
//! QUERY, GET and backup PUT it starts.

// loom's primitives under `--cfg loom`, so that its model checks explore every interleaving.
#[cfg(loom)]
use loom::sync::Arc;
#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::Arc;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(all(test, not(loom)))]
mod tests;

/// A pair of credit amounts: a budget, a charge or a usage. Units are the names: operations and
/// logical Host-block references.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Credits {
    pub operations: u32,
    pub host_blocks: u32,
}

impl Credits {
    pub const ZERO: Self = Self { operations: 0, host_blocks: 0 };

    pub const fn new(operations: u32, host_blocks: u32) -> Self {
        Self { operations, host_blocks }
    }

    /// Half of each amount, rounded down: the share backups may hold of a budget.
    pub const fn half(self) -> Self {
        Self { operations: self.operations / 2, host_blocks: self.host_blocks / 2 }
    }

    fn get(self, kind: CreditKind) -> u32 {
        match kind {
            CreditKind::Operations => self.operations,
            CreditKind::HostBlocks => self.host_blocks,
        }
    }
}

/// One of the two budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CreditKind {
    Operations,
    HostBlocks,
}

impl std::fmt::Display for CreditKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Operations => "operation",
            Self::HostBlocks => "host-block",
        })
    }
}

/// Who is asking. Queries and reads share the whole budget; backups are capped at half of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CreditClass {
    /// A QUERY or GET preparing a request.
    Read,
    /// The PUT of a backup candidate.
    Backup,
}

impl std::fmt::Display for CreditClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Read => "read",
            Self::Backup => "backup",
        })
    }
}

/// Which bound a refusal ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CreditBound {
    /// The whole budget, shared by every class.
    Budget,
    /// Half the budget, rounded down, which backups alone may hold.
    BackupShare,
}

impl std::fmt::Display for CreditBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Budget => "budget",
            Self::BackupShare => "backup share",
        })
    }
}

/// Why credits were not granted. An expected outcome: nothing was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CreditRefusal {
    /// The bound is busy now; the same request can fit once credits come back.
    #[error("{class} needs {requested} {kind} credits; {held} held of the {bound} of {limit}")]
    Exhausted {
        kind: CreditKind,
        class: CreditClass,
        bound: CreditBound,
        requested: u32,
        held: u32,
        limit: u32,
    },
    /// The request is larger than its bound and can never fit (a zero backup share is this).
    #[error("{class} needs {requested} {kind} credits; the {bound} is only {limit}")]
    NeverFits {
        kind: CreditKind,
        class: CreditClass,
        bound: CreditBound,
        requested: u32,
        limit: u32,
    },
}

impl CreditRefusal {
    /// Whether waiting cannot help: the request exceeds its bound even with nothing held.
    pub fn is_permanent(&self) -> bool {
        matches!(self, Self::NeverFits { .. })
    }
}

/// Charged credits, in total and the backups' part of that total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CreditUsage {
    pub total: Credits,
    pub backup: Credits,
}

/// One budget's word: the charged total in the high half, the backup part in the low half.
/// Both fit in 32 bits because neither may exceed the budget, which is a `u32`.
fn pack(total: u32, backup: u32) -> u64 {
    (u64::from(total) << 32) | u64::from(backup)
}

fn unpack(word: u64) -> (u32, u32) {
    let total = u32::try_from(word >> 32).unwrap_or(u32::MAX);
    let backup = u32::try_from(word & u64::from(u32::MAX)).unwrap_or(u32::MAX);
    (total, backup)
}

#[derive(Debug)]
struct Budget {
    kind: CreditKind,
    limit: u32,
    word: AtomicU64,
}

impl Budget {
    fn new(kind: CreditKind, limit: u32) -> Self {
        Self { kind, limit, word: AtomicU64::new(0) }
    }

    fn backup_limit(&self) -> u32 {
        self.limit / 2
    }

    fn usage(&self) -> (u32, u32) {
        unpack(self.word.load(Ordering::Acquire))
    }

    /// Charges `n` for `class` if both bounds allow it, in a single compare-and-swap.
    fn acquire(&self, class: CreditClass, n: u32) -> Result<(), CreditRefusal> {
        if n == 0 {
            return Ok(());
        }
        let (bound, limit) = match class {
            CreditClass::Read => (CreditBound::Budget, self.limit),
            CreditClass::Backup => (CreditBound::BackupShare, self.backup_limit()),
        };
        if n > limit {
            return Err(CreditRefusal::NeverFits {
                kind: self.kind,
                class,
                bound,
                requested: n,
                limit,
            });
        }
        let mut current = self.word.load(Ordering::Acquire);
        loop {
            let (total, backup) = unpack(current);
            if u64::from(total) + u64::from(n) > u64::from(self.limit) {
                return Err(CreditRefusal::Exhausted {
                    kind: self.kind,
                    class,
                    bound: CreditBound::Budget,
                    requested: n,
                    held: total,
                    limit: self.limit,
                });
            }
            let backup_after = match class {
                CreditClass::Read => backup,
                CreditClass::Backup => {
                    if u64::from(backup) + u64::from(n) > u64::from(limit) {
                        return Err(CreditRefusal::Exhausted {
                            kind: self.kind,
                            class,
                            bound,
                            requested: n,
                            held: backup,
                            limit,
                        });
                    }
                    backup + n
                }
            };
            let next = pack(total + n, backup_after);
            match self.word.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(seen) => current = seen,
            }
        }
    }

    /// Returns `n` charged earlier for `class`. Subtracting the packed pair cannot borrow
    /// across the halves: this charge is still inside both of them.
    fn release(&self, class: CreditClass, n: u32) {
        if n == 0 {
            return;
        }
        let backup = if class == CreditClass::Backup { n } else { 0 };
        let previous = self.word.fetch_sub(pack(n, backup), Ordering::AcqRel);
        let (total, held_backup) = unpack(previous);
        debug_assert!(total >= n, "{} credits released without their charge", self.kind);
        debug_assert!(held_backup >= backup, "{} backup credits underflow", self.kind);
    }
}

#[derive(Debug)]
struct PoolInner {
    operations: Budget,
    host_blocks: Budget,
}

impl PoolInner {
    fn budget(&self, kind: CreditKind) -> &Budget {
        match kind {
            CreditKind::Operations => &self.operations,
            CreditKind::HostBlocks => &self.host_blocks,
        }
    }
}

/// The shared credit budgets. Clones share the same accounting; grants may be dropped on any
/// thread.
#[derive(Debug, Clone)]
pub struct CreditPool {
    inner: Arc<PoolInner>,
}

impl CreditPool {
    pub fn new(budget: Credits) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                operations: Budget::new(CreditKind::Operations, budget.operations),
                host_blocks: Budget::new(CreditKind::HostBlocks, budget.host_blocks),
            }),
        }
    }

    /// The configured budgets.
    pub fn budget(&self) -> Credits {
        Credits::new(self.inner.operations.limit, self.inner.host_blocks.limit)
    }

    /// What backups alone may hold: half of each budget, rounded down.
    pub fn backup_limit(&self) -> Credits {
        self.budget().half()
    }

    /// Whether a backup PUT can ever be admitted: both halves must be at least one.
    pub fn backups_enabled(&self) -> bool {
        let limit = self.backup_limit();
        limit.operations > 0 && limit.host_blocks > 0
    }

    /// What is charged now. Each budget is read atomically; the pair is not one snapshot.
    pub fn usage(&self) -> CreditUsage {
        let (ops_total, ops_backup) = self.inner.operations.usage();
        let (host_total, host_backup) = self.inner.host_blocks.usage();
        CreditUsage {
            total: Credits::new(ops_total, host_total),
            backup: Credits::new(ops_backup, host_backup),
        }
    }

    /// Takes `amount` for `class`, or says which bound stood in the way and by how much.
    /// Operations are charged first; if the Host blocks then do not fit, the operations go back
    /// before the refusal is returned, so a refused call leaves nothing charged.
    pub fn acquire(
        &self,
        class: CreditClass,
        amount: Credits,
    ) -> Result<CreditGrant, CreditRefusal> {
        self.inner.operations.acquire(class, amount.operations)?;
        if let Err(refusal) = self.inner.host_blocks.acquire(class, amount.host_blocks) {
            self.inner.operations.release(class, amount.operations);
            return Err(refusal);
        }
        Ok(CreditGrant { pool: Arc::clone(&self.inner), class, amount })
    }

    /// Whether `amount` for `class` could never be granted, whatever is held: the refusal a
    /// caller may act on at once instead of waiting.
    pub fn never_fits(&self, class: CreditClass, amount: Credits) -> Option<CreditRefusal> {
        [CreditKind::Operations, CreditKind::HostBlocks].into_iter().find_map(|kind| {
            let budget = self.inner.budget(kind);
            let (bound, limit) = match class {
                CreditClass::Read => (CreditBound::Budget, budget.limit),
                CreditClass::Backup => (CreditBound::BackupShare, budget.backup_limit()),
            };
            let requested = amount.get(kind);
            (requested > limit).then_some(CreditRefusal::NeverFits {
                kind,
                class,
                bound,
                requested,
                limit,
            })
        })
    }
}

/// Credits held until this guard is dropped.
#[derive(Debug)]
#[must_use = "dropping a grant returns its credits at once"]
pub struct CreditGrant {
    pool: Arc<PoolInner>,
    class: CreditClass,
    amount: Credits,
}

impl CreditGrant {
    pub fn class(&self) -> CreditClass {
        self.class
    }
    pub fn amount(&self) -> Credits {
        self.amount
    }
}

impl Drop for CreditGrant {
    fn drop(&mut self) {
        self.pool.host_blocks.release(self.class, self.amount.host_blocks);
        self.pool.operations.release(self.class, self.amount.operations);
    }
}
