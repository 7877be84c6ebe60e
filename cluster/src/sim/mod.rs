//! A seeded simulation of a whole cluster: a hundred and more nodes, a few clients, one
//! coordinator, and all of the membership churn between them. It is built only with this
//! crate's `sim` feature; `tests/cluster_sim.rs` runs it.
//!
//! The simulation runs the data plane's real [`Placement`], [`ClusterView`], [`NodeFence`] and
//! [`ShardDirectory`], and this crate's real membership rules: every change the simulated
//! coordinator makes to its view is computed by one of the functions of [`crate::changes`]
//! ([`MembershipChange`] names which), and its settled epoch by [`crate::settled`], the same
//! function the real [`Coordinator`](crate::Coordinator) calls. Only the network, etcd and the
//! clock are made up. The run is one thread that moves in steps of [`STEP_MS`] simulated
//! milliseconds, and every choice it makes comes from one [`SplitMix64`] seeded by
//! [`SimConfig::seed`]. So a seed always replays the same run, and a failure can be reproduced
//! from its seed alone.
//!
//! What is modelled:
//! - The coordinator stands for etcd. It holds the authoritative view. A membership change
//!   asks the rule for it of the current view: [`join`](crate::join) for a new node or a new
//!   life of a node (which replaces the entry of the old life, as a registration does),
//!   [`remove_life`](crate::remove_life) for a graceful leave or a crashed member whose lease
//!   ran out, [`drain`](crate::drain) and [`finish`](crate::finish) for a drain. A next view
//!   (one epoch later) is sent to every watcher; a change the rules refuse (removing the last
//!   member, say) leaves the view as it is, as on the real coordinator, and is counted in
//!   [`SimReport::refused_changes`]. [`run_watched`] shows a test every change and what the
//!   rules answered. For stretches the coordinator is unreachable: no membership changes, no
//!   views sent, no client refreshes. The data path keeps running through an outage.
//! - A node is a [`NodeFence`], a [`ShardDirectory`] and a model store (a bounded map from key
//!   to version and bytes). Views reach a node late, each node with its own delay. A slow node
//!   gets them much later and applies only the newest one that has arrived, so it can skip
//!   epochs. When a node applies a view it drops from its store every key the fence hands
//!   back, and fences its directory. A crash loses the store, the fence and the directory; the
//!   node comes back later with a new life and a new registration. A node that loses its lease
//!   admits nothing until it registers again. A node that registers (a new node, a restart, a
//!   new registration after a lost lease) applies the view its registration made before it
//!   admits anything, as the real registration does. A graceful leave is a shutdown: the node
//!   stops, leaves the view and gives its lease up.
//! - Settlement. The coordinator keeps a liveness record per registered life (etcd's
//!   `members/`) and the epoch each life last said it applied (`applied/`). A registered node
//!   publishes its applied epoch whenever it changes; the publication reaches the coordinator
//!   late, with the same per-node delays as views. Every step the coordinator computes the
//!   settled epoch with [`crate::settled`] (the least epoch applied by the current life of
//!   each live record; a life that has published nothing counts as 0) and sends every rise of
//!   it to every registered node, again late, where it becomes [`NodeFence::settle`]. A
//!   crashed node's record goes when the coordinator removes it (its lease's time to live); a
//!   node that loses its lease stops admitting first and its record goes a few steps later,
//!   never before ([`SimCheck::Lease`]). A node answers a read of a key it owns but may not
//!   serve yet ([`NodeFence::servable`]) as a miss, and refuses to admit one
//!   ([`NotAdmitting::Settling`]).
//! - A client routes each request by its own view, which also arrives late. It sends that
//!   view's epoch with the request. When a node answers that the epoch is stale, the client
//!   asks the coordinator for the current view and tries again, a bounded number of times.
//!   When a node answers that it is behind, the client takes a miss. A client PUTs a new
//!   version of a key (its bytes follow from the key and the version) or GETs a key. After a
//!   GET miss it begins a fill on the owner's directory. A leader PUTs the block some steps
//!   later and reports to the directory. A joiner polls the directory: finished means GET
//!   again (finished is not a hit), failed means it may fill again, fenced means give up.
//!   A PUT refused as settling is a failed write: no acknowledgement, and no retry.
//!
//! After every step the run checks the rules in [`SimCheck`]. The first broken rule ends the
//! run with a [`SimFailure`] naming the seed, the step and what broke.
//!
//! Every queue and table is bounded by a named constant, and each directory uses a
//! [`CreditPool`] of its own, so that a credit a fill never gave back shows up as a pool that
//! is not full with no fill in flight.
//!
//! The parts: `config.rs` (what a run is asked and what it reports), `world.rs` (the cluster
//! and its events), `coordinator.rs`, `node.rs`, `client.rs`, `mail.rs` (what travels late
//! between them), `requests.rs` (the clients' GETs, PUTs and fills) and `checks.rs`.
//!
//! [`Placement`]: gpucache_dataplane::shard::Placement
//! [`ClusterView`]: gpucache_dataplane::shard::ClusterView
//! [`NodeFence`]: gpucache_dataplane::shard::NodeFence
//! [`NodeFence::settle`]: gpucache_dataplane::shard::NodeFence::settle
//! [`NodeFence::servable`]: gpucache_dataplane::shard::NodeFence::servable
//! [`NotAdmitting::Settling`]: gpucache_dataplane::shard::NotAdmitting::Settling
//! [`ShardDirectory`]: gpucache_dataplane::shard::ShardDirectory
//! [`SplitMix64`]: gpucache_dataplane::rng::SplitMix64
//! [`CreditPool`]: gpucache_dataplane::credits::CreditPool

mod checks;
mod client;
mod config;
mod coordinator;
mod mail;
mod node;
mod requests;
mod world;

pub use config::{
    CLIENTS_MAX, KEPT_COPY, KEYS_MAX, NODES_MAX, SAMPLE_KEYS, STEP_MS, SimCheck, SimConfig,
    SimFailure, SimFaults, SimReport, UNSETTLED,
};
pub use coordinator::{MembershipChange, ViewChange};
pub use world::{run, run_watched};
