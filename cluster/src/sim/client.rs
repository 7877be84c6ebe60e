//! One simulated client (its view, its placement and what it is doing), and the log of what
//! was written to each key, which the hit checks read.

use std::collections::VecDeque;
use std::rc::Rc;

use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::shard::{ClusterView, FillLease, FillTicket, NodeId, Placement};

use super::mail::Inbox;

/// Acknowledged PUTs kept per key for the hit checks.
const ACKS_KEPT: usize = 64;

/// The bytes of `version` of `key`, as one number standing for a digest of them.
pub(super) fn bytes_of(key: usize, version: u64) -> u64 {
    SplitMix64::mix(&[key as u64, version])
}

/// A fill a client leads: it PUTs the block at `due` and reports.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lead {
    pub(super) node: usize,
    pub(super) life: u64,
    pub(super) key: usize,
    pub(super) lease: FillLease,
    pub(super) due: u64,
}

/// A fill a client joined: it polls the directory for the outcome.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    pub(super) node: usize,
    pub(super) life: u64,
    pub(super) key: usize,
    pub(super) ticket: FillTicket,
    pub(super) since: u64,
}

/// What a client is doing besides being free to send a request.
#[derive(Debug, Clone, Copy)]
pub(super) enum Task {
    Idle,
    Leading(Lead),
    Waiting(Wait),
}

#[derive(Debug)]
pub(super) struct Client {
    pub(super) view: Rc<ClusterView>,
    pub(super) placement: Placement,
    pub(super) inbox: Inbox,
    pub(super) task: Task,
}

impl Client {
    pub(super) fn adopt(&mut self, view: Rc<ClusterView>) {
        if view.epoch > self.view.epoch {
            self.placement = view.placement();
            self.view = view;
        }
    }
}

/// One acknowledged PUT.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ack {
    pub(super) version: u64,
    pub(super) epoch: u64,
    pub(super) node: NodeId,
    pub(super) client: usize,
    pub(super) step: u64,
}

/// What was written to one key: the last version handed out and the recent acknowledgements,
/// in the order they were given.
#[derive(Debug, Default)]
pub(super) struct KeyLog {
    versions: u64,
    pub(super) acks: VecDeque<Ack>,
    /// Older acknowledgements were let go to keep the log bounded.
    pub(super) forgot: bool,
}

impl KeyLog {
    pub(super) fn next_version(&mut self) -> u64 {
        self.versions += 1;
        self.versions
    }

    pub(super) fn ack(&mut self, ack: Ack) {
        if self.acks.len() == ACKS_KEPT {
            self.acks.pop_front();
            self.forgot = true;
        }
        self.acks.push_back(ack);
    }

    /// Whether `version` was acknowledged (or may have been, before the log let go of it).
    pub(super) fn was_written(&self, version: u64) -> bool {
        self.acks.iter().any(|a| a.version == version)
            || (self.forgot && self.acks.front().is_some_and(|a| version < a.version))
    }

    /// The newest acknowledgement of a PUT sent at `epoch` or before.
    pub(super) fn newest_up_to(&self, epoch: u64) -> Option<&Ack> {
        self.acks.iter().rev().find(|a| a.epoch <= epoch)
    }
}
