//! Store jobs: one key operation of a [`crate::DpuStore`], carried to the reactor that owns the
//! key's queue as a plain value (the operation, its owned arguments and the store it runs
//! against) and answered as a plain value, so that running one allocates no closure and reading
//! its answer needs no downcast.
//!
//! Payload bytes never travel in a job: a job names how many bytes of its slab slot it reads
//! (`Write`, `Put`) or may fill (`Get`), and the submitter copies them in before submission or
//! out after the completion.

use std::sync::Arc;

use crate::error::DpuError;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::store::{
    Abort, Committed, Get, Invalidate, Lookup, Put, Reservation, Reserve, Retirement, Store,
    StoreError,
};

/// One store call to run on a reactor.
pub(crate) struct Job {
    /// The store the call runs against (the one the agent fronts).
    pub(crate) store: Arc<dyn Store>,
    pub(crate) caller: Caller,
    pub(crate) op: JobOp,
}

/// The store call a [`Job`] makes, with its arguments.
pub(crate) enum JobOp {
    Lookup {
        key: PhysicalKey,
    },
    /// Reads into the first `room` bytes of the slot.
    Get {
        key: PhysicalKey,
        room: usize,
    },
    Reserve {
        key: PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    },
    /// Writes the first `len` bytes of the slot at `offset` of the reservation.
    Write {
        reservation: Reservation,
        offset: u64,
        len: usize,
    },
    Commit {
        reservation: Reservation,
    },
    Abort {
        reservation: Reservation,
        outcome: Retirement,
    },
    /// A whole PUT (reserve, write, commit, or abort) of the first `len` bytes of the slot.
    Put {
        key: PhysicalKey,
        len: usize,
        request: Option<RequestId>,
    },
    Invalidate {
        key: PhysicalKey,
    },
}

/// What a [`Job`] answered: the store call's own result, under the call's name.
#[derive(Debug)]
pub(crate) enum Answer {
    Lookup(Result<Lookup, StoreError>),
    Get(Result<Get, StoreError>),
    Reserve(Result<Reserve, StoreError>),
    Write(Result<(), StoreError>),
    Commit(Result<Committed, StoreError>),
    Abort(Result<Abort, StoreError>),
    Put(Result<Put, StoreError>),
    Invalidate(Result<Invalidate, StoreError>),
}

impl Job {
    /// Runs the call against `slot`, the submission's leased slab slot.
    pub(crate) fn run(self, slot: &mut [u8]) -> Answer {
        let Self { store, caller, op } = self;
        let c = &caller;
        // Lengths come from the submitter, which checked them against the slot size; clamp
        // anyway so that a wrong one fails as a short buffer, never as a panic on the reactor.
        let cap = slot.len();
        let part = |n: usize| n.min(cap);
        match op {
            JobOp::Lookup { key } => Answer::Lookup(store.lookup(c, &key)),
            JobOp::Get { key, room } => {
                let room = part(room);
                Answer::Get(store.get_into(c, &key, &mut slot[..room]))
            }
            JobOp::Reserve { key, len, request } => {
                Answer::Reserve(store.reserve(c, &key, len, request))
            }
            JobOp::Write { reservation, offset, len } => {
                Answer::Write(store.write(c, &reservation, offset, &slot[..part(len)]))
            }
            JobOp::Commit { reservation } => Answer::Commit(store.commit(c, &reservation)),
            JobOp::Abort { reservation, outcome } => {
                Answer::Abort(store.abort(c, reservation, outcome))
            }
            JobOp::Put { key, len, request } => {
                Answer::Put(store.put(c, &key, &slot[..part(len)], request))
            }
            JobOp::Invalidate { key } => Answer::Invalidate(store.invalidate(c, &key)),
        }
    }
}

impl Answer {
    /// The call's name, for an answer that came back under another call's name.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Lookup(_) => "lookup",
            Self::Get(_) => "get",
            Self::Reserve(_) => "reserve",
            Self::Write(_) => "write",
            Self::Commit(_) => "commit",
            Self::Abort(_) => "abort",
            Self::Put(_) => "put",
            Self::Invalidate(_) => "invalidate",
        }
    }
}

/// A store call's answer type, taken back out of an [`Answer`].
pub(crate) trait FromAnswer: Sized {
    /// The store call's result, or [`DpuError::ForeignAnswer`] when `answer` belongs to another
    /// call.
    fn from_answer(answer: Answer) -> Result<Result<Self, StoreError>, DpuError>;
}

macro_rules! from_answer {
    ($($t:ty => $variant:ident, $name:literal;)*) => {$(
        impl FromAnswer for $t {
            fn from_answer(answer: Answer) -> Result<Result<Self, StoreError>, DpuError> {
                match answer {
                    Answer::$variant(r) => Ok(r),
                    other => Err(DpuError::ForeignAnswer { expected: $name, got: other.name() }),
                }
            }
        }
    )*};
}

from_answer! {
    Lookup => Lookup, "lookup";
    Get => Get, "get";
    Reserve => Reserve, "reserve";
    () => Write, "write";
    Committed => Commit, "commit";
    Abort => Abort, "abort";
    Put => Put, "put";
    Invalidate => Invalidate, "invalidate";
}
