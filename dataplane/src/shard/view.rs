//! [`ClusterView`]: the membership every client and node routes by, and its epoch.
//!
//! The view is the one record a cluster agrees on (kept in etcd by the `cluster` crate): the
//! members with their addresses, and a number that advances on every change. A client places
//! keys over the view's members; a node serves only requests sent under its view's epoch.

use super::control::NodeId;
use super::placement::Placement;

/// Whether a member takes new blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemberState {
    Serving,
    /// Being drained for an upgrade: it still owns and serves its keys, but admits nothing
    /// new; finishing the drain removes it from the view.
    Draining,
}

impl MemberState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Serving => "serving",
            Self::Draining => "draining",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "serving" => Some(Self::Serving),
            "draining" => Some(Self::Draining),
            _ => None,
        }
    }
}

/// One member as the view records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewMember {
    pub node: NodeId,
    /// Where clients reach its service (`host:port`).
    pub address: String,
    pub fault_domain: String,
    /// Bytes it offers.
    pub capacity: u64,
    /// Its registration's number: a node that restarts or loses its lease comes back with a
    /// larger one, so a view never confuses two lives of one node.
    pub node_epoch: u64,
    pub state: MemberState,
}

/// The members and the epoch of one membership.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// Advances by one on every change of the members (or of a member's state).
    pub epoch: u64,
    /// Sorted by node, one entry per node.
    pub members: Vec<ViewMember>,
}

impl ClusterView {
    /// A view of `members` at `epoch` (sorted by node; a node named twice keeps its last
    /// entry).
    pub fn new(epoch: u64, members: impl IntoIterator<Item = ViewMember>) -> Self {
        let mut members: Vec<ViewMember> = members.into_iter().collect();
        members.reverse();
        members.sort_by_key(|m| m.node);
        members.dedup_by_key(|m| m.node);
        Self { epoch, members }
    }

    pub fn member(&self, node: NodeId) -> Option<&ViewMember> {
        self.members.binary_search_by_key(&node, |m| m.node).ok().map(|i| &self.members[i])
    }

    /// Keys are placed over every member, draining ones included: a draining node still
    /// serves what it holds until it is removed.
    pub fn placement(&self) -> Placement {
        Placement::new(self.members.iter().map(|m| m.node))
    }

    /// The same members at the next epoch, with `change` applied.
    pub fn next(&self, change: impl FnOnce(&mut Vec<ViewMember>)) -> Self {
        let mut members = self.members.clone();
        change(&mut members);
        Self::new(self.epoch + 1, members)
    }
}
