//! NIC transports for GPUCache blocks: RDMA verbs (through sideway), NIXL (through nixl-sys) and
//! a deterministic, seeded simulated NIC, all under the registration, quarantine and epoch-fence
//! contract of `gpucache_dataplane::registry`.
//!
//! Owns registered NIC memory pools and one-sided block transfers. It must not own block
//! identity or lifecycle; those stay in `gpucache-dataplane`.
//!
//! - [`verbs`]: the transport-neutral, verbs-shaped traits (register, post, poll).
//! - [`sim`]: [`sim::SimNic`], an in-process simulated NIC with a seeded fault plan. It is a
//!   simulation and says so ([`verbs::Implementation::Simulated`]); it never stands in for a
//!   real NIC a caller asked for.
//! - [`transfer`]: moves one block between a [`gpucache_dataplane::registry::RegisteredPool`]
//!   slot and a remote region, and maps every completion (or its absence) onto the contract.
//!
//! - `rdma` (only with the off-by-default `verbs` feature): the real RDMA verbs endpoint over
//!   sideway, which loads libibverbs at run time. Without the feature the module does not exist;
//!   [`VerbsUnavailable::NotBuilt`] is the reason to report when a caller asked for verbs anyway.
//!
//! - [`nixl`]: NIXL through nixl-sys (off-by-default `nixl` feature; `libnixl_capi.so` is
//!   loaded at run time): a per-process agent with UCX and POSIX backends, huge-page pools
//!   registered as DRAM, metadata and block-descriptor exchange, and block READ/WRITE to peers
//!   and files under the same contract. Without the feature only [`nixl::probe`] (answering
//!   [`NixlUnavailable::NotBuilt`]) and the descriptor encoding [`nixl::wire`] exist.

pub mod error;
pub mod nixl;
#[cfg(feature = "verbs")]
pub mod rdma;
pub mod sim;
pub mod slots;
pub mod transfer;
pub mod verbs;

pub use error::{NicError, NixlUnavailable, VerbsUnavailable};
