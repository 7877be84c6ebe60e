//! [`ClusterClient`]: a [`Store`] over every member of a cluster.
//!
//! It keeps the cluster's view (read from etcd every poll interval, and at once when a node
//! refuses its epoch), places each key on the member that owns it by rendezvous hashing, and
//! sends each batch split per member, the parts in parallel. Every connection says the view's
//! epoch, so a node serves it only under the same view.
//!
//! What a caller sees when the cluster moves under it:
//! - a node that refuses the epoch as older, or a key as no longer its own: the client reads
//!   the view again and sends the request once more (at most [`ROUTE_ATTEMPTS_MAX`] times);
//! - a read from a node that is behind, unreachable or failing: a miss (the block is
//!   recomputed), never an error the engine must handle, and never someone else's bytes;
//! - a write to such a node: its error, so the caller knows the block is not stored.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::{KeyDigest, PhysicalKey};
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::shard::{ClusterView, FenceRefusal, NodeId, NotAdmitting, Placement};
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchGet, BatchPut, Committed, FullPolicy, Get, Implementation,
    Invalidate, Located, Lookup, MissReason, Put, Reclaimed, Reservation, Reserve, Retirement,
    Store, StoreError, StoreInfo, StoreStats,
};

use crate::coordinator::{ClusterError, Coordinator, EtcdConfig};
use crate::hot::{HotKeys, ReplicaPolicy};

/// Times one request is sent again after a node refused the client's view.
pub const ROUTE_ATTEMPTS_MAX: usize = 3;
/// Reservations (reserve, then write and commit) open at once through one client.
pub const RESERVATIONS_MAX: usize = 4_096;

/// How to reach a cluster.
#[derive(Debug, Clone)]
pub struct ClusterClientConfig {
    pub etcd: EtcdConfig,
    /// Every node's connection settings (tenant, credentials, deadlines); the address is each
    /// member's own.
    pub client: ClientConfig,
    pub poll_ms: u64,
    /// When a block read often enough gets an extra copy on its second choice; none: never.
    pub replicate: Option<ReplicaPolicy>,
}

impl ClusterClientConfig {
    /// The view polled every [`POLL_MS_DEFAULT`](crate::POLL_MS_DEFAULT) ms, no extra copies.
    pub fn new(etcd: EtcdConfig, client: ClientConfig) -> Self {
        Self { etcd, client, poll_ms: crate::POLL_MS_DEFAULT, replicate: None }
    }
}

/// What a client did as the cluster moved, for tests and operators.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoutingStats {
    /// Views read that were newer than the one held.
    pub views: u64,
    /// Requests a node refused for the client's view (sent again after a refresh).
    pub refused: u64,
    /// Reads answered as misses because the owner was behind, unreachable or failing.
    pub unreachable_misses: u64,
    /// Extra copies of hot blocks made on their second choice.
    pub copies: u64,
    /// Reads served by such a copy.
    pub copy_hits: u64,
}

#[derive(Debug, Default)]
struct Counters {
    views: AtomicU64,
    refused: AtomicU64,
    unreachable_misses: AtomicU64,
    copies: AtomicU64,
    copy_hits: AtomicU64,
}

/// One view, with a connection pool per member.
#[derive(Debug)]
struct Routing {
    view: ClusterView,
    placement: Placement,
    nodes: HashMap<NodeId, Arc<TcpStore>>,
}

/// A store over the members of a cluster (see the module documentation).
#[derive(Debug)]
pub struct ClusterClient {
    shared: Arc<Shared>,
    poller: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    coordinator: Coordinator,
    template: ClientConfig,
    routing: RwLock<Arc<Routing>>,
    /// Serialises refreshes, so that a burst of refusals reads the view once.
    refreshing: Mutex<()>,
    reservations: Mutex<HashMap<(RegionId, Epoch), NodeId>>,
    counters: Counters,
    stop: AtomicBool,
    hot: Option<HotKeys>,
}

/// Whether a node refused the request for the client's view: read the view, send again.
fn refused_view(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Fenced(
            FenceRefusal::StaleEpoch { .. } | FenceRefusal::NotAdmitting(NotAdmitting::NotOwner)
        )
    )
}

fn no_member(operation: &'static str) -> StoreError {
    StoreError::Backend {
        operation,
        detail: "the cluster view lists no member".into(),
        retirement: Retirement::Retired,
    }
}

fn resolve(address: &str) -> Option<SocketAddr> {
    address.to_socket_addrs().ok()?.next()
}

impl ClusterClient {
    /// Reads the view (failing when etcd does not answer) and starts polling it.
    pub fn connect(config: ClusterClientConfig) -> Result<Self, ClusterError> {
        let coordinator = Coordinator::connect(config.etcd)?;
        let (view, _) = coordinator.view()?;
        let shared = Arc::new(Shared {
            coordinator,
            template: config.client,
            routing: RwLock::new(Arc::new(Routing {
                view: ClusterView::default(),
                placement: Placement::default(),
                nodes: HashMap::new(),
            })),
            refreshing: Mutex::new(()),
            reservations: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            hot: config.replicate.map(HotKeys::new),
        });
        shared.install(view);
        let poll = Duration::from_millis(config.poll_ms.max(crate::POLL_MS_MIN));
        let poller = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("gpucache-view".into())
            .spawn(move || {
                while !poller.stop.load(Ordering::Acquire) {
                    let _ = poller.refresh();
                    std::thread::park_timeout(poll);
                }
            })
            .map_err(ClusterError::Runtime)?;
        Ok(Self { shared, poller: Some(thread) })
    }

    /// The view requests are routed by now.
    pub fn view(&self) -> ClusterView {
        self.shared.routing().view.clone()
    }

    /// Reads the view now; returns the one in force afterwards.
    pub fn refresh(&self) -> Result<ClusterView, ClusterError> {
        self.shared.refresh()?;
        Ok(self.view())
    }

    /// The member that owns `key` under the current view.
    pub fn owner(&self, key: &PhysicalKey) -> Option<NodeId> {
        self.shared.routing().placement.owner(&key.digest())
    }

    pub fn stats(&self) -> RoutingStats {
        let c = &self.shared.counters;
        RoutingStats {
            views: c.views.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            unreachable_misses: c.unreachable_misses.load(Ordering::Relaxed),
            copies: c.copies.load(Ordering::Relaxed),
            copy_hits: c.copy_hits.load(Ordering::Relaxed),
        }
    }
}

impl Drop for ClusterClient {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.poller.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Shared {
    fn routing(&self) -> Arc<Routing> {
        Arc::clone(&self.routing.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn refresh(&self) -> Result<(), ClusterError> {
        self.refresh_after(None)
    }

    /// Reads the view again, unless a newer view than `seen` (the one a refused request was
    /// routed by) was installed meanwhile: a burst of refusals reads the view once.
    fn refresh_after(&self, seen: Option<u64>) -> Result<(), ClusterError> {
        let _one = self.refreshing.lock().unwrap_or_else(|e| e.into_inner());
        if seen.is_some_and(|seen| self.routing().view.epoch > seen) {
            return Ok(());
        }
        let (view, _) = self.coordinator.view()?;
        self.install(view);
        Ok(())
    }

    /// Routes by `view` from now on, when it is newer: members whose address is unchanged
    /// keep their connections (saying the new epoch from their next request on).
    fn install(&self, view: ClusterView) {
        let old = self.routing();
        if view.epoch <= old.view.epoch && !old.nodes.is_empty() {
            return;
        }
        let mut nodes = HashMap::with_capacity(view.members.len());
        for m in &view.members {
            let kept = old
                .view
                .member(m.node)
                .filter(|o| o.address == m.address)
                .and_then(|_| old.nodes.get(&m.node));
            let store = match kept {
                Some(s) => Arc::clone(s),
                None => {
                    let Some(addr) = resolve(&m.address) else {
                        tracing::warn!(node = m.node.0, address = %m.address, "member address does not resolve");
                        continue;
                    };
                    let mut config = self.template.clone();
                    config.addr = addr;
                    Arc::new(TcpStore::new(config))
                }
            };
            store.set_cluster_epoch(view.epoch);
            nodes.insert(m.node, store);
        }
        let placement = view.placement();
        *self.routing.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Routing { view, placement, nodes });
        self.counters.views.fetch_add(1, Ordering::Relaxed);
    }

    /// The store of `key`'s second choice, where a hot block's copy goes.
    fn second_for(routing: &Routing, key: &KeyDigest) -> Option<Arc<TcpStore>> {
        let node = *routing.placement.choices(key, 2).get(1)?;
        routing.nodes.get(&node).cloned()
    }

    /// Makes a copy of a hot block on its second choice under `routing`'s view, from bytes
    /// its owner just served. A copy that cannot be made is no loss: the next read tries again.
    fn copy_hot(&self, routing: &Routing, caller: &Caller, key: &PhysicalKey, bytes: &[u8]) {
        let (Some(hot), digest) = (&self.hot, key.digest()) else { return };
        let Some(second) = Self::second_for(routing, &digest) else { return };
        if let Ok(Put::Committed(_) | Put::AlreadyCommitted) = second.put(caller, key, bytes, None)
        {
            hot.copied(digest, routing.view.epoch);
            self.counters.copies.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drops the extra copy of `key`, if extra copies are made at all (best effort: a copy
    /// left behind lives only until the next view).
    fn drop_copy(&self, caller: &Caller, key: &PhysicalKey) {
        let Some(hot) = &self.hot else { return };
        let digest = key.digest();
        if let Some(second) = Self::second_for(&self.routing(), &digest) {
            let _ = second.invalidate(caller, key);
        }
        hot.lost(&digest);
    }

    /// Serves a read of a hot block from its copy when it is the copy's turn; a miss there
    /// (or any failure) leaves the read to the owner.
    fn read_copy(
        &self,
        routing: &Routing,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Option<Get> {
        let hot = self.hot.as_ref()?;
        let digest = key.digest();
        if !hot.to_copy(&digest, routing.view.epoch) {
            return None;
        }
        match Self::second_for(routing, &digest)?.get_into(caller, key, dst) {
            Ok(hit @ Get::Hit { .. }) => {
                self.counters.copy_hits.fetch_add(1, Ordering::Relaxed);
                Some(hit)
            }
            _ => {
                hot.lost(&digest);
                None
            }
        }
    }

    fn store_for(&self, routing: &Routing, key: &PhysicalKey) -> Option<(NodeId, Arc<TcpStore>)> {
        let node = routing.placement.owner(&key.digest())?;
        routing.nodes.get(&node).map(|s| (node, Arc::clone(s)))
    }

    /// One keyed call, sent again after a refresh when a node refuses the client's view.
    fn keyed<T>(
        &self,
        key: &PhysicalKey,
        operation: &'static str,
        call: impl Fn(NodeId, &TcpStore) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut last = no_member(operation);
        for _ in 0..ROUTE_ATTEMPTS_MAX {
            let routing = self.routing();
            let Some((node, store)) = self.store_for(&routing, key) else { return Err(last) };
            match call(node, &store) {
                Err(e) if refused_view(&e) => {
                    self.counters.refused.fetch_add(1, Ordering::Relaxed);
                    last = e;
                    let _ = self.refresh_after(Some(routing.view.epoch));
                }
                other => return other,
            }
        }
        Err(last)
    }

    /// A read's failure as the caller sees it: a node behind, unreachable or failing is a miss.
    fn read_miss<T>(&self, answer: Result<T, StoreError>, miss: T) -> Result<T, StoreError> {
        match answer {
            Err(e) if matches!(e, StoreError::Fenced(_)) || e.is_backend_failure() => {
                self.counters.unreachable_misses.fetch_add(1, Ordering::Relaxed);
                Ok(miss)
            }
            other => other,
        }
    }

    /// A batch over the members: `run` per member with the indices of its items (in
    /// parallel when there are several), again for the items refused for the view, after a
    /// refresh.
    fn batch<T: Send>(
        &self,
        keys: &[&PhysicalKey],
        operation: &'static str,
        run: impl Fn(&TcpStore, &[usize]) -> BatchAnswers<T> + Sync,
    ) -> BatchAnswers<T> {
        let mut answers: Vec<Option<Result<T, StoreError>>> = keys.iter().map(|_| None).collect();
        for attempt in 0..ROUTE_ATTEMPTS_MAX {
            let routing = self.routing();
            let pending: Vec<usize> = (0..keys.len()).filter(|&i| answers[i].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let mut parts: HashMap<NodeId, Vec<usize>> = HashMap::new();
            for &i in &pending {
                match routing.placement.owner(&keys[i].digest()) {
                    Some(node) if routing.nodes.contains_key(&node) => {
                        parts.entry(node).or_default().push(i)
                    }
                    _ => answers[i] = Some(Err(no_member(operation))),
                }
            }
            let results = run_parts(&routing, parts, &run);
            let mut refused = false;
            for (indices, got) in results {
                for (i, answer) in indices.into_iter().zip(got) {
                    if let Err(e) = &answer
                        && refused_view(e)
                        && attempt + 1 < ROUTE_ATTEMPTS_MAX
                    {
                        refused = true;
                        continue;
                    }
                    answers[i] = Some(answer);
                }
            }
            if !refused {
                break;
            }
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            let _ = self.refresh_after(Some(routing.view.epoch));
        }
        answers.into_iter().map(|a| a.unwrap_or_else(|| Err(no_member(operation)))).collect()
    }
}

/// Runs each member's part, in parallel when there are several.
fn run_parts<T: Send>(
    routing: &Routing,
    parts: HashMap<NodeId, Vec<usize>>,
    run: &(impl Fn(&TcpStore, &[usize]) -> BatchAnswers<T> + Sync),
) -> Vec<(Vec<usize>, BatchAnswers<T>)> {
    let mut parts: Vec<(Arc<TcpStore>, Vec<usize>)> =
        parts.into_iter().map(|(node, idx)| (Arc::clone(&routing.nodes[&node]), idx)).collect();
    if parts.len() == 1 {
        let (store, idx) = parts.pop().expect("one part");
        let got = run(&store, &idx);
        return vec![(idx, got)];
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|(store, idx)| {
                s.spawn(move || {
                    let got = run(&store, &idx);
                    (idx, got)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a batch part panicked")).collect()
    })
}

impl Store for ClusterClient {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            name: "cluster",
            implementation: Implementation::Real,
            failures_retire: true,
            full_policy: FullPolicy::Evict,
        }
    }

    /// The epoch of the view requests are routed by.
    fn epoch(&self) -> Epoch {
        Epoch(self.shared.routing().view.epoch)
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        let s = &self.shared;
        s.read_miss(
            s.keyed(key, "lookup", |_, n| n.lookup(caller, key)),
            Lookup::Miss(MissReason::Absent),
        )
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let s = &self.shared;
        let routing = s.routing();
        if let Some(hit) = s.read_copy(&routing, caller, key, dst) {
            return Ok(hit);
        }
        let dst = Mutex::new(dst);
        let answer = s.keyed(key, "get", |_, n| {
            let mut dst = dst.lock().unwrap_or_else(|e| e.into_inner());
            n.get_into(caller, key, &mut dst)
        });
        let answer = s.read_miss(answer, Get::Miss(MissReason::Absent));
        if let (Some(hot), Ok(Get::Hit { len, .. })) = (&s.hot, &answer)
            && hot.read(key.digest(), routing.view.epoch)
        {
            let dst = dst.into_inner().unwrap_or_else(|e| e.into_inner());
            let len = usize::try_from(*len).unwrap_or(usize::MAX).min(dst.len());
            s.copy_hot(&routing, caller, key, &dst[..len]);
        }
        answer
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        let s = &self.shared;
        s.keyed(key, "reserve", |node, n| {
            let answer = n.reserve(caller, key, len, request)?;
            let Reserve::Reserved(r) = answer else { return Ok(answer) };
            let mut open = s.reservations.lock().unwrap_or_else(|e| e.into_inner());
            if open.len() >= RESERVATIONS_MAX {
                drop(open);
                let _ = n.abort(caller, r, Retirement::Retired);
                return Err(StoreError::Backend {
                    operation: "reserve",
                    detail: format!("{RESERVATIONS_MAX} reservations are open through this client"),
                    retirement: Retirement::Retired,
                });
            }
            open.insert((r.region, r.epoch), node);
            drop(open);
            Ok(Reserve::Reserved(r))
        })
    }

    fn write(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        self.reserved(reservation, false)?.write(caller, reservation, offset, src)
    }

    fn commit(&self, caller: &Caller, reservation: &Reservation) -> Result<Committed, StoreError> {
        self.reserved(reservation, true)?.commit(caller, reservation)
    }

    fn abort(
        &self,
        caller: &Caller,
        reservation: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        self.reserved(&reservation, true)?.abort(caller, reservation, outcome)
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        self.shared.keyed(key, "put", |_, n| n.put(caller, key, src, request))
    }

    /// Invalidates the owner's block, and any extra copy this client made of it.
    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let s = &self.shared;
        let answer = s.keyed(key, "invalidate", |_, n| n.invalidate(caller, key));
        s.drop_copy(caller, key);
        answer
    }

    /// Every member's leases.
    fn expire_leases(&self) -> Result<usize, StoreError> {
        let routing = self.shared.routing();
        routing.nodes.values().map(|n| n.expire_leases()).sum()
    }

    fn attest_drained(&self, _caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        Err(per_node("attest_drained", format!("region {region}")))
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        Err(per_node("bump_epoch", "the fencing epoch"))
    }

    fn reclaim_fenced(&self, _epoch: Epoch) -> Result<usize, StoreError> {
        Err(per_node("reclaim_fenced", "fenced regions"))
    }

    /// The members' counters added up (a member that does not answer adds nothing).
    fn stats(&self) -> StoreStats {
        let routing = self.shared.routing();
        let mut total = StoreStats::default();
        for n in routing.nodes.values() {
            let s = n.stats();
            total.committed_blocks += s.committed_blocks;
            total.evictions += s.evictions;
            total.usage.retained_bytes += s.usage.retained_bytes;
        }
        total
    }

    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        let s = &self.shared;
        s.batch(keys, "lookup", |n, idx| {
            let part: Vec<&PhysicalKey> = idx.iter().map(|&i| keys[i]).collect();
            n.lookup_batch(caller, &part)
        })
        .into_iter()
        .map(|a| s.read_miss(a, Lookup::Miss(MissReason::Absent)))
        .collect()
    }

    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        let s = &self.shared;
        let miss = || Located { lookup: Lookup::Miss(MissReason::Absent), tier: None };
        s.batch(keys, "locate", |n, idx| {
            let part: Vec<&PhysicalKey> = idx.iter().map(|&i| keys[i]).collect();
            n.locate(caller, &part)
        })
        .into_iter()
        .map(|a| s.read_miss(a, miss()))
        .collect()
    }

    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        if self.shared.hot.is_some() {
            return self.get_batch_hot(caller, items);
        }
        self.get_batch_owners(caller, items)
    }

    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        let keys: Vec<&PhysicalKey> = items.iter().map(|i| i.key).collect();
        self.shared.batch(&keys, "put", |n, idx| {
            let part: Vec<BatchPut<'_>> = idx.iter().map(|&i| items[i]).collect();
            n.put_batch(caller, &part)
        })
    }

    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        sums: &[Checksum],
    ) -> BatchAnswers<Put> {
        let keys: Vec<&PhysicalKey> = items.iter().map(|i| i.key).collect();
        self.shared.batch(&keys, "put", |n, idx| {
            let part: Vec<BatchPut<'_>> = idx.iter().map(|&i| items[i]).collect();
            let part_sums: Vec<Checksum> = idx.iter().map(|&i| sums[i]).collect();
            n.put_batch_checked(caller, &part, &part_sums)
        })
    }

    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        let s = &self.shared;
        let answers = s.batch(keys, "invalidate", |n, idx| {
            let part: Vec<&PhysicalKey> = idx.iter().map(|&i| keys[i]).collect();
            n.invalidate_batch(caller, &part)
        });
        for key in keys {
            s.drop_copy(caller, key);
        }
        answers
    }
}

impl ClusterClient {
    /// A batch GET from each block's owner, split per member.
    fn get_batch_owners(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let s = &self.shared;
        let keys: Vec<&PhysicalKey> = items.iter().map(|i| i.key).collect();
        // Each item's buffer goes to exactly one part; the lock only hands it over.
        let slots: Vec<Mutex<Option<&mut [u8]>>> =
            items.iter_mut().map(|i| Mutex::new(Some(&mut *i.dst))).collect();
        s.batch(&keys, "get", |n, idx| {
            let mut taken: Vec<(usize, &mut [u8])> = idx
                .iter()
                .filter_map(|&i| {
                    slots[i].lock().unwrap_or_else(|e| e.into_inner()).take().map(|d| (i, d))
                })
                .collect();
            let mut part: Vec<BatchGet<'_>> =
                taken.iter_mut().map(|(i, dst)| BatchGet { key: keys[*i], dst }).collect();
            let got = n.get_batch(caller, &mut part);
            drop(part);
            for (i, dst) in taken {
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(dst);
            }
            got
        })
        .into_iter()
        .map(|a| s.read_miss(a, Get::Miss(MissReason::Absent)))
        .collect()
    }

    /// A batch GET with extra copies: each hot block whose copy's turn it is is read from its
    /// copy first (a miss there is asked of the owner with the rest of the batch), and blocks
    /// that became hot get their copy from the bytes just read.
    fn get_batch_hot(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let s = &self.shared;
        let routing = s.routing();
        let mut answers: Vec<Option<Result<Get, StoreError>>> =
            items.iter().map(|_| None).collect();
        for (i, item) in items.iter_mut().enumerate() {
            if let Some(hit) = s.read_copy(&routing, caller, item.key, item.dst) {
                answers[i] = Some(Ok(hit));
            }
        }
        let rest: Vec<usize> = (0..items.len()).filter(|&i| answers[i].is_none()).collect();
        if !rest.is_empty() {
            let mut part: Vec<BatchGet<'_>> = items
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| answers[*i].is_none())
                .map(|(_, item)| BatchGet { key: item.key, dst: &mut *item.dst })
                .collect();
            let got = self.get_batch_owners(caller, &mut part);
            drop(part);
            for (&i, answer) in rest.iter().zip(got) {
                answers[i] = Some(answer);
            }
        }
        let hot = s.hot.as_ref().expect("called with copies on");
        for &i in &rest {
            if let Some(Ok(Get::Hit { len, .. })) = &answers[i]
                && hot.read(items[i].key.digest(), routing.view.epoch)
            {
                let len = usize::try_from(*len).unwrap_or(usize::MAX).min(items[i].dst.len());
                s.copy_hot(&routing, caller, items[i].key, &items[i].dst[..len]);
            }
        }
        answers.into_iter().map(|a| a.unwrap_or(Ok(Get::Miss(MissReason::Absent)))).collect()
    }

    /// The member a reservation was made on; `done` forgets it (commit, abort).
    fn reserved(&self, r: &Reservation, done: bool) -> Result<Arc<TcpStore>, StoreError> {
        let s = &self.shared;
        let mut open = s.reservations.lock().unwrap_or_else(|e| e.into_inner());
        let node = if done {
            open.remove(&(r.region, r.epoch))
        } else {
            open.get(&(r.region, r.epoch)).copied()
        };
        let node = node.ok_or(StoreError::UnknownReservation { region: r.region })?;
        drop(open);
        s.routing().nodes.get(&node).cloned().ok_or_else(|| StoreError::Backend {
            operation: "reservation",
            detail: format!("node {} left the view while the reservation was open", node.0),
            retirement: Retirement::Retired,
        })
    }
}

fn per_node(operation: &'static str, what: impl std::fmt::Display) -> StoreError {
    StoreError::Backend {
        operation,
        detail: format!("{what} belongs to one node: ask that node, not the cluster client"),
        retirement: Retirement::Retired,
    }
}
