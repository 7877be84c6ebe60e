//! `gpucache-bench trace`: prefix-reuse request traces replayed through a real store, measuring
//! the hit ratio each eviction policy gives at a capacity, beside two offline references computed
//! over the same reference sequence: Belady's bound and plain LRU.
//!
//! Each (trace, capacity, policy) point opens a fresh store (a `MemoryStore` evicting by the
//! policy, or a FileStore with it) whose `retained_bytes_max` holds exactly the capacity's blocks
//! and whose other limits never bind; the policies of one capacity replay the trace in lockstep
//! as [`replay`] describes (each request's keys made once, then walked through every store). Against a
//! running service (`--addr`) the server's own store and policy serve, so the bench replays each
//! trace once and reports what it measured; the offline references are then shown per
//! `--capacity` on their own rows.
//!
//! A capacity is a fraction of the trace's distinct blocks (`5%`) or a size (`64MiB`, divided
//! by the block size). The hit ratio is the verified prefix hits over all block references.
//!
//! `--store cold` puts the cold tier below a tiered store ([`cold`]): the file tier's evictions
//! drain to an S3 bucket (`--cold-endpoint`, `--cold-bucket`) or, without an endpoint, to an
//! object store simulated in memory, and the report gives each tier's share of the references
//! and the latency of the GETs the cold tier served.

mod cold;
mod load;
mod offline;
mod replay;
mod report;
mod row;
mod tiers;

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_service::units::{human_bytes, parse_size, size_label};
use gpucache_storage::MemoryStore;
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::tiered::{MemoryTier, TieredStore, WriteMode};
use serde_json::json;

pub use load::Trace;
pub use offline::{Outcome, belady, lru};
pub use replay::{Replay, replay};
pub use row::Row;

use crate::service::{git_commit, loadavg, machine, utc_now, write_file};

/// Largest block size accepted.
pub const BLOCK_BYTES_MAX: u64 = 64 << 20;
/// Most capacities one run takes (`--capacity` and `--svg-capacities` together).
pub const CAPACITIES_MAX: usize = 64;
/// The policies whose best replay is the reference of the table's "vs best" column.
pub const BEST_OF: [&str; 3] = ["lru", "arc", "s3-fifo"];
/// How often the progress line is redrawn.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

fn parse_write_mode(s: &str) -> Result<WriteMode, String> {
    s.parse().map_err(|e| format!("{e}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreArg {
    /// A MemoryStore that evicts by the policy.
    Memory,
    /// A FileStore (buffered, no flushes) with the policy, in a fresh directory under --dir.
    File,
    /// A TieredStore: a memory tier of --memory-capacity over such a FileStore of --capacity,
    /// both on the policy (writes go through, or back with --write back; file hits are
    /// promoted).
    Tiered,
    /// Such a TieredStore with the cold tier below it: file-tier evictions drain to the object
    /// store (--cold-endpoint and --cold-bucket, or one simulated in memory without them) and
    /// GETs both upper tiers miss refill from it.
    Cold,
}

#[derive(Debug, Args)]
pub struct TraceBenchArgs {
    /// A trace file (JSON lines with `hash_ids`); repeat for several.
    #[arg(long = "trace", required = true)]
    traces: Vec<PathBuf>,
    /// Bytes per block (K, M are binary).
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    block_size: u64,
    /// Capacities, comma-separated: fractions of the trace's distinct blocks (5%) or sizes
    /// (64MiB, divided by the block size).
    #[arg(long, default_value = "5%,10%")]
    capacity: String,
    /// Eviction policies, comma-separated, or `all` (every policy the store knows).
    #[arg(long, default_value = "all")]
    policy: String,
    /// The in-process store to replay through.
    #[arg(long, value_enum, default_value = "memory")]
    store: StoreArg,
    /// With `--store tiered` or `cold`: the memory tier's capacity, as a share of the distinct
    /// blocks (5%) or a size; the file tier gets each --capacity point.
    #[arg(long, default_value = "5%")]
    memory_capacity: String,
    /// With `--store tiered` or `cold`: how PUTs reach the file tier, `through` or `back`.
    #[arg(long, default_value = "through", value_parser = parse_write_mode)]
    write: WriteMode,
    /// The `--cold-*` flags (boxed: they are many and rarely given).
    #[command(flatten)]
    cold: Box<ColdFlags>,
    /// Where `--store file` makes its scratch directory (removed afterwards). Default: the
    /// system temporary directory.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Replay through a running `gpucache serve` at HOST:PORT instead (its store and policy
    /// serve; --store, --policy and --capacity do not apply to the replay).
    #[arg(long, conflicts_with_all = ["store", "dir"])]
    addr: Option<SocketAddr>,
    /// With --addr: the server's HTTP metrics listener (HOST:PORT), scraped before and after
    /// each replay for the hits each tier of a tiered store served.
    #[arg(long, requires = "addr")]
    metrics: Option<SocketAddr>,
    /// The tenant the replay acts as and keys its blocks under (with --addr: one the server
    /// serves, with read and write rights).
    #[arg(long, default_value = replay::TENANT)]
    tenant: String,
    /// Write everything measured as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write hit ratio against capacity, one chart per trace, here (runs every policy at every
    /// --svg-capacities point too).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// The capacities the chart plots.
    #[arg(long, default_value = "1%,2%,5%,10%,20%,40%")]
    svg_capacities: String,
    /// Replay only the first N requests of each trace.
    #[arg(long)]
    limit_requests: Option<usize>,
}

/// With `--store cold`: where the cold tier's objects go and how it drains.
#[derive(Debug, Args)]
pub struct ColdFlags {
    /// With `--store cold`: the S3-compatible endpoint of the cold tier's bucket (e.g.
    /// http://127.0.0.1:9000). Without it the object store is simulated in memory.
    #[arg(long, requires = "cold_bucket")]
    cold_endpoint: Option<String>,
    /// With --cold-endpoint: the bucket (it must exist).
    #[arg(long, requires = "cold_endpoint")]
    cold_bucket: Option<String>,
    /// With --cold-endpoint: the bucket's region.
    #[arg(long, default_value = "us-east-1")]
    cold_region: String,
    /// With --cold-endpoint: the access key (moto's test credentials by default).
    #[arg(long, default_value = "testing")]
    cold_access_key_id: String,
    /// With --cold-endpoint: the secret key.
    #[arg(long, default_value = "testing")]
    cold_secret_access_key: String,
    /// With `--store cold`: the pause between the cold sink's drain rounds, in milliseconds.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    cold_drain_ms: u64,
    /// With --cold-endpoint: leave the objects the replay wrote in the bucket (by default they
    /// are deleted after each replay).
    #[arg(long)]
    cold_keep: bool,
}

/// A capacity as given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Capacity {
    /// A fraction (0, 1] of the trace's distinct blocks.
    Fraction(f64),
    Bytes(u64),
}

impl Capacity {
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| format!("{t:?} is not a percentage"))?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(format!("{t:?}: a percentage must be in (0, 100]"));
            }
            return Ok(Self::Fraction(v / 100.0));
        }
        let bytes = parse_size(t).map_err(|e| format!("{t:?}: not a percentage or size: {e}"))?;
        if bytes == 0 {
            return Err(format!("{t:?}: a capacity must be above zero"));
        }
        Ok(Self::Bytes(bytes))
    }

    pub fn parse_list(text: &str) -> Result<Vec<Self>, String> {
        let list: Vec<Self> = text
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(Self::parse)
            .collect::<Result<_, _>>()?;
        if list.is_empty() {
            return Err(format!("{text:?} names no capacity"));
        }
        Ok(list)
    }

    /// Blocks this capacity holds for a trace of `unique` distinct blocks (at least one).
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    pub fn blocks(self, unique: usize, block: u64) -> u64 {
        let n = match self {
            Self::Fraction(f) => (f * unique as f64).round() as u64,
            Self::Bytes(b) => b / block.max(1),
        };
        n.max(1)
    }

    pub fn label(self) -> String {
        match self {
            Self::Fraction(f) => {
                let text = format!("{:.3}", f * 100.0);
                let text = text.trim_end_matches('0').trim_end_matches('.');
                format!("{text}%")
            }
            Self::Bytes(b) => size_label(b),
        }
    }
}

/// `all`, or policy names, comma-separated.
pub fn parse_policies(text: &str) -> Result<Vec<PolicyKind>, String> {
    if text.trim() == "all" {
        return Ok(PolicyKind::ALL.to_vec());
    }
    let mut out = Vec::new();
    for name in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let p: PolicyKind = name.parse().map_err(|e| format!("--policy: {e}"))?;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    if out.is_empty() {
        return Err(format!("--policy {text:?} names no policy"));
    }
    Ok(out)
}

/// Limits under which only `retained_bytes_max` (`blocks` blocks of `block` bytes) binds.
pub fn limits_for(block: u64, blocks: u64, unique: usize) -> ResourceLimits {
    let d = ResourceLimits::default();
    let retained = block.saturating_mul(blocks);
    let registrations = u64::try_from(unique).unwrap_or(u64::MAX).saturating_add(1024);
    ResourceLimits {
        object_bytes_max: block,
        tenant_inflight_bytes_max: d.tenant_inflight_bytes_max.max(block),
        retained_bytes_max: retained,
        tenant_retained_bytes_max: retained,
        registrations_max: u32::try_from(registrations).unwrap_or(u32::MAX),
        ..d
    }
}

/// A buffered FileStore's configuration (no flushes) for one policy's replay, in a directory of
/// its own under `dir`.
fn scratch_file_store(
    dir: &tempfile::TempDir,
    trace: &str,
    blocks: u64,
    limits: &ResourceLimits,
    policy: PolicyKind,
) -> (PathBuf, FileStoreConfig) {
    let d = dir.path().join(format!("{trace}-{blocks}-{}", policy.name()));
    let mut config = FileStoreConfig::new(&d);
    config.durability = Durability::None;
    config.limits = limits.clone();
    config.policy = policy;
    (d, config)
}

/// Exit status: 0 when every replay was clean, 1 when some replay saw a mismatch, corrupt
/// block, error or refused PUT (the report names it), 2 on a usage or setup error.
pub fn run(args: &TraceBenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache-bench trace: {e}");
            ExitCode::from(2)
        }
    }
}

/// What a run replays, from its checked arguments.
struct Plan {
    /// `--capacity` and then the `--svg-capacities` it lacks.
    capacities: Vec<Capacity>,
    svg_capacities: Vec<Capacity>,
    policies: Vec<PolicyKind>,
    cold_s3: Option<gpucache_cold::S3Config>,
    caller: Caller,
    block: usize,
}

/// What the replays have given so far: the report's rows, whether every replay was clean, and
/// where the cold tier was (for the report's store line).
#[derive(Default)]
struct Results {
    rows: Vec<Row>,
    clean: bool,
    cold_described: Option<String>,
}

/// One trace at one capacity, as every local store of the run sees it.
struct Point<'a> {
    trace: &'a Trace,
    unique: usize,
    blocks: u64,
    limits: ResourceLimits,
    /// `<trace> <capacity>`, for the progress and the log lines.
    label: String,
}

fn run_inner(args: &TraceBenchArgs) -> Result<bool, String> {
    let plan = plan(args)?;
    let load_start = loadavg();
    let scratch = scratch_dir(args)?;
    // A fresh namespace per run, so that a shared server's blocks from earlier runs never hit.
    let nonce = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut results = Results { clean: true, ..Results::default() };
    for path in &args.traces {
        let trace = Trace::read(path, args.limit_requests)?;
        let unique = trace.unique_blocks();
        eprintln!(
            "bench: {}: {} requests, {} block references, {} distinct blocks",
            trace.name,
            trace.requests.len(),
            trace.refs(),
            unique
        );
        if let Some(addr) = args.addr {
            replay_server(args, &plan, &trace, addr, nonce, &mut results)?;
        }
        for &cap in &plan.capacities {
            let blocks = cap.blocks(unique, args.block_size);
            let base = offline_row(&trace, cap, blocks);
            if args.addr.is_some() {
                results.rows.push(base);
                continue;
            }
            let point = Point {
                trace: &trace,
                unique,
                blocks,
                limits: limits_for(args.block_size, blocks, unique),
                label: format!("{} {}", trace.name, cap.label()),
            };
            replay_point(args, &plan, scratch.as_ref(), &point, nonce, base, &mut results)?;
        }
    }
    let Results { rows, clean, cold_described } = results;
    let command: Vec<String> = std::env::args().collect();
    let commit = git_commit();
    let date = utc_now();
    let machine = machine(&load_start);
    let header =
        Header { command: &command, commit: &commit, date: &date, load_start: &load_start };
    let out = report_text(args, &header, cold_described.as_deref(), &rows);
    #[allow(clippy::print_stdout)]
    {
        println!("{}", out.trim_end());
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "command": command,
            "date": date,
            "git_commit": commit,
            "machine": machine,
            "params": params_json(args, &plan),
            "rows": rows.iter().map(report::row_json).collect::<Vec<_>>(),
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| format!("JSON: {e}"))?;
        write_file(path, &text)?;
        eprintln!("bench: JSON written to {}", path.display());
    }
    if let Some(path) = &args.svg {
        let labels: Vec<String> = plan.svg_capacities.iter().map(|c| c.label()).collect();
        let title = format!(
            "gpucache-bench trace — {date}, block {}, load average {} to {}",
            size_label(args.block_size),
            load_start.split_whitespace().next().unwrap_or("?"),
            loadavg().split_whitespace().next().unwrap_or("?")
        );
        write_file(path, &report::svg(&rows, &labels, &title))?;
        eprintln!("bench: SVG written to {}", path.display());
    }
    drop(scratch);
    Ok(clean)
}

/// Checks the arguments and works out what the run replays.
fn plan(args: &TraceBenchArgs) -> Result<Plan, String> {
    if args.block_size == 0 || args.block_size > BLOCK_BYTES_MAX {
        return Err(format!(
            "--block-size {} must be 1 byte to {}",
            args.block_size,
            human_bytes(BLOCK_BYTES_MAX)
        ));
    }
    if args.limit_requests == Some(0) {
        return Err("--limit-requests must be at least 1".to_owned());
    }
    let mut capacities =
        Capacity::parse_list(&args.capacity).map_err(|e| format!("--capacity: {e}"))?;
    let svg_capacities = if args.svg.is_some() {
        Capacity::parse_list(&args.svg_capacities).map_err(|e| format!("--svg-capacities: {e}"))?
    } else {
        Vec::new()
    };
    for c in &svg_capacities {
        if !capacities.contains(c) {
            capacities.push(*c);
        }
    }
    if capacities.len() > CAPACITIES_MAX {
        return Err(format!("at most {CAPACITIES_MAX} capacities per run"));
    }
    let policies = parse_policies(&args.policy)?;
    let cold_s3 = cold_s3_config(args)?;
    let tenant = TenantId::parse(&args.tenant).map_err(|e| format!("--tenant: {e}"))?;
    let caller = Caller::new(tenant, Rights::READ_WRITE);
    let block =
        usize::try_from(args.block_size).map_err(|_| "--block-size too large".to_owned())?;
    Ok(Plan { capacities, svg_capacities, policies, cold_s3, caller, block })
}

/// The scratch directory of the stores on disk (none for memory stores and `--addr`).
fn scratch_dir(args: &TraceBenchArgs) -> Result<Option<tempfile::TempDir>, String> {
    match args.store {
        StoreArg::File | StoreArg::Tiered | StoreArg::Cold if args.addr.is_none() => {
            let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
            std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
            let dir = tempfile::Builder::new()
                .prefix("gpucache-bench-trace-")
                .tempdir_in(&base)
                .map_err(|e| format!("cannot make a directory in {}: {e}", base.display()))?;
            eprintln!("bench: working in {}", dir.path().display());
            Ok(Some(dir))
        }
        _ => Ok(None),
    }
}

/// `trace` replayed once through the server at `addr` (its own policy and capacity), with
/// what each of its tiers served when `--metrics` names its metrics listener.
fn replay_server(
    args: &TraceBenchArgs,
    plan: &Plan,
    trace: &Trace,
    addr: SocketAddr,
    nonce: u128,
    results: &mut Results,
) -> Result<(), String> {
    let caller = &plan.caller;
    let client = TcpStore::new(ClientConfig::new(addr, caller.clone()));
    let namespace = format!("{}-{nonce}", trace.name);
    let before = args.metrics.map(tiers::scrape).transpose()?;
    let start = Instant::now();
    let r = replay_with_progress(&[&client], caller, trace, &namespace, plan.block, "server")
        .pop()
        .ok_or_else(|| "no replay".to_owned())?;
    let tier_hits = match (before, args.metrics) {
        (Some(before), Some(addr)) => Some(tiers::scrape(addr)?.since(&before, r.refs)),
        _ => None,
    };
    if let Some(t) = &tier_hits {
        eprintln!(
            "bench: {} server tiers: memory {:.4}, file {:.4} of {} references \
             ({} promotions)",
            trace.name, t.memory_ratio, t.file_ratio, r.refs, t.promotions
        );
    }
    eprintln!(
        "bench: {} server: hit ratio {:.4} in {:.1} s",
        trace.name,
        r.ratio(),
        start.elapsed().as_secs_f64()
    );
    results.clean &= r.clean();
    results.rows.push(Row {
        trace: trace.name.clone(),
        capacity: "server's".into(),
        capacity_blocks: None,
        policy: Some("server".into()),
        replay: Some(r),
        belady: None,
        lru_offline: None,
        vs_best: None,
        tiers: tier_hits,
    });
    Ok(())
}

/// The row of one capacity with only the offline references (Belady, LRU) filled in.
fn offline_row(trace: &Trace, cap: Capacity, blocks: u64) -> Row {
    Row {
        trace: trace.name.clone(),
        capacity: cap.label(),
        capacity_blocks: Some(blocks),
        policy: None,
        replay: None,
        belady: Some(belady(trace, blocks)),
        lru_offline: Some(lru(trace, blocks)),
        vs_best: None,
        tiers: None,
    }
}

/// Every policy replayed in lockstep at one point, through the local store `--store` names:
/// one row per policy (from `base`), each against the best of [`BEST_OF`] at the point.
fn replay_point(
    args: &TraceBenchArgs,
    plan: &Plan,
    scratch: Option<&tempfile::TempDir>,
    point: &Point<'_>,
    nonce: u128,
    base: Row,
    results: &mut Results,
) -> Result<(), String> {
    let (label, policies) = (&point.label, &plan.policies);
    let first = results.rows.len();
    let start = Instant::now();
    let (replays, tier_rows) = match (scratch, args.store) {
        (Some(dir), StoreArg::File) => (replay_file(plan, dir, point)?, Vec::new()),
        (Some(dir), StoreArg::Cold) => {
            replay_cold(args, plan, dir, point, nonce, &mut results.cold_described)?
        }
        (Some(dir), StoreArg::Tiered) => replay_tiered(args, plan, dir, point)?,
        _ => (replay_memory(plan, point)?, Vec::new()),
    };
    eprintln!(
        "bench: {label} ({} blocks): {} in lockstep, {:.1} s",
        point.blocks,
        if policies.len() == 1 {
            "1 policy".to_owned()
        } else {
            format!("{} policies", policies.len())
        },
        start.elapsed().as_secs_f64()
    );
    for (i, (&policy, r)) in policies.iter().zip(replays).enumerate() {
        eprintln!(
            "bench: {label} {}: hit ratio {:.4}, {:.1} s in the store",
            policy.name(),
            r.ratio(),
            r.seconds
        );
        let tiers = tier_rows.get(i).copied();
        if let Some(t) = &tiers {
            eprintln!(
                "bench: {label} {}: memory served {:.4}, file {:.4} ({} promotions)",
                policy.name(),
                t.memory_ratio,
                t.file_ratio,
                t.promotions
            );
        }
        if let Some(c) = tiers.as_ref().and_then(|t| t.cold.as_ref()) {
            eprintln!("bench: {label} {}: {}", policy.name(), cold_line(c));
        }
        results.clean &= r.clean();
        results.rows.push(Row {
            policy: Some(policy.name().to_owned()),
            replay: Some(r),
            tiers,
            ..base.clone()
        });
    }
    set_vs_best(&mut results.rows[first..]);
    Ok(())
}

/// Each row's hit ratio over the best of [`BEST_OF`] among `rows` (one point's).
fn set_vs_best(rows: &mut [Row]) {
    let best = rows
        .iter()
        .filter(|r| r.policy.as_deref().is_some_and(|p| BEST_OF.contains(&p)))
        .filter_map(|r| r.replay.as_ref().map(Replay::ratio))
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    for row in rows {
        row.vs_best = match (best, &row.replay) {
            (Some(b), Some(r)) if b > 0.0 => Some(r.ratio() / b),
            _ => None,
        };
    }
}

/// `--store memory`: one evicting MemoryStore per policy.
fn replay_memory(plan: &Plan, point: &Point<'_>) -> Result<Vec<Replay>, String> {
    let stores = plan
        .policies
        .iter()
        .map(|&p| {
            MemoryStore::evicting(point.limits.clone(), Arc::new(MonotonicClock::default()), p)
                .map_err(|e| format!("MemoryStore limits: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let dyns: Vec<&dyn Store> = stores.iter().map(|s| s as &dyn Store).collect();
    Ok(replay_with_progress(&dyns, &plan.caller, point.trace, "local", plan.block, &point.label))
}

/// `--store file`: one buffered FileStore per policy, its directory removed after.
fn replay_file(
    plan: &Plan,
    dir: &tempfile::TempDir,
    point: &Point<'_>,
) -> Result<Vec<Replay>, String> {
    let mut stores = Vec::new();
    for &policy in &plan.policies {
        let (d, config) =
            scratch_file_store(dir, &point.trace.name, point.blocks, &point.limits, policy);
        let store = config
            .open(Arc::new(MonotonicClock::default()))
            .map_err(|e| format!("open FileStore in {}: {e}", d.display()))?;
        stores.push((store, d));
    }
    let dyns: Vec<&dyn Store> = stores.iter().map(|(s, _)| s as &dyn Store).collect();
    let r =
        replay_with_progress(&dyns, &plan.caller, point.trace, "local", plan.block, &point.label);
    for (store, d) in stores {
        drop(store);
        let _ = std::fs::remove_dir_all(&d);
    }
    Ok(r)
}

/// `--store tiered`: a TieredStore per policy (memory over a FileStore), with what each tier
/// served.
fn replay_tiered(
    args: &TraceBenchArgs,
    plan: &Plan,
    dir: &tempfile::TempDir,
    point: &Point<'_>,
) -> Result<(Vec<Replay>, Vec<tiers::TierHits>), String> {
    let memory = memory_bytes(args, point.unique)?;
    let mut stores = Vec::new();
    for &policy in &plan.policies {
        let (d, config) =
            scratch_file_store(dir, &point.trace.name, point.blocks, &point.limits, policy);
        let tier = MemoryTier { write: args.write, ..MemoryTier::new(memory, policy) };
        let store = TieredStore::open(config, tier, Arc::new(MonotonicClock::default()))
            .map_err(|e| format!("open a tiered store in {}: {e}", d.display()))?;
        stores.push((store, d));
    }
    let dyns: Vec<&dyn Store> = stores.iter().map(|(s, _)| s as &dyn Store).collect();
    let r =
        replay_with_progress(&dyns, &plan.caller, point.trace, "local", plan.block, &point.label);
    let mut tier_rows = Vec::new();
    for ((store, d), replay) in stores.into_iter().zip(&r) {
        let c = store.counters();
        let before = tiers::TierCounts::default();
        let now = tiers::TierCounts {
            memory_hits: c.memory_hits,
            file_hits: c.file_hits,
            promotions: c.promotions,
        };
        tier_rows.push(now.since(&before, replay.refs));
        drop(store);
        let _ = std::fs::remove_dir_all(&d);
    }
    Ok((r, tier_rows))
}

/// `--store cold`: a tiered store per policy with the cold tier below it, on S3 or the
/// in-memory simulation, with what each tier served; a damaged refill fails the replay. The
/// objects each store wrote are deleted after (unless `--cold-keep`).
fn replay_cold(
    args: &TraceBenchArgs,
    plan: &Plan,
    dir: &tempfile::TempDir,
    point: &Point<'_>,
    nonce: u128,
    cold_described: &mut Option<String>,
) -> Result<(Vec<Replay>, Vec<tiers::TierHits>), String> {
    let (trace, label) = (point.trace, &point.label);
    let memory = memory_bytes(args, point.unique)?;
    let objects = match &plan.cold_s3 {
        Some(c) => cold::ColdObjectsArg::S3(c.clone()),
        None => cold::ColdObjectsArg::Memory {
            bytes_max: simulated_bytes(point.unique, args.block_size),
        },
    };
    *cold_described = Some(objects.describe());
    let mut stores = Vec::new();
    for &policy in &plan.policies {
        let (d, config) = scratch_file_store(dir, &trace.name, point.blocks, &point.limits, policy);
        let tier = MemoryTier { write: args.write, ..MemoryTier::new(memory, policy) };
        let setup = cold::ColdSetup {
            objects: objects.clone(),
            prefix: format!(
                "gpucache-bench-trace/{nonce}/{}-{}-{}",
                object_segment(&trace.name),
                point.blocks,
                policy.name()
            ),
            drain_interval_ms: args.cold.cold_drain_ms,
            keep: args.cold.cold_keep,
        };
        stores.push((cold::open(config, tier, &setup)?, d));
    }
    eprintln!("bench: {label}: the cold tier is on {}", objects.describe());
    let dyns: Vec<&dyn Store> = stores.iter().map(|(s, _)| s as &dyn Store).collect();
    let mut r = replay_with_progress(&dyns, &plan.caller, trace, "local", plan.block, label);
    let mut tier_rows = Vec::new();
    for ((store, d), replay) in stores.into_iter().zip(&mut r) {
        let mut hits = store.upper_counts().since(&tiers::TierCounts::default(), replay.refs);
        let cold = store.cold_hits(replay.refs);
        let damaged = cold.refill_misses.corrupt + cold.refill_misses.mismatch;
        if damaged > 0 {
            // The layer answers these as misses; the bench calls them failures.
            replay.corrupt_misses += damaged;
            replay
                .first_error
                .get_or_insert_with(|| format!("{damaged} cold refills found damaged blocks"));
        }
        hits.cold = Some(cold);
        tier_rows.push(hits);
        match store.finish() {
            Ok(0) => {}
            Ok(n) => eprintln!("bench: {label}: deleted the {n} objects it wrote"),
            Err(e) => eprintln!("bench: {label}: cleaning the bucket: {e}"),
        }
        let _ = std::fs::remove_dir_all(&d);
    }
    Ok((r, tier_rows))
}

/// What the report's first lines say of the run.
struct Header<'a> {
    command: &'a [String],
    commit: &'a str,
    date: &'a str,
    load_start: &'a str,
}

/// The report on stdout: the run, the store, the table, the tier table when any row has
/// tiers, and a line per replay that was not clean.
fn report_text(
    args: &TraceBenchArgs,
    header: &Header<'_>,
    cold_described: Option<&str>,
    rows: &[Row],
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# gpucache-bench trace");
    let _ = writeln!(out, "command: {}", header.command.join(" "));
    let _ = writeln!(
        out,
        "ended: {}; commit: {}; load average {} at the start, {} at the end",
        header.date,
        header.commit,
        header.load_start,
        loadavg()
    );
    let _ = writeln!(
        out,
        "store: {}; block {}; capacity = blocks retained (a share of the trace's distinct \
         blocks, or bytes / block); hit ratio = verified prefix hits / block references; \
         vs best = hit ratio / best of {} at the point; GET GB/s = verified bytes / time in \
         GET calls; req/s and seconds = the store's own time (its calls and the checks of \
         its hits; keys are made once per request for all policies)",
        store_description(args, cold_described),
        size_label(args.block_size),
        BEST_OF.join("/")
    );
    out.push('\n');
    out.push_str(&report::table(rows));
    if rows.iter().any(|r| r.tiers.is_some()) {
        out.push('\n');
        out.push_str(&tier_table(rows));
    }
    for r in rows {
        if let Some(rep) = r.replay.as_ref().filter(|rep| !rep.clean()) {
            let _ = writeln!(
                out,
                "{} {} {}: mismatches {}, corrupt {}, errors {}, PUTs not stored {}{}: {}",
                r.trace,
                r.capacity,
                r.policy.as_deref().unwrap_or("-"),
                rep.mismatches,
                rep.corrupt_misses,
                rep.errors,
                rep.puts_not_stored,
                if rep.aborted { " (stopped early)" } else { "" },
                rep.first_error.as_deref().unwrap_or("")
            );
        }
    }
    out
}

/// The store the report's `store:` line names.
fn store_description(args: &TraceBenchArgs, cold_described: Option<&str>) -> String {
    match (args.addr, args.store) {
        (Some(a), _) => format!("gpucache serve at {a} (its own policy and capacity)"),
        (None, StoreArg::Memory) => "MemoryStore (evicting)".into(),
        (None, StoreArg::File) => "FileStore (buffered, durability none)".into(),
        (None, StoreArg::Tiered) => format!(
            "TieredStore: memory {} over a FileStore (buffered, durability none) of the \
             capacity, writing {}",
            args.memory_capacity, args.write
        ),
        (None, StoreArg::Cold) => format!(
            "TieredStore: memory {} over a FileStore (buffered, durability none) of the \
             capacity, writing {}, with the cold tier below on {} (drain every {} ms, \
             retention 0, default refill budget)",
            args.memory_capacity,
            args.write,
            cold_described.unwrap_or("(no replay)"),
            args.cold.cold_drain_ms
        ),
    }
}

/// The JSON report's `params`.
fn params_json(args: &TraceBenchArgs, plan: &Plan) -> serde_json::Value {
    json!({
        "block_size": args.block_size,
        "store": match (args.addr, args.store) {
            (Some(a), _) => format!("tcp:{a}"),
            (None, StoreArg::Memory) => "memory".into(),
            (None, StoreArg::File) => "file".into(),
            (None, StoreArg::Tiered) => {
                format!("tiered:{}:{}", args.memory_capacity, args.write)
            }
            (None, StoreArg::Cold) => format!(
                "cold:{}:{}:{}",
                args.memory_capacity,
                args.write,
                match &args.cold.cold_endpoint {
                    Some(e) => format!(
                        "s3:{e}/{}",
                        args.cold.cold_bucket.as_deref().unwrap_or("")
                    ),
                    None => "memory-simulated".to_owned(),
                }
            ),
        },
        "capacities": plan.capacities.iter().map(|c| c.label()).collect::<Vec<_>>(),
        "policies": plan.policies.iter().map(|p| p.name()).collect::<Vec<_>>(),
        "limit_requests": args.limit_requests,
        "best_of": BEST_OF,
    })
}

/// The memory tier's bytes under `--store tiered` or `cold`.
fn memory_bytes(args: &TraceBenchArgs, unique: usize) -> Result<u64, String> {
    Ok(Capacity::parse(&args.memory_capacity)
        .map_err(|e| format!("--memory-capacity {e}"))?
        .blocks(unique, args.block_size)
        .saturating_mul(args.block_size))
}

/// The room of a simulated object store for a trace: every distinct block four times over
/// (a block refilled and evicted again is packed again), and room for the manifests.
fn simulated_bytes(unique: usize, block: u64) -> u64 {
    (unique as u64).saturating_mul(block).saturating_mul(4).saturating_add(1 << 30)
}

/// `text` as one safe segment of an object name.
fn object_segment(text: &str) -> String {
    let s: String = text
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '-' })
        .collect();
    if s.is_empty() { "trace".to_owned() } else { s }
}

/// The cold tier's bucket from the `--cold-*` flags, refusing them without `--store cold`.
fn cold_s3_config(args: &TraceBenchArgs) -> Result<Option<gpucache_cold::S3Config>, String> {
    let cold = args.store == StoreArg::Cold && args.addr.is_none();
    if !cold
        && (args.cold.cold_endpoint.is_some()
            || args.cold.cold_bucket.is_some()
            || args.cold.cold_keep)
    {
        return Err("--cold-endpoint, --cold-bucket and --cold-keep go with --store cold".into());
    }
    let (Some(endpoint), Some(bucket)) = (&args.cold.cold_endpoint, &args.cold.cold_bucket) else {
        return Ok(None);
    };
    let mut c = gpucache_cold::S3Config::new(bucket);
    c.endpoint = Some(endpoint.clone());
    c.region.clone_from(&args.cold.cold_region);
    c.access_key_id = Some(args.cold.cold_access_key_id.clone());
    c.secret_access_key = Some(args.cold.cold_secret_access_key.clone());
    Ok(Some(c))
}

fn ms(us: Option<f64>) -> String {
    us.map_or_else(|| "-".to_owned(), |us| format!("{:.3}", us / 1e3))
}

/// One stderr line of what the cold tier did.
fn cold_line(c: &tiers::ColdHits) -> String {
    format!(
        "cold served {:.4} ({} hits{}); refill p50 {} ms, p99 {} ms over {} GETs; {} demoted, \
         {} refused, {} packs stored; {} refills failed (not absent), {} sink jobs failed",
        c.cold_ratio,
        c.cold_hits,
        if c.simulated { ", object store SIMULATED in memory" } else { "" },
        ms(c.refill.p50_us),
        ms(c.refill.p99_us),
        c.refill.samples,
        c.demoted,
        c.demote_refused,
        c.packs_stored,
        c.refill_misses.faults(),
        c.sink_jobs_failed
    )
}

/// Each tiered row's share per tier, and under `--store cold` the GET latency per tier that
/// served it (p50/p99 in ms).
fn tier_table(rows: &[Row]) -> String {
    let mut s = String::new();
    let trace_w = rows.iter().map(|r| r.trace.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(
        s,
        "{:<trace_w$}  {:>16}  {:<8}  {:>7}  {:>7}  {:>7}  {:>15}  {:>15}  {:>15}  {:>8}",
        "trace",
        "capacity",
        "policy",
        "memory",
        "file",
        "cold",
        "memory p50/p99",
        "file p50/p99",
        "refill p50/p99",
        "refills"
    );
    for r in rows {
        let Some(t) = &r.tiers else { continue };
        let capacity = match r.capacity_blocks {
            Some(b) => format!("{} ({b})", r.capacity),
            None => r.capacity.clone(),
        };
        let pair = |l: Option<&tiers::Latency>| {
            l.map_or_else(|| "-".to_owned(), |l| format!("{}/{}", ms(l.p50_us), ms(l.p99_us)))
        };
        let c = t.cold.as_ref();
        let _ = writeln!(
            s,
            "{:<trace_w$}  {:>16}  {:<8}  {:>7.4}  {:>7.4}  {:>7}  {:>15}  {:>15}  {:>15}  {:>8}",
            r.trace,
            capacity,
            r.policy.as_deref().unwrap_or("-"),
            t.memory_ratio,
            t.file_ratio,
            c.map_or_else(|| "-".to_owned(), |c| format!("{:.4}", c.cold_ratio)),
            pair(c.map(|c| &c.memory_get)),
            pair(c.map(|c| &c.file_get)),
            pair(c.map(|c| &c.refill)),
            c.map_or_else(|| "-".to_owned(), |c| c.refill.samples.to_string()),
        );
    }
    if rows.iter().any(|r| r.tiers.and_then(|t| t.cold).is_some()) {
        let _ = writeln!(
            s,
            "with the cold tier below, a hit ratio may pass Belady's bound at the capacity: \
             the bound counts the file tier's blocks only, the cold tier keeps every block"
        );
    }
    if rows.iter().any(|r| r.tiers.and_then(|t| t.cold).is_some_and(|c| c.simulated)) {
        let _ = writeln!(
            s,
            "the cold tier's object store was SIMULATED IN MEMORY (MemoryObjects): no S3 \
             server took part; pass --cold-endpoint and --cold-bucket for a real one"
        );
    }
    let _ = writeln!(
        s,
        "memory/file/cold = GET hits each tier served / block references; p50/p99 = GET \
         latency in ms by the tier that served it (refill = served by the cold tier)"
    );
    s
}

/// [`replay`] with a progress line on stderr when it is a terminal, redrawn at most every
/// [`PROGRESS_EVERY`].
fn replay_with_progress(
    stores: &[&dyn Store],
    caller: &Caller,
    trace: &Trace,
    namespace: &str,
    block: usize,
    label: &str,
) -> Vec<Replay> {
    let total = trace.requests.len();
    let tty = std::io::stderr().is_terminal();
    let mut last = Instant::now();
    let mut drawn = false;
    let mut progress = |done: usize| {
        if !tty || (last.elapsed() < PROGRESS_EVERY && done < total) {
            return;
        }
        last = Instant::now();
        drawn = true;
        let width = 30;
        let filled = done.saturating_mul(width) / total.max(1);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r{label}: [{}{}] {done}/{total}",
            "#".repeat(filled),
            ".".repeat(width - filled.min(width))
        );
        let _ = err.flush();
    };
    let r = replay(stores, caller, trace, namespace, block, &mut progress);
    if drawn {
        eprint!("\r\x1b[2K");
    }
    r
}

#[cfg(test)]
mod tests;
