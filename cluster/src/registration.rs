//! [`Registration`]: a node's membership, kept alive in etcd.
//!
//! A node registers with a lease: its liveness record under `members/`, then itself in the
//! view (a compare-and-swap, so the epoch advances). Its node epoch is the etcd revision of
//! that record, so each life of a node has a larger one than the last. Then, every poll
//! interval, it renews the lease when a third of its time to live has passed, reads the view
//! and hands a newer one to the node, and removes from the view any member whose liveness
//! record is gone (its lease lapsed: it crashed, or lost etcd).
//!
//! A node the control plane takes out of the view (a finished drain, an isolated fault
//! domain) while its lease holds stays out, admitting nothing, until it is restarted.
//!
//! When the node cannot renew for a whole time to live, it must assume its lease lapsed and
//! that the others removed it: it tells the node to admit nothing, and registers again, with
//! a new lease and a new node epoch, as soon as etcd answers. A full etcd outage longer than
//! the time to live therefore stops writes (reads keep being served); a shorter one, such as a
//! leader election, changes nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpucache_dataplane::shard::{ClusterView, MemberState, NodeId, ViewMember};

use crate::changes;
use crate::coordinator::{ClusterError, Coordinator};
use crate::etcd::LeaseKeeper;

/// How often a node reads the view and checks its lease, unless configured otherwise.
pub const POLL_MS_DEFAULT: u64 = 200;
/// The shortest poll interval a node or client keeps, whatever it is configured to.
pub const POLL_MS_MIN: u64 = 10;

/// What a node tells the cluster about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub node: NodeId,
    /// Where clients reach its native listener (`host:port`).
    pub address: String,
    pub fault_domain: String,
    /// Bytes it offers.
    pub capacity: u64,
    /// Seconds its registration lasts without a renewal.
    pub lease_ttl_s: u64,
    pub poll_ms: u64,
}

/// What the node does when its standing changes. Calls come from one thread, in order.
pub trait NodeEvents: Send + Sync + 'static {
    /// A newer view: the node must apply it (fence its fills, drop the keys that moved)
    /// before this returns.
    fn view(&self, view: &ClusterView);
    /// The registration holds again (with `node_epoch`), or lapsed (`None`): a lapsed node
    /// admits nothing.
    fn registration(&self, node_epoch: Option<u64>);
    /// Every live member has applied `epoch` or a newer view: no member takes writes under an
    /// older one any more, so keys that moved with it may be served.
    fn settled(&self, epoch: u64);
}

/// Where a registration stands, for `gpucache cluster status` and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistrationStats {
    /// The current life's node epoch; 0 while not registered.
    pub node_epoch: u64,
    pub registered: bool,
    /// The epoch of the last view handed to the node.
    pub view_epoch: u64,
    /// Times it registered (the first time included).
    pub registrations: u64,
    /// Times its registration lapsed.
    pub lapses: u64,
    /// Members it removed from the view after their liveness record disappeared.
    pub removed_dead: u64,
}

/// A node's registration and the thread that keeps it (see the module documentation).
/// Dropping it stops the thread; [`leave`](Self::leave) also takes the node out of the view.
pub struct Registration {
    shared: Arc<Shared>,
    events: Arc<dyn NodeEvents>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    coordinator: Arc<Coordinator>,
    config: NodeConfig,
    stop: AtomicBool,
    stats: Mutex<RegistrationStats>,
    /// The current life's lease, for a graceful leave.
    lease: Mutex<Option<i64>>,
}

/// One life's lease.
struct Life {
    lease: i64,
    node_epoch: u64,
    keeper: Option<LeaseKeeper>,
    renewed: Instant,
    /// The control plane took this life out of the view.
    removed: bool,
    /// The epoch this life last said it applied (in etcd).
    published: u64,
}

impl Registration {
    /// Registers the node (failing when etcd does not answer within its deadline) and starts
    /// the thread that keeps the registration.
    pub fn start(
        coordinator: Arc<Coordinator>,
        config: NodeConfig,
        events: Arc<dyn NodeEvents>,
    ) -> Result<Self, ClusterError> {
        let shared = Arc::new(Shared {
            coordinator,
            config,
            stop: AtomicBool::new(false),
            stats: Mutex::new(RegistrationStats::default()),
            lease: Mutex::new(None),
        });
        let life = shared.coordinator.runtime().block_on(shared.register(events.as_ref()))?;
        let keeper = Arc::clone(&shared);
        let thread_events = Arc::clone(&events);
        let thread = std::thread::Builder::new()
            .name("gpucache-cluster".into())
            .spawn(move || keeper.run(life, thread_events.as_ref()))
            .map_err(ClusterError::Runtime)?;
        Ok(Self { shared, events, thread: Some(thread) })
    }

    pub fn stats(&self) -> RegistrationStats {
        *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops keeping the registration and takes this life of the node out of the view (a
    /// graceful leave: its keys move to their next choices at once, not after its lease
    /// lapses). Refused, leaving the view as it is, when the node is the last member.
    pub fn leave(mut self) -> Result<(), ClusterError> {
        self.stop_thread();
        // Admit nothing from here on: once this life is out of the view and its lease gone,
        // the others no longer wait for it to settle, so it must take no more writes under
        // the view it still holds.
        self.events.registration(None);
        let stats = self.stats();
        let node = self.shared.config.node;
        let result = self
            .shared
            .coordinator
            .change(|v| changes::remove_life(v, node, stats.node_epoch))
            .map(drop);
        self.shared.revoke();
        result
    }

    fn stop_thread(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

impl Shared {
    fn update(&self, f: impl FnOnce(&mut RegistrationStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs(self.config.lease_ttl_s.max(1))
    }

    /// A new life: a lease, the liveness record, the node in the view; then the view handed
    /// to the node, and only then the registration.
    async fn register(&self, events: &dyn NodeEvents) -> Result<Life, ClusterError> {
        let c = &self.coordinator;
        let ttl = self.config.lease_ttl_s.max(1) as i64;
        let granted = Instant::now();
        let lease = c
            .call_async("grant lease", |mut client| async move { client.lease_grant(ttl).await })
            .await?;
        let mut member = ViewMember {
            node: self.config.node,
            address: self.config.address.clone(),
            fault_domain: self.config.fault_domain.clone(),
            capacity: self.config.capacity,
            node_epoch: 0,
            state: MemberState::Serving,
        };
        // The record's first revision names this life; it is written again to say so.
        member.node_epoch = c.put_member_async(&member, lease).await? as u64;
        c.put_member_async(&member, lease).await?;
        let view = c.change_async(|v| changes::join(v, &member)).await?;
        events.view(&view);
        events.registration(Some(member.node_epoch));
        self.update(|s| {
            s.node_epoch = member.node_epoch;
            s.registered = true;
            s.view_epoch = s.view_epoch.max(view.epoch);
            s.registrations += 1;
        });
        tracing::info!(
            node = member.node.0,
            node_epoch = member.node_epoch,
            epoch = view.epoch,
            "registered in the cluster"
        );
        *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = Some(lease);
        Ok(Life {
            lease,
            node_epoch: member.node_epoch,
            keeper: None,
            renewed: granted,
            removed: false,
            published: 0,
        })
    }

    fn run(&self, life: Life, events: &dyn NodeEvents) {
        let runtime = self.coordinator.runtime();
        let mut life = Some(life);
        let poll = Duration::from_millis(self.config.poll_ms.max(POLL_MS_MIN));
        while !self.stop.load(Ordering::Acquire) {
            let started = Instant::now();
            runtime.block_on(self.round(&mut life, events));
            // The next round after one poll interval (or at once when this one took longer).
            let rest = poll.saturating_sub(started.elapsed());
            std::thread::park_timeout(rest);
        }
    }

    /// One round: renew, notice a lapse, register again, read the view, remove the dead.
    async fn round(&self, life: &mut Option<Life>, events: &dyn NodeEvents) {
        if let Some(l) = life.as_mut() {
            if l.renewed.elapsed() >= self.ttl() / 3 {
                self.renew(l).await;
            }
            if l.renewed.elapsed() >= self.ttl() {
                tracing::warn!(node = self.config.node.0, "cluster registration lapsed");
                *life = None;
                events.registration(None);
                self.update(|s| {
                    s.registered = false;
                    s.lapses += 1;
                });
            }
        }
        if life.is_none() {
            match self.register(events).await {
                Ok(l) => *life = Some(l),
                Err(e) => tracing::debug!(error = %e, "registering again failed; next round"),
            }
            return;
        }
        let Ok((view, _)) = self.coordinator.view_async().await else { return };
        let applied = self.stats.lock().unwrap_or_else(|e| e.into_inner()).view_epoch;
        if view.epoch > applied {
            events.view(&view);
            self.update(|s| s.view_epoch = view.epoch);
        }
        let applied = view.epoch.max(applied);
        if let Some(l) = life.as_mut()
            && l.published < applied
            && self
                .coordinator
                .put_applied_async(self.config.node, l.node_epoch, applied, l.lease)
                .await
                .is_ok()
        {
            l.published = applied;
        }
        // One read of the liveness records serves both the settled epoch and the dead.
        let Ok(live) = self.coordinator.live_members_async().await else { return };
        if let Ok(settled) = self.coordinator.settled_async(&live).await {
            events.settled(settled);
        }
        let node_epoch = life.as_ref().map_or(0, |l| l.node_epoch);
        let listed = view.member(self.config.node).is_some_and(|m| m.node_epoch == node_epoch);
        if !listed {
            // The lease still holds (renewed above), so the control plane took this life out
            // (a finished drain, an isolated domain): it stays out, admitting nothing, until
            // the node is restarted. A lapsed lease is handled above, by a new life.
            if !life.as_ref().is_some_and(|l| l.removed) {
                tracing::warn!(
                    node = self.config.node.0,
                    "removed from the cluster view; staying out until restarted"
                );
                if let Some(l) = life.as_mut() {
                    l.removed = true;
                }
            }
            return;
        }
        self.remove_dead(&view, &live).await;
    }

    /// Renews the lease (opening its keep-alive stream first when there is none); a renewal
    /// etcd answers with no time left means it lapsed.
    async fn renew(&self, life: &mut Life) {
        // The lease runs from when etcd took the renewal, which is after it was sent: counting
        // from the send, this node presumes its lease lapsed no later than etcd lets it lapse.
        let sent = Instant::now();
        let deadline = Duration::from_millis(self.coordinator.config().request_timeout_ms);
        let answer = match life.keeper.as_mut() {
            Some(keeper) => {
                tokio::time::timeout(deadline, keeper.renew()).await.ok().and_then(Result::ok)
            }
            None => {
                let lease = life.lease;
                match self
                    .coordinator
                    .call_async("keep lease alive", |mut c| async move {
                        c.lease_keep_alive(lease).await
                    })
                    .await
                {
                    Ok((keeper, first)) => {
                        life.keeper = Some(keeper);
                        Some(first)
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "opening the lease keep-alive failed");
                        None
                    }
                }
            }
        };
        match answer {
            Some(Some(ttl)) if ttl > 0 => life.renewed = sent,
            Some(Some(_)) => {
                // etcd no longer knows the lease: make the round see a lapse now.
                life.renewed = Instant::now() - self.ttl();
            }
            // No answer, or the stream ended: open it again next time.
            _ => life.keeper = None,
        }
    }

    /// Removes from the view every other member whose liveness record is not among `live`.
    async fn remove_dead(&self, view: &ClusterView, live: &[ViewMember]) {
        for m in &view.members {
            let alive = live.iter().any(|l| l.node == m.node && l.node_epoch == m.node_epoch);
            if alive || m.node == self.config.node {
                continue;
            }
            let (node, node_epoch) = (m.node, m.node_epoch);
            match self.coordinator.change_async(|v| changes::remove_life(v, node, node_epoch)).await
            {
                Ok(v) if v.member(node).is_none() => {
                    tracing::warn!(node = node.0, epoch = v.epoch, "removed a dead member");
                    self.update(|s| s.removed_dead += 1);
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, node = node.0, "removing a dead member"),
            }
        }
    }

    /// Revokes the current lease, so its liveness record goes at once.
    fn revoke(&self) {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(lease) = lease {
            let _ = self
                .coordinator
                .call("revoke lease", |mut c| async move { c.lease_revoke(lease).await });
        }
    }
}
