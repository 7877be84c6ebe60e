//! NIC transports for GPUCache blocks: RDMA verbs (through sideway), NIXL (through nixl-sys) and
//! a deterministic, seeded simulated NIC, all under the registration, quarantine and epoch-fence
//! contract of `gpucache_dataplane::registry`.
//!
//! Owns registered NIC memory pools and one-sided block transfers. It must not own block
//! identity or lifecycle; those stay in `gpucache-dataplane`. Nothing is implemented yet: the
//! paths arrive with their issue, and until then no code here pretends to move bytes.
