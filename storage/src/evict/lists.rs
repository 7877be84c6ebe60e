//! The resident side of a policy made of two queues: every block sits on exactly one of them,
//! and each queue knows the bytes it holds.

use std::collections::HashMap;

use super::order::Order;
use super::policy::BlockId;

/// What a two-queue policy keeps per resident block.
#[derive(Debug, Clone, Copy)]
pub(super) struct Resident<X> {
    /// The name its ghost would carry.
    pub(super) name: u64,
    pub(super) len: u64,
    /// On the second queue rather than the first.
    pub(super) second: bool,
    /// What the policy counts besides (S3-FIFO: reads).
    pub(super) extra: X,
}

#[derive(Debug)]
pub(super) struct TwoQueues<X> {
    queues: [Order; 2],
    bytes: [u64; 2],
    blocks: HashMap<BlockId, Resident<X>>,
}

impl<X> Default for TwoQueues<X> {
    fn default() -> Self {
        Self { queues: Default::default(), bytes: [0; 2], blocks: HashMap::new() }
    }
}

impl<X: Copy> TwoQueues<X> {
    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(super) fn get(&self, id: BlockId) -> Option<&Resident<X>> {
        self.blocks.get(&id)
    }

    /// The first queue, or the second when `second`.
    pub(super) fn queue(&self, second: bool) -> &Order {
        &self.queues[usize::from(second)]
    }

    pub(super) fn bytes(&self, second: bool) -> u64 {
        self.bytes[usize::from(second)]
    }

    /// Changes the policy's own count for `id` in place, keeping its place.
    pub(super) fn update(&mut self, id: BlockId, f: impl FnOnce(&mut X)) {
        if let Some(r) = self.blocks.get_mut(&id) {
            f(&mut r.extra);
        }
    }

    /// Takes `id` off its queue, answering what was kept for it.
    pub(super) fn unlink(&mut self, id: BlockId) -> Option<Resident<X>> {
        let r = self.blocks.remove(&id)?;
        let q = usize::from(r.second);
        self.queues[q].remove(id);
        self.bytes[q] -= r.len;
        Some(r)
    }

    /// Puts `id` at the back of the queue `r` names.
    pub(super) fn link(&mut self, id: BlockId, r: Resident<X>) {
        let q = usize::from(r.second);
        self.queues[q].push_back(id);
        self.bytes[q] += r.len;
        self.blocks.insert(id, r);
    }

    /// Moves a resident `id` to the front of its queue: the next to leave from it.
    pub(super) fn send_first(&mut self, id: BlockId) {
        if let Some(r) = self.blocks.get(&id) {
            self.queues[usize::from(r.second)].push_front(id);
        }
    }

    /// Replaces what is kept for `id` with `f` of it and puts it at the back of the queue
    /// that names; nothing when `id` is not resident.
    pub(super) fn requeue(&mut self, id: BlockId, f: impl FnOnce(Resident<X>) -> Resident<X>) {
        if let Some(r) = self.unlink(id) {
            self.link(id, f(r));
        }
    }
}
