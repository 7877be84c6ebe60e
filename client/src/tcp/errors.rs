//! How the client's failures become [`StoreError`]s: transport failures, refusals the server
//! answered, and the checks every answer frame passes before its contents are used.

use std::io;
use std::time::Duration;

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::store::{Retirement, StoreError};
use gpucache_wire::seal::SealKey;
use gpucache_wire::{Frame, Op, Response, WireError};

pub(super) fn transport(operation: &'static str, detail: impl std::fmt::Display) -> StoreError {
    StoreError::Backend {
        operation,
        detail: format!("transport: {detail}"),
        retirement: Retirement::Retired,
    }
}

/// A transport failure; one caused by a system I/O error keeps that error's kind.
pub(super) fn transport_failure(
    operation: &'static str,
    kind: Option<io::ErrorKind>,
    detail: impl std::fmt::Display,
) -> StoreError {
    match kind {
        Some(kind) => StoreError::Io {
            operation,
            kind,
            detail: format!("transport: {detail}"),
            retirement: Retirement::Retired,
        },
        None => transport(operation, detail),
    }
}

/// How one request and its answer failed, before any answer could be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum ExchangeFailure {
    #[error("request not encodable: {0}")]
    Encode(WireError),
    #[error("{0}")]
    Io(io::Error),
    #[error("no answer within {0:?}")]
    Deadline(Duration),
    #[error("server closed the connection")]
    Closed,
    /// The bytes that came back are not a GPCW frame (or not a sound one).
    #[error("{0}")]
    Frame(WireError),
    #[error("server sent bytes past the answer")]
    PastTheAnswer,
    #[error("answer for request {found} ({what}), expected {expected}")]
    OtherAnswer { found: u64, what: String, expected: u64 },
}

impl ExchangeFailure {
    /// The system's error kind, for a failure of the socket itself.
    fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            Self::Io(e) => Some(e.kind()),
            _ => None,
        }
    }

    /// Whether the connection turned out closed or reset: its server side is gone, and a
    /// request sent on it while it sat idle in the pool can be sent again on a fresh one.
    pub(super) fn is_dead(&self) -> bool {
        matches!(self, Self::Closed | Self::Io(_))
    }

    pub(super) fn into_store_error(self, operation: &'static str) -> StoreError {
        match self {
            Self::Encode(e) => not_encodable(operation, e),
            other => transport_failure(operation, other.io_kind(), other),
        }
    }
}

pub(super) fn not_encodable(operation: &'static str, e: WireError) -> StoreError {
    StoreError::Backend {
        operation,
        detail: format!("request not encodable: {e}"),
        retirement: Retirement::Retired,
    }
}

/// An answer frame as the caller may use it: its seal verified on a sealed session, and not an
/// error that closes the connection (those are transport failures). On failure, says whether
/// the server turned the connection away before serving anything (a dead connection).
pub(super) fn checked(
    frame: Frame,
    seal: Option<&SealKey>,
    operation: &'static str,
) -> Result<Frame, (StoreError, bool)> {
    if let Some(key) = seal {
        // Never let an answer that fails its seal reach the caller, whatever it holds.
        frame
            .verify_seal(key)
            .map_err(|e| (transport(operation, format!("answer: {e}")), false))?;
    }
    if frame.op == Op::Error {
        let response =
            Response::from_frame(&frame).map_err(|e| (transport(operation, e), false))?;
        if let Response::Error(e) = &response
            && e.closes_connection()
        {
            return Err((unexpected(operation, &response), frame.request_id == 0));
        }
    }
    Ok(frame)
}

pub(super) fn unexpected(operation: &'static str, response: &Response) -> StoreError {
    match response {
        // The server turned the connection away (stopping, full): a transport failure.
        Response::Error(e) if e.closes_connection() => transport(operation, format!("server: {e}")),
        Response::Error(WireError::Fenced(refusal)) => StoreError::Fenced(*refusal),
        Response::Error(e) => StoreError::Backend {
            operation,
            detail: format!("server: {e}"),
            retirement: Retirement::Retired,
        },
        other => transport(operation, format!("unexpected answer {:?}", other.op())),
    }
}

pub(super) fn check_right(caller: &Caller, right: Right) -> Result<(), StoreError> {
    if caller.rights.has(right) {
        Ok(())
    } else {
        Err(StoreError::Forbidden { tenant: caller.tenant.clone(), right })
    }
}
