//! MooncakeStore (directly, and under the executor) against a live Mooncake Store on 127.0.0.1: the metadata server, the master
//! and a separate `mooncake_client` holding a small segment, all started here and killed by
//! PID on every path. The store conformance rules the adapter honours run unchanged against
//! such a cluster too; the others are departures, each listed with its reason in ADR 0017.
//!
//! Needs the venv with `mooncake-transfer-engine-non-cuda` (scripts/setup.sh makes it):
//! `GPUCACHE_MOONCAKE_VENV`, else `$CARGO_TARGET_DIR/bench-venv`, else `target/bench-venv`.
//! Without it the test prints why and passes, unless `GPUCACHE_REQUIRE_MOONCAKE=1`.

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::num::NonZeroUsize;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{
    Get, Invalidate, Lookup, MissReason, Put, Retirement, Store, StoreError,
};
use gpucache_dataplane::testing::{Subject, fixture, rules};
use gpucache_executor::testing;
use gpucache_executor::{Executor, HostRange, KeyResult, OperationId, OperationResult};
use gpucache_mooncake::{
    MooncakeConfig, MooncakeError, MooncakeStore, MooncakeVenv, Op, Raw, SidecarConfig, object_key,
    wire,
};

/// Deadline for each server to listen.
const LISTEN_MS: u64 = 30_000;
/// The provider's segment: small, so that filling it is quick.
const SEGMENT_BYTES: u64 = 32 << 20;
/// Payload of each page written to fill the segment.
const PAGE_BYTES: usize = 1 << 20;
/// Most pages written while looking for -200 (several times the segment).
const FILL_PAGES_MAX: usize = 256;

/// Longest wait on a Mooncake server process between two attempts to connect to it.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

fn venv_path() -> PathBuf {
    if let Some(p) = std::env::var_os("GPUCACHE_MOONCAKE_VENV") {
        return PathBuf::from(p);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), |t| workspace.join(t));
    target.join("bench-venv")
}

/// The venv, or `None` (after printing why) when the test should be skipped.
fn venv_or_skip() -> Option<MooncakeVenv> {
    let path = venv_path();
    match MooncakeVenv::at(&path) {
        Ok(v) => Some(v),
        Err(e) => {
            assert!(
                std::env::var("GPUCACHE_REQUIRE_MOONCAKE").as_deref() != Ok("1"),
                "GPUCACHE_REQUIRE_MOONCAKE=1 but {e}"
            );
            eprintln!("skipping the live Mooncake test: {e}");
            None
        }
    }
}

/// A server process killed by its PID when dropped.
struct Server {
    name: &'static str,
    child: Child,
}

impl Server {
    fn start(name: &'static str, program: &Path, args: &[String], logs: &Path) -> Self {
        let log = File::create(logs.join(format!("{name}.log"))).expect("log file");
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self { name, child }
    }

    /// Connects until the server listens, failing once [`LISTEN_MS`] pass or the process exits.
    /// Nothing marks the moment it starts listening (the master listens about 1 ms after its
    /// last start-up log line, and the metadata server logs nothing at WARNING, seen with the
    /// pinned wheel), so between attempts this waits on the process itself: a poll of its pidfd
    /// returns as soon as it exits, or after [`POLL_INTERVAL`] for the next attempt.
    fn wait_listening(&mut self, port: u16) {
        let deadline = Instant::now() + Duration::from_millis(LISTEN_MS);
        let exited = ExitWatch::open(self.child.id());
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "{} not listening on {port} within {LISTEN_MS} ms", self.name);
            exited.wait(left.min(POLL_INTERVAL));
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("{} exited with {status} before listening on {port}", self.name);
            }
        }
    }
}

/// A pidfd of a child: readable once the child exits.
struct ExitWatch(std::os::fd::OwnedFd);

impl ExitWatch {
    fn open(pid: u32) -> Self {
        let pid = libc::pid_t::try_from(pid).expect("pid");
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let fd = i32::try_from(fd)
            .ok()
            .filter(|fd| *fd >= 0)
            .unwrap_or_else(|| panic!("pidfd_open({pid}): {}", std::io::Error::last_os_error()));
        // SAFETY: `fd` was just returned by pidfd_open and is owned by nothing else.
        Self(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
    }

    /// Returns when the child has exited or `within` has passed, whichever is first.
    fn wait(&self, within: Duration) {
        use std::os::fd::AsRawFd;
        let mut p = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = libc::c_int::try_from(within.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        let _ = unsafe { libc::poll(&mut p, 1, ms) };
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// The three Mooncake processes, stopped (last started first) on drop.
struct Cluster {
    servers: Vec<Server>,
    metadata_url: String,
    master: String,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        while let Some(s) = self.servers.pop() {
            drop(s);
        }
    }
}

fn start_cluster(venv: &MooncakeVenv, logs: &Path) -> Cluster {
    let (meta_port, master_port, metrics_port, client_port) =
        (free_port(), free_port(), free_port(), free_port());
    let mut cluster = Cluster {
        servers: Vec::new(),
        metadata_url: format!("http://127.0.0.1:{meta_port}/metadata"),
        master: format!("127.0.0.1:{master_port}"),
    };
    let mut meta = Server::start(
        "metadata",
        &venv.binary("mooncake_http_metadata_server"),
        &[
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            meta_port.to_string(),
            "--log-level".into(),
            "WARNING".into(),
        ],
        logs,
    );
    meta.wait_listening(meta_port);
    cluster.servers.push(meta);
    let mut master = Server::start(
        "master",
        &venv.binary("mooncake_master"),
        &[
            format!("--rpc_port={master_port}"),
            "--rpc_address=127.0.0.1".into(),
            format!("--metrics_port={metrics_port}"),
            "--metrics_host=127.0.0.1".into(),
            "--enable_http_metadata_server=false".into(),
            "--enable_metric_reporting=false".into(),
        ],
        logs,
    );
    master.wait_listening(master_port);
    cluster.servers.push(master);
    let mut client = Server::start(
        "client",
        &venv.binary("mooncake_client"),
        &[
            "--host=127.0.0.1".into(),
            format!("--port={client_port}"),
            format!("--master_server_address={}", cluster.master),
            format!("--metadata_server={}", cluster.metadata_url),
            format!("--global_segment_size={SEGMENT_BYTES}"),
            "--protocol=tcp".into(),
        ],
        logs,
    );
    client.wait_listening(client_port);
    cluster.servers.push(client);
    cluster
}

fn page(seed: u8) -> Vec<u8> {
    (0..PAGE_BYTES).map(|i| (i.to_le_bytes()[0]).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// One probe PUT lands at once: `mooncake_client` mounts its segment before it listens (seen
/// in its log order with the pinned wheel, `scripts/setup.sh`), and the cluster waited
/// for it to listen. Then the probe is removed.
fn assert_mounted(store: &MooncakeStore) {
    let caller = fixture::caller(2);
    let key = fixture::key(2, &[200], KvDtype::Bf16, 16);
    match store.put(&caller, &key, b"probe", None) {
        Ok(Put::Committed(_)) => {}
        other => {
            panic!("probe PUT once the client listens (its segment should be mounted): {other:?}")
        }
    }
    store.invalidate(&caller, &key).expect("remove the probe");
}

fn wait_for(exec: &Executor, operation: OperationId) -> OperationResult {
    testing::wait_for(exec, operation, Duration::from_millis(LISTEN_MS))
}

fn executor_round_trip(store: &Arc<MooncakeStore>) {
    let (exec, host) = testing::executor(Arc::clone(store) as Arc<dyn Store>, 4, PAGE_BYTES);
    let slot = |i: u64, len: usize| HostRange::new(i * PAGE_BYTES as u64, len as u64);
    let data = page(7);
    host.write(slot(0, PAGE_BYTES), &data).expect("source");
    let k = fixture::key(0, &[7], KvDtype::Bf16, 16);
    let put = exec.submit_put(vec![(k.clone(), slot(0, PAGE_BYTES))]).expect("put queued");
    let result = wait_for(&exec, put);
    assert!(result.retired, "{result:?}");
    assert_eq!(result.keys, vec![KeyResult::Written { bytes: PAGE_BYTES as u64 }]);
    let missing = fixture::key(0, &[7, 7], KvDtype::Bf16, 16);
    let get = exec
        .submit_get(vec![(k, slot(1, PAGE_BYTES)), (missing, slot(2, 64))])
        .expect("get queued");
    let result = wait_for(&exec, get);
    assert!(result.retired, "{result:?}");
    assert_eq!(
        result.keys,
        vec![
            KeyResult::Read { bytes: PAGE_BYTES as u64 },
            KeyResult::ObjectFailed(MissReason::Absent),
        ]
    );
    assert!(host.read(slot(1, PAGE_BYTES)).expect("range") == data, "GET returned other bytes");
    let report = exec.close(Duration::from_millis(LISTEN_MS));
    assert!(!report.restart_required, "{report:?}");
}

/// The adapter's settings against `cluster`, with object keys in `namespace`.
fn config(
    venv: &MooncakeVenv,
    metadata_url: &str,
    master: &str,
    namespace: &str,
) -> MooncakeConfig {
    MooncakeConfig {
        sidecar: SidecarConfig {
            venv: venv.clone(),
            metadata_url: metadata_url.to_owned(),
            master: master.to_owned(),
            buffer_bytes: NonZeroUsize::new(2 * PAGE_BYTES).expect("nonzero"),
            segment_bytes: 0,
            startup_ms: 60_000,
            call_ms: 30_000,
        },
        reservations_max: NonZeroUsize::new(16).expect("nonzero"),
        namespace: namespace.to_owned(),
    }
}

#[test]
fn mooncake_store_against_a_live_cluster() {
    let Some(venv) = venv_or_skip() else { return };
    let logs = tempfile::tempdir().expect("log dir");
    let cluster = start_cluster(&venv, logs.path());
    let store = Arc::new(
        config(&venv, &cluster.metadata_url, &cluster.master, "")
            .build()
            .unwrap_or_else(|e| panic!("{e}; logs in {}", logs.keep().display())),
    );
    assert!(!store.failures_retire());
    assert_mounted(&store);

    let caller = fixture::caller(0);
    let mut dst = vec![0_u8; 2 * PAGE_BYTES];

    // PUT then GET: exact bytes.
    let k1 = fixture::key(0, &[1], KvDtype::Bf16, 16);
    let first = page(1);
    assert!(matches!(store.put(&caller, &k1, &first, None), Ok(Put::Committed(_))));
    assert_eq!(store.lookup(&caller, &k1), Ok(Lookup::Hit { len: PAGE_BYTES as u64 }));
    match store.get_into(&caller, &k1, &mut dst) {
        Ok(Get::Hit { len, .. }) => {
            assert_eq!(len, PAGE_BYTES as u64);
            assert!(dst[..PAGE_BYTES] == first[..], "GET returned other bytes");
        }
        other => panic!("GET of a stored page: {other:?}"),
    }

    // A missing key: -704, a retired Absent miss.
    let missing = fixture::key(0, &[9, 9], KvDtype::Bf16, 16);
    let raw_missing = store.raw_call(Op::Get, &object_key(&missing), 64, &[]).expect("raw get");
    eprintln!("observed: get_into of a missing key -> {raw_missing:?}");
    assert_eq!(raw_missing, Raw::Code(-704));
    assert_eq!(store.get_into(&caller, &missing, &mut dst), Ok(Get::Miss(MissReason::Absent)));
    assert_eq!(store.lookup(&caller, &missing), Ok(Lookup::Miss(MissReason::Absent)));

    // A duplicate PUT: success, the first value stays; natively (no existence check) too.
    let second = page(2);
    assert_eq!(store.put(&caller, &k1, &second, None), Ok(Put::AlreadyCommitted));
    let native = store.put_unchecked(&caller, &k1, &second);
    eprintln!("observed: native duplicate put_from -> {native:?}");
    assert!(matches!(native, Ok(Put::Committed(_))), "{native:?}");
    assert!(matches!(store.get_into(&caller, &k1, &mut dst), Ok(Get::Hit { .. })));
    assert!(dst[..PAGE_BYTES] == first[..], "a duplicate PUT replaced the first value");

    // Tenants cannot see each other's objects under the same chain.
    let other = fixture::caller(1);
    let k1_other = fixture::key(1, &[1], KvDtype::Bf16, 16);
    assert_eq!(store.get_into(&other, &k1_other, &mut dst), Ok(Get::Miss(MissReason::Absent)));

    // The executor over the live store: PUT, then GET with a missing key beside it. The -704
    // of the missing key is confirmed object evidence (a retired Absent miss), the other key
    // reads at its exact length, and the operation retired.
    executor_round_trip(&store);

    // Remove of an object never read nor looked up (no lease): it goes, a second remove finds
    // nothing. (Before the fill below, which may evict it.)
    let unread = fixture::key(0, &[1, 1], KvDtype::Bf16, 16);
    assert!(matches!(store.put(&caller, &unread, &first, None), Ok(Put::Committed(_))));
    assert_eq!(store.invalidate(&caller, &unread), Ok(Invalidate::Removed));
    assert_eq!(store.invalidate(&caller, &unread), Ok(Invalidate::Absent));
    assert_eq!(store.get_into(&caller, &unread, &mut dst), Ok(Get::Miss(MissReason::Absent)));

    // An object whose payload disagrees with its header's checksum (written past the adapter)
    // is a Corrupt miss, and none of its bytes reach the caller's buffer.
    let damaged_key = fixture::key(0, &[5, 5], KvDtype::Bf16, 16);
    let mut damaged = wire::object_header(&first).to_vec();
    damaged.extend_from_slice(&first);
    damaged[wire::OBJECT_HEADER_BYTES] ^= 1;
    let name = store.object_key(&damaged_key);
    assert_eq!(store.raw_call(Op::Put, &name, 0, &damaged), Ok(Raw::Code(0)));
    dst.fill(0x5A);
    assert_eq!(store.get_into(&caller, &damaged_key, &mut dst), Ok(Get::Miss(MissReason::Corrupt)));
    assert!(dst.iter().all(|b| *b == 0x5A), "a corrupt object's bytes reached the caller");

    // Fill the segment until the master refuses: -200, a retired per-page failure.
    let mut refused: Option<StoreError> = None;
    for i in 0..FILL_PAGES_MAX {
        let [lo, hi, ..] = i.to_le_bytes();
        let chain = [100, hi, lo];
        let key = fixture::key(0, &chain, KvDtype::Bf16, 16);
        match store.put(&caller, &key, &first, None) {
            Ok(Put::Committed(_)) => {}
            Ok(other) => panic!("fill PUT {i}: {other:?}"),
            Err(e) => {
                eprintln!("observed: fill PUT {i} of {PAGE_BYTES} bytes -> {e}");
                refused = Some(e);
                break;
            }
        }
    }
    let e = refused.expect("the segment never filled");
    assert_eq!(e.retirement(), Retirement::Retired, "{e}");
    assert!(e.to_string().contains("(-200)"), "{e}");
    // The refusal halts nothing: reads and removes still work.
    assert!(matches!(store.get_into(&caller, &k1, &mut dst), Ok(Get::Hit { .. })));

    // Right after a GET the object is under a read lease (the master's default, 10 s): -706,
    // Busy, and it stays readable.
    let under_lease = store.invalidate(&caller, &k1);
    eprintln!("observed: remove right after a GET -> {under_lease:?}");
    assert_eq!(under_lease, Ok(Invalidate::Busy));
    assert!(matches!(store.get_into(&caller, &k1, &mut dst), Ok(Get::Hit { .. })));
    drop(store);
    drop(cluster);
}

/// The conformance rules MooncakeStore honours, run unchanged against the live cluster.
const HONOURED_RULES: [&str; 9] = [
    "exact_hit_needs_committed_physical_key",
    "lookup_and_get_refuse_other_tenants",
    "rights_are_enforced",
    "get_into_small_buffer_fails_retired",
    "put_is_create_only",
    "region_ids_never_recycled",
    "incomplete_commit_is_refused",
    "write_bounds_are_checked",
    "failures_report_retirement",
];

/// The conformance rules it departs from; ADR 0017 names each with its reason, and this test
/// checks that each still fails (one that starts to hold belongs in [`HONOURED_RULES`]).
const DEPARTED_RULES: [&str; 15] = [
    "same_logical_other_physical_is_incompatible",
    "prefix_hit_is_whole_block_and_needs_equal_shape",
    "only_committed_is_readable",
    "corrupt_block_is_a_miss_and_dropped",
    "request_replay_is_idempotent",
    "request_ids_expire_and_are_capped",
    "abort_retired_frees_everything",
    "unknown_outcome_quarantines_and_stays_charged",
    "lease_expiry_quarantines_never_frees",
    "attestation_needs_owner_or_admin",
    "fence_reclaims_only_older_epochs",
    "stale_reservations_refuse_writes_after_bump",
    "refusals_carry_numbers",
    "full_store_follows_its_policy",
    "registrations_count_committed_and_quarantined",
];

/// The model properties, departures too (ADR 0017): not run here, each generated case would
/// start a sidecar, and the first usage comparison fails them.
const DEPARTED_MODELS: [&str; 3] =
    ["model_single_tenant", "model_multi_tenant", "model_tight_limits"];

/// The ADR that lists the departures.
fn adr() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/adr/0017-mooncake-adapter.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_departure_is_listed_in_the_adr() {
    let adr = adr();
    let mut all: Vec<&str> =
        HONOURED_RULES.iter().chain(&DEPARTED_RULES).chain(&DEPARTED_MODELS).copied().collect();
    for name in DEPARTED_RULES.iter().chain(&DEPARTED_MODELS) {
        assert!(adr.contains(&format!("`{name}`")), "ADR 0017 does not list the departure {name}");
    }
    for name in HONOURED_RULES {
        assert!(adr.contains(&format!("`{name}`")), "ADR 0017 does not list the rule {name}");
    }
    all.sort_unstable();
    let count = all.len();
    all.dedup();
    assert_eq!(all.len(), count, "a rule is both honoured and departed from");
    // The suite's 24 rules and 3 model properties, each in one list.
    assert_eq!(count, 27);
}

/// Runs the rule `name` with `make`; the panic's message when it fails.
fn outcome(name: &str, make: &gpucache_dataplane::testing::MakeSubject) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(|| rules::run(name, make))).map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "a panic without a message".to_owned())
    })
}

#[test]
fn conformance_rules_against_a_live_cluster() {
    let Some(venv) = venv_or_skip() else { return };
    let logs = tempfile::tempdir().expect("log dir");
    let cluster = start_cluster(&venv, logs.path());
    let (metadata_url, master, venv) =
        (cluster.metadata_url.clone(), cluster.master.clone(), venv.clone());
    // Each subject is a fresh adapter (its own sidecar) in a namespace of its own, so that no
    // subject sees another's objects in the shared cluster. The adapter has no limits and no
    // clock of its own to take from the suite (ADR 0017).
    let subjects = AtomicU64::new(0);
    let make = move |_limits: ResourceLimits, _clock: ManualClock| -> Subject {
        let namespace = format!("conformance{}", subjects.fetch_add(1, Ordering::Relaxed));
        let store = config(&venv, &metadata_url, &master, &namespace)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        // No honoured rule damages a block: there is no way to reach one in the cluster.
        Subject { store: Box::new(store), corrupt: Box::new(|_| false), evicted: None }
    };
    let failed: Vec<String> = HONOURED_RULES
        .iter()
        .filter_map(|name| outcome(name, &make).err().map(|why| format!("{name}: {why}")))
        .collect();
    let holding: Vec<&str> =
        DEPARTED_RULES.iter().copied().filter(|name| outcome(name, &make).is_ok()).collect();
    drop(cluster);
    assert!(
        failed.is_empty(),
        "honoured rules failed (logs were in {}):\n{}",
        logs.path().display(),
        failed.join("\n")
    );
    assert!(holding.is_empty(), "listed as departures but hold: {holding:?}");
}

#[test]
fn a_missing_venv_is_a_typed_error() {
    let e = MooncakeVenv::at(Path::new("/nonexistent/gpucache-venv")).expect_err("no venv");
    assert!(matches!(e, MooncakeError::Unavailable { .. }));
    assert!(e.to_string().starts_with("Mooncake unavailable: "), "{e}");
}
