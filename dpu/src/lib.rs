//! The GPUCache DPU agent: a process that owns storage queues bound to reactors (threads pinned
//! to cores, polling run-to-completion), backed by io_uring on the host here and by SPDK or DOCA
//! behind features that fail closed where those are absent.
//!
//! Owns queue affinity, the agent's registered slab and the honest report of whether offload is
//! active. It must not own block identity or lifecycle. Nothing is implemented yet.
