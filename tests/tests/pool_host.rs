//! Host memory slots pass the registration conformance rules.

use gpucache_dataplane::registry::HostSlots;

fn make() -> HostSlots {
    HostSlots::new(6, 4096)
}

gpucache_dataplane::pool_conformance_suite!(make);
