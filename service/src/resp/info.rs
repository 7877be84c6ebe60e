//! INFO and CONFIG GET: what the server reports about itself and its store, and the two
//! settings redis-benchmark asks about.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use gpucache_dataplane::store::Implementation;
use gpucache_wire::resp::Reply;

use super::auth::REDIS_VERSION;
use super::reply::{arity, shown};
use super::session::RespSession;

impl RespSession<'_> {
    pub(super) fn info(&self, sections: &[Vec<u8>]) -> Reply {
        let everything = sections.is_empty()
            || sections.iter().any(|s| {
                [&b"all"[..], b"everything", b"default"].iter().any(|a| s.eq_ignore_ascii_case(a))
            });
        let wanted = |name: &str| {
            everything || sections.iter().any(|s| s.eq_ignore_ascii_case(name.as_bytes()))
        };
        let info = self.store.info();
        let stats = self.store.stats();
        let mut text = String::new();
        // Writing to a String cannot fail.
        if wanted("server") {
            let implementation = match info.implementation {
                Implementation::Real => "real".to_owned(),
                Implementation::Simulated { seed } => format!("simulated(seed={seed})"),
            };
            let _ = write!(
                text,
                "# Server\r\nredis_version:{REDIS_VERSION}\r\nredis_mode:standalone\r\n\
                 gpucache_version:{}\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\n\
                 gpucache_store:{}\r\ngpucache_store_implementation:{implementation}\r\n\
                 gpucache_epoch:{}\r\ngpucache_tenant:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                std::process::id(),
                self.shared.port,
                self.shared.started.elapsed().as_secs(),
                info.name,
                self.store.epoch().0,
                self.caller.tenant,
            );
        }
        if wanted("clients") {
            let _ = write!(
                text,
                "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n\r\n",
                self.shared.gate.open.load(Ordering::Acquire),
                self.shared.config.connections_max,
            );
        }
        if wanted("stats") {
            let u = stats.usage;
            let r = stats.regions;
            let _ = write!(
                text,
                "# Stats\r\ncommitted_blocks:{}\r\ncorrupt_dropped:{}\r\nevicted_keys:{}\r\n\
                 retained_bytes:{}\r\ninflight_requests:{}\r\nregistrations:{}\r\n\
                 tenants_active:{}\r\nquarantined_regions:{}\r\nquarantined_bytes:{}\r\n\r\n",
                stats.committed_blocks,
                stats.corrupt_dropped.total(),
                stats.evictions,
                u.retained_bytes,
                u.inflight_requests,
                u.registrations,
                u.tenants,
                r.quarantined,
                r.quarantined_bytes,
            );
        }
        if wanted("keyspace") {
            let _ = write!(
                text,
                "# Keyspace\r\ndb0:keys={},expires={},avg_ttl=0\r\n\r\n",
                stats.committed_blocks,
                self.shared.expiries.len(),
            );
        }
        Reply::Verbatim(text)
    }
}

/// CONFIG GET answers the two settings redis-benchmark asks about (no RDB snapshots, no
/// append-only file: those are Redis' persistence, not the store's) and nothing else.
pub(super) fn config(args: &[Vec<u8>]) -> Reply {
    let Some((sub, params)) = args.split_first() else { return arity("config") };
    if !sub.eq_ignore_ascii_case(b"GET") {
        return Reply::err(format!("CONFIG {} is not supported; only CONFIG GET", shown(sub)));
    }
    if params.is_empty() {
        return arity("config|get");
    }
    let mut pairs = Vec::new();
    for (name, value) in [("save", ""), ("appendonly", "no")] {
        if params.iter().any(|p| p.eq_ignore_ascii_case(name.as_bytes())) {
            pairs.push((
                Reply::Bulk(name.as_bytes().to_vec()),
                Reply::Bulk(value.as_bytes().to_vec()),
            ));
        }
    }
    Reply::Map(pairs)
}
