//! Placement without a directory: rendezvous hashing of key digests over the live members.
//!
//! Every member scores every key; the key belongs to the highest score, and its next choices
//! are the next scores down (where a hot block's extra copies go). A client and a node that
//! see the same members compute the same owner with no table between them. When a member
//! joins, the only keys that move are those it now wins, about one in N+1; when one leaves,
//! only its own keys move, each to its next choice.

use super::control::NodeId;
use crate::key::KeyDigest;

/// The members keys are placed over, in no particular order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    nodes: Vec<NodeId>,
}

/// A 64-bit finalizer (the SplitMix64 output step): every input bit reaches every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `node`'s score for `key`. Digests are BLAKE3 output already, so 8 of their bytes are as
/// uniform as all 32; the node's number is mixed in before and after.
fn score(node: NodeId, key: &KeyDigest) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&key.0[..8]);
    mix(u64::from_le_bytes(first) ^ mix(node.0))
}

impl Placement {
    pub fn new(nodes: impl IntoIterator<Item = NodeId>) -> Self {
        let mut nodes: Vec<NodeId> = nodes.into_iter().collect();
        nodes.sort_unstable();
        nodes.dedup();
        Self { nodes }
    }

    pub fn nodes(&self) -> &[NodeId] {
        &self.nodes
    }

    /// The member that owns `key`; none when there is no member.
    pub fn owner(&self, key: &KeyDigest) -> Option<NodeId> {
        // Ties (a 2^-64 chance) go to the larger node number, the same everywhere.
        self.nodes.iter().copied().max_by_key(|n| (score(*n, key), *n))
    }

    /// The first `n` choices for `key`, best first (fewer when there are fewer members).
    pub fn choices(&self, key: &KeyDigest, n: usize) -> Vec<NodeId> {
        let mut ranked: Vec<(u64, NodeId)> =
            self.nodes.iter().map(|node| (score(*node, key), *node)).collect();
        ranked.sort_unstable_by(|a, b| b.cmp(a));
        ranked.into_iter().take(n).map(|(_, node)| node).collect()
    }

    /// The items of a batch by owner: for each member that owns any of `keys`, the indices of
    /// its keys, in order (a batch split per node, each part sent to its node).
    pub fn split(&self, keys: &[KeyDigest]) -> Vec<(NodeId, Vec<usize>)> {
        let mut parts: Vec<(NodeId, Vec<usize>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let Some(owner) = self.owner(key) else { continue };
            match parts.iter_mut().find(|(n, _)| *n == owner) {
                Some((_, items)) => items.push(i),
                None => parts.push((owner, vec![i])),
            }
        }
        parts
    }
}
