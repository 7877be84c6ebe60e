//! The simulated coordinator, standing for etcd: the view, each node's liveness and applied
//! records, and the membership changes it makes. It decides nothing itself: every change of
//! the view is computed by one of this crate's rules ([`crate::changes`]), and the settled
//! epoch by [`changes::settled`], the function the real [`Coordinator`](crate::Coordinator)
//! uses.

use std::collections::VecDeque;
use std::rc::Rc;

use gpucache_dataplane::shard::{ClusterView, NodeId, ViewMember};

use super::mail::AppliedRecord;
use super::node::slot;
use crate::changes::{self, Change};

/// Recent views the coordinator keeps, to explain a failure.
const VIEWS_KEPT: usize = 64;

/// A change of membership the simulated coordinator asks for. Each names one rule of
/// [`crate::changes`], which computes the next view from the current one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipChange {
    /// [`changes::join`]: a node enters the view, or a new life of a node the view still
    /// lists replaces its entry (a restart, or a new registration after a lost lease), as a
    /// real registration does.
    Join(ViewMember),
    /// [`changes::remove_life`]: one life of a node leaves, gracefully or because its lease
    /// ran out after a crash.
    RemoveLife { node: NodeId, node_epoch: u64 },
    /// [`changes::drain`]: a member starts draining.
    Drain(NodeId),
    /// [`changes::finish`]: a drained member leaves.
    Finish(NodeId),
}

impl MembershipChange {
    /// The next view, as the rule this change names computes it from `view`.
    pub(super) fn apply(&self, view: &ClusterView) -> Change {
        match self {
            Self::Join(member) => changes::join(view, member),
            Self::RemoveLife { node, node_epoch } => changes::remove_life(view, *node, *node_epoch),
            Self::Drain(node) => changes::drain(view, *node),
            Self::Finish(node) => changes::finish(view, *node),
        }
    }

    /// The change in words, with `why` it was made, for a failure's story.
    pub(super) fn describe(&self, why: &str) -> String {
        match self {
            Self::Join(m) => {
                format!("node {} joins at node epoch {} ({why})", m.node.0, m.node_epoch)
            }
            Self::RemoveLife { node, node_epoch } => {
                format!("node {} leaves from node epoch {node_epoch} ({why})", node.0)
            }
            Self::Drain(node) => format!("node {} drains ({why})", node.0),
            Self::Finish(node) => format!("node {} leaves ({why})", node.0),
        }
    }
}

/// One change the simulated coordinator asked of the rules, as the watcher given to
/// [`run_watched`](super::run_watched) sees it.
#[derive(Debug, Clone, Copy)]
pub struct ViewChange<'a> {
    /// The step it was made in.
    pub step: u64,
    /// The view it was computed from: the coordinator's view at that moment.
    pub before: &'a ClusterView,
    pub change: &'a MembershipChange,
    /// What the rule answered: the next view, which the coordinator installed and sent out;
    /// none, when nothing changed; or a refusal, which left the view as it was.
    pub outcome: &'a Change,
}

/// A view the coordinator made, with what made it.
#[derive(Debug)]
pub(super) struct Made {
    pub(super) step: u64,
    pub(super) what: String,
    pub(super) view: Rc<ClusterView>,
}

/// The stand-in for etcd.
#[derive(Debug)]
pub(super) struct Coordinator {
    pub(super) view: Rc<ClusterView>,
    pub(super) down_until: Option<u64>,
    pub(super) recent: VecDeque<Made>,
    /// Per node slot, the node epoch of the life that holds a liveness record (etcd's
    /// `members/`; none: no live lease).
    pub(super) live: Vec<Option<u64>>,
    /// Per node slot, the applied epoch its live life last published (etcd's `applied/`,
    /// written under the same lease, so it goes with the liveness record).
    applied: Vec<Option<AppliedRecord>>,
    /// The largest settled epoch it computed, and (step, epoch) of its recent rises.
    pub(super) settled: u64,
    pub(super) settled_log: VecDeque<(u64, u64)>,
}

impl Coordinator {
    /// A coordinator whose view is `view`, with no liveness record yet.
    pub(super) fn new(view: &Rc<ClusterView>) -> Self {
        Self {
            view: Rc::clone(view),
            down_until: None,
            recent: VecDeque::new(),
            live: Vec::new(),
            applied: Vec::new(),
            settled: 0,
            settled_log: VecDeque::new(),
        }
    }

    pub(super) fn is_up(&self) -> bool {
        self.down_until.is_none()
    }

    pub(super) fn install(&mut self, made: Made) {
        if self.recent.len() == VIEWS_KEPT {
            self.recent.pop_front();
        }
        self.view = Rc::clone(&made.view);
        self.recent.push_back(made);
    }

    pub(super) fn is_member(&self, node: NodeId) -> bool {
        self.view.member(node).is_some()
    }

    /// A new life of the node in slot `n` holds a lease: it has published nothing yet (an
    /// applied record of an earlier life does not count for it).
    pub(super) fn register_life(&mut self, n: usize, node_epoch: u64) {
        if self.live.len() <= n {
            self.live.resize(n + 1, None);
            self.applied.resize(n + 1, None);
        }
        self.live[n] = Some(node_epoch);
    }

    /// The lease of the node in slot `n` is gone, and both records under it with it.
    pub(super) fn let_go(&mut self, n: usize) {
        if let Some(life) = self.live.get_mut(n) {
            *life = None;
            self.applied[n] = None;
        }
    }

    /// Takes a publication: only the live life that made it may write it.
    pub(super) fn take_applied(&mut self, n: usize, published: AppliedRecord) {
        if self.live.get(n) != Some(&Some(published.node_epoch)) {
            return;
        }
        let record = &mut self.applied[n];
        let epoch = match *record {
            Some(r) if r.node_epoch == published.node_epoch => r.epoch.max(published.epoch),
            _ => published.epoch,
        };
        *record = Some(AppliedRecord { node_epoch: published.node_epoch, epoch });
    }

    /// Reads the settled epoch as the real coordinator computes it ([`changes::settled`]: the
    /// least epoch applied by the current life of each live record, 0 for a life that has
    /// published nothing, 0 when no record is live); answers the largest it ever read. That
    /// one stays true: a life that registers later applies the view its registration made,
    /// which is no older, before it admits anything.
    pub(super) fn compute_settled(&mut self, step: u64) -> u64 {
        let lives = self
            .live
            .iter()
            .enumerate()
            .filter_map(|(n, life)| life.map(|node_epoch| (NodeId(n as u64), node_epoch)));
        let applied = &self.applied;
        let least = changes::settled(lives, |node, node_epoch| {
            let record = applied.get(slot(node)).copied().flatten()?;
            (record.node_epoch == node_epoch).then_some(record.epoch)
        });
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
