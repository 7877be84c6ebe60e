//! The rules checked after every step, each a [`SimCheck`]: hits neither wrong nor stale,
//! changes of membership that move only the keys they must, credits that come back, and one
//! fill leader per key at a time. (The lease rule is checked where the coordinator lets a
//! lease go, in `world.rs`.)

use std::fmt::Write as _;

use gpucache_dataplane::credits::Credits;
use gpucache_dataplane::shard::{ClusterView, FillLease, FillNotice, NodeId};

use super::client::{Ack, bytes_of};
use super::config::{KEPT_COPY, SAMPLE_KEYS, SimCheck, SimFailure, UNSETTLED};
use super::coordinator::{Made, MembershipChange};
use super::node::{FILL_COST, Stored, slot};
use super::requests::MOVED_KEPT;
use super::world::{Served, Sim};

/// Acknowledgements and views a stale hit's story tells, at most.
const STORY_ACKS: usize = 6;
const STORY_VIEWS: usize = 12;

/// `n` fills' worth of credits.
fn fills_cost(n: usize) -> Credits {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    Credits::new(FILL_COST.operations * n, FILL_COST.host_blocks * n)
}

impl Sim<'_> {
    /// Rules 1 and 2: the bytes were written for this key, and they are the newest version
    /// acknowledged before this GET by a PUT at an epoch no later than the GET's.
    pub(super) fn check_hit(
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

    /// Rule 3: a node that enters the view moves exactly the keys it now owns, about 1/(N+1)
    /// of them; a node that leaves moves exactly its own keys; a change of one member's entry
    /// (a drain, or a new life of a listed node) moves nothing. `what` tells the change.
    pub(super) fn check_moves(
        &mut self,
        change: &MembershipChange,
        what: &str,
        before: &ClusterView,
        next: &ClusterView,
    ) -> Result<(), SimFailure> {
        let placement = next.placement();
        let unchanged = placement == self.sample.placement;
        let owners: Vec<Option<NodeId>> = if unchanged {
            self.sample.owners.clone()
        } else {
            self.sample.keys.iter().map(|k| placement.owner(k)).collect()
        };
        let was = &self.sample.owners;
        let moved: Vec<usize> = (0..owners.len()).filter(|&i| owners[i] != was[i]).collect();
        let entered = match change {
            MembershipChange::Join(m) if before.member(m.node).is_none() => Some(m.node),
            _ => None,
        };
        let left = match change {
            MembershipChange::RemoveLife { node, .. } | MembershipChange::Finish(node) => {
                Some(*node)
            }
            MembershipChange::Join(_) | MembershipChange::Drain(_) => None,
        };
        let must: Vec<usize> = (0..owners.len())
            .filter(|&i| {
                entered.is_some_and(|n| owners[i] == Some(n))
                    || left.is_some_and(|n| was[i] == Some(n))
            })
            .collect();
        if moved != must {
            let detail = format!(
                "{what} moved {} sample keys where it had to move {} (first moved: {:?}, first \
                 due: {:?})",
                moved.len(),
                must.len(),
                moved.first(),
                must.first()
            );
            return Err(self.fail(SimCheck::Rebalance, detail));
        }
        if unchanged {
            // Nothing moved: the keys the last change of the member set moved stay in play.
            return Ok(());
        }
        if let Some(joiner) = entered {
            self.check_join_share(joiner, moved.len(), next.members.len())?;
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
    pub(super) fn check_credits(&self) -> Result<(), SimFailure> {
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
    pub(super) fn check_single_leader(
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
