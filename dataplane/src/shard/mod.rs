//! One shard's fill directory and the control plane around it.
//!
//! A node of a cluster owns one shard (a single node is shard 0, with the same methods). Its
//! [`ShardDirectory`] knows no blocks: the store does. What it knows is which keys some engine
//! is filling right now (the first engine to miss a key computes the block and PUTs it, and the
//! others wait for that rather than compute it too), what each fill holds of the shard's
//! credits, and the shard's epoch. A membership change advances the epoch, and every fill begun
//! under an older one is fenced: its credits come back, and nobody is told it finished.
//!
//! [`ControlPlane`] wraps one directory with the membership it belongs to: rebalancing,
//! rolling upgrades and fault-domain isolation. None of them moves payload bytes; a shard that
//! moves starts empty, and its keys are misses until they are filled again. [`Placement`] says
//! which member owns a key, by rendezvous hashing, with no directory at all. [`ClusterView`]
//! is the membership a cluster agrees on, and [`NodeFence`] what a node checks of each request
//! against it. The `gpucache-cluster` crate runs all of them together, under its own
//! membership rules, in a seeded simulation of a whole cluster (its `sim` feature).

mod control;
mod directory;
mod node;
mod placement;
#[cfg(test)]
mod tests;
mod view;

pub use control::{ControlError, ControlPlane, Member, NodeId, Upgrade};
pub use directory::{
    FILL_LEASE_MS_DEFAULT, FILLS_MAX_DEFAULT, FillLease, FillNotice, FillOutcome, FillRefusal,
    FillStart, FillTicket, SETTLED_MAX, ShardDirectory, ShardId, ShardStats,
};
pub use node::{FenceRefusal, HELD_KEYS_MAX_DEFAULT, NodeFence, NotAdmitting, VIEW_HISTORY_MAX};
pub use placement::Placement;
pub use view::{ClusterView, MemberState, ViewMember};
