//! What travels between the parts of the simulated cluster, late: views to nodes and clients
//! ([`Inbox`]), settled epochs to nodes and applied epochs to the coordinator ([`Mailbox`]).

use std::collections::VecDeque;
use std::rc::Rc;

use gpucache_dataplane::shard::ClusterView;

/// Views waiting for one receiver; a full inbox drops its oldest view (the receiver will skip
/// that epoch, as a watcher does after its stream is compacted).
const INBOX_MAX: usize = 32;

/// Numbers on their way somewhere (settled epochs to a node, applied epochs to the
/// coordinator), each with the step it arrives in; arrival steps never go down. A full queue
/// drops its oldest entry: every entry is superseded by a later one.
#[derive(Debug)]
pub(super) struct Mailbox<T> {
    queue: VecDeque<(u64, T)>,
}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Self { queue: VecDeque::new() }
    }
}

impl<T> Mailbox<T> {
    pub(super) fn push(&mut self, at: u64, item: T) {
        let at = self.queue.back().map_or(at, |(last, _)| at.max(*last));
        if self.queue.len() >= INBOX_MAX {
            self.queue.pop_front();
        }
        self.queue.push_back((at, item));
    }

    /// The next entry that has arrived by `step`.
    pub(super) fn pop_due(&mut self, step: u64) -> Option<T> {
        if self.queue.front().is_some_and(|(at, _)| *at <= step) {
            self.queue.pop_front().map(|(_, item)| item)
        } else {
            None
        }
    }
}

/// One publication of an applied epoch: which life of the node says it applied which epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct AppliedRecord {
    pub(super) node_epoch: u64,
    pub(super) epoch: u64,
}

/// Views on their way to one receiver, in the order they were sent, each with the step it
/// arrives in. Arrival steps never go down, as on one watch stream.
#[derive(Debug, Default)]
pub(super) struct Inbox {
    queue: VecDeque<(u64, Rc<ClusterView>)>,
}

impl Inbox {
    /// Queues `view` to arrive at `at` (or with the view before it); answers whether a full
    /// inbox dropped its oldest view to make room.
    pub(super) fn push(&mut self, at: u64, view: Rc<ClusterView>) -> bool {
        let at = self.queue.back().map_or(at, |(last, _)| at.max(*last));
        let dropped = self.queue.len() >= INBOX_MAX && self.queue.pop_front().is_some();
        self.queue.push_back((at, view));
        dropped
    }

    /// The views that have arrived by `step`, oldest first.
    pub(super) fn take_due(&mut self, step: u64) -> Vec<Rc<ClusterView>> {
        let mut due = Vec::new();
        while self.queue.front().is_some_and(|(at, _)| *at <= step) {
            if let Some((_, view)) = self.queue.pop_front() {
                due.push(view);
            }
        }
        due
    }
}
