//! How to run a RESP listener: its address, limits, deadlines, the tenant and namespace its
//! connections act in, and the tenant's keys when it has any.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::clock::{Clock, UnixClock};
use gpucache_dataplane::identity::IdentityError;
use gpucache_wire::namespace::IdentityTemplate;
use gpucache_wire::resp::RespLimits;

use crate::auth::TenantKeys;
use crate::bounds::Guard;

use super::expiry::EXPIRING_KEYS_MAX;

/// How to run a RESP listener.
#[derive(Debug, Clone)]
pub struct RespConfig {
    pub addr: SocketAddr,
    /// Open connections at most; one more is answered `-ERR max number of clients reached` and
    /// closed.
    pub connections_max: u32,
    /// A connection with no complete request for this long is closed.
    pub idle_timeout: Duration,
    /// Replies the client does not take whole within this long (one deadline for what is
    /// written at once, however slowly it is drained) close the connection.
    pub write_timeout: Duration,
    /// The in-flight request-body budget, the per-peer connection limit, the body and AUTH
    /// deadlines, and the refusal counts; a built service shares one with the native front.
    pub guard: Arc<Guard>,
    /// How long shutdown waits for connection threads.
    pub shutdown_deadline: Duration,
    /// The caller every RESP connection acts as.
    pub tenant: Caller,
    /// Where plain keys live; its tenant must be `tenant`'s.
    pub namespace: IdentityTemplate,
    pub limits: RespLimits,
    /// The tenant's keys when it has any: then a connection must `AUTH` with one of them before
    /// any other command (`AUTH <key-id> <hex secret>`, or `AUTH <key-id>:<hex secret>`), and is
    /// answered `-NOAUTH` until it does. RESP cannot seal, so the secret crosses the wire in
    /// clear: keep the listener on loopback or a trusted network.
    pub auth: Option<Arc<TenantKeys>>,
    /// Most plain keys with a deadline at once ([`EXPIRING_KEYS_MAX`] by default); a SET with
    /// an expiry that would take one more, when none of them is past its deadline, is refused.
    pub expiring_keys_max: usize,
    /// Unix time in milliseconds, by which deadlines and tenant-key expiry are judged
    /// ([`UnixClock`] by default).
    pub clock: Arc<dyn Clock>,
}

impl RespConfig {
    /// A listener on `addr` for `tenant`, in the tenant's default namespace, with the limits for
    /// the default `object_bytes_max`.
    pub fn new(addr: SocketAddr, tenant: Caller) -> Result<Self, IdentityError> {
        let namespace = IdentityTemplate::for_tenant(&tenant.tenant)?;
        Ok(Self {
            addr,
            connections_max: 256,
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(30),
            guard: Arc::default(),
            shutdown_deadline: Duration::from_secs(10),
            tenant,
            namespace,
            limits: RespLimits::default(),
            auth: None,
            expiring_keys_max: EXPIRING_KEYS_MAX,
            clock: Arc::new(UnixClock),
        })
    }
}
