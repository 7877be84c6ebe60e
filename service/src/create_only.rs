//! Create-only writes as the fronts answer them. A PUT of a key that already holds a block is
//! refused as `AlreadyCommitted` whatever the bytes; the RESP front's `SET` and `gpucache put`
//! then compare what the key holds with what was offered: the same bytes are success (the key
//! holds what was asked for), other bytes are refused with [`DIFFERENT_VALUE_TEXT`].

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Get, Lookup, Store, StoreError};

/// Why a value was not stored over another one: the message both fronts give.
pub const DIFFERENT_VALUE_TEXT: &str =
    "key already holds a different value and values are create-only";

/// What a key that refused a PUT as already committed holds, next to the offered value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Exactly the offered bytes.
    Same,
    /// Other bytes (another length, or the same length with other contents).
    Different,
    /// Nothing usable any more: deleted, or found corrupt and dropped, since the PUT.
    Gone,
}

/// Compares the block under `key` with `value`. A block of another length is not read; one of
/// the same length is read into a buffer of exactly that length and compared byte for byte.
pub fn compare_held<S: Store + ?Sized>(
    store: &S,
    caller: &Caller,
    key: &PhysicalKey,
    value: &[u8],
) -> Result<Held, StoreError> {
    let len = match store.lookup(caller, key)? {
        Lookup::Hit { len } => len,
        // A one-link chain has no strict prefix, so a prefix hit cannot be this key.
        Lookup::PrefixHit { .. } | Lookup::Miss(_) => return Ok(Held::Gone),
    };
    if len != value.len() as u64 {
        return Ok(Held::Different);
    }
    let mut held = vec![0u8; value.len()];
    match store.get_into(caller, key, &mut held) {
        Ok(Get::Hit { len, .. }) if len == value.len() as u64 && held == value => Ok(Held::Same),
        Ok(Get::Hit { .. }) => Ok(Held::Different),
        Ok(Get::Miss(_)) => Ok(Held::Gone),
        // Deleted and stored again, longer, since the lookup: not these bytes.
        Err(StoreError::BufferTooSmall { .. }) => Ok(Held::Different),
        Err(e) => Err(e),
    }
}
