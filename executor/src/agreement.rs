//! Owner agreement: how every cache owner's completion reports for one storage operation become
//! the single result all owners act on.
//!
//! Each round, every owner contributes one [`OwnerReport`] (its clock, its pressure observation,
//! the completions it saw since the last round, and a fault if its own poll was invalid). The
//! reports are all-gathered, so every owner runs [`Agreement::merge_round`] on the same input and
//! reaches the same answer, error included. Per operation:
//! - per-key success and the retirement fact are AND-reduced: a key is usable only if every
//!   owner moved its share, and the operation has retired only when every owner proves it;
//! - confirmed object failures are OR-reduced: one missing shard spoils the shared object, while
//!   an owner that did not read contributes no evidence;
//!
//! and per round the leader's (owner 0's) clock becomes the tick's and pressure is MAX-reduced.
//!
//! Owners finish at different times, so records are retained per operation until the last owner
//! reports; an operation completes on its own, never waiting behind an earlier slow one. Only
//! registered operations are tracked, and at most [`AgreementLimits::operations_inflight_max`]
//! of them: registering one more is refused, never by dropping a retained record (that would
//! lose a retirement fact). Any malformed report is a [`ProtocolError`] for the whole round and
//! every later one: nothing of that round is applied.
//!
//! This module is pure: no I/O, no clock, no threads. It does not decide publication, negative
//! metadata or quarantine; it only states the agreed facts.

use std::collections::BTreeMap;
use std::fmt;
use std::num::{NonZeroU16, NonZeroUsize};

/// A storage operation's id: issued by the scheduler, increasing, never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OperationId(pub u64);

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op{}", self.0)
    }
}

/// A cache owner's index in the replica's owner group, 0 being the leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerIndex(pub u16);

impl fmt::Display for OwnerIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "owner {}", self.0)
    }
}

/// The kind of a storage operation, fixed when it is registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperationKind {
    Query,
    Get,
    Put,
}

impl fmt::Display for OperationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Query => "QUERY",
            Self::Get => "GET",
            Self::Put => "PUT",
        })
    }
}

/// One owner's pressure observation: its queued jobs, their payload bytes and the age of its
/// oldest queued or running job. Ages are durations, so clocks of different hosts never mix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Pressure {
    pub queued_jobs: u64,
    pub queued_payload_bytes: u64,
    pub oldest_job_age_ms: u64,
}

impl Pressure {
    /// The field-wise maximum: the round sees the most loaded owner in each dimension.
    pub fn max(self, other: Pressure) -> Pressure {
        Pressure {
            queued_jobs: self.queued_jobs.max(other.queued_jobs),
            queued_payload_bytes: self.queued_payload_bytes.max(other.queued_payload_bytes),
            oldest_job_age_ms: self.oldest_job_age_ms.max(other.oldest_job_age_ms),
        }
    }
}

/// What one owner saw of one finished operation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CompletionRecord {
    pub operation: OperationId,
    pub kind: OperationKind,
    /// Per key: this owner's share was found (QUERY), read at full length (GET) or stored
    /// (PUT). An owner that holds no rows of a key reports success for it.
    pub key_ok: Vec<bool>,
    /// Per key: this owner confirmed the object missing or invalid. GET only; never together
    /// with success for the same key.
    pub object_failed: Vec<bool>,
    /// This owner has proven that it no longer touches the operation's Host buffers.
    pub retired: bool,
}

/// One owner's contribution to a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerReport {
    pub owner: OwnerIndex,
    /// The owner count this owner was configured with.
    pub owners: u16,
    /// The owner's monotonic clock; only the leader's is used.
    pub clock_ms: u64,
    pub pressure: Pressure,
    pub completions: Vec<CompletionRecord>,
    /// Set when this owner's own poll or records were invalid (see [`Agreement::check_local`]);
    /// the whole round then fails on every owner.
    pub fault: Option<ProtocolError>,
}

/// The agreed facts of one operation once every owner reported it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AgreedCompletion {
    pub operation: OperationId,
    pub kind: OperationKind,
    /// Per key, AND over owners.
    pub key_ok: Vec<bool>,
    /// Per key, OR over owners.
    pub object_failed: Vec<bool>,
    /// AND over owners.
    pub retired: bool,
}

impl AgreedCompletion {
    /// Per key: may its rows be published? Only when the whole operation has retired on every
    /// owner and every owner succeeded for the key.
    pub fn publishable(&self) -> Vec<bool> {
        self.key_ok.iter().map(|ok| *ok && self.retired).collect()
    }
}

/// What a round agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundOutcome {
    /// The leader's clock.
    pub clock_ms: u64,
    /// MAX over every owner's observation.
    pub pressure: Pressure,
    /// Operations whose last owner reported in this round, by increasing id.
    pub completed: Vec<AgreedCompletion>,
}

/// Bounds of the agreement's retained state: at most
/// `operations_inflight_max * owners * keys_per_operation_max` per-key facts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgreementLimits {
    /// Registered operations not yet agreed (the operation credits bound this from above).
    pub operations_inflight_max: NonZeroUsize,
    /// Keys of one operation.
    pub keys_per_operation_max: NonZeroUsize,
}

impl Default for AgreementLimits {
    fn default() -> Self {
        const OPERATIONS: NonZeroUsize = NonZeroUsize::new(1024).expect("nonzero");
        const KEYS: NonZeroUsize = NonZeroUsize::new(4096).expect("nonzero");
        Self { operations_inflight_max: OPERATIONS, keys_per_operation_max: KEYS }
    }
}

/// Why [`Agreement::register`] refused an operation. Nothing was retained.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterRefusal {
    #[error("{inflight} operations await agreement, operations_inflight_max is {max}")]
    Full { inflight: usize, max: usize },
    #[error("{operation} has {keys} keys, keys_per_operation_max is {max}")]
    TooManyKeys { operation: OperationId, keys: usize, max: usize },
    #[error("{operation} does not follow the last registered {last}: ids only increase")]
    NotIncreasing { operation: OperationId, last: OperationId },
    #[error("agreement has failed: {0}")]
    Failed(ProtocolError),
}

/// A report that breaks the agreement protocol. Every owner raises the same error for the
/// round, because every owner checks the same all-gathered reports in the same order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("{got} reports in the round, expected one from each of {expected} owners")]
    WrongReportCount { got: usize, expected: u16 },
    #[error("{owner} was configured with {declared} owners, the agreement with {expected}")]
    OwnerCountMismatch { owner: OwnerIndex, declared: u16, expected: u16 },
    #[error("{owner} is out of range for {owners} owners")]
    OwnerOutOfRange { owner: OwnerIndex, owners: u16 },
    #[error("{owner} reported twice in one round")]
    DuplicateOwner { owner: OwnerIndex },
    #[error("{owner} reported an invalid local poll: {cause}")]
    ReportedByOwner { owner: OwnerIndex, cause: Box<ProtocolError> },
    #[error("{owner} reported {operation}, which is not awaiting agreement")]
    UnknownOperation { owner: OwnerIndex, operation: OperationId },
    #[error("{owner} reported {operation} as {reported}, it was registered as {expected}")]
    KindMismatch {
        owner: OwnerIndex,
        operation: OperationId,
        expected: OperationKind,
        reported: OperationKind,
    },
    #[error(
        "{owner} reported {operation} with {success} success and {failures} failure flags, \
         the operation has {expected} keys"
    )]
    KeyCountMismatch {
        owner: OwnerIndex,
        operation: OperationId,
        expected: usize,
        success: usize,
        failures: usize,
    },
    #[error("{owner} reported key {key} of {operation} both successful and failed")]
    SuccessWithFailure { owner: OwnerIndex, operation: OperationId, key: usize },
    #[error("{owner} reported an object failure for key {key} of {kind} {operation}")]
    ReadFailureOutsideGet {
        owner: OwnerIndex,
        operation: OperationId,
        kind: OperationKind,
        key: usize,
    },
    #[error("{owner} reported {operation} more than once")]
    DuplicateRecord { owner: OwnerIndex, operation: OperationId },
    #[error("a merge of {expected} was given a record of {got}")]
    OperationMismatch { expected: OperationId, got: OperationId },
    #[error("{operation} has {reported} owner records, expected {owners}")]
    MissingOwners { operation: OperationId, reported: usize, owners: u16 },
}

/// What an operation is registered as: enough to validate each owner's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    kind: OperationKind,
    keys: usize,
}

fn check_record(
    owner: OwnerIndex,
    shape: Shape,
    record: &CompletionRecord,
) -> Result<(), ProtocolError> {
    let operation = record.operation;
    if record.kind != shape.kind {
        return Err(ProtocolError::KindMismatch {
            owner,
            operation,
            expected: shape.kind,
            reported: record.kind,
        });
    }
    if record.key_ok.len() != shape.keys || record.object_failed.len() != shape.keys {
        return Err(ProtocolError::KeyCountMismatch {
            owner,
            operation,
            expected: shape.keys,
            success: record.key_ok.len(),
            failures: record.object_failed.len(),
        });
    }
    let failed_keys = record.object_failed.iter().enumerate().filter(|(_, failed)| **failed);
    for (key, _) in failed_keys {
        if shape.kind != OperationKind::Get {
            return Err(ProtocolError::ReadFailureOutsideGet {
                owner,
                operation,
                kind: shape.kind,
                key,
            });
        }
        if record.key_ok[key] {
            return Err(ProtocolError::SuccessWithFailure { owner, operation, key });
        }
    }
    Ok(())
}

/// Folds already checked records of one operation. Starts from the identity of each reduction:
/// everything succeeded and retired, nothing failed.
fn fold<'a>(
    operation: OperationId,
    shape: Shape,
    records: impl IntoIterator<Item = &'a CompletionRecord>,
) -> AgreedCompletion {
    let mut agreed = AgreedCompletion {
        operation,
        kind: shape.kind,
        key_ok: vec![true; shape.keys],
        object_failed: vec![false; shape.keys],
        retired: true,
    };
    for record in records {
        for (all, one) in agreed.key_ok.iter_mut().zip(&record.key_ok) {
            *all &= *one;
        }
        for (any, one) in agreed.object_failed.iter_mut().zip(&record.object_failed) {
            *any |= *one;
        }
        agreed.retired &= record.retired;
    }
    agreed
}

/// Merges one operation's records, exactly one from each of `owners` owners, in any order.
/// The first record fixes the operation, kind and key count the others are checked against;
/// an empty set is [`ProtocolError::MissingOwners`] for operation 0.
pub fn merge_records(
    owners: NonZeroU16,
    records: &[(OwnerIndex, CompletionRecord)],
) -> Result<AgreedCompletion, ProtocolError> {
    let Some((_, first)) = records.first() else {
        return Err(ProtocolError::MissingOwners {
            operation: OperationId(0),
            reported: 0,
            owners: owners.get(),
        });
    };
    let operation = first.operation;
    let shape = Shape { kind: first.kind, keys: first.key_ok.len() };
    let mut seen = vec![false; usize::from(owners.get())];
    for (owner, record) in records {
        if record.operation != operation {
            return Err(ProtocolError::OperationMismatch {
                expected: operation,
                got: record.operation,
            });
        }
        let slot = seen
            .get_mut(usize::from(owner.0))
            .ok_or(ProtocolError::OwnerOutOfRange { owner: *owner, owners: owners.get() })?;
        if *slot {
            return Err(ProtocolError::DuplicateRecord { owner: *owner, operation });
        }
        *slot = true;
        check_record(*owner, shape, record)?;
    }
    if records.len() != usize::from(owners.get()) {
        return Err(ProtocolError::MissingOwners {
            operation,
            reported: records.len(),
            owners: owners.get(),
        });
    }
    Ok(fold(operation, shape, records.iter().map(|(_, r)| r)))
}

/// An operation awaiting agreement and the records its owners sent so far (one slot per owner).
#[derive(Debug)]
struct Pending {
    shape: Shape,
    records: Vec<Option<CompletionRecord>>,
}

/// One owner's copy of the agreement state. Every owner registers the same operations and
/// merges the same gathered rounds, so every copy stays identical.
#[derive(Debug)]
pub struct Agreement {
    owners: NonZeroU16,
    limits: AgreementLimits,
    pending: BTreeMap<OperationId, Pending>,
    last_registered: Option<OperationId>,
    failed: Option<ProtocolError>,
}

impl Agreement {
    pub fn new(owners: NonZeroU16, limits: AgreementLimits) -> Self {
        Self { owners, limits, pending: BTreeMap::new(), last_registered: None, failed: None }
    }

    pub fn owners(&self) -> NonZeroU16 {
        self.owners
    }

    pub fn limits(&self) -> AgreementLimits {
        self.limits
    }

    /// Operations registered and not yet agreed.
    pub fn inflight(&self) -> usize {
        self.pending.len()
    }

    /// How many owners have reported `operation` so far, if it awaits agreement.
    pub fn reported(&self, operation: OperationId) -> Option<usize> {
        self.pending.get(&operation).map(|p| p.records.iter().flatten().count())
    }

    /// The protocol error that stopped this agreement, if any.
    pub fn failure(&self) -> Option<&ProtocolError> {
        self.failed.as_ref()
    }

    /// Starts waiting for `operation`'s records. When `operations_inflight_max` operations are
    /// already waiting, the new one is refused: retained records are never dropped to make
    /// room, since each may carry a retirement fact that frees Host references.
    pub fn register(
        &mut self,
        operation: OperationId,
        kind: OperationKind,
        keys: usize,
    ) -> Result<(), RegisterRefusal> {
        if let Some(error) = &self.failed {
            return Err(RegisterRefusal::Failed(error.clone()));
        }
        if let Some(last) = self.last_registered
            && operation <= last
        {
            return Err(RegisterRefusal::NotIncreasing { operation, last });
        }
        let max = self.limits.operations_inflight_max.get();
        if self.pending.len() >= max {
            return Err(RegisterRefusal::Full { inflight: self.pending.len(), max });
        }
        let keys_max = self.limits.keys_per_operation_max.get();
        if keys > keys_max {
            return Err(RegisterRefusal::TooManyKeys { operation, keys, max: keys_max });
        }
        let records = vec![None; usize::from(self.owners.get())];
        self.pending.insert(operation, Pending { shape: Shape { kind, keys }, records });
        self.last_registered = Some(operation);
        Ok(())
    }

    /// Checks this owner's own records before the exchange. An owner whose check fails sends
    /// its report with the error as [`OwnerReport::fault`], so every owner fails together.
    pub fn check_local(&self, report: &OwnerReport) -> Result<(), ProtocolError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        self.check_report(report, &mut Vec::new())
    }

    /// Merges one round of gathered reports, one per owner in any order. Either the whole round
    /// applies, or nothing does and the agreement fails for good with the returned error.
    pub fn merge_round(&mut self, reports: &[OwnerReport]) -> Result<RoundOutcome, ProtocolError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        match self.check_round(reports) {
            Ok(ordered) => Ok(self.apply(&ordered)),
            Err(error) => {
                self.failed = Some(error.clone());
                Err(error)
            }
        }
    }

    /// Validates a round without changing anything; returns the reports in owner order, so
    /// that the first error found is the same whatever order the reports arrived in.
    fn check_round<'r>(
        &self,
        reports: &'r [OwnerReport],
    ) -> Result<Vec<&'r OwnerReport>, ProtocolError> {
        let owners = self.owners.get();
        if reports.len() != usize::from(owners) {
            return Err(ProtocolError::WrongReportCount { got: reports.len(), expected: owners });
        }
        let mut ordered: Vec<&OwnerReport> = reports.iter().collect();
        ordered.sort_by_key(|r| r.owner);
        for pair in ordered.windows(2) {
            if pair[0].owner == pair[1].owner {
                return Err(ProtocolError::DuplicateOwner { owner: pair[0].owner });
            }
        }
        // Each owner's records for this round, to catch one operation reported twice.
        let mut this_round: Vec<(OwnerIndex, OperationId)> = Vec::new();
        for report in &ordered {
            if let Some(cause) = &report.fault {
                return Err(ProtocolError::ReportedByOwner {
                    owner: report.owner,
                    cause: Box::new(cause.clone()),
                });
            }
            self.check_report(report, &mut this_round)?;
        }
        Ok(ordered)
    }

    fn check_report(
        &self,
        report: &OwnerReport,
        this_round: &mut Vec<(OwnerIndex, OperationId)>,
    ) -> Result<(), ProtocolError> {
        let owners = self.owners.get();
        let owner = report.owner;
        if report.owners != owners {
            return Err(ProtocolError::OwnerCountMismatch {
                owner,
                declared: report.owners,
                expected: owners,
            });
        }
        if owner.0 >= owners {
            return Err(ProtocolError::OwnerOutOfRange { owner, owners });
        }
        for record in &report.completions {
            let operation = record.operation;
            let pending = self
                .pending
                .get(&operation)
                .ok_or(ProtocolError::UnknownOperation { owner, operation })?;
            let already = pending.records.get(usize::from(owner.0)).is_some_and(Option::is_some);
            if already || this_round.contains(&(owner, operation)) {
                return Err(ProtocolError::DuplicateRecord { owner, operation });
            }
            this_round.push((owner, operation));
            check_record(owner, pending.shape, record)?;
        }
        Ok(())
    }

    /// Retains the checked records and agrees every operation whose last owner just reported.
    fn apply(&mut self, ordered: &[&OwnerReport]) -> RoundOutcome {
        let mut touched: Vec<OperationId> = Vec::new();
        for report in ordered {
            for record in &report.completions {
                if let Some(slot) = self
                    .pending
                    .get_mut(&record.operation)
                    .and_then(|p| p.records.get_mut(usize::from(report.owner.0)))
                {
                    *slot = Some(record.clone());
                    touched.push(record.operation);
                }
            }
        }
        touched.sort_unstable();
        touched.dedup();
        let mut completed = Vec::new();
        for operation in touched {
            let complete =
                self.pending.get(&operation).is_some_and(|p| p.records.iter().all(Option::is_some));
            if complete && let Some(pending) = self.pending.remove(&operation) {
                completed.push(fold(operation, pending.shape, pending.records.iter().flatten()));
            }
        }
        RoundOutcome {
            // check_round proved there is one report per owner, sorted, so the first is owner 0.
            clock_ms: ordered.first().map_or(0, |leader| leader.clock_ms),
            pressure: ordered.iter().fold(Pressure::default(), |all, r| all.max(r.pressure)),
            completed,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const OWNERS: u16 = 4;

    fn owners() -> NonZeroU16 {
        NonZeroU16::new(OWNERS).expect("nonzero")
    }

    fn limits(operations: usize) -> AgreementLimits {
        AgreementLimits {
            operations_inflight_max: NonZeroUsize::new(operations).expect("nonzero"),
            keys_per_operation_max: NonZeroUsize::new(64).expect("nonzero"),
        }
    }

    fn record(
        op: u64,
        kind: OperationKind,
        ok: &[bool],
        failed: &[bool],
        retired: bool,
    ) -> CompletionRecord {
        CompletionRecord {
            operation: OperationId(op),
            kind,
            key_ok: ok.to_vec(),
            object_failed: failed.to_vec(),
            retired,
        }
    }

    fn clean(op: u64, kind: OperationKind, keys: usize) -> CompletionRecord {
        record(op, kind, &vec![true; keys], &vec![false; keys], true)
    }

    fn report(owner: u16, completions: Vec<CompletionRecord>) -> OwnerReport {
        OwnerReport {
            owner: OwnerIndex(owner),
            owners: OWNERS,
            clock_ms: 1_000 + u64::from(owner),
            pressure: Pressure::default(),
            completions,
            fault: None,
        }
    }

    fn empty_round() -> Vec<OwnerReport> {
        (0..OWNERS).map(|o| report(o, Vec::new())).collect()
    }

    /// The reduction written out the obvious way, to check the incremental one against.
    fn reference(records: &[CompletionRecord]) -> AgreedCompletion {
        let first = &records[0];
        let keys = first.key_ok.len();
        AgreedCompletion {
            operation: first.operation,
            kind: first.kind,
            key_ok: (0..keys).map(|k| records.iter().all(|r| r.key_ok[k])).collect(),
            object_failed: (0..keys).map(|k| records.iter().any(|r| r.object_failed[k])).collect(),
            retired: records.iter().all(|r| r.retired),
        }
    }

    #[test]
    fn and_or_reductions_and_publishable_rows() {
        use OperationKind::Get;
        let records = [
            (OwnerIndex(0), record(1, Get, &[true, true, false], &[false, false, true], true)),
            (OwnerIndex(1), record(1, Get, &[true, false, false], &[false, true, false], true)),
            (OwnerIndex(2), record(1, Get, &[true, true, true], &[false, false, false], true)),
            (OwnerIndex(3), record(1, Get, &[true, true, true], &[false, false, false], true)),
        ];
        let agreed = merge_records(owners(), &records).expect("valid");
        assert_eq!(agreed.key_ok, vec![true, false, false]);
        assert_eq!(agreed.object_failed, vec![false, true, true]);
        assert!(agreed.retired);
        assert_eq!(agreed.publishable(), vec![true, false, false]);

        let mut unretired = records.clone();
        unretired[2].1.retired = false;
        let agreed = merge_records(owners(), &unretired).expect("valid");
        assert!(!agreed.retired);
        assert_eq!(agreed.publishable(), vec![false, false, false], "unretired publishes nothing");
    }

    #[test]
    fn round_takes_leader_clock_and_max_pressure() {
        let mut a = Agreement::new(owners(), limits(4));
        let mut round = empty_round();
        round[0].clock_ms = 7;
        round[1].clock_ms = 99;
        round[1].pressure =
            Pressure { queued_jobs: 5, queued_payload_bytes: 10, oldest_job_age_ms: 1 };
        round[2].pressure =
            Pressure { queued_jobs: 2, queued_payload_bytes: 40, oldest_job_age_ms: 0 };
        round[3].pressure =
            Pressure { queued_jobs: 0, queued_payload_bytes: 0, oldest_job_age_ms: 9 };
        round.reverse();
        let outcome = a.merge_round(&round).expect("valid idle round");
        assert_eq!(outcome.clock_ms, 7, "owner 0 leads whatever the arrival order");
        assert_eq!(
            outcome.pressure,
            Pressure { queued_jobs: 5, queued_payload_bytes: 40, oldest_job_age_ms: 9 }
        );
        assert!(outcome.completed.is_empty());
    }

    #[test]
    fn partial_rounds_are_retained_until_every_owner_reported() {
        use OperationKind::{Get, Put};
        let mut a = Agreement::new(owners(), limits(4));
        a.register(OperationId(1), Get, 2).expect("room");
        a.register(OperationId(2), Put, 1).expect("room");

        // Round 1: owners 0 and 2 finished op 1; op 2 is complete on everyone.
        let mut round = empty_round();
        round[0].completions = vec![clean(1, Get, 2), clean(2, Put, 1)];
        round[1].completions = vec![clean(2, Put, 1)];
        round[2].completions = vec![clean(1, Get, 2), clean(2, Put, 1)];
        round[3].completions = vec![clean(2, Put, 1)];
        let outcome = a.merge_round(&round).expect("valid");
        let done: Vec<_> = outcome.completed.iter().map(|c| c.operation).collect();
        assert_eq!(done, vec![OperationId(2)], "a later operation does not wait for op 1");
        assert_eq!(a.reported(OperationId(1)), Some(2));

        // Round 2: nobody has anything; op 1 is still retained.
        assert!(a.merge_round(&empty_round()).expect("idle").completed.is_empty());
        assert_eq!(a.reported(OperationId(1)), Some(2));

        // Round 3: the last two owners report op 1, one with a confirmed miss.
        let mut round = empty_round();
        round[1].completions = vec![record(1, Get, &[true, false], &[false, true], true)];
        round[3].completions = vec![clean(1, Get, 2)];
        let outcome = a.merge_round(&round).expect("valid");
        assert_eq!(outcome.completed.len(), 1);
        assert_eq!(outcome.completed[0].key_ok, vec![true, false]);
        assert_eq!(outcome.completed[0].object_failed, vec![false, true]);
        assert_eq!(a.inflight(), 0);
        assert_eq!(a.reported(OperationId(1)), None);
    }

    #[test]
    fn retention_is_bounded_by_refusing_new_operations() {
        use OperationKind::Get;
        let mut a = Agreement::new(owners(), limits(2));
        a.register(OperationId(1), Get, 1).expect("room");
        a.register(OperationId(2), Get, 1).expect("room");
        assert_eq!(
            a.register(OperationId(3), Get, 1),
            Err(RegisterRefusal::Full { inflight: 2, max: 2 })
        );
        // Three of four owners finished op 1: it stays retained, nothing was dropped.
        let mut round = empty_round();
        for r in &mut round[..3] {
            r.completions = vec![clean(1, Get, 1)];
        }
        for r in &mut round {
            r.completions.push(clean(2, Get, 1));
        }
        let outcome = a.merge_round(&round).expect("valid");
        assert_eq!(outcome.completed.len(), 1);
        assert_eq!(outcome.completed[0].operation, OperationId(2));
        assert_eq!(a.reported(OperationId(1)), Some(3), "the oldest partial op is kept");
        // Op 2's agreement freed one slot: op 3 fits now, op 4 does not.
        a.register(OperationId(3), Get, 1).expect("a slot was freed");
        assert!(matches!(a.register(OperationId(4), Get, 1), Err(RegisterRefusal::Full { .. })));
        assert_eq!(
            a.register(OperationId(5), Get, 65),
            Err(RegisterRefusal::Full { inflight: 2, max: 2 }),
            "fullness is checked first"
        );
    }

    #[test]
    fn registration_rules() {
        use OperationKind::Query;
        let mut a = Agreement::new(owners(), limits(8));
        assert_eq!(
            a.register(OperationId(1), Query, 65),
            Err(RegisterRefusal::TooManyKeys { operation: OperationId(1), keys: 65, max: 64 })
        );
        a.register(OperationId(5), Query, 1).expect("room");
        assert_eq!(
            a.register(OperationId(5), Query, 1),
            Err(RegisterRefusal::NotIncreasing { operation: OperationId(5), last: OperationId(5) })
        );
        assert!(matches!(
            a.register(OperationId(4), Query, 1),
            Err(RegisterRefusal::NotIncreasing { .. })
        ));
        // An id is never reused even after its operation was agreed.
        let mut round = empty_round();
        for r in &mut round {
            r.completions = vec![clean(5, Query, 1)];
        }
        assert_eq!(a.merge_round(&round).expect("valid").completed.len(), 1);
        assert!(matches!(
            a.register(OperationId(5), Query, 1),
            Err(RegisterRefusal::NotIncreasing { .. })
        ));
    }

    /// Four owners, each with its own copy of the agreement, merge the same gathered round in
    /// which one report is invalid: all four raise the same error, nothing of the round applies,
    /// and the error stays.
    fn everyone_fails_alike(round: &[OwnerReport], expected: &ProtocolError) {
        use OperationKind::{Get, Put};
        let mut copies: Vec<Agreement> =
            (0..OWNERS).map(|_| Agreement::new(owners(), limits(4))).collect();
        for a in &mut copies {
            a.register(OperationId(1), Get, 2).expect("room");
            a.register(OperationId(2), Put, 1).expect("room");
        }
        for (i, a) in copies.iter_mut().enumerate() {
            // Each owner may see the gathered reports rotated; the error must not depend on it.
            let mut seen = round.to_vec();
            seen.rotate_left(i % round.len().max(1));
            assert_eq!(a.merge_round(&seen).as_ref(), Err(expected), "owner copy {i}");
            assert_eq!(a.reported(OperationId(2)), Some(0), "nothing of the round applied");
            assert_eq!(a.merge_round(&empty_round()).as_ref(), Err(expected), "the error stays");
            assert_eq!(a.failure(), Some(expected));
            assert_eq!(
                a.register(OperationId(3), Get, 1),
                Err(RegisterRefusal::Failed(expected.clone()))
            );
        }
    }

    fn round_with(owner: usize, bad: CompletionRecord) -> Vec<OwnerReport> {
        let mut round = empty_round();
        for r in &mut round {
            r.completions = vec![clean(2, OperationKind::Put, 1)];
        }
        round[owner].completions.push(bad);
        round
    }

    #[test]
    fn invalid_reports_fail_every_owner() {
        use OperationKind::{Get, Put, Query};
        let o = OwnerIndex(2);
        let op = OperationId(1);
        let cases = [
            (
                round_with(2, record(1, Get, &[true], &[false], true)),
                ProtocolError::KeyCountMismatch {
                    owner: o,
                    operation: op,
                    expected: 2,
                    success: 1,
                    failures: 1,
                },
            ),
            (
                round_with(2, record(1, Get, &[true, true], &[false], true)),
                ProtocolError::KeyCountMismatch {
                    owner: o,
                    operation: op,
                    expected: 2,
                    success: 2,
                    failures: 1,
                },
            ),
            (
                round_with(2, record(1, Get, &[true, true], &[false, true], true)),
                ProtocolError::SuccessWithFailure { owner: o, operation: op, key: 1 },
            ),
            (
                round_with(2, clean(1, Query, 2)),
                ProtocolError::KindMismatch {
                    owner: o,
                    operation: op,
                    expected: Get,
                    reported: Query,
                },
            ),
            (
                round_with(2, clean(9, Get, 2)),
                ProtocolError::UnknownOperation { owner: o, operation: OperationId(9) },
            ),
            (
                round_with(2, clean(2, Put, 1)),
                ProtocolError::DuplicateRecord { owner: o, operation: OperationId(2) },
            ),
        ];
        for (round, expected) in &cases {
            everyone_fails_alike(round, expected);
        }

        let mut round = empty_round();
        round[3].completions = vec![record(2, Put, &[false], &[true], true)];
        everyone_fails_alike(
            &round,
            &ProtocolError::ReadFailureOutsideGet {
                owner: OwnerIndex(3),
                operation: OperationId(2),
                kind: Put,
                key: 0,
            },
        );

        let mut short = empty_round();
        short.pop();
        everyone_fails_alike(&short, &ProtocolError::WrongReportCount { got: 3, expected: OWNERS });

        let mut twice = empty_round();
        twice[3].owner = OwnerIndex(1);
        everyone_fails_alike(&twice, &ProtocolError::DuplicateOwner { owner: OwnerIndex(1) });

        let mut outside = empty_round();
        outside[3].owner = OwnerIndex(7);
        everyone_fails_alike(
            &outside,
            &ProtocolError::OwnerOutOfRange { owner: OwnerIndex(7), owners: OWNERS },
        );

        let mut miscounted = empty_round();
        miscounted[1].owners = 8;
        everyone_fails_alike(
            &miscounted,
            &ProtocolError::OwnerCountMismatch {
                owner: OwnerIndex(1),
                declared: 8,
                expected: OWNERS,
            },
        );
    }

    #[test]
    fn an_owner_local_fault_fails_the_round_for_everyone() {
        use OperationKind::{Get, Put};
        let mut local = Agreement::new(owners(), limits(4));
        local.register(OperationId(1), Get, 2).expect("room");
        local.register(OperationId(2), Put, 1).expect("room");
        // Owner 1 validates its own poll before the exchange and finds a bad record.
        let mut mine = report(1, vec![record(1, Get, &[true], &[false], true)]);
        let cause = local.check_local(&mine).expect_err("invalid local record");
        mine.completions.clear();
        mine.fault = Some(cause.clone());
        let mut round = empty_round();
        round[1] = mine;
        everyone_fails_alike(
            &round,
            &ProtocolError::ReportedByOwner { owner: OwnerIndex(1), cause: Box::new(cause) },
        );
    }

    #[test]
    fn merge_records_rejects_bad_sets() {
        use OperationKind::Get;
        let one = |owner: u16, op: u64| (OwnerIndex(owner), clean(op, Get, 1));
        assert_eq!(
            merge_records(owners(), &[one(0, 1), one(1, 1), one(2, 1)]),
            Err(ProtocolError::MissingOwners {
                operation: OperationId(1),
                reported: 3,
                owners: OWNERS
            })
        );
        assert_eq!(
            merge_records(owners(), &[one(0, 1), one(0, 1), one(2, 1), one(3, 1)]),
            Err(ProtocolError::DuplicateRecord { owner: OwnerIndex(0), operation: OperationId(1) })
        );
        assert_eq!(
            merge_records(owners(), &[one(0, 1), one(1, 2)]),
            Err(ProtocolError::OperationMismatch { expected: OperationId(1), got: OperationId(2) })
        );
        assert_eq!(
            merge_records(owners(), &[one(4, 1)]),
            Err(ProtocolError::OwnerOutOfRange { owner: OwnerIndex(4), owners: OWNERS })
        );
        assert!(matches!(
            merge_records(owners(), &[]),
            Err(ProtocolError::MissingOwners { reported: 0, .. })
        ));
    }

    #[test]
    fn error_messages_carry_the_numbers() {
        let o = OwnerIndex(3);
        let op = OperationId(12);
        let cases: [(ProtocolError, &str); 4] = [
            (
                ProtocolError::KeyCountMismatch {
                    owner: o,
                    operation: op,
                    expected: 4,
                    success: 3,
                    failures: 4,
                },
                "owner 3 reported op12 with 3 success and 4 failure flags, the operation has 4 keys",
            ),
            (
                ProtocolError::ReportedByOwner {
                    owner: o,
                    cause: Box::new(ProtocolError::UnknownOperation { owner: o, operation: op }),
                },
                "owner 3 reported an invalid local poll: owner 3 reported op12, which is not awaiting agreement",
            ),
            (
                ProtocolError::ReadFailureOutsideGet {
                    owner: o,
                    operation: op,
                    kind: OperationKind::Query,
                    key: 2,
                },
                "owner 3 reported an object failure for key 2 of QUERY op12",
            ),
            (
                ProtocolError::WrongReportCount { got: 3, expected: 4 },
                "3 reports in the round, expected one from each of 4 owners",
            ),
        ];
        for (error, text) in cases {
            assert_eq!(error.to_string(), text);
        }
        assert_eq!(
            RegisterRefusal::Full { inflight: 2, max: 2 }.to_string(),
            "2 operations await agreement, operations_inflight_max is 2"
        );
    }

    /// One owner's record of a GET: per key 0 = success, 1 = confirmed failure, 2 = neither.
    fn get_record(op: u64, states: &[u8], retired: bool) -> CompletionRecord {
        CompletionRecord {
            operation: OperationId(op),
            kind: OperationKind::Get,
            key_ok: states.iter().map(|s| *s == 0).collect(),
            object_failed: states.iter().map(|s| *s == 1).collect(),
            retired,
        }
    }

    fn owner_records(keys: usize) -> impl Strategy<Value = Vec<(Vec<u8>, bool)>> {
        prop::collection::vec(
            (prop::collection::vec(0_u8..3, keys), any::<bool>()),
            usize::from(OWNERS),
        )
    }

    fn permutation() -> impl Strategy<Value = Vec<usize>> {
        Just((0..usize::from(OWNERS)).collect::<Vec<_>>()).prop_shuffle()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any order of the four owners' records merges to the reference fold.
        #[test]
        fn any_owner_order_merges_like_the_reference(
            (owners_data, order) in (1_usize..9).prop_flat_map(|keys| (owner_records(keys), permutation()))
        ) {
            let records: Vec<CompletionRecord> =
                owners_data.iter().map(|(states, retired)| get_record(7, states, *retired)).collect();
            let permuted: Vec<(OwnerIndex, CompletionRecord)> = order
                .iter()
                .map(|&i| (OwnerIndex(u16::try_from(i).expect("small")), records[i].clone()))
                .collect();
            prop_assert_eq!(merge_records(owners(), &permuted).expect("valid"), reference(&records));
        }

        /// Three operations whose owners report in arbitrary rounds and arrival orders: each is
        /// agreed in the round its last owner reports, equal to the reference fold, and every
        /// round takes the leader's clock and the maximum pressure.
        #[test]
        fn records_spread_over_rounds_agree_like_the_reference(
            data in prop::collection::vec(
                (1_usize..6).prop_flat_map(|keys| (owner_records(keys), prop::collection::vec(0_usize..3, usize::from(OWNERS)))),
                3,
            ),
            orders in prop::collection::vec(permutation(), 3),
            pressures in prop::collection::vec(prop::collection::vec((0_u64..100, 0_u64..100, 0_u64..100), usize::from(OWNERS)), 3),
        ) {
            let mut a = Agreement::new(owners(), limits(3));
            let mut expected: Vec<(usize, AgreedCompletion)> = Vec::new();
            let mut by_round: Vec<Vec<Vec<CompletionRecord>>> =
                vec![vec![Vec::new(); usize::from(OWNERS)]; 3];
            for (i, (owners_data, rounds)) in data.iter().enumerate() {
                let op = u64::try_from(i).expect("small") + 1;
                a.register(OperationId(op), OperationKind::Get, owners_data[0].0.len()).expect("room");
                let records: Vec<CompletionRecord> =
                    owners_data.iter().map(|(states, retired)| get_record(op, states, *retired)).collect();
                for (owner, record) in records.iter().enumerate() {
                    by_round[rounds[owner]][owner].push(record.clone());
                }
                let last = rounds.iter().copied().max().unwrap_or(0);
                expected.push((last, reference(&records)));
            }
            for (round_index, per_owner) in by_round.into_iter().enumerate() {
                let reports: Vec<OwnerReport> = per_owner
                    .into_iter()
                    .enumerate()
                    .map(|(owner, completions)| {
                        let (jobs, bytes, age) = pressures[round_index][owner];
                        let owner = u16::try_from(owner).expect("small");
                        OwnerReport {
                            pressure: Pressure { queued_jobs: jobs, queued_payload_bytes: bytes, oldest_job_age_ms: age },
                            ..report(owner, completions)
                        }
                    })
                    .collect();
                let arrived: Vec<OwnerReport> = orders[round_index].iter().map(|&i| reports[i].clone()).collect();
                let outcome = a.merge_round(&arrived).expect("valid round");
                prop_assert_eq!(outcome.clock_ms, reports[0].clock_ms);
                let max = reports.iter().fold(Pressure::default(), |m, r| m.max(r.pressure));
                prop_assert_eq!(outcome.pressure, max);
                let want: Vec<AgreedCompletion> = expected
                    .iter()
                    .filter(|(last, _)| *last == round_index)
                    .map(|(_, agreed)| agreed.clone())
                    .collect();
                prop_assert_eq!(outcome.completed, want);
            }
            prop_assert_eq!(a.inflight(), 0);
        }
    }
}
