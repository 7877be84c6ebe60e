//! The GPUCache data-plane contract.
//!
//! Owns what every backend must agree on: the identity of a KV block ([`identity`]), its logical
//! and physical keys ([`key`]), its lifecycle ([`lifecycle`]), the payload checksum
//! ([`checksum`]), resource limits and admission ([`limits`]), the operation and Host-block
//! credit pools ([`credits`]), registered regions with quarantine and epoch fences
//! ([`registry`]), callers ([`caller`]), the injected clock ([`clock`]) and the
//! [`store::Store`] trait. [`shard`] holds a shard's single-flight fills under an epoch fence
//! and the control plane around it. [`rng`] is the seeded generator that simulations, fault
//! schedules and tests draw from.
//! With the `testing` feature it also exports the conformance suite every backend runs
//! ([`testing`]). It depends on no backend, transport or device library. The engine-facing
//! asynchronous path (the executor and its admission) is built on this contract in the
//! `gpucache-executor` crate.

pub mod caller;
pub mod checksum;
pub mod clock;
pub mod credits;
pub mod identity;
pub mod key;
pub mod lifecycle;
pub mod limits;
pub mod registry;
pub mod rng;
pub mod shard;
pub mod store;

#[cfg(feature = "testing")]
pub mod testing;

pub use caller::{Caller, Right, Rights};
pub use checksum::Checksum;
pub use identity::{CacheIdentity, IdentityError, TenantId};
pub use key::{KeyDecodeError, LogicalKey, PhysicalKey};
pub use lifecycle::{BlockState, Lifecycle, Transition};
pub use limits::{Ledger, Refusal, RequestId, ResourceLimits};
pub use registry::{Epoch, RegionId};
pub use store::{
    BatchAnswers, BatchGet, BatchPut, Delivery, Get, GetTo, GotOne, Lookup, MissReason, Put,
    Reservation, Reserve, Retirement, Store, StoreError, StoreLayer,
};
