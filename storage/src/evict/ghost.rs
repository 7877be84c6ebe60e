//! A list of the names of blocks that left, oldest first, with the bytes they held: the
//! history ARC and S3-FIFO consult when a name comes back.

use std::collections::HashMap;

use super::order::Order;

#[derive(Debug, Default)]
pub(super) struct Ghosts {
    order: Order,
    len_of: HashMap<u64, u64>,
    bytes: u64,
}

impl Ghosts {
    pub(super) fn len(&self) -> usize {
        self.len_of.len()
    }

    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(super) fn contains(&self, name: u64) -> bool {
        self.len_of.contains_key(&name)
    }

    /// Remembers `name` as the newest ghost, replacing an older entry for the same name.
    pub(super) fn push(&mut self, name: u64, len: u64) {
        self.take(name);
        self.order.push_back(name);
        self.len_of.insert(name, len);
        self.bytes += len;
    }

    /// Forgets `name`, answering whether it was there.
    pub(super) fn take(&mut self, name: u64) -> bool {
        match self.len_of.remove(&name) {
            Some(len) => {
                self.order.remove(name);
                self.bytes -= len;
                true
            }
            None => false,
        }
    }

    /// Forgets the oldest ghost, answering whether there was one.
    pub(super) fn drop_oldest(&mut self) -> bool {
        let Some(name) = self.order.pop_front() else { return false };
        if let Some(len) = self.len_of.remove(&name) {
            self.bytes -= len;
        }
        true
    }
}
