//! The expiry table: the deadlines of plain keys stored with one, shared by every connection
//! of a listener and bounded in size.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use gpucache_dataplane::identity::Digest32;

/// Most plain keys with an expiry (`SET ... EX|PX|EXAT|PXAT`) at once, over all connections, by
/// default ([`RespConfig::expiring_keys_max`]).
///
/// [`RespConfig::expiring_keys_max`]: super::RespConfig::expiring_keys_max
pub const EXPIRING_KEYS_MAX: usize = 65_536;

/// The deadlines (Unix milliseconds) of the plain keys stored with one, by [`chain_link`] of the
/// key: at most `max` of them.
///
/// [`chain_link`]: gpucache_wire::namespace::chain_link
#[derive(Debug)]
pub(super) struct Expiries {
    pub(super) deadlines: Mutex<HashMap<Digest32, u64>>,
    pub(super) max: usize,
}

/// Why a deadline could not be set.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ExpiriesFull;

impl Expiries {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Digest32, u64>> {
        // The map is consistent after every statement, so a panic elsewhere leaves it usable.
        self.deadlines.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn deadline(&self, link: Digest32) -> Option<u64> {
        self.lock().get(&link).copied()
    }

    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Sets the deadline of `link` to `at` and answers the one it replaces. When the table is
    /// full, the keys whose deadlines have passed by `now_ms` are dropped from it first and
    /// handed to `expired` (outside the lock) to be removed from the store.
    pub(super) fn set(
        &self,
        link: Digest32,
        at: u64,
        now_ms: u64,
        expired: impl FnMut(Digest32),
    ) -> Result<Option<u64>, ExpiriesFull> {
        let mut swept = Vec::new();
        let answer = {
            let mut map = self.lock();
            if map.len() >= self.max && !map.contains_key(&link) {
                map.retain(|&k, &mut d| {
                    let keep = d > now_ms;
                    if !keep {
                        swept.push(k);
                    }
                    keep
                });
            }
            if map.len() >= self.max && !map.contains_key(&link) {
                Err(ExpiriesFull)
            } else {
                Ok(map.insert(link, at))
            }
        };
        swept.into_iter().for_each(expired);
        answer
    }

    /// Puts back the deadline `previous` that a [`Self::set`] to `at` replaced (none: no
    /// deadline), unless another SET has set the key's deadline since.
    pub(super) fn restore(&self, link: Digest32, at: u64, previous: Option<u64>) {
        let mut map = self.lock();
        if map.get(&link) != Some(&at) {
            return;
        }
        match previous {
            Some(d) => map.insert(link, d),
            None => map.remove(&link),
        };
    }

    /// Forgets the deadline of `link`.
    pub(super) fn forget(&self, link: Digest32) {
        self.lock().remove(&link);
    }

    /// Forgets the deadline of `link` if it is still `deadline`.
    pub(super) fn forget_if(&self, link: Digest32, deadline: u64) {
        let mut map = self.lock();
        if map.get(&link) == Some(&deadline) {
            map.remove(&link);
        }
    }
}
