//! The whole simulated cluster ([`Sim`]): its nodes, clients and coordinator, the membership
//! and fault events that move it, and the delivery of views and settled epochs. The clients'
//! requests are in `requests.rs`, the rules checked after every step in `checks.rs`.

use std::collections::BTreeMap;
use std::rc::Rc;

use gpucache_dataplane::key::KeyDigest;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::shard::{ClusterView, FillTicket, MemberState, NodeId, Placement};

use super::client::{Client, KeyLog, Task};
use super::config::{
    NODES_MAX, SAMPLE_KEYS, STEP_MS, SimCheck, SimConfig, SimFailure, SimReport, check_config,
};
use super::coordinator::{Coordinator, Made, MembershipChange, ViewChange};
use super::mail::{AppliedRecord, Inbox};
use super::node::{Applied, Node};

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

/// Runs the simulation `config` describes, to its last step or its first broken rule.
pub fn run(config: &SimConfig) -> Result<SimReport, SimFailure> {
    run_watched(config, &mut |_| {})
}

/// Runs the simulation as [`run`] does, and hands `watch` every change of membership the
/// coordinator asks of the rules, with what they answered, in the order it asked.
pub fn run_watched(
    config: &SimConfig,
    watch: &mut dyn FnMut(&ViewChange<'_>),
) -> Result<SimReport, SimFailure> {
    let mut sim = Sim::new(config, watch)?;
    for step in 1..=config.steps {
        sim.step = step;
        sim.now_ms = step * STEP_MS;
        sim.one_step()?;
    }
    Ok(sim.finish())
}

/// The digest of the `i`-th key (of the clients' keys and of the sample alike).
fn key_digest(i: usize) -> KeyDigest {
    KeyDigest::of(format!("key {i}").as_bytes())
}

pub(super) fn draw(rng: &mut SplitMix64, (lo, hi): (u64, u64)) -> u64 {
    rng.range(lo, hi)
}

/// The sample's owners under the coordinator's current view.
#[derive(Debug)]
pub(super) struct Sample {
    pub(super) keys: Vec<KeyDigest>,
    pub(super) placement: Placement,
    pub(super) owners: Vec<Option<NodeId>>,
    /// The clients' keys the last change of the member set moved (at most `MOVED_KEPT`).
    pub(super) moved: Vec<usize>,
}

/// The node that served a request, and the epoch the request was routed by.
#[derive(Debug, Clone, Copy)]
pub(super) struct Served {
    pub(super) node: usize,
    pub(super) epoch: u64,
}

/// The whole simulated cluster.
pub(super) struct Sim<'w> {
    pub(super) cfg: SimConfig,
    pub(super) rng: SplitMix64,
    pub(super) step: u64,
    pub(super) now_ms: u64,
    pub(super) keys: Vec<KeyDigest>,
    pub(super) logs: Vec<KeyLog>,
    pub(super) coord: Coordinator,
    pub(super) nodes: Vec<Node>,
    pub(super) clients: Vec<Client>,
    pub(super) sample: Sample,
    /// The leader each directory gave out last per (node, life, key, epoch). A client leads
    /// one fill at a time and its entry goes when it reports, so this holds at most
    /// [`CLIENTS_MAX`](super::CLIENTS_MAX) entries.
    pub(super) leaders: BTreeMap<(usize, u64, usize, u64), FillTicket>,
    pub(super) report: SimReport,
    /// Sees every change of membership the coordinator asks for.
    watch: &'w mut dyn FnMut(&ViewChange<'_>),
}

impl<'w> Sim<'w> {
    fn new(cfg: &SimConfig, watch: &'w mut dyn FnMut(&ViewChange<'_>)) -> Result<Self, SimFailure> {
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
            coord: Coordinator::new(&view),
            nodes,
            clients,
            sample: Sample { keys: sample_keys, placement, owners, moved: Vec::new() },
            leaders: BTreeMap::new(),
            report: SimReport::default(),
            watch,
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

    pub(super) fn fail(&self, check: SimCheck, detail: String) -> SimFailure {
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

    /// A node that has (re)started joins as the real registration does: it enters the view,
    /// or its new life replaces its entry if the view still lists it; then it holds its
    /// registration.
    fn register(&mut self, n: usize) -> Result<(), SimFailure> {
        let node = &self.nodes[n];
        let why = if self.coord.is_member(node.id) { "restarted" } else { "joined" };
        self.change(MembershipChange::Join(node.entry(MemberState::Serving)), why)?;
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
        let Some(Some(node_epoch)) = self.coord.live.get(n).copied() else { return Ok(()) };
        let node = &self.nodes[n];
        if node.running && node.fence.is_registered() && node.node_epoch == node_epoch {
            let detail = format!(
                "the coordinator let the lease of node {} (node epoch {}) go while the node, at \
                 epoch {}, still admitted under it",
                node.id.0,
                node_epoch,
                node.fence.epoch()
            );
            return Err(self.fail(SimCheck::Lease, detail));
        }
        self.coord.let_go(n);
        Ok(())
    }

    fn leave_one(&mut self) -> Result<(), SimFailure> {
        let (fewest, _) = self.member_bounds();
        if !self.coord.is_up() || self.coord.view.members.len() <= fewest {
            return Ok(());
        }
        let candidates = self.nodes_where(|n| self.settled_member(n));
        let Some(n) = self.choose(&candidates) else { return Ok(()) };
        // A graceful leave is a shutdown: the node stops serving, takes this life of itself
        // out of the view, and gives its lease up (even when the rules refuse the removal).
        let node = &self.nodes[n];
        let change = MembershipChange::RemoveLife { node: node.id, node_epoch: node.node_epoch };
        self.nodes[n].crash(self.step, None);
        self.change(change, "graceful")?;
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
        if self.change(MembershipChange::Drain(self.nodes[n].id), "for an upgrade")? {
            self.nodes[n].drain_until = Some(until);
        }
        Ok(())
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
        let listed = self.coord.view.member(id).map(|m| m.node_epoch);
        if node.wants_registration {
            return self.register(n);
        }
        if !node.running
            && let Some(node_epoch) = listed
            && step >= node.down_since + DETECT_STEPS
        {
            // Its lease ran out: its liveness record goes, and a member removes the life the
            // view lists, as the real registration removes a dead member.
            self.let_lease_go(n)?;
            let change = MembershipChange::RemoveLife { node: id, node_epoch };
            return self.change(change, "crashed").map(drop);
        }
        if node.lapse_at.is_some_and(|at| step >= at) {
            self.nodes[n].lapse_at = None;
            self.report.lease_lapses += 1;
            self.let_lease_go(n)?;
        }
        let node = &self.nodes[n];
        if node.reregister_at.is_some_and(|at| step >= at) {
            return self.reregister(n);
        }
        if node.drain_until.is_some_and(|until| step >= until) {
            self.nodes[n].drain_until = None;
            if listed.is_some() {
                return self.change(MembershipChange::Finish(id), "drained").map(drop);
            }
        }
        Ok(())
    }

    /// A node that lost its lease registers again, under a new registration number: its new
    /// life joins as a real registration does, replacing the entry of the old one.
    fn reregister(&mut self, n: usize) -> Result<(), SimFailure> {
        let node = &mut self.nodes[n];
        node.reregister_at = None;
        node.node_epoch += 1;
        let change = MembershipChange::Join(node.entry(MemberState::Serving));
        self.change(change, "registered again")?;
        self.start_life(n);
        Ok(())
    }

    /// The coordinator asks the real rule for the next view, and the watcher sees what it
    /// answered. A next view is checked for what it moves, installed and sent out; a change
    /// the rules refuse leaves the view as it is, as it does on the real coordinator. Answers
    /// whether a view was made.
    fn change(&mut self, change: MembershipChange, why: &str) -> Result<bool, SimFailure> {
        let before = Rc::clone(&self.coord.view);
        let outcome = change.apply(&before);
        (self.watch)(&ViewChange {
            step: self.step,
            before: &before,
            change: &change,
            outcome: &outcome,
        });
        let next = match outcome {
            Ok(Some(next)) => Rc::new(next),
            Ok(None) => return Ok(false),
            Err(_) => {
                self.report.refused_changes += 1;
                return Ok(false);
            }
        };
        let what = change.describe(why);
        self.check_moves(&change, &what, &before, &next)?;
        match &change {
            MembershipChange::Join(m) if before.member(m.node).is_none() => self.report.joins += 1,
            MembershipChange::Join(_) => {}
            MembershipChange::RemoveLife { .. } | MembershipChange::Finish(_) => {
                self.report.leaves += 1;
            }
            MembershipChange::Drain(_) => self.report.drains += 1,
        }
        self.coord.install(Made { step: self.step, what, view: Rc::clone(&next) });
        self.publish(&next);
        Ok(true)
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
}
