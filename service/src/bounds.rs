//! What keeps a front bounded under hostile clients, shared by the native and the RESP fronts:
//!
//! - the in-flight request-body budget ([`Guard::charge`]): a request's body is charged before
//!   it is buffered (the native front charges the length its header announces, the RESP front
//!   each read before it is appended) and released once the request is served or the connection
//!   ends, against the server's [`ConnectionBounds::inflight_body_bytes_max`] and, once the
//!   connection knows its tenant, that tenant's share
//!   ([`ConnectionBounds::tenant_inflight_body_bytes_max`]), and the share of its peer address
//!   ([`ConnectionBounds::peer_inflight_body_bytes_max`]), so that a few clients cannot take the
//!   whole budget from the others;
//! - the connections one peer address may hold ([`Guard::admit_peer`]);
//! - the deadlines of a connection ([`Deadlines`]): a request that has started must arrive
//!   whole within `body_timeout`, and a connection that must authenticate must do so within
//!   `hello_timeout`;
//! - a write deadline for a whole response ([`DeadlineWriter`]), not one per write call;
//! - the count of every refusal and cut, by front and reason ([`Refusals`]), which the service
//!   registers as `gpucache_connections_refused_total{front,reason}`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_wire::{InflightScope, WireError};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// Default [`ConnectionBounds::inflight_body_bytes_max`]: 1 GiB.
pub const INFLIGHT_BODY_BYTES_MAX_DEFAULT: u64 = 1 << 30;
/// Default [`ConnectionBounds::peer_inflight_body_bytes_max`]: a quarter of the default budget.
pub const PEER_INFLIGHT_BODY_BYTES_MAX_DEFAULT: u64 = 256 << 20;
/// Default [`ConnectionBounds::body_timeout`].
pub const BODY_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// Default [`ConnectionBounds::hello_timeout`].
pub const HELLO_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
/// Default [`ConnectionBounds::connections_per_peer_max`].
pub const CONNECTIONS_PER_PEER_MAX_DEFAULT: u32 = 64;
/// The largest request a connection that has not authenticated may send: a native frame body
/// before HELLO, or the bytes a RESP connection that must `AUTH` buffers before it has. HELLO
/// and AUTH are a few hundred bytes; nothing bigger is buffered for an unknown client.
pub const UNAUTHENTICATED_REQUEST_BYTES_MAX: u64 = 64 << 10;
/// Allocations from this size up get pages of their own from the kernel, given back when freed
/// ([`fix_malloc_mmap_threshold`]).
pub const MALLOC_MMAP_THRESHOLD_BYTES: usize = 1 << 20;
/// Fixes glibc's mmap threshold at [`MALLOC_MMAP_THRESHOLD_BYTES`], for the whole process.
///
/// Request buffers are large and short-lived. By default glibc raises its threshold each time a
/// large block is freed (up to 32 MiB), after which such buffers come from its arenas and, once
/// freed, stay resident there: measured under 100 stalled 64 MiB requests, the server held 100 to
/// 180 MiB above its in-flight budget that way. A fixed threshold hands every buffer of 1 MiB or
/// more back to the kernel when it is freed, so the budget bounds the resident memory. Steady
/// traffic is not affected: connections reuse their buffers. Returns whether the setting took.
pub fn fix_malloc_mmap_threshold() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let bytes = libc::c_int::try_from(MALLOC_MMAP_THRESHOLD_BYTES).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt changes an allocator parameter; it touches no memory of ours.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// The limits a [`Guard`] enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionBounds {
    /// Request-body bytes buffered at once over every connection of every front that shares
    /// the guard; a request that would take more is refused and its connection closed.
    pub inflight_body_bytes_max: u64,
    /// The same bound for one tenant's connections, once they said who they are (the store's
    /// `limits.tenant_inflight_bytes_max` in a built service).
    pub tenant_inflight_body_bytes_max: u64,
    /// The same bound for the connections of one peer IP address.
    pub peer_inflight_body_bytes_max: u64,
    /// Once a request's first byte arrived, the whole request must arrive within this long,
    /// or the connection is closed.
    pub body_timeout: Duration,
    /// A connection that must authenticate (native HELLO; RESP AUTH when the tenant has keys)
    /// and has not within this long is closed.
    pub hello_timeout: Duration,
    /// Connections one IP address may hold open at once, over every front sharing the guard.
    /// Every address is its own peer (127.0.0.1 and 127.0.0.2 are two).
    pub connections_per_peer_max: u32,
}

impl Default for ConnectionBounds {
    fn default() -> Self {
        Self {
            inflight_body_bytes_max: INFLIGHT_BODY_BYTES_MAX_DEFAULT,
            tenant_inflight_body_bytes_max: ResourceLimits::default().tenant_inflight_bytes_max,
            peer_inflight_body_bytes_max: PEER_INFLIGHT_BODY_BYTES_MAX_DEFAULT,
            body_timeout: BODY_TIMEOUT_DEFAULT,
            hello_timeout: HELLO_TIMEOUT_DEFAULT,
            connections_per_peer_max: CONNECTIONS_PER_PEER_MAX_DEFAULT,
        }
    }
}

/// Which front turned a connection away or cut it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Front {
    /// The native protocol over TCP.
    Native,
    /// The native protocol over the same-host Unix socket.
    Local,
    /// The RESP listener.
    Resp,
}

impl Front {
    pub const ALL: [Self; 3] = [Self::Native, Self::Local, Self::Resp];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Local => "local",
            Self::Resp => "resp",
        }
    }
}

/// Why a connection was turned away or cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The front was at `connections_max`.
    ConnectionsMax,
    /// The peer address was at `connections_per_peer_max`.
    PerPeer,
    /// A request body would have exceeded the server's in-flight budget.
    InflightBytes,
    /// A request body would have exceeded its tenant's share of the in-flight budget.
    TenantInflightBytes,
    /// A request body would have exceeded its peer address's share of the in-flight budget.
    PeerInflightBytes,
    /// A request bigger than [`UNAUTHENTICATED_REQUEST_BYTES_MAX`] before authentication.
    Oversize,
    /// A request did not arrive whole within `body_timeout`.
    BodyTimeout,
    /// No authentication within `hello_timeout`.
    HelloTimeout,
    /// No complete request within `idle_timeout`.
    IdleTimeout,
    /// A response was not taken within `write_timeout`.
    WriteTimeout,
}

impl Reason {
    pub const ALL: [Self; 10] = [
        Self::ConnectionsMax,
        Self::PerPeer,
        Self::InflightBytes,
        Self::TenantInflightBytes,
        Self::PeerInflightBytes,
        Self::Oversize,
        Self::BodyTimeout,
        Self::HelloTimeout,
        Self::IdleTimeout,
        Self::WriteTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConnectionsMax => "connections_max",
            Self::PerPeer => "per_peer",
            Self::InflightBytes => "inflight_bytes",
            Self::TenantInflightBytes => "tenant_inflight_bytes",
            Self::PeerInflightBytes => "peer_inflight_bytes",
            Self::Oversize => "oversize",
            Self::BodyTimeout => "body_timeout",
            Self::HelloTimeout => "hello_timeout",
            Self::IdleTimeout => "idle_timeout",
            Self::WriteTimeout => "write_timeout",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusalLabels {
    front: &'static str,
    reason: &'static str,
}

/// Connections turned away or cut, by front and reason; every series exists from the start.
#[derive(Debug, Clone)]
pub struct Refusals {
    family: Family<RefusalLabels, Counter>,
}

impl Default for Refusals {
    fn default() -> Self {
        let family = Family::<RefusalLabels, Counter>::default();
        for front in Front::ALL {
            for reason in Reason::ALL {
                let labels = RefusalLabels { front: front.as_str(), reason: reason.as_str() };
                let _ = family.get_or_create_owned(&labels);
            }
        }
        Self { family }
    }
}

impl Refusals {
    /// Registers the series as `gpucache_connections_refused_total`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "gpucache_connections_refused",
            "Client connections turned away or cut by the server, by front and reason",
            self.family.clone(),
        );
    }

    pub fn count(&self, front: Front, reason: Reason) {
        let labels = RefusalLabels { front: front.as_str(), reason: reason.as_str() };
        self.family.get_or_create(&labels).inc();
    }

    /// How many times `front` counted `reason`.
    pub fn get(&self, front: Front, reason: Reason) -> u64 {
        let labels = RefusalLabels { front: front.as_str(), reason: reason.as_str() };
        self.family.get_or_create(&labels).get()
    }
}

/// A request refused by a budget: the typed error to answer with, and the reason to count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBudget {
    pub reason: Reason,
    pub error: WireError,
}

/// The state every front of one service shares: the bounds, the in-flight body bytes (server
/// and per tenant), the connections per peer address, and the refusal counts.
#[derive(Debug, Default)]
pub struct Guard {
    bounds: ConnectionBounds,
    body_bytes: AtomicU64,
    /// In-flight body bytes by tenant; a tenant is here only while it has some (so the table
    /// holds at most one entry per open connection).
    tenants: Mutex<HashMap<TenantId, u64>>,
    /// Open connections by peer address; an address is here only while it has some.
    peers: Mutex<HashMap<IpAddr, u32>>,
    /// In-flight body bytes by peer address; an address is here only while it has some.
    peer_bytes: Mutex<HashMap<IpAddr, u64>>,
    refusals: Refusals,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Guard {
    pub fn new(bounds: ConnectionBounds) -> Self {
        Self { bounds, ..Self::default() }
    }

    /// A guard counting into `refusals` (a registered family).
    pub fn with_refusals(bounds: ConnectionBounds, refusals: Refusals) -> Self {
        Self { bounds, refusals, ..Self::default() }
    }

    pub fn bounds(&self) -> &ConnectionBounds {
        &self.bounds
    }

    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    pub fn count(&self, front: Front, reason: Reason) {
        tracing::debug!(front = front.as_str(), reason = reason.as_str(), "connection refused");
        self.refusals.count(front, reason);
    }

    /// Request-body bytes charged now, over every connection.
    pub fn body_bytes_in_flight(&self) -> u64 {
        self.body_bytes.load(Ordering::Acquire)
    }

    /// Request-body bytes `tenant`'s connections have charged now.
    pub fn tenant_body_bytes_in_flight(&self, tenant: &TenantId) -> u64 {
        locked(&self.tenants).get(tenant).copied().unwrap_or(0)
    }

    /// Open connections counted for `ip`.
    pub fn peer_connections(&self, ip: IpAddr) -> u32 {
        locked(&self.peers).get(&ip.to_canonical()).copied().unwrap_or(0)
    }

    /// Counts one more connection of `ip`, or says how many it holds and the limit when it is
    /// at `connections_per_peer_max`. The slot is given back when dropped.
    pub fn admit_peer(self: &Arc<Self>, ip: IpAddr) -> Result<PeerSlot, (u32, u32)> {
        let ip = ip.to_canonical();
        let max = self.bounds.connections_per_peer_max;
        let mut peers = locked(&self.peers);
        let open = peers.entry(ip).or_insert(0);
        if *open >= max {
            let held = *open;
            if held == 0 {
                peers.remove(&ip);
            }
            return Err((held, max));
        }
        *open += 1;
        Ok(PeerSlot { guard: Arc::clone(self), ip })
    }

    /// Request-body bytes the connections of `ip` have charged now.
    pub fn peer_body_bytes_in_flight(&self, ip: IpAddr) -> u64 {
        locked(&self.peer_bytes).get(&ip.to_canonical()).copied().unwrap_or(0)
    }

    /// The charge of a connection from `peer` (`None`: a Unix socket peer, which has no share
    /// of its own), empty at first.
    pub fn charge(&self, peer: Option<IpAddr>) -> BodyCharge<'_> {
        BodyCharge { guard: self, server: 0, tenant: None, peer: peer.map(|ip| ip.to_canonical()) }
    }

    fn take_server(&self, more: u64) -> Result<(), OverBudget> {
        let max = self.bounds.inflight_body_bytes_max;
        self.body_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                now.checked_add(more).filter(|total| *total <= max)
            })
            .map(drop)
            .map_err(|in_flight| OverBudget {
                reason: Reason::InflightBytes,
                error: WireError::Overloaded {
                    scope: InflightScope::Server,
                    requested: more,
                    in_flight,
                    max,
                },
            })
    }

    fn give_server(&self, less: u64) {
        let _ = self.body_bytes.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            Some(now.saturating_sub(less))
        });
    }

    fn take_tenant(&self, tenant: &TenantId, more: u64) -> Result<(), OverBudget> {
        let max = self.bounds.tenant_inflight_body_bytes_max;
        let mut tenants = locked(&self.tenants);
        let in_flight = tenants.get(tenant).copied().unwrap_or(0);
        match in_flight.checked_add(more).filter(|total| *total <= max) {
            Some(total) => {
                tenants.insert(tenant.clone(), total);
                Ok(())
            }
            None => Err(OverBudget {
                reason: Reason::TenantInflightBytes,
                error: WireError::Overloaded {
                    scope: InflightScope::Tenant,
                    requested: more,
                    in_flight,
                    max,
                },
            }),
        }
    }

    fn take_peer(&self, ip: IpAddr, more: u64) -> Result<(), OverBudget> {
        let max = self.bounds.peer_inflight_body_bytes_max;
        let mut peers = locked(&self.peer_bytes);
        let in_flight = peers.get(&ip).copied().unwrap_or(0);
        match in_flight.checked_add(more).filter(|total| *total <= max) {
            Some(total) => {
                peers.insert(ip, total);
                Ok(())
            }
            None => Err(OverBudget {
                reason: Reason::PeerInflightBytes,
                error: WireError::Overloaded {
                    scope: InflightScope::Peer,
                    requested: more,
                    in_flight,
                    max,
                },
            }),
        }
    }

    fn give_peer(&self, ip: IpAddr, less: u64) {
        let mut peers = locked(&self.peer_bytes);
        if let Some(held) = peers.get_mut(&ip) {
            *held = held.saturating_sub(less);
            if *held == 0 {
                peers.remove(&ip);
            }
        }
    }

    fn give_tenant(&self, tenant: &TenantId, less: u64) {
        let mut tenants = locked(&self.tenants);
        if let Some(held) = tenants.get_mut(tenant) {
            *held = held.saturating_sub(less);
            if *held == 0 {
                tenants.remove(tenant);
            }
        }
    }
}

/// The guard's state as gauges, read at scrape time: `gpucache_request_body_bytes_inflight` and
/// its limit `gpucache_limit_request_body_bytes_inflight`.
#[derive(Debug)]
pub struct GuardGauges(pub Arc<Guard>);

impl GuardGauges {
    /// Registers the gauges of `guard`.
    pub fn register(registry: &mut Registry, guard: Arc<Guard>) {
        registry.register_collector(Box::new(Self(guard)));
    }
}

impl Collector for GuardGauges {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let rows = [
            (
                "gpucache_request_body_bytes_inflight",
                "Request-body bytes the client fronts have charged now (buffered or about to be)",
                self.0.body_bytes_in_flight(),
            ),
            (
                "gpucache_limit_request_body_bytes_inflight",
                "listen.inflight_body_bytes_max, the bound of gpucache_request_body_bytes_inflight",
                self.0.bounds.inflight_body_bytes_max,
            ),
        ];
        for (name, help, value) in rows {
            let g = ConstGauge::new(value);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

/// One open connection of a peer address, counted until dropped.
#[derive(Debug)]
pub struct PeerSlot {
    guard: Arc<Guard>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut peers = locked(&self.guard.peers);
        if let Some(open) = peers.get_mut(&self.ip) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                peers.remove(&self.ip);
            }
        }
    }
}

/// The request-body bytes one connection has charged: to the server's budget and its peer
/// address's share (the same bytes) and, once it knows its tenant, to that tenant's share.
/// Dropping it gives everything back.
#[derive(Debug)]
pub struct BodyCharge<'g> {
    guard: &'g Guard,
    server: u64,
    tenant: Option<(TenantId, u64)>,
    peer: Option<IpAddr>,
}

impl BodyCharge<'_> {
    /// Bytes charged now.
    pub fn bytes(&self) -> u64 {
        self.server
    }

    /// Makes the charge `total` bytes: growing takes the difference from the server's budget,
    /// the peer's share and `tenant`'s share (when given), and is refused, changing nothing, if
    /// any would pass its limit; shrinking gives the difference back.
    pub fn set(&mut self, total: u64, tenant: Option<&TenantId>) -> Result<(), OverBudget> {
        if total <= self.server {
            self.shrink(total);
            return Ok(());
        }
        let more = total - self.server;
        if let Some(ip) = self.peer {
            self.guard.take_peer(ip, more)?;
        }
        if let Err(e) = self.guard.take_server(more) {
            if let Some(ip) = self.peer {
                self.guard.give_peer(ip, more);
            }
            return Err(e);
        }
        if let Some(tenant) = tenant {
            let held = match &self.tenant {
                Some((t, n)) if t == tenant => *n,
                _ => 0,
            };
            // A connection's tenant never changes once known; charge it the whole of what the
            // connection holds that it was not charged yet.
            let tenant_more = total.saturating_sub(held);
            if let Err(e) = self.guard.take_tenant(tenant, tenant_more) {
                self.guard.give_server(more);
                if let Some(ip) = self.peer {
                    self.guard.give_peer(ip, more);
                }
                return Err(e);
            }
            self.tenant = Some((tenant.clone(), total));
        }
        self.server = total;
        Ok(())
    }

    /// Gives back everything charged.
    pub fn release(&mut self) {
        self.shrink(0);
    }

    fn shrink(&mut self, total: u64) {
        self.guard.give_server(self.server - total);
        if let Some(ip) = self.peer {
            self.guard.give_peer(ip, self.server - total);
        }
        self.server = total;
        if let Some((tenant, held)) = &mut self.tenant {
            let less = held.saturating_sub(total);
            self.guard.give_tenant(tenant, less);
            *held = total.min(*held);
        }
    }
}

impl Drop for BodyCharge<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// A connection's deadlines, checked at each read tick.
#[derive(Debug)]
pub struct Deadlines {
    /// When the connection must have authenticated; `None` once it has, or when it need not.
    hello_by: Option<Instant>,
    /// When the request in progress began arriving; `None` between requests.
    request_since: Option<Instant>,
    body_timeout: Duration,
}

impl Deadlines {
    /// The deadlines of a connection opened now; `authenticate` says whether it must.
    pub fn new(bounds: &ConnectionBounds, authenticate: bool) -> Self {
        let now = Instant::now();
        Self {
            hello_by: authenticate.then(|| now + bounds.hello_timeout),
            request_since: None,
            body_timeout: bounds.body_timeout,
        }
    }

    /// The connection authenticated: no HELLO deadline any more.
    pub fn authenticated(&mut self) {
        self.hello_by = None;
    }

    /// Records, after input was decoded, whether part of a request is buffered: its clock starts
    /// with the first such call and stops when no request is in progress.
    pub fn in_request(&mut self, partial: bool) {
        match (partial, self.request_since) {
            (true, None) => self.request_since = Some(Instant::now()),
            (false, Some(_)) => self.request_since = None,
            _ => {}
        }
    }

    /// The deadline that has passed, if one has.
    pub fn passed(&self, now: Instant) -> Option<Reason> {
        if self.hello_by.is_some_and(|by| now >= by) {
            return Some(Reason::HelloTimeout);
        }
        if self.request_since.is_some_and(|since| now.duration_since(since) >= self.body_timeout) {
            return Some(Reason::BodyTimeout);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str) -> TenantId {
        TenantId::parse(name).expect("tenant")
    }

    fn guard(server: u64, tenant: u64) -> Guard {
        Guard::new(ConnectionBounds {
            inflight_body_bytes_max: server,
            tenant_inflight_body_bytes_max: tenant,
            ..ConnectionBounds::default()
        })
    }

    #[test]
    fn charges_return_to_zero_when_released_or_dropped() {
        let g = guard(100, 60);
        let a = tenant("a");
        let mut one = g.charge(None);
        let mut two = g.charge(None);
        one.set(40, Some(&a)).expect("within both");
        two.set(30, None).expect("within the server's");
        assert_eq!(g.body_bytes_in_flight(), 70);
        assert_eq!(g.tenant_body_bytes_in_flight(&a), 40);
        one.set(10, Some(&a)).expect("shrinks");
        assert_eq!((g.body_bytes_in_flight(), g.tenant_body_bytes_in_flight(&a)), (40, 10));
        one.release();
        assert_eq!((g.body_bytes_in_flight(), g.tenant_body_bytes_in_flight(&a)), (30, 0));
        one.set(50, Some(&a)).expect("again");
        drop(one);
        drop(two);
        assert_eq!(g.body_bytes_in_flight(), 0);
        assert_eq!(g.tenant_body_bytes_in_flight(&a), 0);
        assert!(locked(&g.tenants).is_empty(), "no tenant entry is left behind");
    }

    #[test]
    fn a_charge_past_a_limit_is_refused_with_the_numbers_and_changes_nothing() {
        let g = guard(100, 60);
        let (a, b) = (tenant("a"), tenant("b"));
        let mut one = g.charge(None);
        one.set(50, Some(&a)).expect("fits");
        let mut two = g.charge(None);
        let refused = two.set(20, Some(&a)).expect_err("tenant a is at 50 of 60");
        assert_eq!(refused.reason, Reason::TenantInflightBytes);
        assert_eq!(
            refused.error,
            WireError::Overloaded {
                scope: InflightScope::Tenant,
                requested: 20,
                in_flight: 50,
                max: 60
            }
        );
        assert_eq!((g.body_bytes_in_flight(), two.bytes()), (50, 0));
        two.set(45, Some(&b)).expect("another tenant has its own share");
        let mut three = g.charge(None);
        let refused = three.set(6, None).expect_err("the server is at 95 of 100");
        assert_eq!(refused.reason, Reason::InflightBytes);
        assert_eq!(
            refused.error,
            WireError::Overloaded {
                scope: InflightScope::Server,
                requested: 6,
                in_flight: 95,
                max: 100
            }
        );
        assert!(refused.error.closes_connection());
        drop((one, two, three));
        assert_eq!(g.body_bytes_in_flight(), 0);
    }

    #[test]
    fn a_peer_address_has_its_own_share() {
        let g = Guard::new(ConnectionBounds {
            inflight_body_bytes_max: 100,
            peer_inflight_body_bytes_max: 40,
            ..ConnectionBounds::default()
        });
        let one: IpAddr = "127.0.0.1".parse().expect("ip");
        let two: IpAddr = "127.0.0.2".parse().expect("ip");
        let mut a = g.charge(Some(one));
        let mut b = g.charge(Some(one));
        a.set(30, None).expect("fits the share");
        let refused = b.set(20, None).expect_err("the address is at 30 of 40");
        assert_eq!(refused.reason, Reason::PeerInflightBytes);
        assert_eq!(
            refused.error,
            WireError::Overloaded {
                scope: InflightScope::Peer,
                requested: 20,
                in_flight: 30,
                max: 40
            }
        );
        assert_eq!(g.body_bytes_in_flight(), 30, "a refused charge takes nothing");
        let mut c = g.charge(Some(two));
        c.set(40, None).expect("another address has its own share");
        a.set(10, None).expect("shrinks");
        assert_eq!((g.peer_body_bytes_in_flight(one), g.body_bytes_in_flight()), (10, 50));
        drop((a, b, c));
        assert_eq!(g.peer_body_bytes_in_flight(one) + g.peer_body_bytes_in_flight(two), 0);
        assert!(locked(&g.peer_bytes).is_empty());
    }

    #[test]
    fn peers_are_counted_per_exact_address_and_given_back() {
        let g = Arc::new(Guard::new(ConnectionBounds {
            connections_per_peer_max: 2,
            ..ConnectionBounds::default()
        }));
        let one: IpAddr = "127.0.0.1".parse().expect("ip");
        let two: IpAddr = "127.0.0.2".parse().expect("ip");
        let a = g.admit_peer(one).expect("first");
        let b = g.admit_peer(one).expect("second");
        assert_eq!(g.admit_peer(one).expect_err("third"), (2, 2));
        let c = g.admit_peer(two).expect("another address is another peer");
        drop(a);
        let d = g.admit_peer(one).expect("a slot came back");
        drop((b, c, d));
        assert_eq!(g.peer_connections(one), 0);
        assert!(locked(&g.peers).is_empty());
    }

    #[test]
    fn deadlines_pass_in_order_of_what_is_missing() {
        let bounds = ConnectionBounds {
            hello_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(2),
            ..ConnectionBounds::default()
        };
        let mut d = Deadlines::new(&bounds, true);
        let now = Instant::now();
        assert_eq!(d.passed(now), None);
        assert_eq!(d.passed(now + Duration::from_secs(6)), Some(Reason::HelloTimeout));
        d.authenticated();
        assert_eq!(d.passed(now + Duration::from_secs(6)), None);
        d.in_request(true);
        assert_eq!(d.passed(Instant::now() + Duration::from_secs(3)), Some(Reason::BodyTimeout));
        d.in_request(false);
        assert_eq!(d.passed(Instant::now() + Duration::from_secs(3)), None);
    }

    #[test]
    fn refusals_are_counted_by_front_and_reason() {
        let r = Refusals::default();
        r.count(Front::Resp, Reason::PerPeer);
        r.count(Front::Resp, Reason::PerPeer);
        assert_eq!(r.get(Front::Resp, Reason::PerPeer), 2);
        assert_eq!(r.get(Front::Native, Reason::PerPeer), 0);
        let mut registry = Registry::default();
        r.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert!(
            text.contains(
                r#"gpucache_connections_refused_total{front="resp",reason="per_peer"} 2"#
            ),
            "{text}"
        );
        assert!(text.contains(
            r#"gpucache_connections_refused_total{front="native",reason="body_timeout"} 0"#
        ));
    }
}
