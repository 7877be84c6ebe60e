//! A node of a cluster: the fence every request passes, and the store layer that keeps the
//! node's blocks to the keys it owns.
//!
//! [`ClusterNode`] holds the node's [`NodeFence`] and is told by the node's registration (in
//! `gpucache-cluster`) of every newer view and of the registration lapsing or holding again.
//! The native listener checks each request's connection epoch against it
//! ([`ClusterNode::check`]); [`FencedStore`] admits a block only for a key the node owns now,
//! and remembers it, so that a view which moves the key away drops the block here.
//!
//! Changing the view takes the fence's write lock, so no request is half-served across a
//! change: an admission in progress under the old view finishes first, and the blocks the new
//! view moved away are dropped before any request is served under it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use gpucache_cluster::NodeEvents;
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::shard::{ClusterView, FenceRefusal, NodeFence, NodeId, NotAdmitting};
use gpucache_dataplane::store::{
    BatchAnswers, BatchGet, BatchPut, Get, GetTo, GotOne, Invalidate, Located, Lookup, MissReason,
    Put, Reserve, Store, StoreError, StoreLayer,
};
use gpucache_wire::{NodeStatus, Op};

use crate::fills::Fills;

/// What a node has done as a member, for its metrics.
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Requests refused for an older epoch.
    pub stale_epoch: AtomicU64,
    /// Requests refused because this node had not applied the client's epoch yet.
    pub node_behind: AtomicU64,
    /// Admissions refused (lapsed, draining, not a member, not the owner, table full).
    pub not_admitting: AtomicU64,
    /// Blocks dropped because a newer view moved their key to another member.
    pub moved_away: AtomicU64,
    /// Views applied.
    pub views: AtomicU64,
    /// Extra copies of hot blocks admitted (this node their second choice).
    pub replicas: AtomicU64,
}

/// One node's standing in its cluster (see the module documentation).
pub struct ClusterNode {
    fence: RwLock<NodeFence<PhysicalKey>>,
    /// The node's fills, fenced on every view applied.
    fills: Arc<Fills>,
    /// The store under the fence, where moved blocks are dropped.
    store: Arc<dyn Store>,
    counters: ClusterCounters,
}

/// Whether an op is checked against the view, and whether it admits a block.
fn fenced(op: Op) -> Option<bool> {
    match op {
        Op::Lookup
        | Op::Get
        | Op::Locate
        | Op::GetShared
        | Op::StageGet
        | Op::Invalidate
        | Op::FillBegin => Some(false),
        Op::Put
        | Op::Reserve
        | Op::Write
        | Op::Commit
        | Op::PutShared
        | Op::ReservePut
        | Op::CommitPut => Some(true),
        _ => None,
    }
}

impl ClusterNode {
    /// Node `node` over `store` (the store the fence's layer wraps), remembering up to
    /// `held_max` admitted keys. It admits nothing until its registration holds.
    pub fn new(node: NodeId, held_max: usize, store: Arc<dyn Store>, fills: Arc<Fills>) -> Self {
        Self {
            fence: RwLock::new(NodeFence::new(node, held_max)),
            fills,
            store,
            counters: ClusterCounters::default(),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, NodeFence<PhysicalKey>> {
        self.fence.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn counters(&self) -> &ClusterCounters {
        &self.counters
    }

    pub fn view(&self) -> ClusterView {
        self.read().view().clone()
    }

    pub fn held_keys(&self) -> usize {
        self.read().held_len()
    }

    /// What CLUSTER answers.
    pub fn status(&self) -> NodeStatus {
        let fence = self.read();
        NodeStatus {
            node: fence.node(),
            epoch: fence.epoch(),
            not_admitting: fence.admitting().err(),
        }
    }

    /// Checks a request of `op` from a connection that routes by epoch `sent`; ops that touch
    /// no key pass.
    pub fn check(&self, op: Op, sent: u64) -> Result<(), FenceRefusal> {
        let Some(admits) = fenced(op) else { return Ok(()) };
        let refused = self.read().check(sent, admits);
        if let Err(r) = &refused {
            let counter = match r {
                FenceRefusal::StaleEpoch { .. } => &self.counters.stale_epoch,
                FenceRefusal::NodeBehind { .. } => &self.counters.node_behind,
                FenceRefusal::NotAdmitting(_) => &self.counters.not_admitting,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        refused
    }

    /// Whether the node may admit `key` now (it owns the key under its view), remembering
    /// the key if so, so that a view change that moves it drops the block. Called under the
    /// fence's read lock, held until the admission is [settled](Self::settle).
    fn may_admit(
        &self,
        fence: &NodeFence<PhysicalKey>,
        key: &PhysicalKey,
    ) -> Result<(), StoreError> {
        let digest = key.digest();
        // A PUT of a key whose second choice this node is, is a hot block's extra copy.
        let replica = !fence.owns(&digest) && fence.seconds(&digest);
        let refusal = match fence.admitting() {
            Err(r) => Some(r),
            Ok(()) if !fence.owns(&digest) && !replica => Some(NotAdmitting::NotOwner),
            Ok(()) if !replica && !fence.servable(&digest) => Some(NotAdmitting::Settling),
            Ok(()) => match fence.record(digest, key) {
                Ok(()) => None,
                Err(NotAdmitting::KeysFull) => {
                    // Forget the keys the store no longer holds (evicted), then try again.
                    fence.prune(|k| present(&*self.store, k));
                    fence.record(digest, key).err()
                }
                Err(r) => Some(r),
            },
        };
        match refusal {
            None => {
                if replica {
                    fence.record_replica(digest);
                    self.counters.replicas.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
            Some(r) => {
                self.counters.not_admitting.fetch_add(1, Ordering::Relaxed);
                Err(StoreError::Fenced(FenceRefusal::NotAdmitting(r)))
            }
        }
    }

    /// After an admission: a key that was not stored (and is not held otherwise) is
    /// forgotten again.
    fn settle(&self, fence: &NodeFence<PhysicalKey>, key: &PhysicalKey, stored: bool) {
        if !stored && !present(&*self.store, key) {
            fence.forget(&key.digest());
        }
    }

    /// One admission of `key` by `admit`, under the fence's read lock.
    fn admit<T>(
        &self,
        key: &PhysicalKey,
        admit: impl FnOnce() -> Result<T, StoreError>,
        stored: impl Fn(&T) -> bool,
    ) -> Result<T, StoreError> {
        let fence = self.read();
        self.may_admit(&fence, key)?;
        let answer = admit();
        self.settle(&fence, key, answer.as_ref().is_ok_and(stored));
        answer
    }
}

impl ClusterNode {
    /// The indices of `keys` this node may serve now, in order.
    fn servable_of(&self, keys: &[&PhysicalKey]) -> Vec<usize> {
        let fence = self.read();
        (0..keys.len()).filter(|&i| fence.servable(&keys[i].digest())).collect()
    }
}

/// A batch's answers: the inner store's for the `served` indices (in order), `miss()` for the
/// others.
fn spread<T>(
    n: usize,
    served: &[usize],
    answers: BatchAnswers<T>,
    miss: impl Fn() -> Result<T, StoreError>,
) -> BatchAnswers<T> {
    let mut answers = answers.into_iter();
    let mut next = served.iter().peekable();
    (0..n)
        .map(|i| {
            if next.peek() == Some(&&i) {
                next.next();
                answers.next().unwrap_or_else(&miss)
            } else {
                miss()
            }
        })
        .collect()
}

/// Whether `store` holds `key` (as its owner tenant sees it).
fn present(store: &dyn Store, key: &PhysicalKey) -> bool {
    matches!(store.lookup(&owner_of(key), key), Ok(Lookup::Hit { .. }))
}

/// The key's own tenant with every right: the node acting on its own blocks.
fn owner_of(key: &PhysicalKey) -> Caller {
    Caller::new(key.tenant().clone(), Rights::ALL)
}

impl NodeEvents for ClusterNode {
    fn view(&self, view: &ClusterView) {
        let mut fence = self.fence.write().unwrap_or_else(|e| e.into_inner());
        let epoch = view.epoch;
        let lives = |v: &ClusterView| -> Vec<(NodeId, u64)> {
            v.members.iter().map(|m| (m.node, m.node_epoch)).collect()
        };
        let members_changed = lives(fence.view()) != lives(view);
        let draining = view
            .member(fence.node())
            .is_some_and(|m| m.state == gpucache_dataplane::shard::MemberState::Draining);
        let moved = fence.apply(view.clone());
        let mut dropped = 0u64;
        for key in &moved {
            // A writer holding the key (Busy) commits under the old view's ownership check;
            // its block is then one this node no longer owns, which lookups still find. It is
            // dropped again on the next view; until then the client never routes here for it.
            if let Ok(Invalidate::Removed) = self.store.invalidate(&owner_of(key), key) {
                dropped += 1;
            }
        }
        drop(fence);
        if members_changed {
            self.fills.fence(Epoch(epoch));
        }
        self.fills.drain(draining);
        self.counters.moved_away.fetch_add(dropped, Ordering::Relaxed);
        self.counters.views.fetch_add(1, Ordering::Relaxed);
        tracing::info!(epoch, moved = moved.len(), dropped, "applied a cluster view");
    }

    fn settled(&self, epoch: u64) {
        self.fence.write().unwrap_or_else(|e| e.into_inner()).settle(epoch);
    }

    fn registration(&self, node_epoch: Option<u64>) {
        let mut fence = self.fence.write().unwrap_or_else(|e| e.into_inner());
        match node_epoch {
            Some(_) => fence.registered(),
            None => fence.lose_registration(),
        }
    }
}

/// The store a node of a cluster serves: admissions pass [`ClusterNode`]'s ownership check.
pub struct FencedStore {
    inner: Arc<dyn Store>,
    node: Arc<ClusterNode>,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("fence", &self.fence)
            .field("store", &self.store.info().name)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for FencedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedStore").field("node", &self.node).finish_non_exhaustive()
    }
}

impl FencedStore {
    pub fn new(inner: Arc<dyn Store>, node: Arc<ClusterNode>) -> Self {
        Self { inner, node }
    }
}

fn reserved(r: &Reserve) -> bool {
    matches!(r, Reserve::Reserved(_) | Reserve::AlreadyCommitted)
}

fn put_stored(p: &Put) -> bool {
    matches!(p, Put::Committed(_) | Put::AlreadyCommitted)
}

impl FencedStore {
    /// A batch PUT: the items the node may admit go to `run` as one batch (with their indices
    /// in `items`), under one hold of the fence; the others are answered with the refusal.
    fn admit_batch(
        &self,
        items: &[BatchPut<'_>],
        run: impl FnOnce(&[BatchPut<'_>], &[usize]) -> BatchAnswers<Put>,
    ) -> BatchAnswers<Put> {
        let node = &*self.node;
        let fence = node.read();
        let mut answers: Vec<Option<Result<Put, StoreError>>> = Vec::with_capacity(items.len());
        let mut chosen = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match node.may_admit(&fence, item.key) {
                Ok(()) => {
                    chosen.push(i);
                    answers.push(None);
                }
                Err(e) => answers.push(Some(Err(e))),
            }
        }
        let batch: Vec<BatchPut<'_>> = chosen.iter().map(|&i| items[i]).collect();
        let got = run(&batch, &chosen);
        for (&i, answer) in chosen.iter().zip(got) {
            node.settle(&fence, items[i].key, answer.as_ref().is_ok_and(put_stored));
            answers[i] = Some(answer);
        }
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or(Err(StoreError::Backend {
                    operation: "put",
                    detail: "the store answered fewer items than it was given".into(),
                    retirement: gpucache_dataplane::store::Retirement::Retired,
                }))
            })
            .collect()
    }
}

impl StoreLayer for FencedStore {
    type Inner = dyn Store;

    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }
}

impl Store for FencedStore {
    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        self.node.admit(key, || self.inner.reserve(caller, key, len, request), reserved)
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        self.node.admit(key, || self.inner.put(caller, key, src, request), put_stored)
    }

    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        self.admit_batch(items, |batch, _| self.inner.put_batch(caller, batch))
    }

    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        sums: &[Checksum],
    ) -> BatchAnswers<Put> {
        self.admit_batch(items, |batch, chosen| {
            let sums: Vec<Checksum> = chosen.iter().map(|&i| sums[i]).collect();
            self.inner.put_batch_checked(caller, batch, &sums)
        })
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        if !self.node.read().servable(&key.digest()) {
            return Ok(Lookup::Miss(MissReason::Absent));
        }
        self.inner.lookup(caller, key)
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        if !self.node.read().servable(&key.digest()) {
            return Ok(Get::Miss(MissReason::Absent));
        }
        self.inner.get_into(caller, key, dst)
    }

    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        if !self.node.read().servable(&key.digest()) {
            return Ok(GotOne::copied(Get::Miss(MissReason::Absent)));
        }
        self.inner.get_one(caller, key, capacity, to)
    }

    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        let served = self.node.servable_of(keys);
        let part: Vec<&PhysicalKey> = served.iter().map(|&i| keys[i]).collect();
        let miss = || Ok(Lookup::Miss(MissReason::Absent));
        spread(keys.len(), &served, self.inner.lookup_batch(caller, &part), miss)
    }

    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        let served = self.node.servable_of(keys);
        let part: Vec<&PhysicalKey> = served.iter().map(|&i| keys[i]).collect();
        let miss = || Ok(Located { lookup: Lookup::Miss(MissReason::Absent), tier: None });
        spread(keys.len(), &served, self.inner.locate(caller, &part), miss)
    }

    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let keys: Vec<&PhysicalKey> = items.iter().map(|i| i.key).collect();
        let served = self.node.servable_of(&keys);
        if served.len() == items.len() {
            return self.inner.get_batch(caller, items);
        }
        let mut part: Vec<BatchGet<'_>> = items
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| served.binary_search(i).is_ok())
            .map(|(_, item)| BatchGet { key: item.key, dst: &mut *item.dst })
            .collect();
        let got = self.inner.get_batch(caller, &mut part);
        spread(keys.len(), &served, got, || Ok(Get::Miss(MissReason::Absent)))
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let answer = self.inner.invalidate(caller, key);
        if let Ok(Invalidate::Removed | Invalidate::Absent) = answer {
            self.node.read().forget(&key.digest());
        }
        answer
    }
    gpucache_dataplane::forward_store!(fences, reports, info, write, commit, abort, scope_keys);
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use gpucache_dataplane::clock::ManualClock;
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::limits::ResourceLimits;
    use gpucache_dataplane::shard::{MemberState, ViewMember};
    use gpucache_dataplane::store::Get;
    use gpucache_dataplane::testing::fixture;
    use gpucache_storage::MemoryStore;

    use super::*;

    fn member(node: u64) -> ViewMember {
        ViewMember {
            node: NodeId(node),
            address: format!("127.0.0.1:{node}"),
            fault_domain: "a".into(),
            capacity: 1 << 30,
            node_epoch: 1,
            state: MemberState::Serving,
        }
    }

    fn node() -> (Arc<ClusterNode>, FencedStore) {
        let (node, store, _) = node_with_fills();
        (node, store)
    }

    fn node_with_fills() -> (Arc<ClusterNode>, FencedStore, Arc<Fills>) {
        let memory: Arc<dyn Store> = Arc::new(
            MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
                .expect("memory store"),
        );
        let fills = Arc::new(Fills::new(Arc::new(ManualClock::default())));
        let node =
            Arc::new(ClusterNode::new(NodeId(1), 1 << 10, Arc::clone(&memory), Arc::clone(&fills)));
        let store = FencedStore::new(memory, Arc::clone(&node));
        (node, store, fills)
    }

    fn keys() -> Vec<PhysicalKey> {
        (0..64u8).map(|i| fixture::key(0, &[i, 7], KvDtype::F16, 16)).collect()
    }

    #[test]
    fn requests_of_another_epoch_are_refused_and_counted() {
        let (node, _) = node();
        NodeEvents::view(&*node, &ClusterView::new(3, [member(1)]));
        assert_eq!(node.check(Op::Get, 3), Ok(()));
        assert_eq!(node.check(Op::Stats, 0), Ok(()), "an op with no key is not fenced");
        assert_eq!(node.check(Op::Get, 2), Err(FenceRefusal::StaleEpoch { sent: 2, current: 3 }));
        assert_eq!(
            node.check(Op::Lookup, 4),
            Err(FenceRefusal::NodeBehind { sent: 4, current: 3 })
        );
        assert_eq!(
            node.check(Op::Put, 3),
            Err(FenceRefusal::NotAdmitting(NotAdmitting::LeaseLost)),
            "not registered yet"
        );
        node.registration(Some(9));
        node.settled(3);
        assert_eq!(node.check(Op::Put, 3), Ok(()));
        let c = node.counters();
        let counts =
            [&c.stale_epoch, &c.node_behind, &c.not_admitting].map(|a| a.load(Ordering::Relaxed));
        assert_eq!(counts, [1, 1, 1]);
        assert!(node.status().not_admitting.is_none());
    }

    #[test]
    fn a_view_that_moves_keys_drops_exactly_those_and_they_come_back_as_misses() {
        let (node, store) = node();
        NodeEvents::view(&*node, &ClusterView::new(1, [member(1)]));
        node.registration(Some(1));
        let caller = fixture::caller(0);
        let keys = keys();
        assert_eq!(
            Store::put(&store, &caller, &keys[0], b"early", None),
            Err(StoreError::Fenced(FenceRefusal::NotAdmitting(NotAdmitting::Settling))),
            "nothing is served before the first view settles"
        );
        node.settled(1);
        for (i, k) in keys.iter().enumerate() {
            let put = Store::put(&store, &caller, k, &fixture::payload(i as u64, 64), None);
            assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
        }
        assert_eq!(node.held_keys(), keys.len());
        // Node 2 joins: the keys it wins move, the others stay.
        let two = ClusterView::new(2, [member(1), member(2)]);
        let moved: HashSet<usize> = (0..keys.len())
            .filter(|&i| two.placement().owner(&keys[i].digest()) == Some(NodeId(2)))
            .collect();
        assert!(!moved.is_empty() && moved.len() < keys.len());
        NodeEvents::view(&*node, &two);
        let mut buf = vec![0u8; 64];
        for (i, k) in keys.iter().enumerate() {
            let got = Store::get_into(&store, &caller, k, &mut buf).expect("get");
            assert_eq!(matches!(got, Get::Hit { .. }), !moved.contains(&i), "key {i}");
        }
        assert_eq!(node.counters().moved_away.load(Ordering::Relaxed), moved.len() as u64);
        // A moved key is node 2's now; with two members this node is its second choice, so a
        // PUT here is taken as a hot block's copy, which the next view drops even though this
        // node then owns the key again.
        let k = &keys[*moved.iter().next().expect("one moved")];
        assert!(matches!(Store::put(&store, &caller, k, b"copy", None), Ok(Put::Committed(_))));
        assert_eq!(node.counters().replicas.load(Ordering::Relaxed), 1);
        // Node 2 leaves: the keys come back to this node as misses, not the old copies; until
        // node 2 has applied that view too they are not served at all (node 2 may still take
        // writes of them under epoch 2), then they are.
        NodeEvents::view(&*node, &ClusterView::new(3, [member(1)]));
        node.settled(2);
        for &i in &moved {
            let got = Store::get_into(&store, &caller, &keys[i], &mut buf).expect("get");
            assert!(matches!(got, Get::Miss(_)), "key {i} came back with its old copy");
        }
        let back = &keys[*moved.iter().next().expect("one moved")];
        let settling = Err(StoreError::Fenced(FenceRefusal::NotAdmitting(NotAdmitting::Settling)));
        assert_eq!(Store::put(&store, &caller, back, b"new", None), settling);
        let kept = (0..keys.len()).find(|i| !moved.contains(i)).expect("one kept");
        let got = Store::get_into(&store, &caller, &keys[kept], &mut buf).expect("get");
        assert!(matches!(got, Get::Hit { .. }), "a key that never moved is served while settling");
        node.settled(3);
        assert!(matches!(Store::put(&store, &caller, back, b"new", None), Ok(Put::Committed(_))));
        let got = Store::get_into(&store, &caller, back, &mut buf).expect("get");
        assert!(matches!(got, Get::Hit { len: 3, .. }), "{got:?}");
    }

    #[test]
    fn a_view_that_skips_epochs_drops_every_key() {
        let (node, store) = node();
        NodeEvents::view(&*node, &ClusterView::new(1, [member(1)]));
        node.registration(Some(1));
        node.settled(1);
        let caller = fixture::caller(0);
        for k in keys().iter().take(8) {
            Store::put(&store, &caller, k, b"block", None).expect("put");
        }
        NodeEvents::view(&*node, &ClusterView::new(5, [member(1)]));
        assert_eq!(node.held_keys(), 0);
        assert_eq!(node.counters().moved_away.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_draining_or_lapsed_node_admits_nothing() {
        let (node, store) = node();
        let mut draining = member(1);
        draining.state = MemberState::Draining;
        NodeEvents::view(&*node, &ClusterView::new(1, [draining, member(2)]));
        node.registration(Some(1));
        node.settled(1);
        let caller = fixture::caller(0);
        let k = keys().into_iter().find(|k| {
            ClusterView::new(1, [member(1), member(2)]).placement().owner(&k.digest())
                == Some(NodeId(1))
        });
        let k = k.expect("a key of node 1");
        let refused = Err(StoreError::Fenced(FenceRefusal::NotAdmitting(NotAdmitting::Draining)));
        assert_eq!(Store::put(&store, &caller, &k, b"x", None), refused);
        NodeEvents::view(&*node, &ClusterView::new(2, [member(1), member(2)]));
        node.settled(2);
        assert!(Store::put(&store, &caller, &k, b"x", None).is_ok());
        node.registration(None);
        let lapsed = Err(StoreError::Fenced(FenceRefusal::NotAdmitting(NotAdmitting::LeaseLost)));
        assert_eq!(Store::put(&store, &caller, &keys()[0], b"y", None), lapsed);
    }

    #[test]
    fn a_hot_blocks_copy_is_taken_on_its_second_choice_and_lives_for_one_view() {
        let (node, store) = node();
        let view = ClusterView::new(1, [member(1), member(2), member(3)]);
        NodeEvents::view(&*node, &view);
        node.registration(Some(1));
        node.settled(1);
        let caller = fixture::caller(0);
        let placement = view.placement();
        let keys = keys();
        let second = keys
            .iter()
            .find(|k| placement.choices(&k.digest(), 2) == [NodeId(2), NodeId(1)])
            .expect("a key whose second choice is node 1");
        let third = keys
            .iter()
            .find(|k| placement.choices(&k.digest(), 3)[2] == NodeId(1))
            .expect("a key whose third choice is node 1");
        assert!(matches!(
            Store::put(&store, &caller, second, b"copy", None),
            Ok(Put::Committed(_))
        ));
        assert_eq!(node.counters().replicas.load(Ordering::Relaxed), 1);
        assert_eq!(
            Store::put(&store, &caller, third, b"x", None),
            Err(StoreError::Fenced(FenceRefusal::NotAdmitting(NotAdmitting::NotOwner))),
            "only the second choice takes a copy"
        );
        let mut buf = [0u8; 8];
        let got = Store::get_into(&store, &caller, second, &mut buf).expect("get");
        assert!(matches!(got, Get::Hit { len: 4, .. }), "{got:?}");
        // The same members at the next epoch: the copy is gone, its key a miss.
        NodeEvents::view(&*node, &ClusterView::new(2, [member(1), member(2), member(3)]));
        node.settled(2);
        let got = Store::get_into(&store, &caller, second, &mut buf).expect("get");
        assert!(matches!(got, Get::Miss(_)), "a copy outlived its view: {got:?}");
    }

    #[test]
    fn a_drain_lets_fills_finish_and_a_change_of_members_fences_them() {
        use gpucache_dataplane::shard::{FillNotice, FillOutcome, FillRefusal, FillStart};
        let (node, _, fills) = node_with_fills();
        NodeEvents::view(&*node, &ClusterView::new(1, [member(1), member(2)]));
        let key = |i: u8| fixture::key(0, &[i], KvDtype::F16, 16).digest();
        let Ok(FillStart::Lead(first)) = fills.begin(key(1), fills.epoch()) else {
            panic!("the first filler leads")
        };
        // Node 2 drains: the members are the same, so the fill goes on.
        let mut draining = member(2);
        draining.state = MemberState::Draining;
        NodeEvents::view(&*node, &ClusterView::new(2, [member(1), draining]));
        assert_eq!(fills.finish(&first, FillOutcome::Stored), FillNotice::Finished);
        // This node drains: new fills are refused, the one in flight finishes.
        let Ok(FillStart::Lead(second)) = fills.begin(key(2), fills.epoch()) else {
            panic!("leads")
        };
        let mut me = member(1);
        me.state = MemberState::Draining;
        NodeEvents::view(&*node, &ClusterView::new(3, [me, member(2)]));
        assert_eq!(fills.begin(key(3), fills.epoch()), Err(FillRefusal::Draining));
        assert_eq!(fills.finish(&second, FillOutcome::Stored), FillNotice::Finished);
        // Rolled back: fills begin again. Then node 2 leaves: the fill in flight is fenced.
        NodeEvents::view(&*node, &ClusterView::new(4, [member(1), member(2)]));
        let Ok(FillStart::Lead(third)) = fills.begin(key(4), fills.epoch()) else {
            panic!("leads again after the rollback")
        };
        NodeEvents::view(&*node, &ClusterView::new(5, [member(1)]));
        assert_eq!(fills.wait(&third.ticket, std::time::Duration::ZERO), FillNotice::Fenced);
        assert_eq!(
            fills.finish(&third, FillOutcome::Stored),
            FillNotice::Fenced,
            "fenced is not success"
        );
        assert_eq!(fills.stats().in_flight, 0, "its credits came back");
    }
}
