//! The single-key commands (GET, SET with its options, TTL and PTTL, EXISTS, DEL) over the
//! create-only store, with the deadlines of the expiry table applied as keys are touched.

use std::time::{Duration, Instant};

use gpucache_dataplane::identity::Digest32;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Get, Invalidate, Lookup, Put, StoreError};
use gpucache_wire::namespace::chain_link;
use gpucache_wire::resp::{Reply, parse_int};

use crate::create_only::{DIFFERENT_VALUE_TEXT, Held, compare_held};

use super::expiry::ExpiriesFull;
use super::reply::{arity, store_error};
use super::session::RespSession;

const INVALID_EXPIRE_TEXT: &str = "invalid expire time in 'set' command";

/// How many times a read looks a key up again when the value was replaced by a longer one
/// between its lookup and its read, and how many times SET stores again when the value it found
/// in the way was deleted before it could be compared.
pub(super) const RACE_ATTEMPTS: usize = 3;

/// How long SET waits for another client's write of the same key to finish before it answers
/// that the key is busy, and the longest pause between two tries.
const BUSY_WAIT: Duration = Duration::from_secs(2);

const BUSY_PAUSE_MAX: Duration = Duration::from_millis(20);

/// SET's refusal of another value over a key's: the shared text, and what to do here.
pub(super) fn exists_text() -> String {
    format!("{DIFFERENT_VALUE_TEXT}; DEL it first, or use SET key value NX")
}

const BUSY_TEXT: &str = "another client kept writing this key; retry";

/// The length a lookup found for a value (`None` when nothing usable is there).
pub(super) fn looked_len(looked: Result<Lookup, StoreError>) -> Result<Option<usize>, Reply> {
    match looked.map_err(|e| store_error(&e))? {
        Lookup::Hit { len } => usize::try_from(len)
            .map(Some)
            .map_err(|_| Reply::err(format!("a {len}-byte value does not fit this host"))),
        // A one-link chain has no strict prefix, so a prefix hit cannot be this key.
        Lookup::PrefixHit { .. } | Lookup::Miss(_) => Ok(None),
    }
}

/// What a GET into `value` (sized by the lookup before it) read: the value or `None`, or
/// `None` itself when the value was replaced by a longer one since the lookup (look again).
pub(super) fn read_value(
    got: Result<Get, StoreError>,
    mut value: Vec<u8>,
) -> Option<Result<Option<Vec<u8>>, Reply>> {
    match got {
        Ok(Get::Hit { len, .. }) => {
            let n = value.len();
            value.truncate(usize::try_from(len).unwrap_or(n));
            Some(Ok(Some(value)))
        }
        Ok(Get::Miss(_)) => Some(Ok(None)),
        // Deleted and stored again, longer, since the lookup.
        Err(StoreError::BufferTooSmall { .. }) => None,
        Err(e) => Some(Err(store_error(&e))),
    }
}

/// What a SET does with the key's deadline when it leaves the value there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    /// No option: the key has no deadline afterwards.
    Clear,
    /// `KEEPTTL`: the deadline it had stays.
    Keep,
    /// `EX`, `PX`, `EXAT`, `PXAT`: this deadline, in Unix milliseconds.
    At(u64),
}

/// The options of one SET.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SetOptions {
    nx: bool,
    xx: bool,
    get: bool,
    expiry: Expiry,
}

/// Reads `[NX|XX] [GET] [EX s|PX ms|EXAT unix-s|PXAT unix-ms|KEEPTTL]`, in any order, as Redis
/// does: one condition, one expiry, a positive time that does not overflow.
fn set_options(options: &[Vec<u8>], now_ms: u64) -> Result<SetOptions, Reply> {
    let syntax = || Reply::err("syntax error");
    let mut o = SetOptions { nx: false, xx: false, get: false, expiry: Expiry::Clear };
    let mut expiry_given = false;
    let mut words = options.iter();
    while let Some(word) = words.next() {
        let upper = word.to_ascii_uppercase();
        match upper.as_slice() {
            b"NX" if !o.xx => o.nx = true,
            b"XX" if !o.nx => o.xx = true,
            b"GET" => o.get = true,
            b"KEEPTTL" if !expiry_given => {
                expiry_given = true;
                o.expiry = Expiry::Keep;
            }
            b"EX" | b"PX" | b"EXAT" | b"PXAT" if !expiry_given => {
                let time = words.next().ok_or_else(syntax)?;
                let time = parse_int(time)
                    .ok_or_else(|| Reply::err("value is not an integer or out of range"))?;
                let time = u64::try_from(time)
                    .ok()
                    .filter(|&t| t > 0)
                    .ok_or_else(|| Reply::err(INVALID_EXPIRE_TEXT))?;
                let at = match upper.as_slice() {
                    b"EX" => time.checked_mul(1000).and_then(|ms| now_ms.checked_add(ms)),
                    b"PX" => now_ms.checked_add(time),
                    b"EXAT" => time.checked_mul(1000),
                    _ => Some(time),
                };
                expiry_given = true;
                o.expiry = Expiry::At(at.ok_or_else(|| Reply::err(INVALID_EXPIRE_TEXT))?);
            }
            _ => return Err(syntax()),
        }
    }
    Ok(o)
}

/// Why SET did not leave the value under the key.
pub(super) enum NotStored {
    /// Another value is there (or, with NX, any value).
    Exists,
    /// With XX: no value is there.
    Absent,
    Reply(Reply),
}

impl RespSession<'_> {
    fn key(&self, plain: &[u8]) -> Result<PhysicalKey, Reply> {
        self.namespace.key_for(plain).map_err(|e| Reply::err(format!("key namespace: {e}")))
    }

    /// The physical key of `plain`, and whether it is live. A key whose deadline has passed is
    /// not: it is removed from the store and its deadline forgotten (when the store cannot
    /// remove it, for a tenant without `write` say, the deadline stays and it still is not).
    pub(super) fn live_key(&self, plain: &[u8]) -> Result<(PhysicalKey, bool), Reply> {
        let key = self.key(plain)?;
        let link = chain_link(plain);
        let expiries = &self.shared.expiries;
        match expiries.deadline(link) {
            Some(deadline) if deadline <= self.shared.config.clock.now_ms() => {
                match self.store.invalidate(self.caller, &key) {
                    Ok(Invalidate::Removed | Invalidate::Absent) => {
                        expiries.forget_if(link, deadline);
                    }
                    // Being written again right now: that SET sets the deadline anew.
                    Ok(Invalidate::Busy) => {}
                    Err(e) => tracing::debug!(error = %e, "an expired RESP key stays in the store"),
                }
                Ok((key, false))
            }
            _ => Ok((key, true)),
        }
    }

    /// Removes the key of `link` from the store, whose deadline was dropped from the table.
    fn remove_expired(&self, link: Digest32) {
        if let Ok(key) = self.namespace.key_for_link(link) {
            let _ = self.store.invalidate(self.caller, &key);
        }
    }

    /// GET: the value, or nil when nothing usable is there.
    pub(super) fn get(&self, plain: &[u8]) -> Result<Reply, Reply> {
        let (key, live) = self.live_key(plain)?;
        if !live {
            return Ok(Reply::Nil);
        }
        Ok(self.read(&key)?.map_or(Reply::Nil, Reply::Bulk))
    }

    /// TTL (seconds, rounded) or PTTL (milliseconds): -2 for a key that holds nothing, -1 for
    /// one without a deadline.
    pub(super) fn ttl(&self, plain: &[u8], millis: bool) -> Result<Reply, Reply> {
        if !self.exists(plain)? {
            return Ok(Reply::Integer(-2));
        }
        let Some(deadline) = self.shared.expiries.deadline(chain_link(plain)) else {
            return Ok(Reply::Integer(-1));
        };
        let left = deadline.saturating_sub(self.shared.config.clock.now_ms());
        let left = if millis { left } else { left.saturating_add(500) / 1000 };
        Ok(Reply::Integer(i64::try_from(left).unwrap_or(i64::MAX)))
    }

    /// The value under `key`, `None` when nothing usable is there.
    pub(super) fn read(&self, key: &PhysicalKey) -> Result<Option<Vec<u8>>, Reply> {
        self.read_within(key, RACE_ATTEMPTS)
    }

    /// [`Self::read`] with `attempts` lookups at most.
    pub(super) fn read_within(
        &self,
        key: &PhysicalKey,
        attempts: usize,
    ) -> Result<Option<Vec<u8>>, Reply> {
        for _ in 0..attempts {
            let Some(len) = looked_len(self.store.lookup(self.caller, key))? else {
                return Ok(None);
            };
            let mut value = vec![0u8; len];
            let got = self.store.get_into(self.caller, key, &mut value);
            if let Some(read) = read_value(got, value) {
                return read;
            }
        }
        Ok(None)
    }

    /// Leaves `value` under `plain`: stores it when the key is free; when the key already holds
    /// exactly these bytes, that is success too (unless `nx`), since the outcome is the same.
    /// Waits up to [`BUSY_WAIT`] for another client's write of the key to finish. The caller has
    /// removed the key first if its deadline had passed ([`Self::live_key`]).
    pub(super) fn store_value(
        &self,
        plain: &[u8],
        value: &[u8],
        nx: bool,
    ) -> Result<(), NotStored> {
        if value.is_empty() {
            return Err(NotStored::Reply(Reply::err(
                "empty values cannot be stored: a block holds at least one byte",
            )));
        }
        let key = self.key(plain).map_err(NotStored::Reply)?;
        let first = self.store.put(self.caller, &key, value, None);
        self.settle(&key, value, nx, first)
    }

    /// Finishes leaving `value` under `key` (as [`Self::store_value`]) once a PUT of it has
    /// answered `first`: compares what holds the key, or stores again, as the answer requires.
    pub(super) fn settle(
        &self,
        key: &PhysicalKey,
        value: &[u8],
        nx: bool,
        first: Result<Put, StoreError>,
    ) -> Result<(), NotStored> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(1);
        let mut vanished = 0;
        let mut answer = first;
        loop {
            match answer {
                Ok(Put::Committed(_)) => return Ok(()),
                Ok(Put::AlreadyCommitted) if nx => return Err(NotStored::Exists),
                Ok(Put::AlreadyCommitted) => {
                    let held = compare_held(self.store, self.caller, key, value)
                        .map_err(|e| NotStored::Reply(store_error(&e)))?;
                    match held {
                        Held::Same => return Ok(()),
                        Held::Different => return Err(NotStored::Exists),
                        // Deleted (or found corrupt and dropped) since the put: try again.
                        Held::Gone if vanished < RACE_ATTEMPTS => vanished += 1,
                        Held::Gone => return Err(NotStored::Reply(Reply::err(BUSY_TEXT))),
                    }
                }
                Ok(Put::Busy) => {
                    if started.elapsed() >= BUSY_WAIT {
                        return Err(NotStored::Reply(Reply::err(BUSY_TEXT)));
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(BUSY_PAUSE_MAX);
                }
                Ok(Put::Refused(r)) => {
                    return Err(NotStored::Reply(Reply::err(format!("refused: {r}"))));
                }
                Err(e) => return Err(NotStored::Reply(store_error(&e))),
            }
            answer = self.store.put(self.caller, key, value, None);
        }
    }

    /// SET with its options. The store is create-only, so XX never stores: a key it finds
    /// either holds these bytes already (`+OK`) or other bytes it cannot replace (an error),
    /// and a missing one answers nil. GET reads the value held before the SET.
    pub(super) fn set(&self, args: &[Vec<u8>]) -> Reply {
        let [plain, value, options @ ..] = args else { return arity("set") };
        let now_ms = self.shared.config.clock.now_ms();
        let o = match set_options(options, now_ms) {
            Ok(o) => o,
            Err(r) => return r,
        };
        // A key past its deadline is removed first, so that it is free for this SET.
        if let Err(r) = self.live_key(plain) {
            return r;
        }
        let old = if o.get {
            match self.get(plain) {
                Ok(old) => old,
                Err(r) => return r,
            }
        } else {
            Reply::Nil
        };
        let link = chain_link(plain);
        let expiries = &self.shared.expiries;
        // Take the deadline's place in the table before storing, so that a value is never
        // stored without the deadline it was asked with; put the old one back if not stored.
        let previous = match o.expiry {
            Expiry::At(at) => {
                match expiries.set(link, at, now_ms, |swept| self.remove_expired(swept)) {
                    Ok(previous) => Some(previous),
                    Err(ExpiriesFull) => {
                        return Reply::err(format!(
                            "{} keys already have a deadline, the most this \
                             server tracks; SET without EX/PX/EXAT/PXAT, or DEL some",
                            expiries.max
                        ));
                    }
                }
            }
            Expiry::Clear | Expiry::Keep => None,
        };
        let stored = if o.xx {
            self.replace_only(plain, value)
        } else {
            self.store_value(plain, value, o.nx)
        };
        match stored {
            Ok(()) => {
                if o.expiry == Expiry::Clear {
                    expiries.forget(link);
                }
                if o.get { old } else { Reply::ok() }
            }
            Err(not_stored) => {
                if let (Some(previous), Expiry::At(at)) = (previous, o.expiry) {
                    expiries.restore(link, at, previous);
                }
                match not_stored {
                    // NX found a value, XX none: nothing to do, and GET answers what is there.
                    NotStored::Exists if o.nx => old,
                    NotStored::Absent => old,
                    NotStored::Exists => Reply::err(exists_text()),
                    NotStored::Reply(r) => r,
                }
            }
        }
    }

    /// SET XX: what holds the key decides; nothing is ever stored. The caller has removed the
    /// key first if its deadline had passed ([`Self::live_key`]).
    fn replace_only(&self, plain: &[u8], value: &[u8]) -> Result<(), NotStored> {
        let key = self.key(plain).map_err(NotStored::Reply)?;
        match compare_held(self.store, self.caller, &key, value) {
            Ok(Held::Same) => Ok(()),
            Ok(Held::Different) => Err(NotStored::Exists),
            Ok(Held::Gone) => Err(NotStored::Absent),
            Err(e) => Err(NotStored::Reply(store_error(&e))),
        }
    }

    pub(super) fn exists(&self, plain: &[u8]) -> Result<bool, Reply> {
        let (key, live) = self.live_key(plain)?;
        if !live {
            return Ok(false);
        }
        match self.store.lookup(self.caller, &key) {
            Ok(Lookup::Hit { .. }) => Ok(true),
            Ok(Lookup::PrefixHit { .. } | Lookup::Miss(_)) => Ok(false),
            Err(e) => Err(store_error(&e)),
        }
    }

    pub(super) fn del(&self, plain: &[u8]) -> Result<bool, Reply> {
        let (key, live) = self.live_key(plain)?;
        if !live {
            return Ok(false);
        }
        match self.store.invalidate(self.caller, &key) {
            Ok(Invalidate::Removed) => {
                self.shared.expiries.forget(chain_link(plain));
                Ok(true)
            }
            Ok(Invalidate::Absent | Invalidate::Busy) => Ok(false),
            Err(e) => Err(store_error(&e)),
        }
    }

    /// How many keys `check` says yes to; the first error answers instead.
    pub(super) fn count(
        &self,
        keys: &[Vec<u8>],
        check: impl Fn(&Self, &[u8]) -> Result<bool, Reply>,
    ) -> Reply {
        let mut n: i64 = 0;
        for key in keys {
            match check(self, key) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(r) => return r,
            }
        }
        Reply::Integer(n)
    }
}
