//! `gpucache-bench service`: our service beside its real peers, in one run.
//!
//! For each value size and client count it measures, one after another on the same machine:
//!
//! - **ours** (`ours-tcp`): `gpucache serve` (this executable) as a child process with the
//!   in-memory store, one per point, driven by N client threads with one [`TcpStore`] each (one
//!   connection per thread, as Redis gets) — a PUT phase of distinct keys, then a GET phase over
//!   them;
//! - **ours-shm**: the same service with its Unix socket on, each client thread's [`TcpStore`]
//!   on the same-host path with a segment of its own, PUT from and GET into shared buffers;
//! - **raw-socket**: a bare blocking TCP server thread in this process moving the same bytes per
//!   operation as ours over TCP, with one value buffer per connection and no store: the ceiling
//!   of `ours-tcp` (`raw.rs`);
//! - **redis**: `redis-server` with persistence off, one per point, the same load through a small
//!   RESP2 client;
//! - **mooncake**: Mooncake Store over TCP, with the segment in a separate `mooncake_client`
//!   process, through `bench/peers/mooncake_bench.py` (N worker processes);
//! - **iperf3**: `-P N` streams on loopback writing value-sized buffers;
//! - **memcpy**: N threads copying value-sized chunks through buffers larger than the LLC.
//!
//! - on request (`--peers ours-file,redis-aof`), the on-disk rows: **ours-file-none** and
//!   **ours-file-durable** (the service on a FileStore with a file per block, durability `none`
//!   and `per-block`), **ours-log-none** and **ours-log-durable** (the same on the block log),
//!   each also `-cold`, the page cache dropped before the GET phase; `filestore.rs`) beside
//!   **redis-aof-always** and **redis-aof-everysec** (Redis with an append-only file); and
//!   (`--peers ours-default`) **ours-default**: `gpucache serve` with no configuration, as the
//!   README's first command runs it, on its default ports in a fresh working directory.
//!
//! Then it prints a ratio table per store kind (in memory, on disk) and the aims at 1 MiB, and
//! writes JSON (with every ratio) and an SVG chart.
//!
//! [`TcpStore`]: gpucache_client::TcpStore

mod filestore;
pub(crate) mod load;
pub(crate) mod ours;
pub(crate) mod peers;
pub(crate) mod process;
mod raw;
mod redis;
pub(crate) mod report;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use clap::Args;
use serde_json::json;

use filestore::FileRow;
use gpucache_service::units::{GIB, MIB, human_bytes, parse_size, parse_size_list, size_label};
use load::{LoadSpec, PointResult};
use ours::Transport;
use redis::Persistence;
use report::{PeerRun, Table};

/// Fewest keys a point's working set holds per client, whatever the value size.
const KEYS_PER_CLIENT_MIN: u64 = 4;
/// Largest client count accepted.
const CLIENTS_MAX: usize = 64;

#[derive(Debug, Args)]
pub struct ServiceBenchArgs {
    /// Value sizes, comma-separated (K, M, G are binary). Default 64K,256K,1M,4M (64K,1M with
    /// --quick).
    #[arg(long)]
    sizes: Option<String>,
    /// Client counts (threads, processes or streams), comma-separated. Default 1,8 (1 with
    /// --quick).
    #[arg(long)]
    clients: Option<String>,
    /// Deadline of each phase (PUT, GET) of each point, in seconds. Default 3 (0.5 with --quick).
    #[arg(long)]
    seconds: Option<f64>,
    /// Bytes of distinct values a point's PUT phase writes at most. Default 512M (64M with
    /// --quick).
    #[arg(long, value_parser = parse_size)]
    working_set: Option<u64>,
    /// Source (and destination) buffer of the memcpy peer. Default 1G (256M with --quick).
    #[arg(long, value_parser = parse_size)]
    memcpy_bytes: Option<u64>,
    /// Peers to run, comma-separated: ours (loopback TCP; also ours-tcp), ours-shm (the
    /// same-host shared-memory path), raw-socket (a bare TCP server: ours-tcp's ceiling),
    /// redis, mooncake, iperf3, memcpy; and, not by default, the on-disk rows: ours-file (all
    /// eight of ours-file-none, ours-file-durable, ours-log-none, ours-log-durable, each also
    /// -cold),
    /// ours-default (gpucache serve with no configuration, on its default ports) and redis-aof
    /// (both of redis-aof-always, redis-aof-everysec).
    #[arg(long, default_value = "ours,ours-shm,raw-socket,redis,mooncake,iperf3,memcpy")]
    peers: String,
    /// A smoke run: small defaults for everything not given.
    #[arg(long)]
    quick: bool,
    /// The Python venv holding mooncake-transfer-engine-non-cuda. Default: bench-venv in the
    /// build folder this executable was built in (scripts/setup.sh makes it).
    #[arg(long)]
    mooncake_venv: Option<PathBuf>,
    /// Write every raw measurement as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the grouped bar chart here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Where peers' configurations and logs go; a fresh subdirectory is made there and removed
    /// afterwards (kept with --keep-logs). Default: the system temporary directory.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the scratch directory (configurations and every peer's log).
    #[arg(long)]
    keep_logs: bool,
}

/// The run's parameters, resolved from the arguments.
#[derive(Debug, Clone)]
struct Plan {
    sizes: Vec<u64>,
    clients: Vec<usize>,
    phase: Duration,
    working_set_bytes: u64,
    memcpy_bytes: u64,
    peers: Vec<PeerName>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerName {
    Ours,
    OursShm,
    RawSocket,
    Redis(Persistence),
    Mooncake,
    Iperf3,
    Memcpy,
    File(FileRow),
    /// `gpucache serve` on its embedded default (`ours-default`).
    Default,
}

const PEER_NAMES: &str = "ours, ours-shm, raw-socket, redis, mooncake, iperf3, memcpy, \
                          ours-file[-none|-none-cold|-durable|-durable-cold], \
                          ours-log[-none|-none-cold|-durable|-durable-cold], \
                          ours-default, \
                          redis-aof[-always|-everysec]";

impl PeerName {
    /// The rows one name of --peers stands for (a group name stands for several).
    fn parse(text: &str) -> Result<Vec<Self>, String> {
        let one = match text.trim() {
            "ours" | "ours-tcp" => Self::Ours,
            "ours-shm" => Self::OursShm,
            "raw-socket" => Self::RawSocket,
            "redis" => Self::Redis(Persistence::Off),
            "redis-aof-always" => Self::Redis(Persistence::AofAlways),
            "redis-aof-everysec" => Self::Redis(Persistence::AofEverysec),
            "redis-aof" => {
                return Ok(vec![
                    Self::Redis(Persistence::AofAlways),
                    Self::Redis(Persistence::AofEverysec),
                ]);
            }
            "mooncake" => Self::Mooncake,
            "iperf3" => Self::Iperf3,
            "memcpy" => Self::Memcpy,
            "ours-file" => return Ok(FileRow::ALL.into_iter().map(Self::File).collect()),
            "ours-default" => Self::Default,
            other => match FileRow::parse(other) {
                Some(row) => Self::File(row),
                None => return Err(format!("unknown peer {other:?} (use {PEER_NAMES})")),
            },
        };
        Ok(vec![one])
    }
}

fn plan(args: &ServiceBenchArgs) -> Result<Plan, String> {
    let q = args.quick;
    let sizes = parse_size_list(args.sizes.as_deref().unwrap_or(if q {
        "64K,1M"
    } else {
        "64K,256K,1M,4M"
    }))?;
    if let Some(&s) = sizes.iter().find(|&&s| !(16..=64 * MIB).contains(&s)) {
        return Err(format!("value size {s} is outside 16 B..=64 MiB"));
    }
    let clients: Vec<usize> = args
        .clients
        .as_deref()
        .unwrap_or(if q { "1" } else { "1,8" })
        .split(',')
        .filter(|c| !c.trim().is_empty())
        .map(|c| c.trim().parse::<usize>().map_err(|e| format!("--clients {c:?}: {e}")))
        .collect::<Result<_, _>>()?;
    if clients.is_empty() || clients.iter().any(|&c| c == 0 || c > CLIENTS_MAX) {
        return Err(format!("--clients must list counts in 1..={CLIENTS_MAX}"));
    }
    let seconds = args.seconds.unwrap_or(if q { 0.5 } else { 3.0 });
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= 600.0) {
        return Err(format!("--seconds {seconds} must be in (0, 600]"));
    }
    let working_set_bytes = args.working_set.unwrap_or(if q { 64 * MIB } else { 512 * MIB });
    let memcpy_bytes = args.memcpy_bytes.unwrap_or(if q { 256 * MIB } else { GIB });
    let mut peers = Vec::new();
    for p in args.peers.split(',').filter(|p| !p.trim().is_empty()) {
        for p in PeerName::parse(p)? {
            if !peers.contains(&p) {
                peers.push(p);
            }
        }
    }
    if peers.is_empty() {
        return Err("--peers names no peer".into());
    }
    Ok(Plan {
        sizes,
        clients,
        phase: Duration::from_secs_f64(seconds),
        working_set_bytes,
        memcpy_bytes,
        peers,
    })
}

/// Exit status: 0 when every peer that was found ran cleanly (aims met or not), 1 when a point
/// failed or a value did not verify, 2 on a usage or setup error.
pub fn run(args: &ServiceBenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache-bench service: {e}");
            ExitCode::from(2)
        }
    }
}

fn keys_for(plan: &Plan, size: u64, clients: usize) -> u64 {
    (plan.working_set_bytes / size).max(KEYS_PER_CLIENT_MIN * clients as u64)
}

fn skipped(name: &str, table: Table, why: String) -> PeerRun {
    eprintln!("bench: {name}: skipped: {why}");
    PeerRun {
        name: name.into(),
        table,
        ours: name.starts_with("ours"),
        shared_memory: false,
        version: None,
        skipped: Some(why),
        note: None,
        points: Vec::new(),
    }
}

fn ran(name: &str, table: Table, version: Option<String>, note: &str) -> PeerRun {
    PeerRun {
        name: name.into(),
        table,
        ours: false,
        shared_memory: false,
        version,
        skipped: None,
        note: Some(note.into()),
        points: Vec::new(),
    }
}

/// How one row of the report is measured.
enum Slot {
    Skipped,
    Ours(Transport),
    RawSocket,
    Redis(Persistence),
    File(FileRow),
    Default,
    Mooncake(peers::MooncakeVenv),
    Iperf3,
    Memcpy,
}

const NO_REDIS: &str = "redis-server not on PATH (run scripts/setup.sh redis iperf3 mooncake)";
const NO_IPERF3: &str = "iperf3 not on PATH (run scripts/setup.sh redis iperf3 mooncake)";

/// One Mooncake point: a driver run of its own; the run's version comes from the first one.
fn mooncake_point(
    venv: &peers::MooncakeVenv,
    dir: &Path,
    size: u64,
    clients: usize,
    phase: Duration,
    working_set_bytes: u64,
    run: &mut PeerRun,
) -> PointResult {
    match peers::mooncake_run(venv, dir, &[size], &[clients], phase, working_set_bytes, 0) {
        Ok(report) => {
            if run.version.is_none() {
                run.version = report.version;
                if let (Some(seg), Some(note)) = (report.segment_bytes, &mut run.note) {
                    let _ = write!(
                        note,
                        "; segment {} at the first point, sized per point",
                        human_bytes(seg)
                    );
                }
            }
            report
                .points
                .into_iter()
                .next()
                .map_or_else(|| PointResult::failed(size, clients, "no point".into()), Into::into)
        }
        Err(e) => PointResult::failed(size, clients, e),
    }
}

pub(crate) fn default_venv() -> PathBuf {
    // <target>/<profile>/gpucache-bench -> <target>/bench-venv
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().and_then(Path::parent).map(|t| t.join("bench-venv")))
        .unwrap_or_else(|| PathBuf::from("target/bench-venv"))
}

fn run_inner(args: &ServiceBenchArgs) -> Result<bool, String> {
    let plan = plan(args)?;
    let load_start = loadavg();
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
    let scratch = tempfile::Builder::new()
        .prefix("gpucache-bench-service-")
        .tempdir_in(&base)
        .map_err(|e| format!("cannot make a directory in {}: {e}", base.display()))?;
    let dir = scratch.path().to_owned();
    eprintln!("bench: working in {}", dir.display());

    // One row per peer (per transport for ours); a peer whose tools are missing is skipped with
    // its reason. Then the points run in order, and within a point every peer runs back to back,
    // so that load from elsewhere on a shared machine falls on all peers of a point alike.
    let mut slots: Vec<(Slot, PeerRun)> = Vec::new();
    for &peer in &plan.peers {
        match peer {
            PeerName::Ours | PeerName::OursShm => {
                let t = if peer == PeerName::Ours { Transport::Tcp } else { Transport::Shm };
                let mut run = ran(
                    t.peer_name(),
                    Table::Memory,
                    Some(env!("CARGO_PKG_VERSION").into()),
                    t.note(),
                );
                run.ours = true;
                run.shared_memory = t.is_shared_memory();
                slots.push((Slot::Ours(t), run));
            }
            PeerName::File(row) => {
                let mut run = ran(
                    row.peer_name(),
                    Table::File,
                    Some(env!("CARGO_PKG_VERSION").into()),
                    &row.note(),
                );
                run.ours = true;
                slots.push((Slot::File(row), run));
            }
            PeerName::Default => {
                let version = Some(env!("CARGO_PKG_VERSION").into());
                let mut run = ran("ours-default", Table::File, version, filestore::DEFAULT_NOTE);
                run.ours = true;
                slots.push((Slot::Default, run));
            }
            PeerName::RawSocket => {
                let sizes = raw::FrameSizes::for_value(64 << 10).ok();
                slots.push((
                    Slot::RawSocket,
                    ran("raw-socket", Table::Memory, None, &raw::note(sizes)),
                ));
            }
            PeerName::Redis(p) => {
                let table = if p == Persistence::Off { Table::Memory } else { Table::File };
                match redis::version() {
                    None => {
                        slots.push((Slot::Skipped, skipped(p.peer_name(), table, NO_REDIS.into())))
                    }
                    Some(v) => {
                        slots.push((Slot::Redis(p), ran(p.peer_name(), table, Some(v), p.note())))
                    }
                }
            }
            PeerName::Mooncake => {
                let venv = args.mooncake_venv.clone().unwrap_or_else(default_venv);
                match peers::mooncake_venv(&venv) {
                    Err(why) => {
                        slots.push((Slot::Skipped, skipped("mooncake", Table::Memory, why)))
                    }
                    Ok(v) => slots.push((
                        Slot::Mooncake(v),
                        ran(
                            "mooncake",
                            Table::Memory,
                            None,
                            "segment in a separate mooncake_client process (its own metadata \
                             server, master and client per point); one worker process per \
                             client, put_from / get_into with a registered buffer",
                        ),
                    )),
                }
            }
            PeerName::Iperf3 => match peers::iperf3_version() {
                None => {
                    slots.push((Slot::Skipped, skipped("iperf3", Table::Memory, NO_IPERF3.into())));
                }
                Some(v) => slots.push((
                    Slot::Iperf3,
                    ran(
                        "iperf3",
                        Table::Memory,
                        Some(v),
                        "loopback TCP, -P clients streams, -l value size (at most 1 MiB, \
                         iperf3's limit); the same figure in GET and PUT",
                    ),
                )),
            },
            PeerName::Memcpy => {
                let note = format!(
                    "in process, one thread per client over {} source and destination; the \
                     same figure in GET and PUT",
                    human_bytes(plan.memcpy_bytes)
                );
                slots.push((Slot::Memcpy, ran("memcpy", Table::Memory, None, &note)));
            }
        }
    }
    for &size in &plan.sizes {
        for &c in &plan.clients {
            for (slot, run) in &mut slots {
                if matches!(slot, Slot::Skipped) {
                    continue;
                }
                eprintln!("bench: {} x{c}: {}", size_label(size), run.name);
                let spec = spec(&plan, size, c);
                // What the stores must hold: more than --working-set when each client's fewest
                // keys take more.
                let held = stored_bytes(&plan, &spec);
                let p = match slot {
                    Slot::Skipped => continue,
                    Slot::Ours(t) => ours::measure(*t, &dir, spec, held),
                    Slot::RawSocket => raw::measure(spec),
                    Slot::Redis(p) => redis::measure(&dir, spec, held, *p),
                    Slot::File(row) => filestore::measure(*row, &dir, spec, held),
                    Slot::Default => filestore::measure_default(&dir, spec),
                    Slot::Mooncake(v) => {
                        mooncake_point(v, &dir, size, c, plan.phase, plan.working_set_bytes, run)
                    }
                    Slot::Iperf3 => peers::iperf3_point(&dir, size, c, plan.phase),
                    Slot::Memcpy => peers::memcpy_point(size, c, plan.memcpy_bytes, plan.phase),
                };
                if let Some(e) = &p.error {
                    eprintln!("bench: {} x{c}: {}: {e}", size_label(size), run.name);
                }
                run.points.push(p);
            }
        }
    }
    let runs: Vec<PeerRun> = slots.into_iter().map(|(_, r)| r).collect();

    let aims = report::aims(&runs);
    let machine = machine(&load_start);
    let command: Vec<String> = std::env::args().collect();
    let commit = git_commit();
    let date = utc_now();
    let mut out = String::new();
    let _ = writeln!(out, "# gpucache-bench service");
    let _ = writeln!(out, "command: {}", command.join(" "));
    let _ = writeln!(out, "ended: {date}; commit: {commit}; machine: {}", machine_line(&machine));
    let _ = writeln!(
        out,
        "phase deadline {:.1} s; working set {} per point; GB/s = 1e9 B/s; p99 per operation in ms",
        plan.phase.as_secs_f64(),
        human_bytes(plan.working_set_bytes)
    );
    for r in &runs {
        match (&r.skipped, &r.version) {
            (Some(why), _) => {
                let _ = writeln!(out, "- {}: skipped: {why}", r.name);
            }
            (None, v) => {
                let _ = writeln!(
                    out,
                    "- {}{}: {}",
                    r.name,
                    v.as_ref().map_or_else(String::new, |v| format!(" ({v})")),
                    r.note.as_deref().unwrap_or("")
                );
            }
        }
    }
    out.push('\n');
    out.push_str(&report::tables(&runs, &plan.sizes, &plan.clients));
    out.push('\n');
    out.push_str(&report::aims_table(&aims));
    let mut clean = true;
    for r in &runs {
        for p in &r.points {
            if p.error.is_some() || p.mismatches > 0 {
                clean = false;
                let _ = writeln!(
                    out,
                    "{} {} x{}: {} (verified {}, mismatches {})",
                    r.name,
                    size_label(p.size),
                    p.clients,
                    p.error.as_deref().unwrap_or("no error"),
                    p.verified,
                    p.mismatches
                );
            }
        }
    }
    let verified: u64 = runs.iter().flat_map(|r| &r.points).map(|p| p.verified).sum();
    let _ = writeln!(out, "\nvalues verified in full: {verified} GETs");
    #[allow(clippy::print_stdout)]
    {
        println!("{}", out.trim_end());
    }

    if let Some(path) = &args.json {
        let doc = json!({
            "command": command,
            "date": date, // when the measurements ended
            "git_commit": commit,
            "machine": machine,
            "params": {
                "sizes": plan.sizes,
                "clients": plan.clients,
                "phase_seconds": plan.phase.as_secs_f64(),
                "working_set_bytes": plan.working_set_bytes,
                "memcpy_bytes": plan.memcpy_bytes,
            },
            "peers": runs,
            "ratios": report::ratios(&runs, &plan.sizes, &plan.clients),
            "aims": aims,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| format!("JSON: {e}"))?;
        write_file(path, &text)?;
        eprintln!("bench: JSON written to {}", path.display());
    }
    if let Some(path) = &args.svg {
        // Short enough for the chart's width: the machine line goes to the report and JSON.
        let load = |k: &str| {
            let v = machine.get(k).and_then(serde_json::Value::as_str).unwrap_or("?");
            v.split_whitespace().next().unwrap_or("?").to_owned()
        };
        let title = format!(
            "gpucache-bench service — {date}, {} CPUs, load average {} to {}",
            machine.get("nproc").and_then(serde_json::Value::as_u64).unwrap_or(0),
            load("loadavg_start"),
            load("loadavg_end")
        );
        write_file(path, &report::svg(&runs, &plan.sizes, &plan.clients, &title))?;
        eprintln!("bench: SVG written to {}", path.display());
    }
    if args.keep_logs {
        let kept = scratch.keep();
        eprintln!("bench: logs kept in {}", kept.display());
    }
    Ok(clean)
}

/// The bytes a point's PUT phase can store: the working set, or the clients' fewest keys when
/// those take more.
fn stored_bytes(plan: &Plan, spec: &LoadSpec) -> u64 {
    plan.working_set_bytes.max(spec.keys.saturating_mul(spec.value_bytes as u64))
}

fn spec(plan: &Plan, size: u64, clients: usize) -> LoadSpec {
    LoadSpec {
        value_bytes: gpucache_service::units::narrow(size),
        clients,
        keys: keys_for(plan, size, clients),
        phase: plan.phase,
    }
}

pub fn write_file(path: &Path, text: &str) -> Result<(), String> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The 1, 5 and 15 minute load averages: other work on a shared machine moves every figure.
pub fn loadavg() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

pub fn machine(load_start: &str) -> serde_json::Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned());
    let mem_kib: Option<u64> = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok());
    json!({
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "nproc": std::thread::available_parallelism().map_or(0, usize::from),
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "cpu": cpu,
        "mem_bytes": mem_kib.map(|k| k * 1024),
    })
}

fn machine_line(m: &serde_json::Value) -> String {
    let text = |k: &str| m.get(k).and_then(serde_json::Value::as_str).unwrap_or("?").to_owned();
    format!(
        "{} CPUs, kernel {}, load average {} at the start and {} at the end",
        m.get("nproc").and_then(serde_json::Value::as_u64).unwrap_or(0),
        text("kernel"),
        text("loadavg_start"),
        text("loadavg_end")
    )
}

pub fn git_commit() -> String {
    let out = Command::new("git").args(["rev-parse", "--short", "HEAD"]).output();
    let commit = out
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let Some(commit) = commit else { return "unknown".into() };
    let dirty =
        Command::new("git").args(["diff", "--quiet", "HEAD"]).status().is_ok_and(|s| !s.success());
    if dirty { format!("{commit} (with local changes)") } else { commit }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_from_unix(secs)
}

fn utc_from_unix(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (the proleptic Gregorian calendar, in 400-year eras).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_from_unix(1_798_675_199), "2026-12-30T23:59:59Z");
    }

    fn args(extra: &[&str]) -> ServiceBenchArgs {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Wrap {
            #[command(flatten)]
            a: ServiceBenchArgs,
        }
        let mut argv = vec!["x"];
        argv.extend_from_slice(extra);
        Wrap::parse_from(argv).a
    }

    #[test]
    fn plans_resolve_defaults_quick_and_peers() {
        let p = plan(&args(&[])).expect("plan");
        assert_eq!(p.sizes, vec![64 << 10, 256 << 10, MIB, 4 * MIB]);
        assert_eq!(p.clients, vec![1, 8]);
        assert_eq!(p.peers.len(), 7);
        assert_eq!(p.peers[..3], [PeerName::Ours, PeerName::OursShm, PeerName::RawSocket]);
        assert!(!p.peers.iter().any(|x| matches!(x, PeerName::File(_))), "file rows are opt-in");
        let q = plan(&args(&["--quick", "--peers", "ours,memcpy,ours-tcp", "--clients", "2"]))
            .expect("plan");
        assert_eq!(q.sizes, vec![64 << 10, MIB]);
        assert_eq!(q.clients, vec![2]);
        assert_eq!(q.peers, vec![PeerName::Ours, PeerName::Memcpy]);
        let s = plan(&args(&["--peers", "ours-shm,memcpy"])).expect("plan");
        assert_eq!(s.peers, vec![PeerName::OursShm, PeerName::Memcpy]);
        let e = plan(&args(&["--peers", "memcached"])).expect_err("unknown");
        assert!(e.contains("raw-socket") && e.contains("redis-aof"), "{e}");
        let d = plan(&args(&["--peers", "ours-file,redis-aof,ours-file-none,redis,ours-default"]))
            .expect("plan");
        assert_eq!(d.peers.len(), 12, "the groups expand and repeats drop: {:?}", d.peers);
        assert_eq!(d.peers[0], PeerName::File(FileRow::ALL[0]));
        assert_eq!(d.peers[8], PeerName::Redis(Persistence::AofAlways));
        assert_eq!(d.peers[10], PeerName::Redis(Persistence::Off));
        assert_eq!(d.peers[11], PeerName::Default);
        assert!(plan(&args(&["--clients", "0"])).is_err());
        assert_eq!(keys_for(&p, MIB, 8), 512);
        assert_eq!(keys_for(&p, 64 * MIB, 8), 32);
        // 32 clients at 4 MiB with a 256 MiB working set: 4 keys each, 512 MiB to hold.
        let small = plan(&args(&["--working-set", "256M"])).expect("plan");
        assert_eq!(stored_bytes(&small, &spec(&small, 4 * MIB, 32)), 512 * MIB);
        assert_eq!(stored_bytes(&small, &spec(&small, MIB, 1)), 256 * MIB);
    }
}
