//! The load loop every key-value peer driven from Rust shares (ours over each transport, Redis):
//! N client threads, each with its own connection, a PUT phase of distinct keys and a GET phase
//! over the keys that were put, with per-operation latencies and a verified sample of values.

use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use gpucache_dataplane::rng::SplitMix64;
use serde::Serialize;

use crate::stats;

/// Every `VERIFY_EVERY`-th GET of a thread is compared in full with the value that was put.
pub(crate) const VERIFY_EVERY: u64 = 16;
/// A phase stops early after this many failed operations in a row (a dead server must not spin
/// for the whole deadline).
const FAILURES_IN_A_ROW_MAX: u32 = 16;
/// The seed of the bytes every value shares.
const VALUE_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// One client of a peer. `index` names a key; the driver maps indices to distinct keys.
pub(crate) trait KvClient {
    fn put(&mut self, index: u64, value: &[u8]) -> Result<(), String>;
    /// Reads the value of `index` into the front of `dst`, or into a buffer of the client's own
    /// that [`KvClient::got`] then shows; returns its length.
    fn get(&mut self, index: u64, dst: &mut [u8]) -> Result<usize, String>;
    /// The value the last successful GET left in the client's own buffer, when it did not
    /// write `dst` (a zero-copy path); the driver verifies this instead of `dst`.
    fn got(&self) -> Option<&[u8]> {
        None
    }
}

/// What one point of the matrix asks of a peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoadSpec {
    pub value_bytes: usize,
    pub clients: usize,
    /// Distinct keys in the working set (the PUT phase writes at most this many).
    pub keys: u64,
    /// Deadline of each phase.
    pub phase: Duration,
}

/// One timed phase of one peer at one point, all clients together.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct PhaseStats {
    /// Operations attempted.
    pub ops: u64,
    /// Bytes moved by the operations that succeeded.
    pub bytes: u64,
    /// From the first client's start to the last client's end.
    pub seconds: f64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub errors: u64,
}

impl PhaseStats {
    /// 10^9 bytes per second.
    pub(crate) fn gbps(&self) -> f64 {
        stats::gbps(self.bytes, self.seconds)
    }
}

/// One point of one peer: a PUT and a GET phase (for iperf3 and memcpy, the same figure twice).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct PointResult {
    pub size: u64,
    pub clients: usize,
    pub put: Option<PhaseStats>,
    pub get: Option<PhaseStats>,
    /// GETs compared in full with what was put, and how many differed.
    pub verified: u64,
    pub mismatches: u64,
    pub error: Option<String>,
}

impl PointResult {
    pub(crate) fn failed(size: u64, clients: usize, error: String) -> Self {
        Self { size, clients, put: None, get: None, verified: 0, mismatches: 0, error: Some(error) }
    }
}

/// The bytes of key `index`: a fixed pseudo-random pattern whose first 8 bytes hold the index.
pub(crate) struct ValuePattern {
    base: Vec<u8>,
}

impl ValuePattern {
    pub(crate) fn new(bytes: usize) -> Self {
        Self { base: SplitMix64::bytes(VALUE_SEED, bytes.max(8)) }
    }

    /// A fresh buffer holding the pattern (the caller stamps indices into it).
    pub(crate) fn buffer(&self) -> Vec<u8> {
        self.base.clone()
    }

    pub(crate) fn stamp(buf: &mut [u8], index: u64) {
        buf[..8].copy_from_slice(&index.to_le_bytes());
    }

    /// Whether `got` is exactly the value of `index`.
    pub(crate) fn matches(&self, got: &[u8], index: u64) -> bool {
        got.len() == self.base.len()
            && got[..8] == index.to_le_bytes()
            && got[8..] == self.base[8..]
    }
}

/// What one client thread measured in one phase.
#[derive(Debug, Default)]
struct Part {
    start: Option<Instant>,
    end: Option<Instant>,
    ops: u64,
    ok: u64,
    errors: u64,
    first_error: Option<String>,
    latencies_ns: Vec<u64>,
}

impl Part {
    fn record(&mut self, took: Duration, outcome: Result<(), String>) -> bool {
        self.ops += 1;
        self.latencies_ns.push(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
        match outcome {
            Ok(()) => {
                self.ok += 1;
                false
            }
            Err(e) => {
                self.errors += 1;
                self.first_error.get_or_insert(e);
                true
            }
        }
    }
}

#[derive(Debug, Default)]
struct ThreadOutcome {
    put: Part,
    get: Part,
    verified: u64,
    mismatches: u64,
    setup_error: Option<String>,
}

/// What happens between the PUT and the GET phase of a point, untimed: `hook` runs once, on one
/// thread, after every client's PUT phase ended and before any GET starts (for example to drop
/// the page cache); with `get_once`, each client then reads each of its keys at most once (a
/// cold read stays cold), ending its GET phase early when they are all read.
#[derive(Clone, Copy)]
pub(crate) struct Between<'a> {
    pub hook: &'a (dyn Fn() -> Result<(), String> + Sync),
    pub get_once: bool,
}

/// Runs one point: `spec.clients` threads, each with the client `connect(thread)` returns. The
/// clients are created before the clock starts; the phases are separated by barriers, so PUT
/// and GET never overlap.
pub(crate) fn run<C, F>(spec: LoadSpec, connect: F) -> PointResult
where
    C: KvClient,
    F: Fn(usize) -> Result<C, String> + Sync,
{
    run_with(spec, connect, None)
}

/// [`run`], with `between` run between the phases.
pub(crate) fn run_with<C, F>(
    spec: LoadSpec,
    connect: F,
    between: Option<Between<'_>>,
) -> PointResult
where
    C: KvClient,
    F: Fn(usize) -> Result<C, String> + Sync,
{
    let pattern = ValuePattern::new(spec.value_bytes);
    let barrier = Barrier::new(spec.clients);
    let hook_error: Mutex<Option<String>> = Mutex::new(None);
    let outcomes: Vec<ThreadOutcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..spec.clients)
            .map(|t| {
                let (pattern, connect, hook_error) = (&pattern, &connect, &hook_error);
                let steps = Steps { barrier: &barrier, between, hook_error };
                scope.spawn(move || client_thread(spec, t, pattern, steps, connect))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| ThreadOutcome {
                    setup_error: Some("a client thread panicked".to_owned()),
                    ..ThreadOutcome::default()
                })
            })
            .collect()
    });
    let size = spec.value_bytes as u64;
    let mut errors: Vec<String> = outcomes.iter().filter_map(|o| o.setup_error.clone()).collect();
    errors.extend(
        outcomes
            .iter()
            .flat_map(|o| [&o.put.first_error, &o.get.first_error].into_iter().flatten().cloned()),
    );
    errors.dedup();
    if let Some(e) = hook_error.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
        errors.insert(0, format!("between the phases: {e}"));
    }
    PointResult {
        size,
        clients: spec.clients,
        put: summarize(outcomes.iter().map(|o| &o.put), size),
        get: summarize(outcomes.iter().map(|o| &o.get), size),
        verified: outcomes.iter().map(|o| o.verified).sum(),
        mismatches: outcomes.iter().map(|o| o.mismatches).sum(),
        error: (!errors.is_empty()).then(|| errors.join("; ")),
    }
}

/// How the client threads of a point keep in step.
#[derive(Clone, Copy)]
struct Steps<'a> {
    barrier: &'a Barrier,
    between: Option<Between<'a>>,
    hook_error: &'a Mutex<Option<String>>,
}

impl Steps<'_> {
    /// The end of the PUT phase: every thread waits here, and the hook, when there is one, runs
    /// on one of them while the others wait again.
    fn between_phases(&self) {
        let leader = self.barrier.wait().is_leader();
        let Some(between) = self.between else { return };
        if leader
            && let Err(e) = (between.hook)()
            && let Ok(mut slot) = self.hook_error.lock()
        {
            *slot = Some(e);
        }
        self.barrier.wait();
    }
}

fn client_thread<C, F>(
    spec: LoadSpec,
    thread: usize,
    pattern: &ValuePattern,
    steps: Steps<'_>,
    connect: &F,
) -> ThreadOutcome
where
    C: KvClient,
    F: Fn(usize) -> Result<C, String> + Sync,
{
    let mut out = ThreadOutcome::default();
    let client = connect(thread);
    let mut buf = pattern.buffer();
    let mut dst = vec![0u8; spec.value_bytes];
    // Touch the destination once so that page faults are not timed.
    dst.fill(1);
    // Every thread passes every barrier, even one whose client failed, so no thread waits
    // forever.
    steps.barrier.wait();
    let mut client = match client {
        Ok(c) => c,
        Err(e) => {
            out.setup_error = Some(format!("client {thread}: {e}"));
            steps.between_phases();
            return out;
        }
    };
    let step = spec.clients as u64;
    let mut put_keys = Vec::new();
    let start = Instant::now();
    let deadline = start + spec.phase;
    out.put.start = Some(start);
    let mut failed_in_a_row = 0;
    let mut index = thread as u64;
    while index < spec.keys && Instant::now() < deadline {
        ValuePattern::stamp(&mut buf, index);
        let t = Instant::now();
        let r = client.put(index, &buf);
        let failed = out.put.record(t.elapsed(), r);
        if failed {
            failed_in_a_row += 1;
            if failed_in_a_row >= FAILURES_IN_A_ROW_MAX {
                break;
            }
        } else {
            failed_in_a_row = 0;
            put_keys.push(index);
        }
        index += step;
    }
    out.put.end = Some(Instant::now());

    steps.between_phases();
    let get_once = steps.between.is_some_and(|b| b.get_once);
    let start = Instant::now();
    let deadline = start + spec.phase;
    out.get.start = Some(start);
    let mut n: u64 = 0;
    failed_in_a_row = 0;
    while !put_keys.is_empty() && Instant::now() < deadline {
        if get_once && n >= put_keys.len() as u64 {
            break;
        }
        let index = put_keys[usize::try_from(n).unwrap_or(0) % put_keys.len()];
        n += 1;
        let t = Instant::now();
        let r = client.get(index, &mut dst);
        let took = t.elapsed();
        let r = match r {
            Ok(len) if len == spec.value_bytes => Ok(()),
            Ok(len) => Err(format!("GET of key {index} returned {len} bytes, not {}", dst.len())),
            Err(e) => Err(e),
        };
        let verify = r.is_ok() && n % VERIFY_EVERY == 1;
        if out.get.record(took, r) {
            failed_in_a_row += 1;
            if failed_in_a_row >= FAILURES_IN_A_ROW_MAX {
                break;
            }
            continue;
        }
        failed_in_a_row = 0;
        if verify {
            if pattern.matches(client.got().unwrap_or(&dst), index) {
                out.verified += 1;
            } else {
                out.mismatches += 1;
            }
        }
    }
    out.get.end = Some(Instant::now());
    out
}

fn summarize<'a>(parts: impl Iterator<Item = &'a Part>, size: u64) -> Option<PhaseStats> {
    let parts: Vec<&Part> = parts.filter(|p| p.start.is_some() && p.end.is_some()).collect();
    let start = parts.iter().filter_map(|p| p.start).min()?;
    let end = parts.iter().filter_map(|p| p.end).max()?;
    let mut latencies: Vec<u64> =
        parts.iter().flat_map(|p| p.latencies_ns.iter().copied()).collect();
    latencies.sort_unstable();
    Some(PhaseStats {
        ops: parts.iter().map(|p| p.ops).sum(),
        bytes: parts.iter().map(|p| p.ok).sum::<u64>() * size,
        seconds: end.duration_since(start).as_secs_f64(),
        p50_us: stats::percentile_us(&latencies, 50.0),
        p99_us: stats::percentile_us(&latencies, 99.0),
        errors: parts.iter().map(|p| p.errors).sum(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A client over a shared in-memory map; key 2 reads back damaged.
    struct MapClient<'a>(&'a std::sync::Mutex<HashMap<u64, Vec<u8>>>);
    impl KvClient for MapClient<'_> {
        fn put(&mut self, index: u64, value: &[u8]) -> Result<(), String> {
            self.0.lock().map_err(|e| e.to_string())?.insert(index, value.to_vec());
            Ok(())
        }
        fn get(&mut self, index: u64, dst: &mut [u8]) -> Result<usize, String> {
            let map = self.0.lock().map_err(|e| e.to_string())?;
            let v = map.get(&index).ok_or("missing")?;
            dst[..v.len()].copy_from_slice(v);
            if index == 2 {
                dst[100] ^= 1;
            }
            Ok(v.len())
        }
    }

    #[test]
    fn the_driver_puts_every_key_once_and_verifies_gets() {
        let map = std::sync::Mutex::new(HashMap::new());
        let spec =
            LoadSpec { value_bytes: 4096, clients: 3, keys: 30, phase: Duration::from_millis(200) };
        let r = run(spec, |_| Ok(MapClient(&map)));
        let put = r.put.expect("put phase");
        assert_eq!(put.ops, 30);
        assert_eq!(put.bytes, 30 * 4096);
        assert_eq!(map.lock().expect("lock").len(), 30);
        let get = r.get.expect("get phase");
        assert!(get.ops > 30, "{get:?}");
        assert!(r.verified > 0);
        // Thread 2 owns keys 2, 5, 8, ...: its first GET, which is verified, reads key 2.
        assert!(r.mismatches > 0, "{:?}", r.mismatches);
        assert_eq!(r.error, None);
    }

    /// The hook runs once, after every PUT and before any GET; with `get_once` each key is read
    /// once, and the GET phase ends then, long before its deadline.
    #[test]
    fn the_step_between_the_phases_sees_every_put_and_no_get() {
        let map = std::sync::Mutex::new(HashMap::new());
        let seen = std::sync::Mutex::new(Vec::new());
        let hook = || {
            let n = map.lock().map_err(|e| e.to_string())?.len();
            seen.lock().map_err(|e| e.to_string())?.push(n);
            Ok(())
        };
        let spec =
            LoadSpec { value_bytes: 256, clients: 4, keys: 40, phase: Duration::from_secs(20) };
        let t = Instant::now();
        let r =
            run_with(spec, |_| Ok(MapClient(&map)), Some(Between { hook: &hook, get_once: true }));
        assert!(t.elapsed() < Duration::from_secs(10), "the GET phase ran to its deadline");
        assert_eq!(*seen.lock().expect("lock"), vec![40]);
        assert_eq!(r.get.as_ref().map(|g| g.ops), Some(40));
        // Key 2 reads back damaged, and with one GET per key thread 2's first (verified) GET
        // still reads it.
        assert!(r.mismatches > 0);

        let failing = || Err("no cache to drop".to_owned());
        let between = Between { hook: &failing, get_once: false };
        let spec = LoadSpec { phase: Duration::from_millis(50), ..spec };
        let r = run_with(spec, |_| Ok(MapClient(&map)), Some(between));
        assert!(
            r.error.as_deref().is_some_and(|e| e.contains("between the phases: no cache to drop")),
            "{r:?}"
        );
    }

    #[test]
    fn a_client_that_cannot_connect_is_reported_not_hung() {
        let spec =
            LoadSpec { value_bytes: 64, clients: 2, keys: 4, phase: Duration::from_millis(50) };
        let r = run::<MapClient<'_>, _>(spec, |t| Err(format!("refused {t}")));
        assert!(r.error.as_deref().is_some_and(|e| e.contains("refused 0")), "{r:?}");
        assert_eq!(r.put, None);
    }
}
