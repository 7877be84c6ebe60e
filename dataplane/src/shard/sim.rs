//! A seeded simulation of a whole cluster: a hundred and more nodes, a few clients, one
//! coordinator, and all of the membership churn between them.
//!
//! The simulation runs the real [`Placement`], [`ClusterView`], [`NodeFence`] and
//! [`ShardDirectory`]. Only the network and the clock are made up. The run is one thread that
//! moves in steps of [`STEP_MS`] simulated milliseconds, and every choice it makes comes from
//! one [`SplitMix64`] seeded by [`SimConfig::seed`]. So a seed always replays the same run, and
//! a failure can be reproduced from its seed alone.
//!
//! What is modelled:
//! - The coordinator stands for etcd. It holds the authoritative view, and every membership
//!   change makes the next view (one epoch later) and sends it to every watcher. For stretches
//!   it is unreachable: no membership changes, no views sent, no client refreshes. The data
//!   path keeps running through an outage.
//! - A node is a [`NodeFence`], a [`ShardDirectory`] and a model store (a bounded map from key
//!   to version and bytes). Views reach a node late, each node with its own delay. A slow node
//!   gets them much later and applies only the newest one that has arrived, so it can skip
//!   epochs. When a node applies a view it drops from its store every key the fence hands
//!   back, and fences its directory. A crash loses the store, the fence and the directory; the
//!   node comes back later with a new life and a new registration. A node that loses its lease
//!   admits nothing until it registers again. A node that registers (a new node, a restart, a
//!   new registration after a lost lease) applies the view its registration made before it
//!   admits anything, as the real registration does. A graceful leave is a shutdown: the node
//!   stops, leaves the view and gives its lease up.
//! - Settlement. The coordinator keeps a liveness record per registered life (etcd's
//!   `members/`) and the epoch each life last said it applied (`applied/`). A registered node
//!   publishes its applied epoch whenever it changes; the publication reaches the coordinator
//!   late, with the same per-node delays as views. Every step the coordinator takes the least
//!   applied epoch over the live records (a life that has published nothing counts as 0) and
//!   sends every rise of it to every registered node, again late, where it becomes
//!   [`NodeFence::settle`]. A crashed node's record goes when the coordinator removes it (its
//!   lease's time to live); a node that loses its lease stops admitting first and its record
//!   goes a few steps later, never before ([`SimCheck::Lease`]). A node answers a read of a key
//!   it owns but may not serve yet ([`NodeFence::servable`]) as a miss, and refuses to admit
//!   one ([`NotAdmitting::Settling`]).
//! - A client routes each request by its own view, which also arrives late. It sends that
//!   view's epoch with the request. When a node answers that the epoch is stale, the client
//!   asks the coordinator for the current view and tries again, a bounded number of times.
//!   When a node answers that it is behind, the client takes a miss. A client PUTs a new
//!   version of a key (its bytes follow from the key and the version) or GETs a key. After a
//!   GET miss it begins a fill on the owner's directory. A leader PUTs the block some steps
//!   later and reports to the directory. A joiner polls the directory: finished means GET
//!   again (finished is not a hit), failed means it may fill again, fenced means give up.
//!   A PUT refused as settling is a failed write: no acknowledgement, and no retry.
//!
//! After every step the run checks the rules in [`SimCheck`]. The first broken rule ends the
//! run with a [`SimFailure`] naming the seed, the step and what broke.
//!
//! Every queue and table is bounded by a named constant, and each directory uses a
//! [`CreditPool`] of its own, so that a credit a fill never gave back shows up as a pool that
//! is not full with no fill in flight.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::{self, Write as _};
use std::rc::Rc;

use super::{
    ClusterView, FenceRefusal, FillLease, FillNotice, FillOutcome, FillStart, FillTicket,
    MemberState, NodeFence, NodeId, NotAdmitting, Placement, ShardDirectory, ShardId, ViewMember,
};
use crate::credits::{CreditPool, Credits};
use crate::key::KeyDigest;
use crate::registry::Epoch;
use crate::rng::SplitMix64;

/// What a stale hit's detail says when the node served a copy it should have dropped
/// (under [`SimFaults::skip_drop_on_apply`]).
pub const KEPT_COPY: &str = "served a copy it kept after a view handed the key back";
/// What a stale hit's detail says when the node served a key, or a copy it wrote, before its
/// view had settled (under [`SimFaults::ignore_settlement`]).
pub const UNSETTLED: &str = "served a key before its view had settled";

/// Simulated milliseconds per step.
pub const STEP_MS: u64 = 10;
/// Node slots a run may ever use (the first members plus every new node that joins).
pub const NODES_MAX: usize = 1024;
/// Clients a run may have.
pub const CLIENTS_MAX: usize = 256;
/// Keys clients may touch.
pub const KEYS_MAX: usize = 1 << 16;
/// Key digests the rebalance check follows through every change of the member set. The
/// clients' keys are the first of them, so the check also says which of those a change moved.
pub const SAMPLE_KEYS: usize = 2048;

/// Keys one node's model store holds; a full store evicts before it takes a new key.
const STORE_KEYS_MAX: usize = 256;
/// Keys a node's fence remembers. The fence only remembers keys its store holds, so it can
/// never fill up before the store does.
const HELD_KEYS_MAX: usize = STORE_KEYS_MAX;
/// Views waiting for one receiver; a full inbox drops its oldest view (the receiver will skip
/// that epoch, as a watcher does after its stream is compacted).
const INBOX_MAX: usize = 32;
/// Acknowledged PUTs kept per key for the hit checks.
const ACKS_KEPT: usize = 64;
/// Recent views the coordinator keeps, to explain a failure.
const VIEWS_KEPT: usize = 64;
/// Acknowledgements and views a stale hit's story tells, at most.
const STORY_ACKS: usize = 6;
const STORY_VIEWS: usize = 12;
/// Recent view applies kept per node, to explain a failure.
const APPLIES_KEPT: usize = 8;
/// Times a client refreshes its view and retries one request.
const RETRIES_MAX: usize = 3;
/// Fills a directory keeps in flight.
const FILLS_MAX: usize = 64;
/// Credits each directory's pool holds, and what one fill is charged.
const POOL_CREDITS: Credits = Credits::new(8, 8);
const FILL_COST: Credits = Credits::new(1, 1);
/// A fill's lease. Leaders take 1..=7 steps, so the slowest run out of lease and fail.
const FILL_LEASE_MS: u64 = 6 * STEP_MS;
const FILL_STEPS: (u64, u64) = (1, 7);
/// A joiner that has waited this many steps gives up.
const JOIN_WAIT_STEPS_MAX: u64 = 20;

/// The share of keys a client picks from the hot set, and the size of that set: hot keys
/// make many clients touch the same key around the same change.
const HOT_SHARE: f64 = 0.8;
const HOT_KEYS: usize = 64;
/// The share of requests aimed at the keys the last change of the member set moved, and how
/// many of those keys are kept: for a few steps after a change the old and the new owner of
/// such a key may serve it under different epochs, and that is where the fence has to hold.
const MOVED_SHARE: f64 = 0.25;
const MOVED_KEPT: usize = 64;
/// How often an idle client issues a request, and how many of those are PUTs.
const OP_CHANCE: f64 = 0.6;
const PUT_SHARE: f64 = 0.3;
/// How often a step brings a membership or fault event.
const EVENT_CHANCE: f64 = 0.05;

/// Steps a view takes to reach a node, a slow node and a client.
const NODE_DELAY: (u64, u64) = (0, 3);
const SLOW_DELAY: (u64, u64) = (10, 60);
const CLIENT_DELAY: (u64, u64) = (0, 6);
/// How long a node stays slow, the coordinator stays away, a drain lasts, a crashed node
/// stays down before it restarts, and a node without a lease waits to register again.
const SLOW_STEPS: (u64, u64) = (40, 300);
const OUTAGE_STEPS: (u64, u64) = (10, 120);
const DRAIN_STEPS: (u64, u64) = (10, 80);
const DOWN_STEPS: (u64, u64) = (5, 80);
const LEASE_STEPS: (u64, u64) = (3, 30);
/// Steps between a node presuming its lease lapsed (it admits nothing from then on) and the
/// coordinator letting the lease go: the node counts from when it sent its last renewal, so
/// it is never later than the coordinator.
const LAPSE_STEPS: (u64, u64) = (0, 5);
/// Steps before the coordinator removes a crashed member (its lease's time to live).
const DETECT_STEPS: u64 = 30;
/// Members that may be down at once.
const DOWN_MAX: usize = 8;
/// Fault domains the members are spread over.
const DOMAINS: u64 = 16;

/// Faults a test switches on to show that the checks can fail. A real run leaves them off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimFaults {
    /// Nodes keep in their store the keys [`NodeFence::apply`] hands back.
    pub skip_drop_on_apply: bool,
    /// Nodes serve and admit every key they own as if their view had settled
    /// ([`NodeFence::servable`] is not asked).
    pub ignore_settlement: bool,
}

/// What to simulate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    pub seed: u64,
    /// Members at the start (the run keeps the count within an eighth of this).
    pub nodes: usize,
    pub clients: usize,
    pub steps: u64,
    /// Keys clients touch.
    pub keys: usize,
    pub faults: SimFaults,
}

impl SimConfig {
    /// 128 nodes, 16 clients, 1024 keys and 2000 steps, with no faults.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            nodes: 128,
            clients: 16,
            steps: 2000,
            keys: 1024,
            faults: SimFaults::default(),
        }
    }
}

/// What a run did. Two runs of one configuration give equal reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimReport {
    pub steps: u64,
    pub gets: u64,
    pub hits: u64,
    pub misses: u64,
    pub puts: u64,
    pub puts_acked: u64,
    /// Requests a node refused as routed by an older epoch (each one made a refresh).
    pub stale_refusals: u64,
    /// Requests sent to a node that had not applied the client's epoch yet.
    pub node_behind: u64,
    /// Requests sent to a node that was down.
    pub unreachable: u64,
    /// PUTs a node refused to admit (lease lost, draining, not a member, not the owner).
    pub not_admitting: u64,
    /// GETs a node answered as a miss because the key came to it with a view that had not
    /// settled yet.
    pub settling_misses: u64,
    /// PUTs (a client's or a fill leader's) a node refused as [`NotAdmitting::Settling`].
    pub settling_refusals: u64,
    /// Times a node's settled epoch rose.
    pub settle_raises: u64,
    /// The most epochs the coordinator's view was ahead of the settled epoch it computed.
    pub max_unsettled_epochs: u64,
    /// Liveness records the coordinator let go after a node lost its lease.
    pub lease_lapses: u64,
    pub fills_led: u64,
    pub fills_joined: u64,
    pub fills_finished: u64,
    pub fills_failed: u64,
    /// begin_fill calls a directory refused (drain, credits, bounds, epoch).
    pub fills_refused: u64,
    /// Fills a directory fenced when its node applied a newer view.
    pub fenced: u64,
    /// Leaders and joiners told their fill was fenced.
    pub fenced_notices: u64,
    /// Fills whose node crashed under them.
    pub fills_lost: u64,
    pub joins: u64,
    /// Members removed: graceful leaves, crashed members and finished drains.
    pub leaves: u64,
    pub crashes: u64,
    /// Crashed nodes that restarted with a new registration.
    pub restarts: u64,
    pub lease_losses: u64,
    pub drains: u64,
    pub outages: u64,
    pub slow_nodes: u64,
    /// View applies on nodes that skipped at least one epoch.
    pub skipped_epochs: u64,
    /// Keys nodes dropped because a view they applied moved them away.
    pub dropped_on_apply: u64,
    /// PUTs acknowledged at an epoch older than that of the key's previous acknowledgement:
    /// an old owner that had not applied a view yet took a write after the new owner did.
    pub reordered_acks: u64,
    /// Views an inbox dropped because it was full.
    pub inbox_overflows: u64,
    /// Hits the stale check could not decide: the key's log had let its oldest
    /// acknowledgements go, and none of those it kept was of an epoch old enough.
    pub unchecked_hits: u64,
    /// The largest share of the sample whose owner changed in one membership change.
    pub max_moved_fraction: f64,
    /// The coordinator's epoch at the end.
    pub final_epoch: u64,
    pub final_members: usize,
}

/// The rules checked after every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimCheck {
    /// The configuration is outside the bounds of the simulation.
    Config,
    /// A hit returned bytes that no PUT of that key wrote.
    WrongHit,
    /// A hit at epoch E returned something other than the newest version acknowledged, before
    /// the GET was sent, by a PUT at an epoch no later than E.
    StaleHit,
    /// A membership change moved other keys than it had to, or a join moved an unlikely
    /// share of them.
    Rebalance,
    /// A directory's credits are not exactly one fill's cost per fill in flight.
    Credits,
    /// A directory made a second leader for a key while the first was still filling it.
    SingleFlight,
    /// The coordinator let a node's registration go while the node still admitted writes
    /// under it (the node must presume its lease lapsed no later than the coordinator).
    Lease,
}

impl SimCheck {
    pub fn name(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::WrongHit => "wrong hit",
            Self::StaleHit => "stale hit",
            Self::Rebalance => "rebalance",
            Self::Credits => "credits",
            Self::SingleFlight => "single flight",
            Self::Lease => "lease",
        }
    }
}

/// The first rule a run broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimFailure {
    pub seed: u64,
    /// The step it broke in (0: before the first step).
    pub step: u64,
    pub check: SimCheck,
    /// What happened, with the history that led to it.
    pub detail: String,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {}, step {}: {}: {}", self.seed, self.step, self.check.name(), self.detail)
    }
}

impl std::error::Error for SimFailure {}

/// Runs the simulation `config` describes, to its last step or its first broken rule.
pub fn run(config: &SimConfig) -> Result<SimReport, SimFailure> {
    let mut sim = Sim::new(config)?;
    for step in 1..=config.steps {
        sim.step = step;
        sim.now_ms = step * STEP_MS;
        sim.one_step()?;
    }
    Ok(sim.finish())
}

/// The bytes of `version` of `key`, as one number standing for a digest of them.
fn bytes_of(key: usize, version: u64) -> u64 {
    SplitMix64::mix(&[key as u64, version])
}

/// The digest of the `i`-th key (of the clients' keys and of the sample alike).
fn key_digest(i: usize) -> KeyDigest {
    KeyDigest::of(format!("key {i}").as_bytes())
}

/// A node's slot in the simulation's table.
fn slot(node: NodeId) -> usize {
    usize::try_from(node.0).unwrap_or(usize::MAX)
}

/// `n` fills' worth of credits.
fn fills_cost(n: usize) -> Credits {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    Credits::new(FILL_COST.operations * n, FILL_COST.host_blocks * n)
}

fn draw(rng: &mut SplitMix64, (lo, hi): (u64, u64)) -> u64 {
    rng.range(lo, hi)
}

/// One block in a model store: which version, and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stored {
    version: u64,
    bytes: u64,
    /// The node kept this copy after a view handed it back (only under
    /// [`SimFaults::skip_drop_on_apply`]).
    kept: bool,
    /// The node wrote this copy while the key was not servable (only under
    /// [`SimFaults::ignore_settlement`]).
    unsettled: bool,
}

/// Numbers on their way somewhere (settled epochs to a node, applied epochs to the
/// coordinator), each with the step it arrives in; arrival steps never go down. A full queue
/// drops its oldest entry: every entry is superseded by a later one.
#[derive(Debug)]
struct Mailbox<T> {
    queue: VecDeque<(u64, T)>,
}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Self { queue: VecDeque::new() }
    }
}

impl<T> Mailbox<T> {
    fn push(&mut self, at: u64, item: T) {
        let at = self.queue.back().map_or(at, |(last, _)| at.max(*last));
        if self.queue.len() >= INBOX_MAX {
            self.queue.pop_front();
        }
        self.queue.push_back((at, item));
    }

    /// The next entry that has arrived by `step`.
    fn pop_due(&mut self, step: u64) -> Option<T> {
        if self.queue.front().is_some_and(|(at, _)| *at <= step) {
            self.queue.pop_front().map(|(_, item)| item)
        } else {
            None
        }
    }
}

/// One publication of an applied epoch: which life of the node says it applied which epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct AppliedRecord {
    node_epoch: u64,
    epoch: u64,
}

/// Views on their way to one receiver, in the order they were sent, each with the step it
/// arrives in. Arrival steps never go down, as on one watch stream.
#[derive(Debug, Default)]
struct Inbox {
    queue: VecDeque<(u64, Rc<ClusterView>)>,
}

impl Inbox {
    /// Queues `view` to arrive at `at` (or with the view before it); answers whether a full
    /// inbox dropped its oldest view to make room.
    fn push(&mut self, at: u64, view: Rc<ClusterView>) -> bool {
        let at = self.queue.back().map_or(at, |(last, _)| at.max(*last));
        let dropped = self.queue.len() >= INBOX_MAX && self.queue.pop_front().is_some();
        self.queue.push_back((at, view));
        dropped
    }

    /// The views that have arrived by `step`, oldest first.
    fn take_due(&mut self, step: u64) -> Vec<Rc<ClusterView>> {
        let mut due = Vec::new();
        while self.queue.front().is_some_and(|(at, _)| *at <= step) {
            if let Some((_, view)) = self.queue.pop_front() {
                due.push(view);
            }
        }
        due
    }
}

/// What applying one view did on a node.
#[derive(Debug, Default)]
struct Applied {
    skipped: bool,
    dropped: usize,
    fenced: usize,
}

/// One node: its fence, its directory, its model store and its inbox.
#[derive(Debug)]
struct Node {
    id: NodeId,
    /// Its registration number, as a view records it: every restart and every new
    /// registration after a lost lease takes a larger one.
    node_epoch: u64,
    /// Bumped by every restart: a fill begun in an earlier life ended with it.
    life: u64,
    running: bool,
    down_since: u64,
    /// When a crashed node comes back (none: it stays down until it is asked to join).
    restart_at: Option<u64>,
    /// A restarted node that has not registered yet.
    wants_registration: bool,
    /// When a node that lost its lease registers again.
    reregister_at: Option<u64>,
    /// When a draining member is removed.
    drain_until: Option<u64>,
    slow_until: Option<u64>,
    fence: NodeFence<KeyDigest>,
    directory: ShardDirectory,
    store: BTreeMap<KeyDigest, Stored>,
    inbox: Inbox,
    /// (step, epoch) of its last view applies.
    applies: VecDeque<(u64, u64)>,
    /// When the coordinator lets this node's lost lease go.
    lapse_at: Option<u64>,
    /// Settled epochs on their way to this node.
    settle_inbox: Mailbox<u64>,
    /// The largest settled epoch the coordinator has sent this node (this life).
    settle_sent: u64,
    /// Its applied epochs on their way to the coordinator.
    outbox: Mailbox<AppliedRecord>,
    /// What it last published (this life).
    published: AppliedRecord,
    /// (step, settled epoch) of its last settles that raised the epoch.
    settles: VecDeque<(u64, u64)>,
}

impl Node {
    /// A node that has just started: empty, at epoch 0, not registered.
    fn started(id: NodeId, node_epoch: u64, life: u64) -> Self {
        Self {
            id,
            node_epoch,
            life,
            running: true,
            down_since: 0,
            restart_at: None,
            wants_registration: false,
            reregister_at: None,
            drain_until: None,
            slow_until: None,
            fence: NodeFence::new(id, HELD_KEYS_MAX),
            directory: fresh_directory(),
            store: BTreeMap::new(),
            inbox: Inbox::default(),
            applies: VecDeque::new(),
            lapse_at: None,
            settle_inbox: Mailbox::default(),
            settle_sent: 0,
            outbox: Mailbox::default(),
            published: AppliedRecord::default(),
            settles: VecDeque::new(),
        }
    }

    /// Starts this node again from nothing, under a new life and a new registration number.
    fn restart(&mut self) {
        *self = Self::started(self.id, self.node_epoch + 1, self.life + 1);
    }

    /// The process dies: everything it held is gone.
    fn crash(&mut self, step: u64, restart_at: Option<u64>) {
        let (node_epoch, life) = (self.node_epoch, self.life);
        *self = Self::started(self.id, node_epoch, life);
        self.running = false;
        self.down_since = step;
        self.restart_at = restart_at;
    }

    fn entry(&self, state: MemberState) -> ViewMember {
        let n = self.id.0;
        ViewMember {
            node: self.id,
            address: format!("10.0.{}.{}:7400", n / 256, n % 256),
            fault_domain: format!("rack-{}", n % DOMAINS),
            capacity: 1 << 40,
            node_epoch: self.node_epoch,
            state,
        }
    }

    fn is_slow(&self, step: u64) -> bool {
        self.slow_until.is_some_and(|until| step < until)
    }

    /// Applies `view` if it is newer than the node's: drops the keys the fence hands back
    /// (unless `keep` says to keep them, a fault), fences the directory and drains it when the
    /// view lists this node as draining.
    fn apply(&mut self, view: &ClusterView, keep: bool, step: u64) -> Option<Applied> {
        let before = self.fence.epoch();
        if view.epoch <= before {
            return None;
        }
        let state = view.member(self.id).map(|m| m.state);
        let handed_back = self.fence.apply(view.clone());
        let mut dropped = 0;
        for key in &handed_back {
            if keep {
                if let Some(stored) = self.store.get_mut(key) {
                    stored.kept = true;
                }
            } else if self.store.remove(key).is_some() {
                dropped += 1;
            }
        }
        let fenced = self.directory.fence(Epoch(view.epoch));
        match state {
            Some(MemberState::Draining) => self.directory.start_drain(),
            _ => self.directory.stop_drain(),
        }
        if self.applies.len() == APPLIES_KEPT {
            self.applies.pop_front();
        }
        self.applies.push_back((step, view.epoch));
        Some(Applied { skipped: before != 0 && view.epoch != before + 1, dropped, fenced })
    }

    /// Whether the node may serve `key` now (under [`SimFaults::ignore_settlement`], whenever
    /// it owns it).
    fn may_serve(&self, key: &KeyDigest, ignore_settlement: bool) -> bool {
        if ignore_settlement { self.fence.owns(key) } else { self.fence.servable(key) }
    }

    /// Why the node would refuse to admit `key` (past its fence's check), as the real store
    /// layer says it: not the owner, or owned but not servable yet.
    fn admission(&self, key: &KeyDigest, ignore_settlement: bool) -> Result<(), NotAdmitting> {
        if !self.fence.owns(key) {
            Err(NotAdmitting::NotOwner)
        } else if !self.may_serve(key, ignore_settlement) {
            Err(NotAdmitting::Settling)
        } else {
            Ok(())
        }
    }

    /// Takes the settled epochs that have arrived; answers how many raised the node's.
    fn take_settles(&mut self, step: u64) -> u64 {
        let mut raised = 0;
        while let Some(epoch) = self.settle_inbox.pop_due(step) {
            if epoch > self.fence.settled() {
                self.fence.settle(epoch);
                raised += 1;
                if self.settles.len() == APPLIES_KEPT {
                    self.settles.pop_front();
                }
                self.settles.push_back((step, epoch));
            }
        }
        raised
    }

    /// Stores `stored` under `key` and has the fence remember it, evicting first when full.
    fn store_put(&mut self, key: KeyDigest, stored: Stored) -> Result<(), NotAdmitting> {
        if !self.store.contains_key(&key)
            && self.store.len() >= STORE_KEYS_MAX
            && let Some((evicted, _)) = self.store.pop_first()
        {
            self.fence.forget(&evicted);
        }
        self.fence.record(key, &key)?;
        self.store.insert(key, stored);
        Ok(())
    }
}

fn fresh_directory() -> ShardDirectory {
    ShardDirectory::new(ShardId(0), Epoch(0), CreditPool::new(POOL_CREDITS), FILL_COST)
        .with_bounds(FILLS_MAX, FILL_LEASE_MS)
}

/// A fill a client leads: it PUTs the block at `due` and reports.
#[derive(Debug, Clone, Copy)]
struct Lead {
    node: usize,
    life: u64,
    key: usize,
    lease: FillLease,
    due: u64,
}

/// A fill a client joined: it polls the directory for the outcome.
#[derive(Debug, Clone, Copy)]
struct Wait {
    node: usize,
    life: u64,
    key: usize,
    ticket: FillTicket,
    since: u64,
}

/// What a client is doing besides being free to send a request.
#[derive(Debug, Clone, Copy)]
enum Task {
    Idle,
    Leading(Lead),
    Waiting(Wait),
}

#[derive(Debug)]
struct Client {
    view: Rc<ClusterView>,
    placement: Placement,
    inbox: Inbox,
    task: Task,
}

impl Client {
    fn adopt(&mut self, view: Rc<ClusterView>) {
        if view.epoch > self.view.epoch {
            self.placement = view.placement();
            self.view = view;
        }
    }
}

/// One acknowledged PUT.
#[derive(Debug, Clone, Copy)]
struct Ack {
    version: u64,
    epoch: u64,
    node: NodeId,
    client: usize,
    step: u64,
}

/// What was written to one key: the last version handed out and the recent acknowledgements,
/// in the order they were given.
#[derive(Debug, Default)]
struct KeyLog {
    versions: u64,
    acks: VecDeque<Ack>,
    /// Older acknowledgements were let go to keep the log bounded.
    forgot: bool,
}

impl KeyLog {
    fn next_version(&mut self) -> u64 {
        self.versions += 1;
        self.versions
    }

    fn ack(&mut self, ack: Ack) {
        if self.acks.len() == ACKS_KEPT {
            self.acks.pop_front();
            self.forgot = true;
        }
        self.acks.push_back(ack);
    }

    /// Whether `version` was acknowledged (or may have been, before the log let go of it).
    fn was_written(&self, version: u64) -> bool {
        self.acks.iter().any(|a| a.version == version)
            || (self.forgot && self.acks.front().is_some_and(|a| version < a.version))
    }

    /// The newest acknowledgement of a PUT sent at `epoch` or before.
    fn newest_up_to(&self, epoch: u64) -> Option<&Ack> {
        self.acks.iter().rev().find(|a| a.epoch <= epoch)
    }
}

/// A view the coordinator made, with what made it.
#[derive(Debug)]
struct Made {
    step: u64,
    what: String,
    view: Rc<ClusterView>,
}

/// The stand-in for etcd.
#[derive(Debug)]
struct Coordinator {
    view: Rc<ClusterView>,
    down_until: Option<u64>,
    recent: VecDeque<Made>,
    /// Per node slot, the liveness record of its registered life (none: no live lease), with
    /// the epoch that life last published as applied (0: none yet).
    live: Vec<Option<AppliedRecord>>,
    /// The largest settled epoch it computed, and (step, epoch) of its recent rises.
    settled: u64,
    settled_log: VecDeque<(u64, u64)>,
}

impl Coordinator {
    fn is_up(&self) -> bool {
        self.down_until.is_none()
    }

    fn install(&mut self, made: Made) {
        if self.recent.len() == VIEWS_KEPT {
            self.recent.pop_front();
        }
        self.view = Rc::clone(&made.view);
        self.recent.push_back(made);
    }

    fn is_member(&self, node: NodeId) -> bool {
        self.view.member(node).is_some()
    }

    /// A new life of the node in slot `n` holds a lease: it has published nothing yet.
    fn register_life(&mut self, n: usize, node_epoch: u64) {
        if self.live.len() <= n {
            self.live.resize(n + 1, None);
        }
        self.live[n] = Some(AppliedRecord { node_epoch, epoch: 0 });
    }

    /// Takes a publication: only a live record of the same life takes it.
    fn take_applied(&mut self, n: usize, applied: AppliedRecord) {
        if let Some(Some(record)) = self.live.get_mut(n)
            && record.node_epoch == applied.node_epoch
        {
            record.epoch = record.epoch.max(applied.epoch);
        }
    }

    /// Reads the least applied epoch over the live records (0 when there is none, or while a
    /// new life has published nothing); answers the largest it ever read. That one stays
    /// true: a life that registers later applies the view its registration made, which is no
    /// older, before it admits anything.
    fn compute_settled(&mut self, step: u64) -> u64 {
        let least = self.live.iter().flatten().map(|r| r.epoch).min().unwrap_or(0);
        if least > self.settled {
            if self.settled_log.len() == VIEWS_KEPT {
                self.settled_log.pop_front();
            }
            self.settled_log.push_back((step, least));
            self.settled = least;
        }
        self.settled
    }
}

/// One membership change.
#[derive(Debug, Clone)]
enum Change {
    Join(ViewMember),
    Leave {
        node: NodeId,
        why: &'static str,
    },
    /// The set of members stays; one member's entry changes.
    Update {
        node: NodeId,
        node_epoch: u64,
        state: MemberState,
        why: &'static str,
    },
}

impl Change {
    fn edit(&self, members: &mut Vec<ViewMember>) {
        match self {
            Self::Join(m) => members.push(m.clone()),
            Self::Leave { node, .. } => members.retain(|m| m.node != *node),
            Self::Update { node, node_epoch, state, .. } => {
                for m in members.iter_mut().filter(|m| m.node == *node) {
                    m.node_epoch = *node_epoch;
                    m.state = *state;
                }
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Join(m) => format!("node {} joins (node epoch {})", m.node.0, m.node_epoch),
            Self::Leave { node, why } => format!("node {} leaves ({why})", node.0),
            Self::Update { node, node_epoch, state, why } => {
                format!("node {} is {} at node epoch {node_epoch} ({why})", node.0, state.name())
            }
        }
    }
}

/// The sample's owners under the coordinator's current view.
#[derive(Debug)]
struct Sample {
    keys: Vec<KeyDigest>,
    placement: Placement,
    owners: Vec<Option<NodeId>>,
    /// The clients' keys the last change of the member set moved (at most [`MOVED_KEPT`]).
    moved: Vec<usize>,
}

/// The node that served a request, and the epoch the request was routed by.
#[derive(Debug, Clone, Copy)]
struct Served {
    node: usize,
    epoch: u64,
}

/// The whole simulated cluster.
#[derive(Debug)]
struct Sim {
    cfg: SimConfig,
    rng: SplitMix64,
    step: u64,
    now_ms: u64,
    keys: Vec<KeyDigest>,
    logs: Vec<KeyLog>,
    coord: Coordinator,
    nodes: Vec<Node>,
    clients: Vec<Client>,
    sample: Sample,
    /// The leader each directory gave out last per (node, life, key, epoch). A client leads
    /// one fill at a time and its entry goes when it reports, so this holds at most
    /// [`CLIENTS_MAX`] entries.
    leaders: BTreeMap<(usize, u64, usize, u64), FillTicket>,
    report: SimReport,
}

impl Sim {
    fn new(cfg: &SimConfig) -> Result<Self, SimFailure> {
        check_config(cfg)?;
        let nodes: Vec<Node> =
            (0..cfg.nodes).map(|i| Node::started(NodeId(i as u64), 1, 1)).collect();
        let view =
            Rc::new(ClusterView::new(1, nodes.iter().map(|n| n.entry(MemberState::Serving))));
        let placement = view.placement();
        let sample_keys: Vec<KeyDigest> = (0..SAMPLE_KEYS).map(key_digest).collect();
        let owners = sample_keys.iter().map(|k| placement.owner(k)).collect();
        let clients = (0..cfg.clients)
            .map(|_| Client {
                view: Rc::clone(&view),
                placement: placement.clone(),
                inbox: Inbox::default(),
                task: Task::Idle,
            })
            .collect();
        let mut sim = Self {
            cfg: cfg.clone(),
            rng: SplitMix64::new(cfg.seed),
            step: 0,
            now_ms: 0,
            keys: (0..cfg.keys).map(key_digest).collect(),
            logs: (0..cfg.keys).map(|_| KeyLog::default()).collect(),
            coord: Coordinator {
                view: Rc::clone(&view),
                down_until: None,
                recent: VecDeque::new(),
                live: Vec::new(),
                settled: 0,
                settled_log: VecDeque::new(),
            },
            nodes,
            clients,
            sample: Sample { keys: sample_keys, placement, owners, moved: Vec::new() },
            leaders: BTreeMap::new(),
            report: SimReport::default(),
        };
        sim.coord.install(Made {
            step: 0,
            what: "the first members".into(),
            view: Rc::clone(&view),
        });
        // Every first member has applied the first view, and said so.
        let first = AppliedRecord { node_epoch: 1, epoch: view.epoch };
        for (n, node) in sim.nodes.iter_mut().enumerate() {
            node.apply(&view, false, 0);
            node.fence.registered();
            node.fence.settle(view.epoch);
            node.settle_sent = view.epoch;
            node.published = first;
            sim.coord.register_life(n, first.node_epoch);
            sim.coord.take_applied(n, first);
        }
        sim.coord.compute_settled(0);
        Ok(sim)
    }

    fn fail(&self, check: SimCheck, detail: String) -> SimFailure {
        SimFailure { seed: self.cfg.seed, step: self.step, check, detail }
    }

    fn one_step(&mut self) -> Result<(), SimFailure> {
        self.event()?;
        self.timers()?;
        self.deliver();
        self.settlement();
        self.finish_due_fills();
        for c in 0..self.clients.len() {
            self.client_turn(c)?;
        }
        for node in self.nodes.iter_mut().filter(|n| n.running) {
            node.directory.expire(self.now_ms);
        }
        self.check_credits()
    }

    fn finish(mut self) -> SimReport {
        self.report.steps = self.cfg.steps;
        self.report.final_epoch = self.coord.view.epoch;
        self.report.final_members = self.coord.view.members.len();
        self.report
    }

    // ---- Membership and faults ----

    /// At most one membership or fault event per step, drawn by weight.
    fn event(&mut self) -> Result<(), SimFailure> {
        if !self.rng.chance(EVENT_CHANCE) {
            return Ok(());
        }
        match self.rng.below(100) {
            0..20 => self.join_one(),
            20..32 => self.leave_one(),
            32..48 => {
                self.crash_one();
                Ok(())
            }
            48..58 => {
                self.lose_one_lease();
                Ok(())
            }
            58..66 => {
                self.start_outage();
                Ok(())
            }
            66..82 => {
                self.slow_one();
                Ok(())
            }
            _ => self.drain_one(),
        }
    }

    /// The fewest and most members churn may leave the cluster with.
    fn member_bounds(&self) -> (usize, usize) {
        let band = self.cfg.nodes / 8;
        (self.cfg.nodes - band, self.cfg.nodes + band)
    }

    /// Slots of nodes matching `pick`, in slot order.
    fn nodes_where(&self, pick: impl Fn(&Node) -> bool) -> Vec<usize> {
        (0..self.nodes.len()).filter(|&n| pick(&self.nodes[n])).collect()
    }

    fn choose(&mut self, candidates: &[usize]) -> Option<usize> {
        (!candidates.is_empty()).then(|| candidates[self.rng.index(candidates.len())])
    }

    /// A running, serving, registered member with nothing pending.
    fn settled_member(&self, node: &Node) -> bool {
        node.running
            && node.fence.is_registered()
            && node.drain_until.is_none()
            && self.coord.view.member(node.id).is_some_and(|m| m.state == MemberState::Serving)
    }

    /// A node joins: one that is out of the view, or a new one.
    fn join_one(&mut self) -> Result<(), SimFailure> {
        let (_, most) = self.member_bounds();
        if !self.coord.is_up() || self.coord.view.members.len() >= most {
            return Ok(());
        }
        let out = self.nodes_where(|n| {
            n.restart_at.is_none() && !n.wants_registration && !self.coord.is_member(n.id)
        });
        let reuse = !out.is_empty() && (self.nodes.len() >= NODES_MAX || self.rng.chance(0.5));
        let n = if reuse {
            match self.choose(&out) {
                Some(n) => n,
                None => return Ok(()),
            }
        } else if self.nodes.len() < NODES_MAX {
            let id = NodeId(self.nodes.len() as u64);
            self.nodes.push(Node::started(id, 0, 0));
            self.nodes.len() - 1
        } else {
            return Ok(());
        };
        self.nodes[n].restart();
        self.register(n)
    }

    /// A node that has (re)started enters the view, or updates its entry if the view still
    /// lists it; then it holds its registration.
    fn register(&mut self, n: usize) -> Result<(), SimFailure> {
        let node = &self.nodes[n];
        let change = if self.coord.is_member(node.id) {
            Change::Update {
                node: node.id,
                node_epoch: node.node_epoch,
                state: MemberState::Serving,
                why: "restarted",
            }
        } else {
            self.report.joins += 1;
            Change::Join(node.entry(MemberState::Serving))
        };
        self.change(change)?;
        self.start_life(n);
        Ok(())
    }

    /// The node in slot `n` holds a new registration: as the real registration does, it
    /// applies the view that its registration made, and only then admits; the coordinator
    /// holds a liveness record of this life, which has published nothing yet.
    fn start_life(&mut self, n: usize) {
        let view = Rc::clone(&self.coord.view);
        let (step, keep) = (self.step, self.cfg.faults.skip_drop_on_apply);
        let node = &mut self.nodes[n];
        let applied = node.apply(&view, keep, step);
        node.wants_registration = false;
        node.lapse_at = None;
        node.fence.registered();
        node.published = AppliedRecord::default();
        let node_epoch = node.node_epoch;
        self.coord.register_life(n, node_epoch);
        if let Some(applied) = applied {
            self.count_applied(&applied);
        }
    }

    fn count_applied(&mut self, applied: &Applied) {
        self.report.skipped_epochs += u64::from(applied.skipped);
        self.report.dropped_on_apply += applied.dropped as u64;
        self.report.fenced += applied.fenced as u64;
    }

    /// The coordinator lets the lease of the node in slot `n` go: its liveness record (and so
    /// its applied epoch) no longer counts. The node must not admit under that lease by then.
    fn let_lease_go(&mut self, n: usize) -> Result<(), SimFailure> {
        let Some(Some(record)) = self.coord.live.get(n).copied() else { return Ok(()) };
        let node = &self.nodes[n];
        if node.running && node.fence.is_registered() && node.node_epoch == record.node_epoch {
            let detail = format!(
                "the coordinator let the lease of node {} (node epoch {}) go while the node, at \
                 epoch {}, still admitted under it",
                node.id.0,
                record.node_epoch,
                node.fence.epoch()
            );
            return Err(self.fail(SimCheck::Lease, detail));
        }
        self.coord.live[n] = None;
        Ok(())
    }

    fn leave_one(&mut self) -> Result<(), SimFailure> {
        let (fewest, _) = self.member_bounds();
        if !self.coord.is_up() || self.coord.view.members.len() <= fewest {
            return Ok(());
        }
        let candidates = self.nodes_where(|n| self.settled_member(n));
        let Some(n) = self.choose(&candidates) else { return Ok(()) };
        self.report.leaves += 1;
        // A graceful leave is a shutdown: the node stops serving, takes itself out of the
        // view, and gives its lease up.
        let id = self.nodes[n].id;
        self.nodes[n].crash(self.step, None);
        self.change(Change::Leave { node: id, why: "graceful" })?;
        self.let_lease_go(n)
    }

    /// A running member crashes; half of them restart after a while, the others stay down
    /// until the coordinator removes them (and may be asked to join again later).
    fn crash_one(&mut self) {
        let down = self.nodes_where(|n| !n.running && self.coord.is_member(n.id)).len();
        if down >= DOWN_MAX {
            return;
        }
        let candidates = self.nodes_where(|n| n.running && self.coord.is_member(n.id));
        let Some(n) = self.choose(&candidates) else { return };
        let restart_at = self.rng.chance(0.5).then(|| self.step + draw(&mut self.rng, DOWN_STEPS));
        self.nodes[n].crash(self.step, restart_at);
        self.report.crashes += 1;
    }

    fn lose_one_lease(&mut self) {
        let candidates = self.nodes_where(|n| self.settled_member(n) && n.reregister_at.is_none());
        let Some(n) = self.choose(&candidates) else { return };
        let at = self.step + draw(&mut self.rng, LEASE_STEPS);
        let lapse = self.step + draw(&mut self.rng, LAPSE_STEPS);
        let node = &mut self.nodes[n];
        // The node stops admitting first; the coordinator lets the lease go at `lapse` or
        // later (when it is reachable), unless the node has registered again by then.
        node.fence.lose_registration();
        node.reregister_at = Some(at);
        node.lapse_at = Some(lapse);
        self.report.lease_losses += 1;
    }

    fn start_outage(&mut self) {
        if self.coord.is_up() {
            self.coord.down_until = Some(self.step + draw(&mut self.rng, OUTAGE_STEPS));
            self.report.outages += 1;
        }
    }

    fn slow_one(&mut self) {
        let step = self.step;
        let candidates = self.nodes_where(|n| n.running && !n.is_slow(step));
        let Some(n) = self.choose(&candidates) else { return };
        self.nodes[n].slow_until = Some(step + draw(&mut self.rng, SLOW_STEPS));
        self.report.slow_nodes += 1;
    }

    fn drain_one(&mut self) -> Result<(), SimFailure> {
        let (fewest, _) = self.member_bounds();
        if !self.coord.is_up() || self.coord.view.members.len() <= fewest {
            return Ok(());
        }
        let candidates = self.nodes_where(|n| self.settled_member(n));
        let Some(n) = self.choose(&candidates) else { return Ok(()) };
        let until = self.step + draw(&mut self.rng, DRAIN_STEPS);
        let node = &mut self.nodes[n];
        node.drain_until = Some(until);
        let change = Change::Update {
            node: node.id,
            node_epoch: node.node_epoch,
            state: MemberState::Draining,
            why: "drain",
        };
        self.report.drains += 1;
        self.change(change)
    }

    /// What falls due this step: the coordinator's return, restarts, registrations, removals
    /// of crashed members and of drained ones.
    fn timers(&mut self) -> Result<(), SimFailure> {
        let step = self.step;
        if self.coord.down_until.is_some_and(|until| step >= until) {
            self.coord.down_until = None;
        }
        for n in 0..self.nodes.len() {
            let node = &mut self.nodes[n];
            if node.slow_until.is_some_and(|until| step >= until) {
                node.slow_until = None;
            }
            if !node.running && node.restart_at.is_some_and(|at| step >= at) {
                node.restart();
                node.wants_registration = true;
                self.report.restarts += 1;
            }
            if self.coord.is_up() {
                self.coordinator_timers(n)?;
            }
        }
        Ok(())
    }

    /// The timers of node `n` that need the coordinator.
    fn coordinator_timers(&mut self, n: usize) -> Result<(), SimFailure> {
        let step = self.step;
        let node = &self.nodes[n];
        let id = node.id;
        let member = self.coord.view.member(id).map(|m| m.state);
        if node.wants_registration {
            return self.register(n);
        }
        if !node.running && member.is_some() && step >= node.down_since + DETECT_STEPS {
            // Its lease ran out: its liveness record goes, and a member removes it.
            self.report.leaves += 1;
            self.let_lease_go(n)?;
            return self.change(Change::Leave { node: id, why: "crashed" });
        }
        if node.lapse_at.is_some_and(|at| step >= at) {
            self.nodes[n].lapse_at = None;
            self.report.lease_lapses += 1;
            self.let_lease_go(n)?;
        }
        let node = &self.nodes[n];
        if node.reregister_at.is_some_and(|at| step >= at) {
            return self.reregister(n, member);
        }
        if node.drain_until.is_some_and(|until| step >= until) {
            self.nodes[n].drain_until = None;
            if member.is_some() {
                self.report.leaves += 1;
                return self.change(Change::Leave { node: id, why: "drained" });
            }
        }
        Ok(())
    }

    /// A node that lost its lease registers again, under a new registration number.
    fn reregister(&mut self, n: usize, member: Option<MemberState>) -> Result<(), SimFailure> {
        let node = &mut self.nodes[n];
        node.reregister_at = None;
        node.node_epoch += 1;
        let change = member.map(|state| Change::Update {
            node: node.id,
            node_epoch: node.node_epoch,
            state,
            why: "registered again",
        });
        if let Some(change) = change {
            self.change(change)?;
        }
        self.start_life(n);
        Ok(())
    }

    /// The coordinator makes the next view, checks what it moves, and sends it out.
    fn change(&mut self, change: Change) -> Result<(), SimFailure> {
        let next = Rc::new(self.coord.view.next(|members| change.edit(members)));
        self.check_moves(&change, &next)?;
        self.coord.install(Made {
            step: self.step,
            what: change.describe(),
            view: Rc::clone(&next),
        });
        self.publish(&next);
        Ok(())
    }

    /// Sends `view` to every running node and every client, each with its own delay.
    fn publish(&mut self, view: &Rc<ClusterView>) {
        let step = self.step;
        for node in self.nodes.iter_mut().filter(|n| n.running) {
            let delay = if node.is_slow(step) { SLOW_DELAY } else { NODE_DELAY };
            let at = step + draw(&mut self.rng, delay);
            self.report.inbox_overflows += u64::from(node.inbox.push(at, Rc::clone(view)));
        }
        for client in &mut self.clients {
            let at = step + draw(&mut self.rng, CLIENT_DELAY);
            self.report.inbox_overflows += u64::from(client.inbox.push(at, Rc::clone(view)));
        }
    }

    /// Hands every receiver the views that have reached it. A slow node, like every client,
    /// only looks at the newest one.
    fn deliver(&mut self) {
        let (step, keep) = (self.step, self.cfg.faults.skip_drop_on_apply);
        for node in self.nodes.iter_mut().filter(|n| n.running) {
            let mut due = node.inbox.take_due(step);
            if node.is_slow(step) && due.len() > 1 {
                due.drain(..due.len() - 1);
            }
            for view in due {
                let Some(applied) = node.apply(&view, keep, step) else { continue };
                self.report.skipped_epochs += u64::from(applied.skipped);
                self.report.dropped_on_apply += applied.dropped as u64;
                self.report.fenced += applied.fenced as u64;
            }
        }
        for client in &mut self.clients {
            if let Some(view) = client.inbox.take_due(step).pop() {
                client.adopt(view);
            }
        }
    }

    /// Registered nodes publish their applied epoch when it changed; the coordinator takes
    /// what has reached it, computes the settled epoch and sends a larger one to every
    /// registered node; each node settles what has reached it. Every leg takes the node's
    /// delay, a slow node's much longer. Nothing moves through the coordinator while it is
    /// unreachable.
    fn settlement(&mut self) {
        let step = self.step;
        for node in self.nodes.iter_mut().filter(|n| n.running && n.fence.is_registered()) {
            let now = AppliedRecord { node_epoch: node.node_epoch, epoch: node.fence.epoch() };
            if now != node.published {
                let delay = if node.is_slow(step) { SLOW_DELAY } else { NODE_DELAY };
                node.outbox.push(step + draw(&mut self.rng, delay), now);
                node.published = now;
            }
        }
        if self.coord.is_up() {
            for n in 0..self.nodes.len() {
                while let Some(applied) = self.nodes[n].outbox.pop_due(step) {
                    self.coord.take_applied(n, applied);
                }
            }
            let settled = self.coord.compute_settled(step);
            let ahead = self.coord.view.epoch.saturating_sub(settled);
            self.report.max_unsettled_epochs = self.report.max_unsettled_epochs.max(ahead);
            for node in self.nodes.iter_mut().filter(|n| n.running && n.fence.is_registered()) {
                if settled > node.settle_sent {
                    let delay = if node.is_slow(step) { SLOW_DELAY } else { NODE_DELAY };
                    node.settle_inbox.push(step + draw(&mut self.rng, delay), settled);
                    node.settle_sent = settled;
                }
            }
        }
        for node in self.nodes.iter_mut().filter(|n| n.running) {
            self.report.settle_raises += node.take_settles(step);
        }
    }

    // ---- Clients ----

    fn client_turn(&mut self, c: usize) -> Result<(), SimFailure> {
        match self.clients[c].task {
            Task::Leading(_) => Ok(()),
            Task::Waiting(wait) => self.poll_fill(c, wait),
            Task::Idle => {
                if !self.rng.chance(OP_CHANCE) {
                    return Ok(());
                }
                let key = self.pick_key();
                if self.rng.chance(PUT_SHARE) {
                    self.put(c, key);
                    Ok(())
                } else {
                    self.get(c, key, true)
                }
            }
        }
    }

    fn pick_key(&mut self) -> usize {
        let keys = self.keys.len();
        let moved = &self.sample.moved;
        if !moved.is_empty() && self.rng.chance(MOVED_SHARE) {
            moved[self.rng.index(moved.len())]
        } else if self.rng.chance(HOT_SHARE) {
            self.rng.index(HOT_KEYS.min(keys))
        } else {
            self.rng.index(keys)
        }
    }

    /// The client takes the coordinator's current view; false while it is unreachable.
    fn refresh(&mut self, c: usize) -> bool {
        if !self.coord.is_up() {
            return false;
        }
        self.clients[c].adopt(Rc::clone(&self.coord.view));
        true
    }

    /// Routes a request for `key` by client `c`'s view to the node that serves it, refreshing
    /// the view and retrying when the node says the epoch is stale. None: not served.
    fn route(&mut self, c: usize, key: usize, admits: bool) -> Option<Served> {
        for _ in 0..=RETRIES_MAX {
            let client = &self.clients[c];
            let epoch = client.view.epoch;
            let node = slot(client.placement.owner(&self.keys[key])?);
            let target = &self.nodes[node];
            if !target.running {
                self.report.unreachable += 1;
                return None;
            }
            match target.fence.check(epoch, admits) {
                Ok(()) => return Some(Served { node, epoch }),
                Err(FenceRefusal::StaleEpoch { .. }) => {
                    self.report.stale_refusals += 1;
                    if !self.refresh(c) {
                        return None;
                    }
                }
                Err(FenceRefusal::NodeBehind { .. }) => {
                    self.report.node_behind += 1;
                    return None;
                }
                Err(FenceRefusal::NotAdmitting(_)) => {
                    self.report.not_admitting += 1;
                    return None;
                }
            }
        }
        None
    }

    /// A PUT. A node that refuses it as settling acknowledges nothing, and the client does not
    /// try again: it is a failed write.
    fn put(&mut self, c: usize, key: usize) {
        self.report.puts += 1;
        if let Some(served) = self.route(c, key, true)
            && self.admits(served.node, key)
            && self.store_new_version(c, served, key)
        {
            self.report.puts_acked += 1;
        }
    }

    /// The node's store layer, past the fence's check: it admits a key it owns and may serve
    /// now, refuses one it owns that has not settled, and one it does not own.
    fn admits(&mut self, node: usize, key: usize) -> bool {
        let ignore = self.cfg.faults.ignore_settlement;
        match self.nodes[node].admission(&self.keys[key], ignore) {
            Ok(()) => true,
            Err(NotAdmitting::Settling) => {
                self.report.settling_refusals += 1;
                false
            }
            Err(_) => {
                self.report.not_admitting += 1;
                false
            }
        }
    }

    /// Node `served.node` stores a new version of `key` for client `c`'s request of epoch
    /// `served.epoch`; answers whether it was acknowledged.
    fn store_new_version(&mut self, c: usize, served: Served, key: usize) -> bool {
        let version = self.logs[key].next_version();
        let node = &mut self.nodes[served.node];
        let unsettled = !node.fence.servable(&self.keys[key]);
        let stored = Stored { version, bytes: bytes_of(key, version), kept: false, unsettled };
        if node.store_put(self.keys[key], stored).is_err() {
            return false;
        }
        let ack = Ack { version, epoch: served.epoch, node: node.id, client: c, step: self.step };
        let log = &mut self.logs[key];
        if log.acks.back().is_some_and(|last| last.epoch > ack.epoch) {
            self.report.reordered_acks += 1;
        }
        log.ack(ack);
        true
    }

    /// A GET; on a miss at the owner, a fill when `may_fill`.
    fn get(&mut self, c: usize, key: usize, may_fill: bool) -> Result<(), SimFailure> {
        self.report.gets += 1;
        let Some(served) = self.route(c, key, false) else {
            self.report.misses += 1;
            return Ok(());
        };
        // A key the node owns but may not serve yet is a plain miss: the client cannot tell
        // it from an absent block, and fills it as it would any miss.
        let node = &self.nodes[served.node];
        let servable = node.may_serve(&self.keys[key], self.cfg.faults.ignore_settlement);
        if !servable {
            self.report.settling_misses += 1;
        }
        let found = if servable { node.store.get(&self.keys[key]).copied() } else { None };
        match found {
            Some(stored) => {
                self.check_hit(c, key, served, stored)?;
                self.report.hits += 1;
                Ok(())
            }
            None => {
                self.report.misses += 1;
                if may_fill { self.begin_fill(c, key, served) } else { Ok(()) }
            }
        }
    }

    fn begin_fill(&mut self, c: usize, key: usize, served: Served) -> Result<(), SimFailure> {
        let node = &mut self.nodes[served.node];
        let life = node.life;
        let begun = node.directory.begin_fill(self.keys[key], Epoch(served.epoch), self.now_ms);
        let task = match begun {
            Ok(FillStart::Lead(lease)) => {
                self.check_single_leader(served.node, life, key, lease)?;
                self.report.fills_led += 1;
                let due = self.step + draw(&mut self.rng, FILL_STEPS);
                Task::Leading(Lead { node: served.node, life, key, lease, due })
            }
            Ok(FillStart::Join(ticket)) => {
                self.report.fills_joined += 1;
                Task::Waiting(Wait { node: served.node, life, key, ticket, since: self.step })
            }
            Err(_) => {
                self.report.fills_refused += 1;
                Task::Idle
            }
        };
        self.clients[c].task = task;
        Ok(())
    }

    /// Leaders whose block is ready PUT it to the fill's node at the fill's epoch and report.
    fn finish_due_fills(&mut self) {
        for c in 0..self.clients.len() {
            if let Task::Leading(lead) = self.clients[c].task
                && lead.due <= self.step
            {
                self.clients[c].task = Task::Idle;
                self.finish_fill(c, lead);
            }
        }
    }

    fn finish_fill(&mut self, c: usize, lead: Lead) {
        let epoch = lead.lease.ticket.epoch.0;
        self.leaders.remove(&(lead.node, lead.life, lead.key, epoch));
        let node = &self.nodes[lead.node];
        if !node.running || node.life != lead.life {
            self.report.fills_lost += 1;
            return;
        }
        let admitted = node.fence.check(epoch, true).is_ok() && self.admits(lead.node, lead.key);
        let stored =
            admitted && self.store_new_version(c, Served { node: lead.node, epoch }, lead.key);
        let outcome = if stored { FillOutcome::Stored } else { FillOutcome::GaveUp };
        let notice = self.nodes[lead.node].directory.finish_fill(&lead.lease, outcome, self.now_ms);
        self.count_notice(notice);
    }

    fn count_notice(&mut self, notice: FillNotice) {
        match notice {
            FillNotice::Pending => {}
            FillNotice::Finished => self.report.fills_finished += 1,
            FillNotice::Failed => self.report.fills_failed += 1,
            FillNotice::Fenced => self.report.fenced_notices += 1,
        }
    }

    /// A joiner looks at its fill: finished means GET again (it is not a hit), failed means it
    /// may fill the key itself, fenced means nothing can be assumed and it gives up.
    fn poll_fill(&mut self, c: usize, wait: Wait) -> Result<(), SimFailure> {
        let node = &self.nodes[wait.node];
        if !node.running || node.life != wait.life {
            self.report.fills_lost += 1;
            self.clients[c].task = Task::Idle;
            return Ok(());
        }
        let notice = node.directory.notice(&wait.ticket);
        if notice == FillNotice::Pending {
            if self.step - wait.since > JOIN_WAIT_STEPS_MAX {
                self.clients[c].task = Task::Idle;
            }
            return Ok(());
        }
        self.clients[c].task = Task::Idle;
        self.count_notice(notice);
        match notice {
            FillNotice::Finished => self.get(c, wait.key, false),
            FillNotice::Failed => self.get(c, wait.key, true),
            FillNotice::Pending | FillNotice::Fenced => Ok(()),
        }
    }

    // ---- Checks ----

    /// Rules 1 and 2: the bytes were written for this key, and they are the newest version
    /// acknowledged before this GET by a PUT at an epoch no later than the GET's.
    fn check_hit(
        &mut self,
        c: usize,
        key: usize,
        served: Served,
        stored: Stored,
    ) -> Result<(), SimFailure> {
        let log = &self.logs[key];
        if stored.bytes != bytes_of(key, stored.version) || !log.was_written(stored.version) {
            let detail = format!(
                "GET of key {key} from node {} returned version {} with bytes {:#x}, which no PUT \
                 wrote",
                served.node, stored.version, stored.bytes
            );
            return Err(self.fail(SimCheck::WrongHit, detail));
        }
        match log.newest_up_to(served.epoch).copied() {
            Some(want) if want.version != stored.version => {
                let detail = self.stale_story(c, key, served, stored, want);
                Err(self.fail(SimCheck::StaleHit, detail))
            }
            Some(_) => Ok(()),
            None if log.forgot => {
                self.report.unchecked_hits += 1;
                Ok(())
            }
            None => {
                let detail = format!(
                    "GET of key {key} at epoch {} hit version {} on node {}, but no PUT at that \
                     epoch or before was acknowledged",
                    served.epoch, stored.version, served.node
                );
                Err(self.fail(SimCheck::WrongHit, detail))
            }
        }
    }

    /// How a stale hit came about: the key's acknowledged PUTs, its owners in the recent
    /// views, and when the nodes involved applied them.
    fn stale_story(&self, c: usize, key: usize, served: Served, got: Stored, want: Ack) -> String {
        let log = &self.logs[key];
        let mut s = format!(
            "client {c} GET key {key} at epoch {} from node {} and hit version {}, but version {} \
             was acknowledged before, at epoch {} <= {}.",
            served.epoch, served.node, got.version, want.version, want.epoch, served.epoch
        );
        if got.kept {
            let _ = write!(s, "\n  node {} {KEPT_COPY}.", served.node);
        }
        let server = &self.nodes[served.node];
        if got.unsettled || !server.fence.servable(&self.keys[key]) {
            let _ = write!(
                s,
                "\n  node {} {UNSETTLED} (it is at epoch {}, settled {}; the copy was written \
                 {}).",
                served.node,
                server.fence.epoch(),
                server.fence.settled(),
                if got.unsettled { "before it settled" } else { "after it settled" }
            );
        }
        s.push_str("\n  the latest acknowledged PUTs of the key, oldest first:");
        let recent: Vec<&Ack> = log.acks.iter().rev().take(STORY_ACKS).collect();
        let mut involved = vec![self.nodes[served.node].id];
        for a in recent.iter().rev() {
            let _ = write!(
                s,
                "\n    version {} at step {}: client {} at epoch {}, node {}",
                a.version, a.step, a.client, a.epoch, a.node.0
            );
            if !involved.contains(&a.node) {
                involved.push(a.node);
            }
        }
        let oldest = recent.iter().map(|a| a.epoch).min().unwrap_or(served.epoch);
        let since: Vec<&Made> =
            self.coord.recent.iter().rev().filter(|m| m.view.epoch + 1 >= oldest).collect();
        s.push_str("\n  the latest views (epoch, step, change, owner of the key):");
        let shown: Vec<&Made> = since.into_iter().take(STORY_VIEWS).rev().collect();
        // The settled epochs since the first view told (or the first acknowledgement).
        let first_step = shown
            .first()
            .map(|m| m.step)
            .into_iter()
            .chain(recent.last().map(|a| a.step))
            .min()
            .unwrap_or(self.step);
        for made in shown {
            let owner = made.view.placement().owner(&self.keys[key]).map(|n| n.0);
            let _ = write!(
                s,
                "\n    epoch {} at step {}: {}; owner {owner:?}",
                made.view.epoch, made.step, made.what
            );
        }
        let settled: Vec<&(u64, u64)> =
            self.coord.settled_log.iter().filter(|(step, _)| *step >= first_step).collect();
        let _ = write!(s, "\n  the coordinator's settled epoch rose (step, epoch): {settled:?}");
        s.push_str(
            "\n  the nodes involved: view applies (step, epoch), then settled epochs (step, epoch):",
        );
        for id in involved {
            let node = &self.nodes[slot(id)];
            let _ = write!(s, "\n    node {}: {:?}; {:?}", id.0, node.applies, node.settles);
        }
        s
    }

    /// Rule 3: a join moves exactly the keys the joiner now owns, about 1/(N+1) of them; a
    /// leave moves exactly the leaver's keys; a change of one member's entry moves nothing.
    fn check_moves(&mut self, change: &Change, next: &ClusterView) -> Result<(), SimFailure> {
        let placement = next.placement();
        if placement == self.sample.placement {
            return Ok(());
        }
        let owners: Vec<Option<NodeId>> =
            self.sample.keys.iter().map(|k| placement.owner(k)).collect();
        let before = &self.sample.owners;
        let moved: Vec<usize> = (0..owners.len()).filter(|&i| owners[i] != before[i]).collect();
        let must: Vec<usize> = match change {
            Change::Join(m) => (0..owners.len()).filter(|&i| owners[i] == Some(m.node)).collect(),
            Change::Leave { node, .. } => {
                (0..owners.len()).filter(|&i| before[i] == Some(*node)).collect()
            }
            Change::Update { .. } => Vec::new(),
        };
        if moved != must {
            let detail = format!(
                "{} moved {} sample keys where it had to move {} (first moved: {:?}, first due: \
                 {:?})",
                change.describe(),
                moved.len(),
                must.len(),
                moved.first(),
                must.first()
            );
            return Err(self.fail(SimCheck::Rebalance, detail));
        }
        if let Change::Join(m) = change {
            self.check_join_share(m.node, moved.len(), next.members.len())?;
        }
        let fraction = moved.len() as f64 / owners.len() as f64;
        self.report.max_moved_fraction = self.report.max_moved_fraction.max(fraction);
        self.sample.moved =
            moved.into_iter().filter(|&i| i < self.keys.len()).take(MOVED_KEPT).collect();
        self.sample.owners = owners;
        self.sample.placement = placement;
        Ok(())
    }

    /// A joiner of a cluster of `members` wins about 1/`members` of the sample: the count is
    /// binomial, so anything within six standard deviations (and at least one key) is sane.
    fn check_join_share(
        &self,
        joiner: NodeId,
        moved: usize,
        members: usize,
    ) -> Result<(), SimFailure> {
        let expected = SAMPLE_KEYS as f64 / members as f64;
        let slack = 6.0 * expected.sqrt() + 1.0;
        let got = moved as f64;
        if moved >= 1 && (got - expected).abs() <= slack {
            return Ok(());
        }
        let detail = format!(
            "node {} joined {members} members and won {moved} of {SAMPLE_KEYS} sample keys; \
             about {expected:.1} (within {slack:.1}) was due",
            joiner.0
        );
        Err(self.fail(SimCheck::Rebalance, detail))
    }

    /// Rule 4: every directory holds exactly one fill's cost per fill in flight, so its pool
    /// is full whenever nothing is in flight (fenced, failed and finished fills gave theirs
    /// back, and joiners were never charged).
    fn check_credits(&self) -> Result<(), SimFailure> {
        for node in self.nodes.iter().filter(|n| n.running) {
            let in_flight = node.directory.stats().in_flight;
            let held = node.directory.credits().usage().total;
            if held != fills_cost(in_flight) {
                let detail = format!(
                    "node {} holds {held:?} of its credits with {in_flight} fills in flight, each \
                     charged {FILL_COST:?}",
                    node.id.0
                );
                return Err(self.fail(SimCheck::Credits, detail));
            }
        }
        Ok(())
    }

    /// Rule 5: a directory hands out a lead for a key only when no earlier leader of that key
    /// at that epoch on that node is still filling it.
    fn check_single_leader(
        &mut self,
        node: usize,
        life: u64,
        key: usize,
        lease: FillLease,
    ) -> Result<(), SimFailure> {
        let at = (node, life, key, lease.ticket.epoch.0);
        if let Some(earlier) = self.leaders.get(&at)
            && self.nodes[node].directory.notice(earlier) == FillNotice::Pending
        {
            let detail = format!(
                "node {node} made fill {} the leader of key {key} at epoch {} while fill {} still \
                 leads it",
                lease.ticket.fill, at.3, earlier.fill
            );
            return Err(self.fail(SimCheck::SingleFlight, detail));
        }
        self.leaders.insert(at, lease.ticket);
        Ok(())
    }
}

fn check_config(cfg: &SimConfig) -> Result<(), SimFailure> {
    let broken = if cfg.nodes < 8 || cfg.nodes > NODES_MAX / 2 {
        Some(format!("{} nodes; 8 to {} are simulated", cfg.nodes, NODES_MAX / 2))
    } else if cfg.clients == 0 || cfg.clients > CLIENTS_MAX {
        Some(format!("{} clients; 1 to {CLIENTS_MAX} are simulated", cfg.clients))
    } else if cfg.keys == 0 || cfg.keys > KEYS_MAX {
        Some(format!("{} keys; 1 to {KEYS_MAX} are simulated", cfg.keys))
    } else {
        None
    };
    match broken {
        None => Ok(()),
        Some(detail) => {
            Err(SimFailure { seed: cfg.seed, step: 0, check: SimCheck::Config, detail })
        }
    }
}
