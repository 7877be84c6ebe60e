//! GPUCache past one machine.
//!
//! A cluster is a set of `gpucache serve` nodes and one record they agree on, kept in etcd
//! ([`Coordinator`]): the view (members, their addresses, states and an epoch). Each node
//! registers under a lease and keeps the view current ([`Registration`]); clients watch the
//! view and place every key on a member by rendezvous hashing, with no directory of blocks
//! anywhere. etcd holds membership only: when it is down, membership freezes and the data path
//! keeps running. A block one client reads often gets an extra copy on its second choice, for
//! reads to spread over; the copy lives for one view and is never needed.
//!
//! The membership changes are pure functions of a view ([`join`], [`remove_life`], [`drain`]
//! and the rest), and so is the settled epoch ([`settled`]): the coordinator applies them to
//! the view in etcd. With the `sim` feature the crate also holds `sim`, a seeded simulation of
//! a whole cluster that drives these same functions (see `cluster/tests/cluster_sim.rs`).

mod changes;
mod coordinator;
mod etcd;
mod hot;
mod record;
mod registration;
mod routing;
#[cfg(feature = "sim")]
pub mod sim;

pub use changes::{
    Change, drain, finish, isolate, join, rebalance, remove, remove_life, settled, undrain,
};
pub use coordinator::{
    CHANGE_ATTEMPTS_MAX, ClusterError, Coordinator, EtcdConfig, LEASE_TTL_S_DEFAULT, MEMBERS_MAX,
    REQUEST_TIMEOUT_MS_DEFAULT, RETRY_PAUSE_MS_FIRST, RETRY_PAUSE_MS_MAX,
};
pub use hot::{HOT_KEYS_MAX, ReplicaPolicy};
pub use registration::{
    NodeConfig, NodeEvents, POLL_MS_DEFAULT, POLL_MS_MIN, Registration, RegistrationStats,
};
pub use routing::{
    ClusterClient, ClusterClientConfig, RESERVATIONS_MAX, ROUTE_ATTEMPTS_MAX, RoutingStats,
};
