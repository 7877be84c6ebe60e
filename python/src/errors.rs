//! The exceptions of the package and how store answers become them. A miss is never an
//! exception: it is `None` or `False`. A refusal carries a stable snake_case `reason` and a
//! human `detail`; a transport failure (unreachable, deadline, server gone) is
//! `UnavailableError`.

use gpucache_client::ConnectError;
use gpucache_dataplane::limits::Refusal;
use gpucache_dataplane::store::{Retirement, StoreError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    gpucache,
    Error,
    PyException,
    "Every error of gpucache. A miss is never an error."
);
create_exception!(
    gpucache,
    RefusedError,
    Error,
    "The store refused the call. `.reason` is a stable snake_case word (too_large, forbidden, \
     wrong_tenant, budget, busy, quarantined, conflict, ...), `.detail` the store's message."
);
create_exception!(
    gpucache,
    BufferTooSmallError,
    RefusedError,
    "The destination is smaller than the block; `.needed` is the block's size in bytes."
);
create_exception!(
    gpucache,
    UnavailableError,
    Error,
    "The server could not be used: unreachable, not answering within the deadline, gone, or \
     not a GPCW listener. Nothing was read; the caller recomputes."
);

/// A refusal with its reason word and detail.
pub(crate) fn refused(reason: &str, detail: impl Into<String>) -> PyErr {
    let detail = detail.into();
    Python::attach(|py| {
        let err = RefusedError::new_err(format!("{reason}: {detail}"));
        let value = err.value(py);
        let set = value
            .setattr("reason", reason)
            .and_then(|()| value.setattr("detail", &detail))
            .and_then(|()| value.setattr("retired", true));
        match set {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

/// A transport failure.
pub(crate) fn unavailable(detail: impl Into<String>) -> PyErr {
    let detail = detail.into();
    Python::attach(|py| {
        let err = UnavailableError::new_err(detail.clone());
        let value = err.value(py);
        let set = value
            .setattr("reason", "unavailable")
            .and_then(|()| value.setattr("detail", &detail))
            .and_then(|()| value.setattr("retired", true));
        match set {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

fn too_small(needed: u64, provided: u64) -> PyErr {
    let detail = format!("destination holds {provided} bytes, the block has {needed}");
    Python::attach(|py| {
        let err = BufferTooSmallError::new_err(format!("buffer_too_small: {detail}"));
        let value = err.value(py);
        let set = value
            .setattr("reason", "buffer_too_small")
            .and_then(|()| value.setattr("detail", &detail))
            .and_then(|()| value.setattr("needed", needed))
            .and_then(|()| value.setattr("retired", true));
        match set {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

/// The reason word of an admission refusal.
pub(crate) fn refusal_reason(r: &Refusal) -> &'static str {
    match r {
        Refusal::ObjectTooLarge { .. } => "too_large",
        Refusal::RetainedBytes { .. } | Refusal::TenantRetainedBytes { .. } => "budget",
        Refusal::InflightRequests { .. } | Refusal::TenantInflightBytes { .. } => "inflight",
        Refusal::Registrations { .. } => "registrations",
        Refusal::Tenants { .. } => "tenants",
        Refusal::IdempotencyTable { .. } => "idempotency",
        Refusal::DiskFull { .. } => "disk_full",
        _ => "refused",
    }
}

pub(crate) fn from_refusal(r: &Refusal) -> PyErr {
    refused(refusal_reason(r), r.to_string())
}

/// Whether a backend failure's detail says the transport failed (the client's own wording).
fn is_transport(detail: &str) -> bool {
    detail.starts_with("transport:")
}

/// The exception for a failed store call. Every exception of the package has `.retired`, true
/// unless the store may still be touching the call's buffers (only on the same-host path, for a
/// destination in the shared segment that the server may still be writing: do not trust or
/// reuse it), which only a failed store call can say.
pub(crate) fn from_store(e: &StoreError) -> PyErr {
    let err = store_exception(e);
    let retired = e.retirement() == Retirement::Retired;
    Python::attach(|py| {
        let _ = err.value(py).setattr("retired", retired);
    });
    err
}

fn store_exception(e: &StoreError) -> PyErr {
    let text = e.to_string();
    match e {
        StoreError::WrongTenant { .. } => refused("wrong_tenant", text),
        StoreError::Forbidden { .. } => refused("forbidden", text),
        StoreError::EmptyObject => refused("empty", text),
        StoreError::BufferTooSmall { needed, provided } => too_small(*needed, *provided),
        StoreError::Replay(_) => refused("conflict", text),
        StoreError::ReservationQuarantined { .. } => refused("quarantined", text),
        StoreError::Backend { detail, .. } if is_transport(detail) => unavailable(text),
        StoreError::Backend { detail, .. } => refused(server_reason(detail), text),
        StoreError::Io { .. } => unavailable(text),
        StoreError::Storage { .. } => refused("storage", text),
        _ => refused("store", text),
    }
}

/// The reason word of an error the server answered with (`server: ...`).
fn server_reason(detail: &str) -> &'static str {
    let d = detail.to_ascii_lowercase();
    if d.contains("too large") || d.contains("exceeds") || d.contains("payload") {
        "too_large"
    } else if d.contains("quarantin") {
        "quarantined"
    } else {
        "bad_request"
    }
}

/// The exception for a session that could not be opened.
pub(crate) fn from_connect(e: &ConnectError) -> PyErr {
    let text = e.to_string();
    match e {
        ConnectError::UnknownTenant { .. } => refused("unknown_tenant", text),
        ConnectError::Refused(_) => refused("auth", text),
        ConnectError::NoLocalSocket => refused("no_local_socket", text),
        _ => unavailable(text),
    }
}
