//! [`TcpStore`] itself: the state one client keeps (configuration, connection pools, the shared
//! segment, the cluster epoch), its constructor, and the accessors of the same-host segment.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::store::StoreError;
use gpucache_storage::host::segment::{Segment, SharedArena, SharedBuf};
use gpucache_wire::RemoteInfo;

use super::config::ClientConfig;
use super::conn::Conn;
use super::errors::transport_failure;
use super::shm::{SharedCounters, SharedStats};

pub(super) type PoolKey = (TenantId, bool, bool, bool);

pub(super) fn pool_key(caller: &Caller) -> PoolKey {
    (caller.tenant.clone(), caller.rights.read, caller.rights.write, caller.rights.admin)
}

/// A [`Store`](gpucache_dataplane::store::Store) served by a remote `gpucache serve`.
#[derive(Debug)]
pub struct TcpStore {
    pub(super) config: ClientConfig,
    pub(super) pools: Mutex<HashMap<PoolKey, Vec<Conn>>>,
    pub(super) next_id: AtomicU64,
    pub(super) info: OnceLock<RemoteInfo>,
    /// The shared segment of the same-host path, made at the first connection.
    pub(super) arena: OnceLock<SharedArena>,
    /// The Unix socket the server offered, when the configuration names none.
    pub(super) local_path: OnceLock<PathBuf>,
    pub(super) shared: SharedCounters,
    /// The cluster epoch requests are routed by; [`NOT_CLUSTERED`] for a server that runs
    /// alone.
    pub(super) cluster_epoch: AtomicU64,
}

/// [`TcpStore::set_cluster_epoch`] was never called: requests say no epoch.
pub(super) const NOT_CLUSTERED: u64 = u64::MAX;

impl TcpStore {
    pub fn new(config: ClientConfig) -> Self {
        Self {
            config,
            pools: Mutex::default(),
            next_id: AtomicU64::new(1),
            info: OnceLock::new(),
            arena: OnceLock::new(),
            local_path: OnceLock::new(),
            cluster_epoch: AtomicU64::new(NOT_CLUSTERED),
            shared: SharedCounters::default(),
        }
    }

    /// What the same-host path has done so far (all zero over TCP).
    pub fn shared_stats(&self) -> SharedStats {
        let c = &self.shared;
        let arena = self.arena.get();
        SharedStats {
            direct_items: c.direct_items.load(Ordering::Relaxed),
            bounced_items: c.bounced_items.load(Ordering::Relaxed),
            framed_batches: c.framed_batches.load(Ordering::Relaxed),
            quarantined_bytes: arena.map_or(0, SharedArena::quarantined_bytes),
            free_bytes: arena.map_or(0, SharedArena::free_bytes),
        }
    }

    /// The shared segment of the same-host path (made on first use); `None` over TCP.
    pub(super) fn arena(
        &self,
        operation: &'static str,
    ) -> Result<Option<&SharedArena>, StoreError> {
        let Some(local) = &self.config.local else { return Ok(None) };
        if let Some(a) = self.arena.get() {
            return Ok(Some(a));
        }
        let segment = Segment::create(local.segment_bytes, local.pages).map_err(|e| {
            transport_failure(operation, e.io_kind(), format!("shared segment: {e}"))
        })?;
        Ok(Some(self.arena.get_or_init(|| SharedArena::new(segment))))
    }

    /// A buffer of `len` bytes inside the segment shared with the server: a GET into it or a PUT
    /// from it moves no payload through the socket and copies nothing on this side. `None` when
    /// the client is not on the same-host path or the segment has no free range that large.
    pub fn shared_buffer(&self, len: usize) -> Option<SharedBuf> {
        self.arena("shared_buffer").ok().flatten()?.alloc(len)
    }

    /// Where the segment shared with the server is mapped in this process (its first byte's
    /// address and its length), once the same-host path has made it; `None` over TCP. A GET
    /// into a range inside it, or a PUT from one, is served there by the server directly.
    pub fn shared_segment_span(&self) -> Option<(usize, usize)> {
        let segment = self.arena.get()?.segment();
        let base = segment.with_bytes(0, segment.len(), |all| all.as_ptr() as usize).ok()?;
        Some((base, usize::try_from(segment.len()).ok()?))
    }

    /// Whether this client takes the same-host path (its configuration has a [`LocalConfig`]).
    ///
    /// [`LocalConfig`]: super::LocalConfig
    pub fn is_local(&self) -> bool {
        self.config.local.is_some()
    }
}
