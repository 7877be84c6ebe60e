//! `gpucache-bench python`: the `gpucache` Python package's batch calls beside the Rust client
//! they wrap and beside Mooncake Store's Python client, in one run.
//!
//! One `gpucache serve` (memory store, Unix socket on) serves every row of ours. For each
//! repetition, each batch shape (`ITEMSxSIZE`, default 128 x 64 KiB and 16 x 1 MiB) and each
//! row, one after another (so load from elsewhere on a shared machine falls on all rows of a
//! repetition alike), one client moves a pool of `--working-set` bytes batch by batch: a PUT
//! phase stores the pool once (or until the deadline), a GET phase reads the stored batches
//! back in a cycle until the deadline; then one batch is read again into a zeroed destination
//! and compared byte for byte. The rows:
//!
//! - `rust-tcp`, `rust-local`, `rust-local-seg`: [`TcpStore`] in this process (`put_batch` /
//!   `get_batch`), over loopback TCP, over the same-host path with the pool in plain host memory
//!   (bounced through the segment), and with the pool inside the shared segment (served in
//!   place, docs/adr/0021);
//! - `python-tcp`, `python-local`, `python-local-seg`: the same through `gpucache.Client`
//!   (`batch_put_from` / `batch_get_into` with int addresses), in a Python process running the
//!   embedded driver `bench/peers/gpucache_py_bench.py` from the venv scripts/setup.sh's
//!   `python` component makes;
//! - `mooncake`: Mooncake Store's `batch_put_from` / `batch_get_into` with the segment in a
//!   separate `mooncake_client` process (as `gpucache-bench service` runs it), through the
//!   embedded `bench/peers/mooncake_bench.py --batch`.
//!
//! It prints a table (median and range over the repetitions), the same-repetition ratios
//! python/rust and python/mooncake with the aims at 1 MiB, and writes JSON.
//!
//! [`TcpStore`]: gpucache_client::TcpStore

mod rust_rows;
mod types;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use serde_json::json;

use crate::service::load::PhaseStats;
use crate::service::ours::{self, Service, TENANT};
use crate::service::peers::{self, MooncakePhase, MooncakeVenv};
use crate::service::process::ChildGuard;
use crate::service::{git_commit, loadavg, machine, utc_now, write_file};
use crate::stats::{Spread, cell, spread, spread_cell};
use gpucache_dataplane::identity::TenantId;
use gpucache_service::resp::IdentityTemplate;
use gpucache_service::units::{MIB, human_bytes, parse_size, size_label};
use types::{Buffers, Measurement, Point};

/// The Python driver, embedded so that the binary does not depend on where it runs from.
const PY_SCRIPT: &str = include_str!("../../peers/gpucache_py_bench.py");
/// Most repetitions accepted.
const REPS_MAX: usize = 100;
/// Time beyond its two phases one Python driver run may take (start, import, pool fill).
const PY_SLACK: Duration = Duration::from_secs(120);
/// The aims, judged at the 1 MiB shape: python/rust at least this (the layer costs under 5%) ...
pub const AIM_PY_OVER_RUST: f64 = 0.95;
/// ... and python-tcp/mooncake at least this.
pub const AIM_PY_OVER_MOONCAKE: f64 = 2.0;

#[derive(Debug, Args)]
pub struct PythonBenchArgs {
    /// Batch shapes, comma-separated, each ITEMSxSIZE (SIZE with K, M binary; --quick keeps
    /// them).
    #[arg(long, default_value = "128x64K,16x1M")]
    batches: String,
    /// Rows to run, comma-separated: rust-tcp, python-tcp, rust-local, python-local,
    /// rust-local-seg, python-local-seg, mooncake.
    #[arg(
        long,
        default_value = "rust-tcp,python-tcp,rust-local,python-local,rust-local-seg,python-local-seg,mooncake"
    )]
    rows: String,
    /// Repetitions of every row and shape. Default 5 (1 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Deadline of each phase (PUT, GET) of each measurement, in seconds. Default 2 (0.3 with
    /// --quick).
    #[arg(long)]
    seconds: Option<f64>,
    /// Bytes of the pool each measurement stores (and the server holds at once). Default 256M
    /// (16M with --quick).
    #[arg(long, value_parser = parse_size)]
    working_set: Option<u64>,
    /// A smoke run: small defaults for everything not given.
    #[arg(long)]
    quick: bool,
    /// The Python venv holding the gpucache package. Default: $GPUCACHE_PY_VENV, else py-venv in
    /// the build folder this executable was built in (scripts/setup.sh python makes it).
    #[arg(long)]
    py_venv: Option<PathBuf>,
    /// The Python venv holding mooncake-transfer-engine-non-cuda. Default: bench-venv in the
    /// build folder this executable was built in (scripts/setup.sh mooncake makes it).
    #[arg(long)]
    mooncake_venv: Option<PathBuf>,
    /// Write every measurement and the summaries as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Where configurations and logs go; a fresh subdirectory is made there and removed
    /// afterwards (kept with --keep-logs). Default: the system temporary directory.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the scratch directory.
    #[arg(long)]
    keep_logs: bool,
}

/// Who drives a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    Rust,
    Python,
    Mooncake,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    driver: Driver,
    local: bool,
    buffers: Buffers,
}

const ROW_NAMES: [&str; 7] = [
    "rust-tcp",
    "python-tcp",
    "rust-local",
    "python-local",
    "rust-local-seg",
    "python-local-seg",
    "mooncake",
];

impl Row {
    fn parse(text: &str) -> Result<Self, String> {
        let (driver, rest) = match text.trim() {
            "mooncake" => {
                return Ok(Row { driver: Driver::Mooncake, local: false, buffers: Buffers::Host });
            }
            t => match t.split_once('-') {
                Some(("rust", r)) => (Driver::Rust, r),
                Some(("python", r)) => (Driver::Python, r),
                _ => return Err(format!("unknown row {t:?} (use {})", ROW_NAMES.join(", "))),
            },
        };
        let (local, buffers) = match rest {
            "tcp" => (false, Buffers::Host),
            "local" => (true, Buffers::Host),
            "local-seg" => (true, Buffers::Segment),
            _ => return Err(format!("unknown row {text:?} (use {})", ROW_NAMES.join(", "))),
        };
        Ok(Row { driver, local, buffers })
    }

    fn name(self) -> String {
        let driver = match self.driver {
            Driver::Mooncake => return "mooncake".into(),
            Driver::Rust => "rust",
            Driver::Python => "python",
        };
        let transport = match (self.local, self.buffers) {
            (false, _) => "tcp",
            (true, Buffers::Host) => "local",
            (true, Buffers::Segment) => "local-seg",
        };
        format!("{driver}-{transport}")
    }

    /// What the row's note says about how it is driven.
    fn note(self) -> &'static str {
        match (self.driver, self.local, self.buffers) {
            (Driver::Mooncake, ..) => {
                "Mooncake Store, segment in a separate mooncake_client process; one worker \
                 process, batch_put_from / batch_get_into from one registered buffer"
            }
            (Driver::Rust, false, _) => "TcpStore in this process over loopback TCP",
            (Driver::Rust, true, Buffers::Host) => {
                "TcpStore on the same-host path, pool in host memory (bounced)"
            }
            (Driver::Rust, true, Buffers::Segment) => {
                "TcpStore on the same-host path, pool in the shared segment (in place)"
            }
            (Driver::Python, false, _) => "gpucache.Client over loopback TCP (local=False)",
            (Driver::Python, true, Buffers::Host) => {
                "gpucache.Client(local=True), pool in a bytearray (bounced)"
            }
            (Driver::Python, true, Buffers::Segment) => {
                "gpucache.Client(local=True), pool in a SharedBuffer (in place)"
            }
        }
    }
}

/// The run's parameters, resolved from the arguments.
#[derive(Debug, Clone)]
struct Plan {
    points: Vec<Point>,
    rows: Vec<Row>,
    reps: usize,
    phase: Duration,
    working_set_bytes: u64,
}

/// `ITEMSxSIZE` shapes, comma-separated.
fn parse_points(text: &str) -> Result<Vec<Point>, String> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (items, size) = part
            .split_once(['x', 'X'])
            .ok_or_else(|| format!("batch {part:?} is not ITEMSxSIZE (e.g. 16x1M)"))?;
        let items: usize =
            items.trim().parse().map_err(|e| format!("batch {part:?}: items: {e}"))?;
        let size = parse_size(size.trim()).map_err(|e| format!("batch {part:?}: {e}"))?;
        if !(1..=gpucache_wire::BATCH_ITEMS_MAX).contains(&items) {
            return Err(format!(
                "batch {part:?}: items must be in 1..={}",
                gpucache_wire::BATCH_ITEMS_MAX
            ));
        }
        if !(16..=64 * MIB).contains(&size) {
            return Err(format!("batch {part:?}: value size {size} is outside 16 B..=64 MiB"));
        }
        out.push(Point { items, size });
    }
    if out.is_empty() {
        return Err("--batches names no batch shape".into());
    }
    Ok(out)
}

fn plan(args: &PythonBenchArgs) -> Result<Plan, String> {
    let q = args.quick;
    let points = parse_points(&args.batches)?;
    let mut rows = Vec::new();
    for r in args.rows.split(',').filter(|r| !r.trim().is_empty()) {
        let r = Row::parse(r)?;
        if !rows.contains(&r) {
            rows.push(r);
        }
    }
    if rows.is_empty() {
        return Err("--rows names no row".into());
    }
    let reps = args.reps.unwrap_or(if q { 1 } else { 5 });
    if !(1..=REPS_MAX).contains(&reps) {
        return Err(format!("--reps must be in 1..={REPS_MAX}"));
    }
    let seconds = args.seconds.unwrap_or(if q { 0.3 } else { 2.0 });
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= 600.0) {
        return Err(format!("--seconds {seconds} must be in (0, 600]"));
    }
    let working_set_bytes = args.working_set.unwrap_or(if q { 16 * MIB } else { 256 * MIB });
    if let Some(p) = points.iter().find(|p| (p.items as u64) * p.size > working_set_bytes) {
        return Err(format!(
            "--working-set {} is smaller than one {} batch",
            human_bytes(working_set_bytes),
            p.label()
        ));
    }
    Ok(Plan { points, rows, reps, phase: Duration::from_secs_f64(seconds), working_set_bytes })
}

/// One measurement as the report keeps it.
#[derive(Debug, Clone, Serialize)]
struct Sample {
    row: String,
    rep: usize,
    items: usize,
    size: u64,
    #[serde(flatten)]
    result: Option<Measurement>,
    error: Option<String>,
}

/// The Python driver's JSON.
#[derive(Debug, serde::Deserialize)]
struct PyOutput {
    put: Option<MooncakePhase>,
    get: Option<MooncakePhase>,
    verified: u64,
    mismatches: u64,
    transport: Option<String>,
    direct_items: Option<u64>,
    bounced_items: Option<u64>,
    layer_us: Option<f64>,
    error: Option<String>,
}

fn parse_py(stdout: &str) -> Result<PyOutput, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| "the Python driver printed no JSON".to_owned())?;
    serde_json::from_str(line).map_err(|e| format!("the Python driver's JSON does not parse: {e}"))
}

/// Exit status: 0 when every measurement ran and verified (aims met or not), 1 when one
/// failed or a value did not verify, 2 on a usage or setup error.
pub fn run(args: &PythonBenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache-bench python: {e}");
            ExitCode::from(2)
        }
    }
}

/// `<target>/<profile>/gpucache-bench` -> `<target>/<name>`.
fn beside_target(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().and_then(Path::parent).map(|t| t.join(name)))
        .unwrap_or_else(|| PathBuf::from("target").join(name))
}

fn py_venv(args: &PythonBenchArgs) -> PathBuf {
    args.py_venv
        .clone()
        .or_else(|| std::env::var_os("GPUCACHE_PY_VENV").map(PathBuf::from))
        .unwrap_or_else(|| beside_target("py-venv"))
}

#[allow(clippy::too_many_arguments)]
fn py_measure(
    python: &Path,
    script: &Path,
    dir: &Path,
    service: &Service,
    row: Row,
    point: Point,
    plan: &Plan,
    prefix: &str,
) -> Result<Measurement, String> {
    let mut command = Command::new(python);
    command
        .current_dir(dir)
        .arg(script)
        .arg("--addr")
        .arg(service.native.to_string())
        .arg("--tenant")
        .arg(TENANT)
        .arg("--transport")
        .arg(if row.local { "local" } else { "tcp" })
        .arg("--buffers")
        .arg(match row.buffers {
            Buffers::Host => "host",
            Buffers::Segment => "segment",
        })
        .arg("--items")
        .arg(point.items.to_string())
        .arg("--size")
        .arg(point.size.to_string())
        .arg("--working-set")
        .arg(plan.working_set_bytes.to_string())
        .arg("--seconds")
        .arg(plan.phase.as_secs_f64().to_string())
        .arg("--prefix")
        .arg(prefix);
    let out_path = dir.join(format!("{prefix}.out"));
    let mut child = ChildGuard::spawn("python driver", command, &out_path, false)?;
    let budget = plan.phase * 2 + PY_SLACK;
    let status = child.wait_until(Instant::now() + budget);
    child.stop();
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let tail = || text.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
    let out = match status {
        None => return Err(format!("the Python driver did not finish in {budget:?}; killed")),
        Some(s) if !s.success() => return Err(format!("the Python driver exited {s}: {}", tail())),
        Some(_) => parse_py(&text)?,
    };
    if let Some(e) = out.error {
        return Err(e);
    }
    let want = if row.local { "local" } else { "tcp" };
    if out.transport.as_deref() != Some(want) {
        return Err(format!("the Python client took {:?}, not {want}", out.transport));
    }
    Ok(Measurement {
        put: out.put.map(Into::into),
        get: out.get.map(Into::into),
        verified: out.verified,
        mismatches: out.mismatches,
        direct_items: row.local.then_some(out.direct_items).flatten(),
        bounced_items: row.local.then_some(out.bounced_items).flatten(),
        layer_us: out.layer_us,
    })
}

fn mooncake_measure(
    venv: &MooncakeVenv,
    dir: &Path,
    point: Point,
    plan: &Plan,
) -> Result<Measurement, String> {
    let report = peers::mooncake_run(
        venv,
        dir,
        &[point.size],
        &[1],
        plan.phase,
        plan.working_set_bytes,
        point.items,
    )?;
    let p: crate::service::load::PointResult =
        report.points.into_iter().next().ok_or("the Mooncake driver gave no point")?.into();
    if let Some(e) = p.error {
        return Err(e);
    }
    Ok(Measurement {
        put: p.put,
        get: p.get,
        verified: p.verified,
        mismatches: p.mismatches,
        direct_items: None,
        bounced_items: None,
        layer_us: None,
    })
}

/// Removes the values a measurement of ours stored under `prefix`.
fn remove_values(
    service: &Service,
    ns: &IdentityTemplate,
    point: Point,
    plan: &Plan,
    prefix: &str,
) -> Result<(), String> {
    let count = rust_rows::batches(point, plan.working_set_bytes) * point.items;
    rust_rows::keys(ns, prefix, count)
        .and_then(|k| rust_rows::remove_all(service, &k))
        .map_err(|e| format!("removing {prefix}: {e}"))
}

/// What a row needs that may be missing: `Err(why)` skips it.
enum Ready {
    Ours,
    Python(PathBuf),
    Mooncake(MooncakeVenv),
}

fn run_inner(args: &PythonBenchArgs) -> Result<bool, String> {
    let plan = plan(args)?;
    let load_start = loadavg();
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
    let scratch = tempfile::Builder::new()
        .prefix("gpucache-bench-python-")
        .tempdir_in(&base)
        .map_err(|e| format!("cannot make a directory in {}: {e}", base.display()))?;
    let dir = scratch.path().to_owned();
    eprintln!("bench: working in {}", dir.display());

    let mut ready: Vec<(Row, Result<Ready, String>)> = Vec::new();
    for &row in &plan.rows {
        let r = match row.driver {
            Driver::Rust => Ok(Ready::Ours),
            Driver::Python => {
                let python = py_venv(args).join("bin").join("python");
                if python.is_file() {
                    // The driver runs in the scratch directory: a relative venv must not move.
                    let python = std::path::absolute(&python)
                        .map_err(|e| format!("{}: {e}", python.display()))?;
                    Ok(Ready::Python(python))
                } else {
                    // The rows this harness exists for: a missing venv is a setup error.
                    return Err(format!(
                        "{} not found (run scripts/setup.sh python, or give --py-venv)",
                        python.display()
                    ));
                }
            }
            Driver::Mooncake => {
                let venv = args.mooncake_venv.clone().unwrap_or_else(crate::service::default_venv);
                peers::mooncake_venv(&venv).map(Ready::Mooncake)
            }
        };
        if let Err(why) = &r {
            eprintln!("bench: {}: skipped: {why}", row.name());
        }
        ready.push((row, r));
    }
    let script = dir.join("gpucache_py_bench.py");
    std::fs::write(&script, PY_SCRIPT).map_err(|e| format!("{}: {e}", script.display()))?;

    let max_value = plan.points.iter().map(|p| p.size).max().unwrap_or(MIB);
    let max_batch = plan.points.iter().map(|p| p.items as u64 * p.size).max().unwrap_or(MIB);
    let socket = dir.join("serve.sock");
    // The server holds one pool at a time (each measurement's values are removed after it),
    // plus a batch in flight.
    let service = ours::start_serve(
        &dir,
        "python",
        max_value,
        plan.working_set_bytes + 2 * max_batch,
        Some(&socket),
    )?;
    let tenant = TenantId::parse(TENANT).map_err(|e| format!("bench tenant: {e}"))?;
    let ns = IdentityTemplate::for_tenant(&tenant).map_err(|e| format!("namespace: {e}"))?;

    // Untimed: one pass of every shape, so that the server's allocator has grown to hold a
    // pool before any row is timed (else the first row pays the server's page faults).
    for &point in &plan.points {
        let prefix = format!("warmup-{}x{}", point.items, point.size);
        eprintln!("bench: warm-up {}", point.label());
        rust_rows::measure(
            &service,
            false,
            Buffers::Host,
            point,
            plan.working_set_bytes,
            plan.phase,
            &prefix,
            &ns,
        )
        .map_err(|e| format!("warm-up {}: {e}", point.label()))?;
        remove_values(&service, &ns, point, &plan, &prefix)?;
    }
    let mut samples: Vec<Sample> = Vec::new();
    for rep in 0..plan.reps {
        for &point in &plan.points {
            // Each repetition starts at another row, so no row is always first after a gap.
            let mut order: Vec<&(Row, Result<Ready, String>)> = ready.iter().collect();
            order.rotate_left(rep % ready.len().max(1));
            for (row, r) in order {
                let Ok(r) = r else { continue };
                let name = row.name();
                let prefix = format!("{name}-r{rep}-{}x{}", point.items, point.size);
                eprintln!("bench: rep {} {}: {name}", rep + 1, point.label());
                let result = match r {
                    Ready::Ours => rust_rows::measure(
                        &service,
                        row.local,
                        row.buffers,
                        point,
                        plan.working_set_bytes,
                        plan.phase,
                        &prefix,
                        &ns,
                    ),
                    Ready::Python(python) => {
                        py_measure(python, &script, &dir, &service, *row, point, &plan, &prefix)
                    }
                    Ready::Mooncake(v) => {
                        let d = dir.join(format!("mooncake-r{rep}-{}", point.label()));
                        mooncake_measure(v, &d, point, &plan)
                    }
                };
                if row.driver != Driver::Mooncake {
                    remove_values(&service, &ns, point, &plan, &prefix)?;
                }
                let (result, error) = match result {
                    Ok(m) => (Some(m), None),
                    Err(e) => {
                        eprintln!("bench: rep {} {}: {name}: {e}", rep + 1, point.label());
                        (None, Some(e))
                    }
                };
                samples.push(Sample {
                    row: name,
                    rep,
                    items: point.items,
                    size: point.size,
                    result,
                    error,
                });
            }
        }
    }
    drop(service);

    let skipped: Vec<(String, String)> = ready
        .iter()
        .filter_map(|(row, r)| r.as_ref().err().map(|why| (row.name(), why.clone())))
        .collect();
    let summary = summarize(&plan, &samples);
    let ratios = ratios(&plan, &samples);
    let aims = aims(&ratios);
    let machine = machine(&load_start);
    let command: Vec<String> = std::env::args().collect();
    let commit = git_commit();
    let date = utc_now();

    let mut out = String::new();
    let _ = writeln!(out, "# gpucache-bench python");
    let _ = writeln!(out, "command: {}", command.join(" "));
    let _ = writeln!(
        out,
        "ended: {date}; commit: {commit}; load average {} at the start, {} at the end",
        load_start,
        loadavg()
    );
    let _ = writeln!(
        out,
        "{} repetitions; phase deadline {:.1} s; pool {} per measurement; GB/s = 1e9 B/s; \
         median (min-max) over repetitions; p50 per batch call in ms",
        plan.reps,
        plan.phase.as_secs_f64(),
        human_bytes(plan.working_set_bytes)
    );
    for &row in &plan.rows {
        match skipped.iter().find(|(n, _)| *n == row.name()) {
            Some((n, why)) => {
                let _ = writeln!(out, "- {n}: skipped: {why}");
            }
            None => {
                let _ = writeln!(out, "- {}: {}", row.name(), row.note());
            }
        }
    }
    out.push('\n');
    out.push_str(&table(&summary));
    out.push('\n');
    out.push_str(&ratio_table(&ratios));
    out.push('\n');
    out.push_str(&aims_table(&aims));
    let mut clean = true;
    for s in &samples {
        let bad = s.result.as_ref().is_none_or(|m| m.mismatches > 0);
        if bad {
            clean = false;
            let _ = writeln!(
                out,
                "{} rep {} {}x{}: {}",
                s.row,
                s.rep + 1,
                s.items,
                size_label(s.size),
                s.error.as_deref().unwrap_or("values differ")
            );
        }
    }
    let verified: u64 = samples.iter().filter_map(|s| s.result.as_ref()).map(|m| m.verified).sum();
    let _ = writeln!(out, "\nvalues verified byte for byte: {verified}");
    #[allow(clippy::print_stdout)]
    {
        println!("{}", out.trim_end());
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "bench": "python",
            "command": command,
            "date": date,
            "git_commit": commit,
            "machine": machine,
            "params": {
                "batches": plan.points,
                "rows": plan.rows.iter().map(|r| r.name()).collect::<Vec<_>>(),
                "reps": plan.reps,
                "phase_seconds": plan.phase.as_secs_f64(),
                "working_set_bytes": plan.working_set_bytes,
            },
            "skipped": skipped.iter().map(|(n, w)| json!({"row": n, "why": w})).collect::<Vec<_>>(),
            "samples": samples,
            "summary": summary,
            "ratios": ratios,
            "aims": aims,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| format!("JSON: {e}"))?;
        write_file(path, &text)?;
        eprintln!("bench: JSON written to {}", path.display());
    }
    if args.keep_logs {
        let kept = scratch.keep();
        eprintln!("bench: logs kept in {}", kept.display());
    }
    Ok(clean)
}

// ---------------------------------------------------------------------------------------------
// Report maths

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Op {
    Put,
    Get,
}

impl Op {
    const BOTH: [Op; 2] = [Op::Put, Op::Get];
    fn of(self, m: &Measurement) -> Option<&PhaseStats> {
        match self {
            Op::Put => m.put.as_ref(),
            Op::Get => m.get.as_ref(),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Op::Put => "PUT",
            Op::Get => "GET",
        }
    }
}

/// The phase of one row, shape, repetition and operation, when it was measured.
fn phase<'a>(
    samples: &'a [Sample],
    row: &str,
    point: Point,
    rep: usize,
    op: Op,
) -> Option<&'a PhaseStats> {
    samples
        .iter()
        .find(|s| s.row == row && s.rep == rep && s.items == point.items && s.size == point.size)
        .and_then(|s| s.result.as_ref())
        .and_then(|m| op.of(m))
}

/// Throughput of one row, shape, repetition and operation, when it moved bytes.
fn gbps(samples: &[Sample], row: &str, point: Point, rep: usize, op: Op) -> Option<f64> {
    phase(samples, row, point, rep, op).map(PhaseStats::gbps).filter(|g| *g > 0.0)
}

fn p50_ms(samples: &[Sample], row: &str, point: Point, rep: usize, op: Op) -> Option<f64> {
    phase(samples, row, point, rep, op).and_then(|p| p.p50_us).map(|us| us / 1e3)
}

/// One row at one shape: the spread of its throughput and per-batch p50 over repetitions.
#[derive(Debug, Clone, Serialize)]
struct RowSummary {
    row: String,
    batch: String,
    put_gbps: Option<Spread>,
    get_gbps: Option<Spread>,
    put_p50_ms: Option<Spread>,
    get_p50_ms: Option<Spread>,
    /// Python rows: the binding's argument handling per call, in microseconds.
    layer_us: Option<Spread>,
}

fn summarize(plan: &Plan, samples: &[Sample]) -> Vec<RowSummary> {
    let mut out = Vec::new();
    for &point in &plan.points {
        for row in &plan.rows {
            let name = row.name();
            let over = |f: &dyn Fn(usize) -> Option<f64>| {
                spread(&(0..plan.reps).filter_map(f).collect::<Vec<_>>())
            };
            out.push(RowSummary {
                row: name.clone(),
                batch: point.label(),
                put_gbps: over(&|r| gbps(samples, &name, point, r, Op::Put)),
                get_gbps: over(&|r| gbps(samples, &name, point, r, Op::Get)),
                put_p50_ms: over(&|r| p50_ms(samples, &name, point, r, Op::Put)),
                get_p50_ms: over(&|r| p50_ms(samples, &name, point, r, Op::Get)),
                layer_us: over(&|r| {
                    samples
                        .iter()
                        .find(|s| {
                            s.row == name
                                && s.rep == r
                                && s.items == point.items
                                && s.size == point.size
                        })
                        .and_then(|s| s.result.as_ref())
                        .and_then(|m| m.layer_us)
                }),
            });
        }
    }
    out
}

/// The pairs compared: (numerator, denominator).
const PAIRS: [(&str, &str); 5] = [
    ("python-tcp", "rust-tcp"),
    ("python-local", "rust-local"),
    ("python-local-seg", "rust-local-seg"),
    ("python-tcp", "mooncake"),
    ("python-local-seg", "mooncake"),
];

/// A ratio of two rows at one shape and operation: each repetition's own ratio (both sides
/// measured minutes apart at most, under the same load), then their spread.
#[derive(Debug, Clone, Serialize)]
struct Ratio {
    num: &'static str,
    den: &'static str,
    batch: String,
    items: usize,
    size: u64,
    op: Op,
    per_rep: Vec<f64>,
    spread: Option<Spread>,
}

fn ratios(plan: &Plan, samples: &[Sample]) -> Vec<Ratio> {
    let names: Vec<String> = plan.rows.iter().map(|r| r.name()).collect();
    let mut out = Vec::new();
    for &point in &plan.points {
        for (num, den) in PAIRS {
            if !names.iter().any(|n| n == num) || !names.iter().any(|n| n == den) {
                continue;
            }
            for op in Op::BOTH {
                let per_rep: Vec<f64> = (0..plan.reps)
                    .filter_map(|r| {
                        Some(gbps(samples, num, point, r, op)? / gbps(samples, den, point, r, op)?)
                    })
                    .collect();
                out.push(Ratio {
                    num,
                    den,
                    batch: point.label(),
                    items: point.items,
                    size: point.size,
                    op,
                    spread: spread(&per_rep),
                    per_rep,
                });
            }
        }
    }
    out
}

/// One aim, judged on the median same-repetition ratio at the 1 MiB shapes.
#[derive(Debug, Clone, Serialize)]
struct Aim {
    ratio: String,
    batch: String,
    op: Op,
    need: f64,
    median: Option<f64>,
    met: Option<bool>,
}

fn aims(ratios: &[Ratio]) -> Vec<Aim> {
    ratios
        .iter()
        .filter(|r| r.size == MIB)
        .filter_map(|r| {
            let need = match (r.num, r.den) {
                (_, "mooncake") if r.num == "python-tcp" => AIM_PY_OVER_MOONCAKE,
                (_, d) if d.starts_with("rust-") => AIM_PY_OVER_RUST,
                _ => return None,
            };
            let median = r.spread.map(|s| s.median);
            Some(Aim {
                ratio: format!("{}/{}", r.num, r.den),
                batch: r.batch.clone(),
                op: r.op,
                need,
                median,
                met: median.map(|m| m >= need),
            })
        })
        .collect()
}

/// The binding's cost per call, and its share of the median GET batch.
fn layer_cell(layer_us: Option<Spread>, get_p50_ms: Option<Spread>) -> String {
    match (layer_us, get_p50_ms) {
        (None, _) => "-".into(),
        (Some(l), Some(g)) if g.median > 0.0 => {
            format!("{} ({:.2}%)", spread_cell(Some(l), 1), l.median / (g.median * 1e3) * 100.0)
        }
        (Some(l), _) => spread_cell(Some(l), 1),
    }
}

fn table(summary: &[RowSummary]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| batch | row | PUT GB/s | GET GB/s | PUT p50 ms/batch | GET p50 ms/batch | binding us/call \
         (of GET p50) |\n| --- | --- | --- | --- | --- | --- | --- |"
    );
    for r in summary {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.batch,
            r.row,
            spread_cell(r.put_gbps, 2),
            spread_cell(r.get_gbps, 2),
            spread_cell(r.put_p50_ms, 2),
            spread_cell(r.get_p50_ms, 2),
            layer_cell(r.layer_us, r.get_p50_ms)
        );
    }
    s
}

fn ratio_table(ratios: &[Ratio]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "same-repetition ratios, median (min-max):\n| batch | ratio | PUT | GET |\n| --- | --- | --- | --- |"
    );
    let mut seen: Vec<(String, &str, &str)> = Vec::new();
    for r in ratios {
        let k = (r.batch.clone(), r.num, r.den);
        if seen.contains(&k) {
            continue;
        }
        let find = |op: Op| {
            ratios
                .iter()
                .find(|x| x.batch == r.batch && x.num == r.num && x.den == r.den && x.op == op)
                .and_then(|x| x.spread)
        };
        let _ = writeln!(
            s,
            "| {} | {}/{} | {} | {} |",
            r.batch,
            r.num,
            r.den,
            spread_cell(find(Op::Put), 3),
            spread_cell(find(Op::Get), 3)
        );
        seen.push(k);
    }
    s
}

fn aims_table(aims: &[Aim]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "aims at 1 MiB (median same-repetition ratio):\n| batch | ratio | op | need | median | met |\n\
         | --- | --- | --- | --- | --- | --- |"
    );
    for a in aims {
        let _ = writeln!(
            s,
            "| {} | {} | {} | >= {:.2} | {} | {} |",
            a.batch,
            a.ratio,
            a.op.name(),
            a.need,
            cell(a.median, 3),
            match a.met {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "not judged",
            }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> PythonBenchArgs {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Wrap {
            #[command(flatten)]
            a: PythonBenchArgs,
        }
        let mut argv = vec!["x"];
        argv.extend_from_slice(extra);
        Wrap::parse_from(argv).a
    }

    #[test]
    fn plans_resolve_defaults_quick_and_rows() {
        let p = plan(&args(&[])).expect("plan");
        assert_eq!(
            p.points,
            vec![Point { items: 128, size: 64 << 10 }, Point { items: 16, size: MIB }]
        );
        assert_eq!(p.rows.iter().map(|r| r.name()).collect::<Vec<_>>(), ROW_NAMES);
        assert_eq!((p.reps, p.phase, p.working_set_bytes), (5, Duration::from_secs(2), 256 * MIB));
        let q = plan(&args(&["--quick", "--rows", "python-tcp,rust-local-seg,python-tcp"]))
            .expect("plan");
        assert_eq!((q.reps, q.working_set_bytes), (1, 16 * MIB));
        assert_eq!(q.rows.len(), 2);
        assert_eq!(q.rows[1], Row { driver: Driver::Rust, local: true, buffers: Buffers::Segment });
        for bad in [
            &["--rows", "python-udp"][..],
            &["--rows", "java-tcp"],
            &["--rows", ","],
            &["--batches", "16"],
            &["--batches", "0x1M"],
            &["--batches", "16x8"],
            &["--batches", "16x1M", "--working-set", "8M"],
            &["--reps", "0"],
            &["--seconds", "0"],
        ] {
            assert!(plan(&args(bad)).is_err(), "{bad:?} accepted");
        }
        assert_eq!(parse_points("4X1K, 2x2M").expect("ok")[1], Point { items: 2, size: 2 * MIB });
    }

    #[test]
    fn the_binding_cost_is_shown_as_a_share_of_the_get_batch() {
        let s = |x: f64| spread(&[x]);
        assert_eq!(layer_cell(s(10.0), s(2.0)), "10.0 (0.50%)");
        assert_eq!(layer_cell(s(10.0), None), "10.0");
        assert_eq!(layer_cell(None, s(2.0)), "-");
    }

    #[test]
    fn row_names_round_trip() {
        for name in ROW_NAMES {
            assert_eq!(Row::parse(name).expect(name).name(), name);
        }
    }

    fn sample(row: &str, rep: usize, size: u64, put_s: f64, get_s: f64) -> Sample {
        let phase = |seconds: f64| PhaseStats {
            ops: 1,
            bytes: 1_000_000_000,
            seconds,
            p50_us: Some(1000.0),
            p99_us: None,
            errors: 0,
        };
        Sample {
            row: row.into(),
            rep,
            items: 16,
            size,
            result: Some(Measurement {
                put: Some(phase(put_s)),
                get: Some(phase(get_s)),
                verified: 16,
                mismatches: 0,
                direct_items: None,
                bounced_items: None,
                layer_us: None,
            }),
            error: None,
        }
    }

    #[test]
    fn ratios_pair_each_repetition_and_aims_judge_the_median() {
        let p = plan(&args(&[
            "--batches",
            "16x1M",
            "--reps",
            "3",
            "--rows",
            "rust-tcp,python-tcp,mooncake",
        ]))
        .expect("plan");
        // rust 1 GB/s each rep; python PUT 0.9, 1.0, 0.99 GB/s, GET 1 GB/s; mooncake PUT 0.5,
        // GET 0.4 GB/s.
        let mut s = Vec::new();
        for (rep, py) in [0.9, 1.0, 0.99].into_iter().enumerate() {
            s.push(sample("rust-tcp", rep, MIB, 1.0, 1.0));
            s.push(sample("python-tcp", rep, MIB, 1.0 / py, 1.0));
            s.push(sample("mooncake", rep, MIB, 2.0, 1.0 / 0.4));
        }
        // A failed measurement drops out of its repetition's ratio.
        s[4].result = None;
        let r = ratios(&p, &s);
        assert_eq!(r.len(), 4, "{r:?}");
        let put = &r[0];
        assert_eq!((put.num, put.den, put.op), ("python-tcp", "rust-tcp", Op::Put));
        assert_eq!(put.per_rep.len(), 2);
        assert!((put.spread.expect("spread").median - 0.945).abs() < 1e-9, "{put:?}");
        let a = aims(&r);
        assert_eq!(a.len(), 4);
        assert_eq!(a[0].met, Some(false), "0.945 < 0.95");
        assert_eq!(a[1].met, Some(true), "GET 1.0");
        assert_eq!(a[2].need, AIM_PY_OVER_MOONCAKE);
        assert_eq!(a[2].met, Some(false), "PUT 1.8 and 1.98: median 1.89 < 2");
        assert!((a[3].median.expect("median") - 2.5).abs() < 1e-9);
        let t = ratio_table(&r);
        assert!(
            t.contains(
                "| 16x1M | python-tcp/rust-tcp | 0.945 (0.900-0.990) | 1.000 (1.000-1.000) |"
            ),
            "{t}"
        );
        let sum = summarize(&p, &s);
        assert_eq!(sum[1].row, "python-tcp");
        assert_eq!(sum[1].get_gbps.expect("get").n, 2);
        assert!(table(&sum).contains("| 16x1M | rust-tcp | 1.00 (1.00-1.00) |"));
    }

    #[test]
    fn the_python_driver_json_parses_after_other_lines() {
        let out = "warning: something\n{\"put\": {\"ops\": 2, \"bytes\": 33554432, \"seconds\": \
                   0.01, \"p50_us\": 5000.0, \"p99_us\": 5100.0, \"errors\": 0}, \"get\": null, \
                   \"verified\": 16, \"mismatches\": 0, \"transport\": \"local\", \
                   \"direct_items\": 48, \"bounced_items\": 0, \"error\": null}\n";
        let p = parse_py(out).expect("parses");
        assert_eq!(
            (p.verified, p.direct_items, p.transport.as_deref()),
            (16, Some(48), Some("local"))
        );
        let put: PhaseStats = p.put.expect("put").into();
        assert!((put.gbps() - 33_554_432.0 / 0.01 / 1e9).abs() < 1e-9);
        assert!(p.get.is_none());
        assert!(parse_py("nothing\n").is_err());
    }
}
