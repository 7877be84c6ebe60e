//! Building the policy a name stands for.

use super::arc::AdaptiveReplacement;
use super::fifo::Fifo;
use super::lru::Lru;
use super::policy::{EvictionPolicy, PolicyKind};
use super::prefix::PrefixAware;
use super::s3fifo::S3Fifo;

impl PolicyKind {
    /// A policy for a store that retains at most `capacity_bytes`.
    pub fn build(self, capacity_bytes: u64) -> Box<dyn EvictionPolicy> {
        match self {
            Self::Fifo => Box::new(Fifo::default()),
            Self::Lru => Box::new(Lru::default()),
            Self::Arc => Box::new(AdaptiveReplacement::new(capacity_bytes)),
            Self::S3Fifo => Box::new(S3Fifo::new(capacity_bytes)),
            Self::Prefix => Box::new(PrefixAware::new(capacity_bytes)),
        }
    }
}
