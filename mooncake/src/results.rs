//! What a Mooncake Store result code proves, as typed values.
//!
//! Pure: no I/O, no process, no Python. The adapter ([`super::MooncakeStore`]) hands every raw
//! answer of the SDK (as the sidecar relays it) to one of the functions here and acts only on
//! the typed result. The rule behind every mapping is the retirement contract of
//! [`gpucache_dataplane::Store`]: a failure may say the caller's buffers are free again
//! ([`Retirement::Retired`]) only when the code proves the native call stopped before or after
//! the transfer; everything else is [`Retirement::Unknown`] and quarantines.
//!
//! | call | code | meaning here |
//! | --- | --- | --- |
//! | PUT | `0` | success; **cannot** tell a new write from an existing object (see below) |
//! | PUT | `-705` OBJECT_ALREADY_EXISTS | create-only rejection before the source transfer: idempotent success |
//! | PUT | `-200` NO_AVAILABLE_HANDLE | the master refused the allocation before any transfer: retired per-page failure, re-offer later |
//! | GET | `n == expected` | success, proven by the exact byte count |
//! | GET | `0 <= n < expected` | short read: retired failure |
//! | GET | `n > expected` | malformed: unretired |
//! | GET | `-704` OBJECT_NOT_FOUND | metadata miss before the destination transfer: retired miss with object evidence |
//! | any | other negative, an exception after the call was entered, an unreadable answer | unretired |
//!
//! Duplicate PUT on a live store: Mooncake Store 0.3.13 answers a second `put_from` of an
//! existing key with `0` and keeps the first value (observed here; `-705` was not seen). So a
//! `0` proves that the key now holds *a* value, not that it holds ours. We count it as success,
//! which is what create-only means (the first committed value wins), and the adapter checks
//! existence first so that the ordinary repeat is reported as [`PutResult::AlreadyExists`].
//! A racing second writer that passes the check still gets `0`; its PUT is counted as a
//! success although nothing new was written. Counters of new writes must not be built on it.
//!
//! QUERY (`is_exist`) and REMOVE touch no caller payload, so their failures are retired.

use std::fmt;

use gpucache_dataplane::{Checksum, Get, MissReason, Put, Retirement, StoreError};

/// OBJECT_NOT_FOUND: the master has no metadata for the key.
pub const OBJECT_NOT_FOUND: i64 = -704;
/// OBJECT_ALREADY_EXISTS: a create-only PUT found the key taken.
pub const OBJECT_ALREADY_EXISTS: i64 = -705;
/// NO_AVAILABLE_HANDLE: the master could not allocate space for a PUT (segments full).
pub const NO_AVAILABLE_HANDLE: i64 = -200;
/// OBJECT_HAS_LEASE: a REMOVE found the object under a read lease.
pub const OBJECT_HAS_LEASE: i64 = -706;
/// INVALID_PARAMS: an empty key or a zero size (the adapter never sends either).
pub const INVALID_PARAMS: i64 = -600;

/// Which SDK call a result belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Put,
    Get,
    Size,
    Exists,
    Remove,
}

impl Call {
    /// The operation name used in [`StoreError::Backend`].
    pub fn name(self) -> &'static str {
        match self {
            Self::Put => "mooncake put",
            Self::Get => "mooncake get",
            Self::Size => "mooncake size",
            Self::Exists => "mooncake exists",
            Self::Remove => "mooncake remove",
        }
    }

    /// Whether the call reads or writes a payload buffer. Only these can leave one in use.
    fn moves_payload(self) -> bool {
        matches!(self, Self::Put | Self::Get)
    }
}

/// One raw answer from the sidecar, before interpretation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Raw {
    /// The SDK call returned this integer.
    Code(i64),
    /// The SDK call raised after it was entered: whether a transfer was submitted is unknown.
    Raised,
    /// The sidecar refused the request before calling the SDK (too large, bad frame).
    Refused,
}

/// Why a Mooncake call failed. Every failure carries no object evidence: only
/// [`GetResult::Missing`] and [`RemoveResult::Absent`] say anything about the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// PUT `-200`: no space was allocated and nothing was transferred. Leave the page
    /// unacknowledged so the scheduler offers it again; never quarantine.
    NoAvailableHandle,
    /// GET returned fewer bytes than the object holds.
    ShortRead { got: u64, expected: u64 },
    /// The answer cannot be a valid result of this call (a GET longer than asked, a PUT or
    /// QUERY returning a positive number it never returns).
    Malformed { code: i64 },
    /// Any other negative code.
    Native { code: i64 },
    /// The SDK raised after the call was entered.
    Raised,
    /// The sidecar refused the request before calling the SDK.
    Refused,
}

/// A failed Mooncake call and what it proves about the caller's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MooncakeFailure {
    pub call: Call,
    pub failure: Failure,
    pub retirement: Retirement,
}

impl MooncakeFailure {
    fn new(call: Call, failure: Failure) -> Self {
        let retirement = match failure {
            Failure::NoAvailableHandle | Failure::ShortRead { .. } | Failure::Refused => {
                Retirement::Retired
            }
            Failure::Malformed { .. } | Failure::Native { .. } | Failure::Raised => {
                if call.moves_payload() { Retirement::Unknown } else { Retirement::Retired }
            }
        };
        Self { call, failure, retirement }
    }

    /// Whether the page should be offered again later (the store had no room), rather than
    /// counted as a broken store.
    pub fn reoffer(&self) -> bool {
        self.failure == Failure::NoAvailableHandle
    }
}

impl fmt::Display for MooncakeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.failure {
            Failure::NoAvailableHandle => write!(
                f,
                "no available handle ({NO_AVAILABLE_HANDLE}): the store is full, offer the page \
                 again later"
            ),
            Failure::ShortRead { got, expected } => {
                write!(f, "short read: {got} of {expected} bytes")
            }
            Failure::Malformed { code } => write!(f, "malformed result {code}"),
            Failure::Native { code } => write!(f, "result code {code}"),
            Failure::Raised => write!(f, "the SDK raised after the call was entered"),
            Failure::Refused => write!(f, "the sidecar refused the request before the SDK call"),
        }
    }
}

impl From<MooncakeFailure> for StoreError {
    fn from(e: MooncakeFailure) -> Self {
        StoreError::Backend {
            operation: e.call.name(),
            detail: e.to_string(),
            retirement: e.retirement,
        }
    }
}

/// A successful create-only PUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutResult {
    /// `0`: the key holds a value now; it may be an earlier writer's (see the module docs).
    Stored,
    /// `-705`: the key was taken before any transfer; idempotent success.
    AlreadyExists,
}

impl PutResult {
    /// The store answer: `Stored` commits `checksum`, `AlreadyExists` is
    /// [`Put::AlreadyCommitted`].
    pub fn into_put(self, checksum: Checksum) -> Put {
        match self {
            Self::Stored => Put::Committed(checksum),
            Self::AlreadyExists => Put::AlreadyCommitted,
        }
    }
}

/// What a PUT's code proves.
pub fn put_result(raw: Raw) -> Result<PutResult, MooncakeFailure> {
    let call = Call::Put;
    match raw {
        Raw::Code(0) => Ok(PutResult::Stored),
        Raw::Code(OBJECT_ALREADY_EXISTS) => Ok(PutResult::AlreadyExists),
        Raw::Code(NO_AVAILABLE_HANDLE) => {
            Err(MooncakeFailure::new(call, Failure::NoAvailableHandle))
        }
        Raw::Code(code) if code < 0 => Err(MooncakeFailure::new(call, Failure::Native { code })),
        Raw::Code(code) => Err(MooncakeFailure::new(call, Failure::Malformed { code })),
        Raw::Raised => Err(MooncakeFailure::new(call, Failure::Raised)),
        Raw::Refused => Err(MooncakeFailure::new(call, Failure::Refused)),
    }
}

/// A successful GET (a miss is a successful answer too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetResult {
    /// Exactly the expected number of bytes arrived.
    Read,
    /// `-704`: no such object; nothing was transferred. Confirmed object evidence.
    Missing,
}

impl GetResult {
    /// The store answer for a miss: a retired [`MissReason::Absent`]. `None` for a read, whose
    /// bytes the caller still has to check.
    pub fn miss(self) -> Option<Get> {
        match self {
            Self::Read => None,
            Self::Missing => Some(Get::Miss(MissReason::Absent)),
        }
    }
}

/// What a GET's code proves, given how many bytes the object holds.
pub fn get_result(raw: Raw, expected_bytes: u64) -> Result<GetResult, MooncakeFailure> {
    let call = Call::Get;
    match raw {
        Raw::Code(OBJECT_NOT_FOUND) => Ok(GetResult::Missing),
        Raw::Code(code) if code < 0 => Err(MooncakeFailure::new(call, Failure::Native { code })),
        Raw::Code(code) => {
            let got = code.unsigned_abs();
            if got == expected_bytes {
                Ok(GetResult::Read)
            } else if got < expected_bytes {
                Err(MooncakeFailure::new(
                    call,
                    Failure::ShortRead { got, expected: expected_bytes },
                ))
            } else {
                Err(MooncakeFailure::new(call, Failure::Malformed { code }))
            }
        }
        Raw::Raised => Err(MooncakeFailure::new(call, Failure::Raised)),
        Raw::Refused => Err(MooncakeFailure::new(call, Failure::Refused)),
    }
}

/// What a size query proves: the object's byte count, or `None` for `-704`.
pub fn size_result(raw: Raw) -> Result<Option<u64>, MooncakeFailure> {
    let call = Call::Size;
    match raw {
        Raw::Code(OBJECT_NOT_FOUND) => Ok(None),
        // Objects are never empty: a zero size is not an answer Mooncake gives for one.
        Raw::Code(0) => Err(MooncakeFailure::new(call, Failure::Malformed { code: 0 })),
        Raw::Code(code) if code < 0 => Err(MooncakeFailure::new(call, Failure::Native { code })),
        Raw::Code(code) => Ok(Some(code.unsigned_abs())),
        Raw::Raised => Err(MooncakeFailure::new(call, Failure::Raised)),
        Raw::Refused => Err(MooncakeFailure::new(call, Failure::Refused)),
    }
}

/// What an existence query proves: `is_exist` answers 1 or 0.
pub fn exists_result(raw: Raw) -> Result<bool, MooncakeFailure> {
    let call = Call::Exists;
    match raw {
        Raw::Code(1) => Ok(true),
        Raw::Code(0) | Raw::Code(OBJECT_NOT_FOUND) => Ok(false),
        Raw::Code(code) if code < 0 => Err(MooncakeFailure::new(call, Failure::Native { code })),
        Raw::Code(code) => Err(MooncakeFailure::new(call, Failure::Malformed { code })),
        Raw::Raised => Err(MooncakeFailure::new(call, Failure::Raised)),
        Raw::Refused => Err(MooncakeFailure::new(call, Failure::Refused)),
    }
}

/// A successful REMOVE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveResult {
    Removed,
    /// `-704`: nothing to remove.
    Absent,
    /// `-706`: a reader holds a lease on the object; try again later.
    Leased,
}

/// What a REMOVE's code proves.
pub fn remove_result(raw: Raw) -> Result<RemoveResult, MooncakeFailure> {
    let call = Call::Remove;
    match raw {
        Raw::Code(0) => Ok(RemoveResult::Removed),
        Raw::Code(OBJECT_NOT_FOUND) => Ok(RemoveResult::Absent),
        Raw::Code(OBJECT_HAS_LEASE) => Ok(RemoveResult::Leased),
        Raw::Code(code) if code < 0 => Err(MooncakeFailure::new(call, Failure::Native { code })),
        Raw::Code(code) => Err(MooncakeFailure::new(call, Failure::Malformed { code })),
        Raw::Raised => Err(MooncakeFailure::new(call, Failure::Raised)),
        Raw::Refused => Err(MooncakeFailure::new(call, Failure::Refused)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(r: Result<impl fmt::Debug, MooncakeFailure>) -> MooncakeFailure {
        r.expect_err("a failure")
    }

    #[test]
    fn put_zero_is_success_even_for_a_duplicate() {
        assert_eq!(put_result(Raw::Code(0)), Ok(PutResult::Stored));
    }

    #[test]
    fn put_already_exists_is_idempotent_success() {
        assert_eq!(put_result(Raw::Code(-705)), Ok(PutResult::AlreadyExists));
    }

    #[test]
    fn put_no_handle_is_a_retired_failure_to_reoffer() {
        let f = failure(put_result(Raw::Code(-200)));
        assert_eq!(f.failure, Failure::NoAvailableHandle);
        assert_eq!(f.retirement, Retirement::Retired);
        assert!(f.reoffer());
        let e = StoreError::from(f);
        assert_eq!(e.retirement(), Retirement::Retired);
        assert_eq!(
            e.to_string(),
            "mooncake put failed in the backend: no available handle (-200): the store is full, \
             offer the page again later"
        );
    }

    #[test]
    fn put_other_negatives_and_exceptions_are_unretired() {
        for code in [-1, -199, -201, -600, -704, -706, -800, i64::MIN] {
            let f = failure(put_result(Raw::Code(code)));
            assert_eq!(f.failure, Failure::Native { code }, "{code}");
            assert_eq!(f.retirement, Retirement::Unknown, "{code}");
            assert!(!f.reoffer());
        }
        assert_eq!(failure(put_result(Raw::Raised)).retirement, Retirement::Unknown);
    }

    #[test]
    fn put_positive_is_malformed_and_unretired() {
        for code in [1, 4096, i64::MAX] {
            let f = failure(put_result(Raw::Code(code)));
            assert_eq!(f.failure, Failure::Malformed { code });
            assert_eq!(f.retirement, Retirement::Unknown);
        }
    }

    #[test]
    fn a_refused_request_is_retired_for_every_call() {
        assert_eq!(failure(put_result(Raw::Refused)).retirement, Retirement::Retired);
        assert_eq!(failure(get_result(Raw::Refused, 8)).retirement, Retirement::Retired);
        assert_eq!(failure(size_result(Raw::Refused)).retirement, Retirement::Retired);
        assert_eq!(failure(exists_result(Raw::Refused)).retirement, Retirement::Retired);
        assert_eq!(failure(remove_result(Raw::Refused)).retirement, Retirement::Retired);
    }

    #[test]
    fn get_exact_count_is_the_only_success() {
        assert_eq!(get_result(Raw::Code(4096), 4096), Ok(GetResult::Read));
        assert_eq!(get_result(Raw::Code(1), 1), Ok(GetResult::Read));
    }

    #[test]
    fn results_become_store_answers() {
        let sum = Checksum(7);
        assert_eq!(PutResult::Stored.into_put(sum), Put::Committed(sum));
        assert_eq!(PutResult::AlreadyExists.into_put(sum), Put::AlreadyCommitted);
        assert_eq!(GetResult::Missing.miss(), Some(Get::Miss(MissReason::Absent)));
        assert_eq!(GetResult::Read.miss(), None);
    }

    #[test]
    fn get_short_reads_are_retired_failures() {
        for got in [0_i64, 1, 4095] {
            let f = failure(get_result(Raw::Code(got), 4096));
            assert_eq!(f.failure, Failure::ShortRead { got: got as u64, expected: 4096 });
            assert_eq!(f.retirement, Retirement::Retired);
        }
    }

    #[test]
    fn get_longer_than_expected_is_malformed_and_unretired() {
        let f = failure(get_result(Raw::Code(4097), 4096));
        assert_eq!(f.failure, Failure::Malformed { code: 4097 });
        assert_eq!(f.retirement, Retirement::Unknown);
    }

    #[test]
    fn get_not_found_is_a_retired_miss() {
        assert_eq!(get_result(Raw::Code(-704), 4096), Ok(GetResult::Missing));
    }

    #[test]
    fn get_other_negatives_and_exceptions_are_unretired() {
        for code in [-1, -200, -600, -703, -705, -706, i64::MIN] {
            let f = failure(get_result(Raw::Code(code), 4096));
            assert_eq!(f.failure, Failure::Native { code });
            assert_eq!(f.retirement, Retirement::Unknown, "{code}");
        }
        assert_eq!(failure(get_result(Raw::Raised, 1)).retirement, Retirement::Unknown);
    }

    #[test]
    fn size_answers_a_length_or_a_miss() {
        assert_eq!(size_result(Raw::Code(24)), Ok(Some(24)));
        assert_eq!(size_result(Raw::Code(-704)), Ok(None));
        assert_eq!(failure(size_result(Raw::Code(0))).failure, Failure::Malformed { code: 0 });
        // A size query moves no payload: its failures are retired.
        let f = failure(size_result(Raw::Code(-1)));
        assert_eq!(f.retirement, Retirement::Retired);
        assert_eq!(failure(size_result(Raw::Raised)).retirement, Retirement::Retired);
    }

    #[test]
    fn exists_answers_one_or_zero_and_fails_retired() {
        assert_eq!(exists_result(Raw::Code(1)), Ok(true));
        assert_eq!(exists_result(Raw::Code(0)), Ok(false));
        assert_eq!(exists_result(Raw::Code(-704)), Ok(false));
        let f = failure(exists_result(Raw::Code(2)));
        assert_eq!(f.failure, Failure::Malformed { code: 2 });
        assert_eq!(f.retirement, Retirement::Retired);
        assert_eq!(failure(exists_result(Raw::Code(-1))).retirement, Retirement::Retired);
    }

    #[test]
    fn remove_maps_absent_and_leased() {
        assert_eq!(remove_result(Raw::Code(0)), Ok(RemoveResult::Removed));
        assert_eq!(remove_result(Raw::Code(-704)), Ok(RemoveResult::Absent));
        assert_eq!(remove_result(Raw::Code(-706)), Ok(RemoveResult::Leased));
        let f = failure(remove_result(Raw::Code(-600)));
        assert_eq!(f.failure, Failure::Native { code: -600 });
        assert_eq!(f.retirement, Retirement::Retired);
        assert_eq!(failure(remove_result(Raw::Code(3))).failure, Failure::Malformed { code: 3 });
    }

    #[test]
    fn every_failure_displays() {
        let cases = [
            (Failure::NoAvailableHandle, "no available handle (-200)"),
            (Failure::ShortRead { got: 3, expected: 8 }, "short read: 3 of 8 bytes"),
            (Failure::Malformed { code: 9 }, "malformed result 9"),
            (Failure::Native { code: -800 }, "result code -800"),
            (Failure::Raised, "the SDK raised after the call was entered"),
            (Failure::Refused, "the sidecar refused the request before the SDK call"),
        ];
        for (failure, text) in cases {
            let f = MooncakeFailure::new(Call::Get, failure);
            assert!(f.to_string().starts_with(text), "{f}");
            assert!(StoreError::from(f).to_string().starts_with("mooncake get failed"));
        }
    }
}
