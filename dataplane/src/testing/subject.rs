//! What the suite runs against: a store with its hooks, how to make one, and how many cases
//! each property generates. The model and the rules both use it, so it sits below them.

use crate::clock::ManualClock;
use crate::key::PhysicalKey;
use crate::limits::ResourceLimits;
use crate::store::Store;

/// A store under test plus the hooks the suite needs.
pub struct Subject {
    pub store: Box<dyn Store>,
    /// Damages the stored payload of the committed block under the key (one bit is enough);
    /// returns whether such a block existed.
    pub corrupt: Box<dyn Fn(&PhysicalKey) -> bool + Send + Sync>,
    /// The blocks the store evicted since the last call, oldest first. Required of a store
    /// whose full policy is [`crate::store::FullPolicy::Evict`]: the model cannot rank blocks
    /// as the store's policy does, so it checks each eviction the store reports instead.
    pub evicted: Option<EvictionLog>,
}

/// See [`Subject::evicted`].
pub type EvictionLog = Box<dyn Fn() -> Vec<PhysicalKey> + Send + Sync>;

impl std::fmt::Debug for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subject").field("store", &self.store.info()).finish()
    }
}

/// Builds a fresh, empty store with these limits, reading time from this clock.
pub type MakeSubject = dyn Fn(ResourceLimits, ManualClock) -> Subject + Send + Sync;

/// Generated cases per property: `GPUCACHE_CONFORMANCE_CASES`, or 1,000.
pub fn cases() -> u32 {
    std::env::var("GPUCACHE_CONFORMANCE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
}
