//! `Executor`: the data plane's asynchronous L3 executor (`gpucache_executor`) for a
//! Python engine, over a `Client`'s store and caller. Submissions return operation ids at once
//! (or raise a refusal); worker threads make the store calls; `poll` hands back per-key results,
//! retirement facts, the pressure snapshot and the health state; `close` reports whether a
//! restart is needed. The semantics are the Rust executor's, unchanged: quarantine after an
//! unretired result, health epochs and cooldown after an outage, bounded queues.
//!
//! Jobs read from and write into the executor's own Host allocation (`allocation_bytes`, in
//! slots of `slot_bytes`; a range lies inside one slot). The engine fills and drains it with
//! `write` / `read` / `read_into`, which copy.

use std::num::{NonZeroU64, NonZeroUsize};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use gpucache_dataplane::clock::UnixClock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{MissReason, Store};
use gpucache_executor::HealthState;
use gpucache_executor::{
    CancelOutcome, CloseReport, Ending, Executor as Core, ExecutorConfig, HostBuffer, HostRange,
    KeyFailure, KeyResult, OperationId, OperationKind, OperationResult, PressureSnapshot,
    QuarantinedOperation, SubmitRefusal,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffers::{Access, Span, range_of};
use crate::client::Client;
use crate::errors::{refused, unavailable};

/// Largest Host allocation an executor makes.
pub(crate) const ALLOCATION_BYTES_MAX: u64 = 64 << 30;
/// Longest `poll(timeout_s=...)` and `close(join_deadline_s=...)` wait.
const WAIT_S_MAX: f64 = 3600.0;

fn nz(v: usize, what: &str) -> PyResult<NonZeroUsize> {
    NonZeroUsize::new(v).ok_or_else(|| PyValueError::new_err(format!("{what} must be positive")))
}

fn wait(seconds: f64, what: &str) -> PyResult<Duration> {
    if !(seconds.is_finite() && (0.0..=WAIT_S_MAX).contains(&seconds)) {
        return Err(PyValueError::new_err(format!("{what} must be in [0, {WAIT_S_MAX}]")));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The Rust executor for a Python engine. See the module documentation.
#[pyclass(module = "gpucache._native", frozen)]
#[derive(Debug)]
pub struct Executor {
    /// Taken out by `close`; calls hold a clone of the `Arc` ([`Held`]) and never this lock
    /// while they wait.
    core: Mutex<Option<Arc<Core>>>,
    /// Signalled (under `core`'s lock) each time a call lets its clone of the core go, so that
    /// `close` waits for the last one with a deadline.
    released: Condvar,
    host: Arc<HostBuffer>,
    namespace_client: Py<Client>,
}

/// A call's clone of the running core; letting it go wakes a waiting `close`.
struct Held<'a> {
    core: Option<Arc<Core>>,
    owner: &'a Executor,
}

impl std::ops::Deref for Held<'_> {
    type Target = Core;

    fn deref(&self) -> &Core {
        self.core.as_deref().expect("held until dropped")
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        drop(self.core.take());
        // Under the lock, so that a close between its count and its wait cannot miss this.
        let _g = self.owner.core.lock();
        self.owner.released.notify_all();
    }
}

fn kind_name(k: OperationKind) -> &'static str {
    match k {
        OperationKind::Query => "query",
        OperationKind::Get => "get",
        OperationKind::Put => "put",
    }
}

fn miss_name(m: &MissReason) -> &'static str {
    match m {
        MissReason::Absent => "absent",
        MissReason::Incompatible => "incompatible",
        MissReason::NotReadable(_) => "not_readable",
        MissReason::Corrupt => "corrupt",
    }
}

fn refusal(r: &SubmitRefusal) -> PyErr {
    let reason = match r {
        SubmitRefusal::QueueFull { .. } => "queue_full",
        SubmitRefusal::OutstandingFull { .. } => "outstanding_full",
        SubmitRefusal::Unhealthy(_) => "unhealthy",
        SubmitRefusal::Quarantined { .. } => "quarantined",
        SubmitRefusal::Closed => "closed",
        SubmitRefusal::NoKeys => "no_keys",
        SubmitRefusal::TooManyKeys { .. } => "too_many_keys",
        SubmitRefusal::BadRange { .. } => "bad_range",
        _ => "refused",
    };
    let e = refused(reason, r.to_string());
    if let SubmitRefusal::BadRange { index, .. } = r {
        Python::attach(|py| {
            let _ = e.value(py).setattr("index", *index);
        });
    }
    e
}

/// One key's answer as a dict: `ok`, `result` (found, read, written, already_stored,
/// object_failed, failed) and its details.
fn key_dict<'py>(py: Python<'py>, k: &KeyResult) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("ok", k.is_success())?;
    match k {
        KeyResult::Found { len } => {
            d.set_item("result", "found")?;
            d.set_item("bytes", *len)?;
        }
        KeyResult::Read { bytes } => {
            d.set_item("result", "read")?;
            d.set_item("bytes", *bytes)?;
        }
        KeyResult::Written { bytes } => {
            d.set_item("result", "written")?;
            d.set_item("bytes", *bytes)?;
        }
        KeyResult::AlreadyStored => d.set_item("result", "already_stored")?,
        KeyResult::ObjectFailed(m) => {
            d.set_item("result", "object_failed")?;
            d.set_item("reason", miss_name(m))?;
        }
        KeyResult::Failed(f) => {
            d.set_item("result", "failed")?;
            let (reason, detail) = match f {
                KeyFailure::NotFound => ("not_found", String::new()),
                KeyFailure::NotReadable => ("not_readable", String::new()),
                KeyFailure::ShortRead { expected, got } => {
                    ("short_read", format!("expected {expected} bytes, got {got}"))
                }
                KeyFailure::Malformed { expected, reported } => {
                    ("malformed", format!("range holds {expected}, reported {reported}"))
                }
                KeyFailure::Busy => ("busy", String::new()),
                KeyFailure::Refused => ("refused", String::new()),
                KeyFailure::Store(e) => ("store", e.to_string()),
                KeyFailure::NotAttempted => ("not_attempted", String::new()),
                _ => ("failed", format!("{f:?}")),
            };
            d.set_item("reason", reason)?;
            d.set_item("detail", detail)?;
        }
        other => {
            d.set_item("result", "other")?;
            d.set_item("detail", format!("{other:?}"))?;
        }
    }
    Ok(d)
}

fn result_dict<'py>(py: Python<'py>, r: &OperationResult) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("operation", r.operation.0)?;
    d.set_item("kind", kind_name(r.kind))?;
    d.set_item(
        "ending",
        match r.ending {
            Ending::Ran => "ran",
            Ending::Cancelled => "cancelled",
            Ending::Rejected => "rejected",
            Ending::Shutdown => "shutdown",
            _ => "other",
        },
    )?;
    d.set_item("retired", r.retired)?;
    d.set_item("detached", r.detached)?;
    let keys = PyList::empty(py);
    for k in &r.keys {
        keys.append(key_dict(py, k)?)?;
    }
    d.set_item("keys", keys)?;
    Ok(d)
}

fn pressure_dict<'py>(py: Python<'py>, p: &PressureSnapshot) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, load) in [("query", p.query), ("get", p.get), ("put", p.put)] {
        let q = PyDict::new(py);
        q.set_item("jobs", load.jobs)?;
        q.set_item("payload_bytes", load.payload_bytes)?;
        d.set_item(name, q)?;
    }
    d.set_item("running_jobs", p.running_jobs)?;
    d.set_item("undelivered_results", p.undelivered_results)?;
    d.set_item("oldest_job_age_ms", p.oldest_job_age_ms)?;
    Ok(d)
}

fn quarantined_list<'py>(
    py: Python<'py>,
    q: &[QuarantinedOperation],
) -> PyResult<Bound<'py, PyList>> {
    let l = PyList::empty(py);
    for op in q {
        let d = PyDict::new(py);
        d.set_item("operation", op.operation.0)?;
        d.set_item("kind", kind_name(op.kind))?;
        let ranges: Vec<(u64, u64)> = op.ranges.iter().map(|r| (r.offset, r.len)).collect();
        d.set_item("ranges", ranges)?;
        l.append(d)?;
    }
    Ok(l)
}

fn close_dict<'py>(py: Python<'py>, r: &CloseReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("restart_required", r.restart_required)?;
    d.set_item("workers_joined", r.workers_joined)?;
    d.set_item("workers_stuck", r.workers_stuck)?;
    let results = PyList::empty(py);
    for res in &r.results {
        results.append(result_dict(py, res)?)?;
    }
    d.set_item("results", results)?;
    d.set_item("quarantined", quarantined_list(py, &r.quarantined)?)?;
    d.set_item("text", r.to_string())?;
    Ok(d)
}

impl Executor {
    /// Makes the Host allocation and starts the workers.
    fn start(
        py: Python<'_>,
        client: Py<Client>,
        allocation_bytes: u64,
        slot_bytes: u64,
        config: ExecutorConfig,
    ) -> PyResult<Self> {
        if allocation_bytes == 0 || allocation_bytes > ALLOCATION_BYTES_MAX {
            return Err(PyValueError::new_err(format!(
                "allocation_bytes must be in 1..={ALLOCATION_BYTES_MAX}"
            )));
        }
        if slot_bytes == 0 || !allocation_bytes.is_multiple_of(slot_bytes) {
            return Err(PyValueError::new_err(
                "slot_bytes must be positive and divide allocation_bytes",
            ));
        }
        let too_big = |_| PyValueError::new_err("the allocation does not fit this host");
        let slots = usize::try_from(allocation_bytes / slot_bytes).map_err(too_big)?;
        let slot = usize::try_from(slot_bytes).map_err(too_big)?;
        let host = HostBuffer::new(nz(slots, "slots")?, nz(slot, "slot_bytes")?)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let host = Arc::new(host);
        let (store, caller) = {
            let c = client.bind(py).get();
            (Arc::clone(c.store()) as Arc<dyn Store>, c.caller().clone())
        };
        let core = Core::start(config, store, caller, Arc::clone(&host), Arc::new(UnixClock))
            .map_err(|e| unavailable(e.to_string()))?;
        Ok(Self {
            core: Mutex::new(Some(Arc::new(core))),
            released: Condvar::new(),
            host,
            namespace_client: client,
        })
    }

    fn lock_core(&self) -> PyResult<MutexGuard<'_, Option<Arc<Core>>>> {
        self.core.lock().map_err(|_| PyValueError::new_err("poisoned"))
    }

    /// The running core, or the refusal of a closed executor. The lock is held only to clone.
    fn core(&self) -> PyResult<Held<'_>> {
        let g = self.lock_core()?;
        let core = g.as_ref().map(Arc::clone);
        core.map(|core| Held { core: Some(core), owner: self })
            .ok_or_else(|| refused("closed", "the executor is closed"))
    }

    fn with_core<R>(&self, f: impl FnOnce(&Core) -> R) -> PyResult<R> {
        let core = self.core()?;
        Ok(f(&core))
    }

    fn keys(&self, py: Python<'_>, keys: &[Bound<'_, PyAny>]) -> PyResult<Vec<PhysicalKey>> {
        let client = self.namespace_client.bind(py).get();
        keys.iter().map(|k| client.key_of(k)).collect()
    }

    fn pairs(
        &self,
        py: Python<'_>,
        keys: &[Bound<'_, PyAny>],
        ranges: Vec<(u64, u64)>,
    ) -> PyResult<Vec<(PhysicalKey, HostRange)>> {
        if keys.len() != ranges.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys but {} ranges",
                keys.len(),
                ranges.len()
            )));
        }
        let keys = self.keys(py, keys)?;
        Ok(keys.into_iter().zip(ranges).map(|(k, (o, l))| (k, HostRange::new(o, l))).collect())
    }

    /// Queues a GET or a PUT of `keys` with their ranges.
    fn submit_ranged(
        &self,
        py: Python<'_>,
        keys: &[Bound<'_, PyAny>],
        ranges: Vec<(u64, u64)>,
        kind: OperationKind,
    ) -> PyResult<u64> {
        let pairs = self.pairs(py, keys, ranges)?;
        let submitted = self.with_core(|c| match kind {
            OperationKind::Put => c.submit_put(pairs),
            _ => c.submit_get(pairs),
        })?;
        submitted.map(|o| o.0).map_err(|e| refusal(&e))
    }
}

/// The slot size `slot_bytes=None` means: the whole allocation up to 4 MiB, else 4 MiB slots.
const SLOT_BYTES_DEFAULT: u64 = 4 << 20;

#[pymethods]
impl Executor {
    #[new]
    #[pyo3(signature = (
        client, allocation_bytes, slot_bytes = None, queue_depth = 256, workers_query = 1,
        workers_get = 2, workers_put = 2, operations_outstanding_max = 1024,
        keys_per_job_max = 4096, cooldown_ms = 5000
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        client: Py<Client>,
        allocation_bytes: u64,
        slot_bytes: Option<u64>,
        queue_depth: usize,
        workers_query: usize,
        workers_get: usize,
        workers_put: usize,
        operations_outstanding_max: usize,
        keys_per_job_max: usize,
        cooldown_ms: u64,
    ) -> PyResult<Self> {
        let slot = slot_bytes.unwrap_or(allocation_bytes.min(SLOT_BYTES_DEFAULT));
        let config = ExecutorConfig {
            queue_depth_query: nz(queue_depth, "queue_depth")?,
            queue_depth_get: nz(queue_depth, "queue_depth")?,
            queue_depth_put: nz(queue_depth, "queue_depth")?,
            workers_query: nz(workers_query, "workers_query")?,
            workers_get: nz(workers_get, "workers_get")?,
            workers_put: nz(workers_put, "workers_put")?,
            operations_outstanding_max: nz(
                operations_outstanding_max,
                "operations_outstanding_max",
            )?,
            keys_per_job_max: nz(keys_per_job_max, "keys_per_job_max")?,
            cooldown_ms: NonZeroU64::new(cooldown_ms)
                .ok_or_else(|| PyValueError::new_err("cooldown_ms must be positive"))?,
            ..ExecutorConfig::default()
        };
        Self::start(py, client, allocation_bytes, slot, config)
    }

    /// Bytes of the Host allocation.
    #[getter]
    fn allocation_bytes(&self) -> u64 {
        self.host.len_bytes()
    }

    /// Bytes of one slot (a range lies inside one slot).
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.host.slot_bytes()
    }

    /// Queues a QUERY of `keys`; returns its operation id.
    fn submit_query(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<u64> {
        let keys = self.keys(py, &keys)?;
        self.with_core(|c| c.submit_query(keys))?.map(|o| o.0).map_err(|e| refusal(&e))
    }

    /// Queues a GET of each key into its range `(offset, len)` of the allocation; a key succeeds
    /// only when exactly `len` bytes are read.
    fn submit_get(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ranges: Vec<(u64, u64)>,
    ) -> PyResult<u64> {
        self.submit_ranged(py, &keys, ranges, OperationKind::Get)
    }

    /// Queues a create-only PUT of each key from its range `(offset, len)`.
    fn submit_put(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ranges: Vec<(u64, u64)>,
    ) -> PyResult<u64> {
        self.submit_ranged(py, &keys, ranges, OperationKind::Put)
    }

    /// Cancels an operation: "cancelled" (it was queued; its result waits for the next poll),
    /// "detached" (running; its result still comes, marked detached) or "not_outstanding".
    fn cancel(&self, operation: u64) -> PyResult<&'static str> {
        Ok(match self.with_core(|c| c.cancel(OperationId(operation)))? {
            CancelOutcome::Cancelled => "cancelled",
            CancelOutcome::Detached => "detached",
            CancelOutcome::NotOutstanding => "not_outstanding",
        })
    }

    /// Every finished result, with the pressure snapshot taken under the same lock, the health
    /// state and the quarantined operations: `{"results": [...], "pressure": {...}, "health":
    /// {"state", "epoch"}, "quarantined": [...]}`. With `timeout_s` > 0 it first waits (GIL
    /// released) up to that long for at least one result.
    #[pyo3(signature = (timeout_s = 0.0))]
    fn poll<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyDict>> {
        let timeout = wait(timeout_s, "timeout_s")?;
        let core = self.core()?;
        let (poll, health, quarantined) = py.detach(|| {
            let poll = if timeout.is_zero() { core.poll() } else { core.poll_wait(timeout) };
            (poll, core.health(), core.quarantined())
        });
        drop(core);
        let d = PyDict::new(py);
        let results = PyList::empty(py);
        for r in &poll.results {
            results.append(result_dict(py, r)?)?;
        }
        d.set_item("results", results)?;
        d.set_item("pressure", pressure_dict(py, &poll.pressure)?)?;
        let h = PyDict::new(py);
        h.set_item(
            "state",
            match health.state {
                HealthState::Healthy => "healthy",
                HealthState::CoolingDown { .. } => "cooling_down",
                HealthState::Probing { .. } => "probing",
            },
        )?;
        h.set_item("epoch", health.epoch)?;
        h.set_item("text", health.state.to_string())?;
        d.set_item("health", h)?;
        d.set_item("quarantined", quarantined_list(py, &quarantined)?)?;
        Ok(d)
    }

    /// Copies `data` (bytes or any buffer) into the front of the range `(offset, len)`.
    fn write(&self, offset: u64, len: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let src = range_of(data, None, Access::Read)?;
        if src.len as u64 > len {
            return Err(PyValueError::new_err(format!(
                "{} bytes do not fit the {len}-byte range",
                src.len
            )));
        }
        let span = Span::of(&src);
        // SAFETY: `src` holds the buffer for this call and the bytes are only read.
        let bytes = unsafe { span.bytes() };
        self.host
            .write(HostRange::new(offset, len), bytes)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// A copy of the bytes of the range `(offset, len)`.
    fn read<'py>(&self, py: Python<'py>, offset: u64, len: u64) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self
            .host
            .read(HostRange::new(offset, len))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Copies the bytes of the range `(offset, len)` into the front of `dst` (any writable
    /// buffer: a bytearray, a NumPy array, a CPU torch tensor), which must hold them all.
    fn read_into(
        &self,
        py: Python<'_>,
        offset: u64,
        len: u64,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let dst = range_of(dst, None, Access::Write)?;
        if (dst.len as u64) < len {
            return Err(PyValueError::new_err(format!(
                "the {len}-byte range does not fit a {}-byte buffer",
                dst.len
            )));
        }
        let span = Span::of(&dst);
        let host = &self.host;
        py.detach(|| {
            host.with_range(HostRange::new(offset, len), |src| {
                // SAFETY: `dst` holds the writable buffer for this call, and no other range of
                // this call aliases it.
                let out = unsafe { span.bytes_mut() };
                out[..src.len()].copy_from_slice(src);
            })
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Stops the executor: refuses new work, drops queued jobs, waits up to `join_deadline_s`
    /// for the workers. Returns `{"restart_required", "workers_joined", "workers_stuck",
    /// "results", "quarantined", "text"}`; `restart_required` is true when a worker is stuck in
    /// a store call or a result was unretired. A second close raises RefusedError("closed").
    #[pyo3(signature = (join_deadline_s = 5.0))]
    fn close<'py>(&self, py: Python<'py>, join_deadline_s: f64) -> PyResult<Bound<'py, PyDict>> {
        let deadline = wait(join_deadline_s, "join_deadline_s")?;
        // A call of another thread may still hold the core (a poll for at most its timeout):
        // wait for the last one to let it go, until the deadline.
        let until = std::time::Instant::now() + deadline;
        let report = py.detach(|| -> PyResult<Result<_, ()>> {
            let mut g = self.lock_core()?;
            let core = g.take().ok_or_else(|| refused("closed", "the executor is closed"))?;
            loop {
                if Arc::strong_count(&core) == 1 {
                    drop(g);
                    let left = until.saturating_duration_since(std::time::Instant::now());
                    return Ok(Arc::try_unwrap(core).map(|c| c.close(left)).map_err(|_| ()));
                }
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    // Put it back, so that a later close can finish the job.
                    *g = Some(core);
                    return Ok(Err(()));
                }
                g = self
                    .released
                    .wait_timeout(g, left)
                    .map_err(|_| PyValueError::new_err("poisoned"))?
                    .0;
            }
        })?;
        match report {
            Ok(report) => close_dict(py, &report),
            Err(()) => {
                Err(unavailable("a poll in another thread still holds the executor; close again"))
            }
        }
    }
}
