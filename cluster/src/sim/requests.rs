//! What the clients do: GETs and PUTs routed by their own view, refreshed when a node says
//! it is stale, and the fills that follow a miss.

use std::rc::Rc;

use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::shard::{FenceRefusal, FillNotice, FillOutcome, FillStart, NotAdmitting};

use super::client::{Ack, Lead, Task, Wait, bytes_of};
use super::config::SimFailure;
use super::node::{Stored, slot};
use super::world::{Served, Sim, draw};

/// Times a client refreshes its view and retries one request.
const RETRIES_MAX: usize = 3;
/// Steps a fill's leader takes to PUT the block: the slowest outlast the fill's lease and
/// fail.
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
pub(super) const MOVED_KEPT: usize = 64;
/// How often an idle client issues a request, and how many of those are PUTs.
const OP_CHANCE: f64 = 0.6;
const PUT_SHARE: f64 = 0.3;

impl Sim<'_> {
    pub(super) fn client_turn(&mut self, c: usize) -> Result<(), SimFailure> {
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
    pub(super) fn finish_due_fills(&mut self) {
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
}
