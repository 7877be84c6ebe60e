//! How a client reaches its server: the address, deadlines, identities and credentials, and the
//! optional same-host path over the server's Unix socket.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::clock::{Clock, UnixClock};
use gpucache_dataplane::identity::TenantId;
use gpucache_storage::host::segment::Pages;

use super::parts::Stripe;
use crate::Credentials;

/// Default for [`ClientConfig::handshake_deadline`].
pub const HANDSHAKE_DEADLINE_DEFAULT: Duration = Duration::from_secs(5);

/// How to reach a server.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub addr: SocketAddr,
    /// Sending a request and receiving its answer each must finish within this.
    pub deadline: Duration,
    /// Connecting and the HELLO exchange must finish within this, whatever `deadline` is: a
    /// peer that is not a GPCW server (a RESP or HTTP port) never answers HELLO.
    pub handshake_deadline: Duration,
    /// The identity used for calls the store trait makes without a caller (epoch, stats,
    /// leases, fences).
    pub control: Caller,
    pub client_name: String,
    /// The keys of tenants that authenticate; a tenant not here connects as an open tenant.
    pub credentials: HashMap<TenantId, Credentials>,
    /// Unix-epoch milliseconds, for HELLO timestamps.
    pub clock: Arc<dyn Clock>,
    /// The same-host fast path: talk to the server's Unix socket and share a segment with it.
    pub local: Option<LocalConfig>,
    /// Striping one large PUT over several pooled connections (TCP, unsealed sessions).
    pub stripe: Stripe,
}

/// The same-host fast path of a client. It is required once configured: a server that offers
/// no Unix socket (another host, or no `listen.local`) is a transport error, never a silent
/// fallback to TCP.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// The server's Unix socket (`listen.local` in its configuration); `None` to take the one
    /// the server offers in its HELLO answer to a TCP client on this host.
    pub path: Option<PathBuf>,
    /// Size of the one segment this client shares with the server over all its connections;
    /// it bounds the shared buffers and bounce space in use at once.
    pub segment_bytes: u64,
    pub pages: Pages,
}

impl LocalConfig {
    /// Negotiated at connect: the socket is the one the server offers over TCP.
    pub fn negotiated() -> Self {
        Self { path: None, segment_bytes: 256 << 20, pages: Pages::Normal }
    }

    /// A known socket path.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: Some(path.into()), ..Self::negotiated() }
    }
}

impl ClientConfig {
    pub fn new(addr: SocketAddr, control: Caller) -> Self {
        Self {
            addr,
            deadline: Duration::from_secs(30),
            handshake_deadline: HANDSHAKE_DEADLINE_DEFAULT,
            control,
            client_name: "gpucache-client".into(),
            credentials: HashMap::new(),
            clock: Arc::new(UnixClock),
            local: None,
            stripe: Stripe::default(),
        }
    }

    /// Adds the credentials `tenant` signs its sessions with.
    pub fn with_credentials(mut self, tenant: TenantId, credentials: Credentials) -> Self {
        self.credentials.insert(tenant, credentials);
        self
    }
}
