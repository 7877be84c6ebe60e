//! `gpucache bench file`: FileStore PUT and GET per engine and block size, with fio run in the
//! same process run on the same directory with the same block size, queue depth, total size
//! and direct flag, so that the two can be read as a ratio on a noisy machine.
//!
//! Each (size, engine) pair runs four phases, each bounded by `--seconds` and by one pass over
//! a working set of `--file-mib` MiB:
//!
//! 1. store PUT: `Store::put` of fresh keys, one block per key, until the working set is written
//!    or the deadline passes (the rest is then written untimed, so GET sees the whole set);
//! 2. store GET: `Store::get_into` of the committed keys in order into one reused buffer;
//! 3. fio write: `--rw=write` of one file of the working-set size;
//! 4. fio read: `--rw=read` of that file.
//!
//! Everything is flushed (`sync`) before each write phase so that one phase's dirty pages do
//! not throttle the next. With buffered I/O (the default) a working set that fits in RAM is
//! read back from the page cache by both the store and fio; `--drop-caches` (root) drops the
//! cache before each read phase and `--direct` bypasses it.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::{
    CacheIdentity, KvDtype, PositionEncoding, QuantFormat, RopeParams, RopeScaling, Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig, OpenReport};

use crate::fio;
use crate::fixtures::{digest, payload};
use gpucache_service::units::{
    KIB, MIB, SizeList, human_bytes, narrow, parse_size, size_label, size_list, wide,
};

pub const TENANT: &str = "bench-tenant";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    Uring,
    Psync,
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DurabilityArg {
    /// Acknowledge after the rename, no flush (fio: no fsync).
    None,
    /// fsync the block and its directory per PUT (fio: --fsync=1).
    PerBlock,
    /// One shared syncfs per group of commits (fio: --fsync=1, the same with one writer).
    Group,
}

#[derive(Debug, Args)]
pub struct FileBenchArgs {
    /// Where to put the stores and fio's files; a fresh subdirectory is made there and removed
    /// afterwards. Default: the system temporary directory.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Which FileStore engine(s) to measure; fio uses the matching ioengine.
    #[arg(long, value_enum, default_value = "both")]
    engine: EngineArg,
    /// Block sizes, comma-separated (K, M, G are binary).
    #[arg(long, default_value = "64K,256K,1M,4M", value_parser = size_list)]
    sizes: SizeList,
    /// Working set per size and engine, in MiB: the bytes one PUT pass writes (as that many
    /// block files) and fio's file size.
    #[arg(long, default_value_t = 1024)]
    file_mib: u64,
    /// The store's io_uring queue depth and fio's --iodepth.
    #[arg(long, default_value_t = 32)]
    queue_depth: u32,
    /// O_DIRECT for the store (direct_io) and fio (--direct=1).
    #[arg(long)]
    direct: bool,
    /// Deadline per phase, in seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Require fio (fail when it is not on PATH). Without either flag fio runs when found.
    #[arg(long, conflicts_with = "no_fio")]
    fio: bool,
    /// Do not run fio.
    #[arg(long)]
    no_fio: bool,
    /// Rounds per size and engine; the table shows medians. Odd rounds run fio first.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// The store's durability policy.
    #[arg(long, value_enum, default_value = "none")]
    durability: DurabilityArg,
    /// Write 3 to /proc/sys/vm/drop_caches (after a sync) before every read phase and before
    /// the first reopen of --open-blocks. Needs root.
    #[arg(long)]
    drop_caches: bool,
    /// Also create this many committed small blocks in a fresh store, close it and time
    /// reopening it.
    #[arg(long)]
    open_blocks: Option<u64>,
    /// Only run the --open-blocks measurement (no PUT/GET/fio phases).
    #[arg(long, requires = "open_blocks")]
    open_only: bool,
    /// Payload size of the --open-blocks blocks.
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    open_block_size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Uring,
    Psync,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Uring => "uring",
            Engine::Psync => "psync",
        }
    }
    fn choice(self) -> EngineChoice {
        match self {
            Engine::Uring => EngineChoice::Uring,
            Engine::Psync => EngineChoice::Psync,
        }
    }
    fn fio_ioengine(self) -> &'static str {
        match self {
            Engine::Uring => "io_uring",
            Engine::Psync => "psync",
        }
    }
}

/// One timed phase of the store.
#[derive(Debug, Clone, Copy)]
struct Phase {
    ops: u64,
    bytes: u64,
    elapsed: Duration,
    /// Whether the phase covered the whole working set before its deadline.
    complete: bool,
}

impl Phase {
    fn gbps(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        // Display only: the rounding of a u64 to f64 does not matter here.
        if secs > 0.0 { self.bytes as f64 / secs / 1e9 } else { 0.0 }
    }
}

#[derive(Debug)]
enum FioRun {
    /// fio not run (disabled or missing).
    Off,
    Ran {
        write: Result<fio::Outcome, String>,
        read: Result<fio::Outcome, String>,
    },
}

/// One round of one (size, engine) pair: the store's PUT and GET, and fio's write and read.
#[derive(Debug)]
struct Round {
    store: Result<(Phase, Phase), String>,
    fio: FioRun,
}

#[derive(Debug)]
struct Row {
    size: u64,
    engine: Engine,
    rounds: Vec<Round>,
}

/// Everything fixed for one run of the benchmark.
struct Ctx<'a> {
    args: &'a FileBenchArgs,
    root: PathBuf,
    durability: Durability,
    deadline: Duration,
    file_bytes: u64,
    use_fio: bool,
    caller: Caller,
}

/// Exit status: 0 when every phase ran, 1 when a store phase, a fio job or the reopen failed
/// (the report still names it), 2 on a usage or setup error.
pub fn run(args: &FileBenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache bench file: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs the benchmark and prints its report; `Ok(false)` when some phase failed.
fn run_inner(args: &FileBenchArgs) -> Result<bool, String> {
    if !(args.seconds.is_finite() && args.seconds > 0.0 && args.seconds <= 3600.0) {
        return Err(format!("--seconds {} must be in (0, 3600]", args.seconds));
    }
    if args.file_mib == 0 {
        return Err("--file-mib must be at least 1".to_owned());
    }
    if !(1..=20).contains(&args.repeat) {
        return Err(format!("--repeat {} must be in 1..=20", args.repeat));
    }
    if args.queue_depth == 0 {
        return Err("--queue-depth must be at least 1".to_owned());
    }
    let file_bytes =
        args.file_mib.checked_mul(MIB).ok_or_else(|| "--file-mib is too large".to_owned())?;
    let fio_version = if args.no_fio { None } else { fio::version() };
    if args.fio && fio_version.is_none() {
        return Err("--fio given but fio is not on PATH (apt-get install -y fio)".to_owned());
    }
    if args.drop_caches {
        drop_caches().map_err(|e| format!("--drop-caches: {e}"))?;
    }
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
    let scratch = tempfile::Builder::new()
        .prefix("gpucache-bench-file-")
        .tempdir_in(&base)
        .map_err(|e| format!("cannot make a directory in {}: {e}", base.display()))?;
    let tenant = TenantId::parse(TENANT).map_err(|e| format!("bench tenant: {e}"))?;
    let ctx = Ctx {
        args,
        root: scratch.path().to_owned(),
        durability: match args.durability {
            DurabilityArg::None => Durability::None,
            DurabilityArg::PerBlock => Durability::PerBlock,
            DurabilityArg::Group => Durability::GroupCommit,
        },
        deadline: Duration::from_secs_f64(args.seconds),
        file_bytes,
        use_fio: fio_version.is_some(),
        caller: Caller::new(tenant, Rights::READ_WRITE),
    };
    let engines: &[Engine] = match args.engine {
        EngineArg::Uring => &[Engine::Uring],
        EngineArg::Psync => &[Engine::Psync],
        EngineArg::Both => &[Engine::Uring, Engine::Psync],
    };

    let header = describe_setup(&ctx, fio_version.as_deref());
    eprintln!("bench: working in {}", ctx.root.display());
    let mut rows = Vec::new();
    let sizes: &[u64] = if args.open_only { &[] } else { &args.sizes.0 };
    for &size in sizes {
        for &engine in engines {
            rows.push(measure(&ctx, engine, size));
        }
    }
    let open = args.open_blocks.map(|n| open_bench(&ctx, engines[0], n));

    let fio_failed = |f: &FioRun| match f {
        FioRun::Off => false,
        FioRun::Ran { write, read } => write.is_err() || read.is_err(),
    };
    let all_ran =
        rows.iter().flat_map(|r| &r.rounds).all(|r| r.store.is_ok() && !fio_failed(&r.fio))
            && open.as_ref().is_none_or(Result::is_ok);
    let mut out = header;
    out.push_str("\n\n");
    if !rows.is_empty() {
        out.push_str(&table(&rows));
        out.push('\n');
        out.push_str(&details(&rows));
    }
    if let Some(open) = open {
        out.push('\n');
        match open {
            Ok(text) => out.push_str(&text),
            Err(e) => {
                let _ = writeln!(out, "open: failed: {e}");
            }
        }
    }
    #[allow(clippy::print_stdout)]
    {
        println!("{}", out.trim_end());
    }
    eprintln!("bench: removing {}", ctx.root.display());
    drop(scratch);
    Ok(all_ran)
}

/// The run's parameters and the machine facts that bear on reading its numbers.
fn describe_setup(ctx: &Ctx<'_>, fio_version: Option<&str>) -> String {
    let a = ctx.args;
    let mut s = String::new();
    let fs_type = filesystem_of(&ctx.root).unwrap_or_else(|| "unknown".to_owned());
    let _ = writeln!(s, "# gpucache bench file");
    let _ = writeln!(s, "dir: {} ({fs_type})", ctx.root.display());
    let _ = writeln!(
        s,
        "working set: {} MiB per size and engine; queue depth {}; {}; durability {:?}; \
         deadline {} s per phase; {} round(s), table = medians, ratios = median of per-round \
         ratios",
        a.file_mib,
        a.queue_depth,
        if a.direct { "O_DIRECT" } else { "buffered I/O" },
        a.durability,
        a.seconds,
        a.repeat
    );
    let ram = mem_total_bytes();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let _ = writeln!(
        s,
        "machine: {cpus} CPUs, RAM {}, kernel {}",
        ram.map_or_else(|| "unknown".to_owned(), human_bytes),
        kernel.trim()
    );
    let _ = writeln!(
        s,
        "fio: {}",
        match (fio_version, a.no_fio) {
            (Some(v), _) => v.to_owned(),
            (None, true) => "disabled (--no-fio)".to_owned(),
            (None, false) => "not found on PATH; fio columns are empty".to_owned(),
        }
    );
    let cache_note = if a.direct {
        "page cache: bypassed (O_DIRECT) by both the store and fio".to_owned()
    } else if a.drop_caches {
        "page cache: dropped (sync + drop_caches) before every read phase, for the store and fio"
            .to_owned()
    } else {
        let fits = ram.is_some_and(|r| ctx.file_bytes.saturating_mul(2) < r);
        format!(
            "page cache: kept; the {} MiB working set {} RAM, so GETs and fio reads are mostly \
             served from memory (use --drop-caches or --direct for device reads)",
            a.file_mib,
            if fits { "fits in" } else { "may not fit in" }
        )
    };
    let _ = writeln!(s, "{cache_note}");
    let _ = write!(
        s,
        "store: one file per block (header + payload, 4 KiB padded), Store::put of fresh keys, \
         get_into of committed keys into one reused buffer, one caller thread, files kept \
         until the run ends; fio: one job, one file, --invalidate=0 --fallocate=none{}",
        if ctx.durability == Durability::None { "" } else { ", --fsync=1 on writes" }
    );
    s
}

/// Runs the store phases and fio for one engine and block size.
/// Runs `--repeat` rounds of the store phases and fio for one engine and block size. Odd
/// rounds run fio first, so that neither side always inherits the other's page-cache and
/// writeback state.
fn measure(ctx: &Ctx<'_>, engine: Engine, size: u64) -> Row {
    let label = size_label(size);
    let rounds = (0..ctx.args.repeat)
        .map(|round| {
            let store_dir =
                ctx.root.join(format!("store-{}-{label}-r{}", engine.name(), round + 1));
            // The store's files stay until the whole run ends: on ext4 without a journal,
            // inode allocation skips (and scans past) every inode freed in the last 60-300 s,
            // so deleting one round's files would slow the next round's creates.
            let store = || {
                eprintln!("bench: {label} {} round {}: store", engine.name(), round + 1);
                store_phases(ctx, engine, size, &store_dir)
            };
            let fio = || {
                if ctx.use_fio {
                    eprintln!("bench: {label} {} round {}: fio", engine.name(), round + 1);
                    fio_phases(ctx, engine, size)
                } else {
                    FioRun::Off
                }
            };
            if round % 2 == 0 {
                let store = store();
                Round { store, fio: fio() }
            } else {
                let fio = fio();
                Round { store: store(), fio }
            }
        })
        .collect();
    Row { size, engine, rounds }
}

/// Limits that let `blocks` blocks of `size` bytes all be retained (the bench DPU store too).
pub fn limits_for(size: u64, blocks: u64) -> ResourceLimits {
    let d = ResourceLimits::default();
    let retained = size.saturating_mul(blocks.saturating_add(1)).max(d.retained_bytes_max);
    ResourceLimits {
        object_bytes_max: d.object_bytes_max.max(size),
        tenant_inflight_bytes_max: d.tenant_inflight_bytes_max.max(size),
        retained_bytes_max: retained,
        tenant_retained_bytes_max: retained,
        registrations_max: d
            .registrations_max
            .max(u32::try_from(blocks.saturating_add(1024)).unwrap_or(u32::MAX)),
        ..d
    }
}

fn open_store(
    ctx: &Ctx<'_>,
    engine: Engine,
    dir: &Path,
    size: u64,
    blocks: u64,
) -> Result<FileStore, String> {
    let mut config = FileStoreConfig::new(dir);
    config.engine = engine.choice();
    config.engine_config.queue_depth = ctx.args.queue_depth;
    config.direct_io = ctx.args.direct;
    config.durability = ctx.durability;
    config.limits = limits_for(size, blocks);
    config.open(Arc::new(MonotonicClock::default())).map_err(|e| format!("open store: {e}"))
}

fn put_one(
    store: &FileStore,
    caller: &Caller,
    key: &PhysicalKey,
    src: &[u8],
) -> Result<(), String> {
    match store.put(caller, key, src, None) {
        Ok(Put::Committed(_)) => Ok(()),
        Ok(other) => Err(format!("put not committed: {other:?}")),
        Err(e) => Err(format!("put: {e}")),
    }
}

fn store_phases(
    ctx: &Ctx<'_>,
    engine: Engine,
    size: u64,
    dir: &Path,
) -> Result<(Phase, Phase), String> {
    let blocks = (ctx.file_bytes / size).max(1);
    let store = open_store(ctx, engine, dir, size, blocks)?;
    let src = payload(narrow(size));
    let keys: Vec<PhysicalKey> = (0..blocks).map(|i| bench_key((size << 24) | i)).collect();
    let caller = &ctx.caller;

    settle();
    let started = Instant::now();
    let until = started + ctx.deadline;
    let mut written = 0;
    for key in &keys {
        if written > 0 && Instant::now() >= until {
            break;
        }
        put_one(&store, caller, key, &src)?;
        written += 1;
    }
    let put = Phase {
        ops: wide(written),
        bytes: wide(written) * size,
        elapsed: started.elapsed(),
        complete: written == keys.len(),
    };
    // GET reads the whole working set: write what the deadline left out, untimed.
    for key in &keys[written..] {
        put_one(&store, caller, key, &src)?;
    }

    if ctx.args.drop_caches {
        drop_caches()?;
    }
    let mut dst = vec![0u8; narrow(size)];
    let started = Instant::now();
    let until = started + ctx.deadline;
    let mut read = 0;
    for key in &keys {
        if read > 0 && Instant::now() >= until {
            break;
        }
        match store.get_into(caller, key, &mut dst) {
            Ok(Get::Hit { len, .. }) if len == size => {}
            Ok(other) => return Err(format!("get_into did not hit: {other:?}")),
            Err(e) => return Err(format!("get_into: {e}")),
        }
        read += 1;
    }
    let get = Phase {
        ops: wide(read),
        bytes: wide(read) * size,
        elapsed: started.elapsed(),
        complete: read == keys.len(),
    };
    if dst != src {
        return Err("get_into delivered other bytes than were put".to_owned());
    }
    drop(store);
    Ok((put, get))
}

fn fio_phases(ctx: &Ctx<'_>, engine: Engine, size: u64) -> FioRun {
    let file = ctx.root.join(format!("fio-{}-{}.dat", engine.name(), size_label(size)));
    // Same total as the store: whole blocks only.
    let total = (ctx.file_bytes / size).max(1) * size;
    let job = |direction| fio::Job {
        file: &file,
        direction,
        ioengine: engine.fio_ioengine(),
        block_bytes: size,
        total_bytes: total,
        queue_depth: ctx.args.queue_depth,
        direct: ctx.args.direct,
        fsync_each: ctx.durability != Durability::None,
        runtime: ctx.deadline,
    };
    settle();
    let write = job(fio::Direction::Write).run();
    let read = match ctx.args.drop_caches.then(drop_caches).transpose() {
        Ok(_) => job(fio::Direction::Read).run(),
        Err(e) => Err(e),
    };
    let _ = fs::remove_file(&file);
    FioRun::Ran { write, read }
}

/// Creates `n` committed small blocks, closes the store and times reopening it (twice: the
/// second open finds every inode and directory cached).
fn open_bench(ctx: &Ctx<'_>, engine: Engine, n: u64) -> Result<String, String> {
    let size = ctx.args.open_block_size;
    let dir = ctx.root.join("open");
    eprintln!("bench: open: creating {n} blocks of {}", size_label(size));
    let src = payload(narrow(size));
    let store = open_store(ctx, engine, &dir, size, n)?;
    let started = Instant::now();
    for i in 0..n {
        put_one(&store, &ctx.caller, &bench_key((1 << 62) | i), &src)?;
    }
    let create = started.elapsed();
    drop(store);
    settle();
    if ctx.args.drop_caches {
        drop_caches()?;
    }
    eprintln!("bench: open: reopening");
    let timed_open = || -> Result<(Duration, OpenReport), String> {
        let started = Instant::now();
        let store = open_store(ctx, engine, &dir, size, n)?;
        let elapsed = started.elapsed();
        let report = store.open_report().clone();
        drop(store);
        Ok((elapsed, report))
    };
    let (first, report) = timed_open()?;
    let (second, second_report) = timed_open()?;
    if report.loaded != n || second_report.loaded != n {
        return Err(format!(
            "reopen loaded {} and then {} blocks of {n}",
            report.loaded, second_report.loaded
        ));
    }
    let rate = |d: Duration| {
        let s = d.as_secs_f64();
        // Display only.
        if s > 0.0 { n as f64 / s } else { 0.0 }
    };
    let mut s = String::new();
    let _ = writeln!(s, "## open of {n} blocks of {}", size_label(size));
    let _ = writeln!(
        s,
        "created: {n} puts in {:.2} s ({:.0} puts/s, durability {:?}, engine {})",
        create.as_secs_f64(),
        rate(create),
        ctx.args.durability,
        engine.name()
    );
    let first_label = if ctx.args.drop_caches { "after drop_caches" } else { "caches warm" };
    let _ = writeln!(
        s,
        "first open ({first_label}): {:.0} ms, {:.0} blocks/s; report: loaded {} ({}), \
         skipped {}, tmp removed {}, elapsed_ms {}, epoch {}",
        first.as_secs_f64() * 1e3,
        rate(first),
        report.loaded,
        human_bytes(report.loaded_bytes),
        report.skipped.values().sum::<u64>(),
        report.tmp_removed,
        report.elapsed_ms,
        report.epoch
    );
    let _ = writeln!(
        s,
        "second open (caches warm): {:.0} ms, {:.0} blocks/s; report elapsed_ms {}",
        second.as_secs_f64() * 1e3,
        rate(second),
        second_report.elapsed_ms
    );
    Ok(s)
}

fn fmt_gbps(v: f64) -> String {
    if v >= 10.0 { format!("{v:.1}") } else { format!("{v:.2}") }
}

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// Per-round GB/s of one row: (put, get, fio write, fio read), each `None` where that phase
/// failed or did not run.
type RoundRates = (Option<f64>, Option<f64>, Option<f64>, Option<f64>);

fn round_rates(round: &Round) -> RoundRates {
    let (put, get) = match &round.store {
        Ok((p, g)) => (Some(p.gbps()), Some(g.gbps())),
        Err(_) => (None, None),
    };
    let (fw, fr) = match &round.fio {
        FioRun::Off => (None, None),
        FioRun::Ran { write, read } => (
            write.as_ref().ok().map(|o| o.bw_bytes / 1e9),
            read.as_ref().ok().map(|o| o.bw_bytes / 1e9),
        ),
    };
    (put, get, fw, fr)
}

/// The comparison table (markdown): medians over the rounds; each ratio is the median of the
/// per-round ratios (a store phase against the fio job of the same round).
fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| size | engine | put GB/s | get GB/s | fio write GB/s | fio read GB/s | put/fio | get/fio |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    let cell = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), fmt_gbps);
    let ratio = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}"));
    for r in rows {
        let rates: Vec<RoundRates> = r.rounds.iter().map(round_rates).collect();
        let column =
            |pick: fn(&RoundRates) -> Option<f64>| median(rates.iter().filter_map(pick).collect());
        let ratios = |pick: fn(&RoundRates) -> (Option<f64>, Option<f64>)| {
            median(
                rates
                    .iter()
                    .filter_map(|x| match pick(x) {
                        (Some(n), Some(d)) if d > 0.0 => Some(n / d),
                        _ => None,
                    })
                    .collect(),
            )
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            size_label(r.size),
            r.engine.name(),
            cell(column(|x| x.0)),
            cell(column(|x| x.1)),
            cell(column(|x| x.2)),
            cell(column(|x| x.3)),
            ratio(ratios(|x| (x.0, x.2))),
            ratio(ratios(|x| (x.1, x.3)))
        );
    }
    s
}

/// What each phase of each round moved and how long it took, and every error.
fn details(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "details (per round):");
    let phase = |p: &Phase| {
        format!(
            "{} blocks, {} in {:.3} s = {} GB/s{}",
            p.ops,
            human_bytes(p.bytes),
            p.elapsed.as_secs_f64(),
            fmt_gbps(p.gbps()),
            if p.complete { "" } else { " (deadline)" }
        )
    };
    let fio_side = |o: &Result<fio::Outcome, String>| match o {
        Ok(o) => format!(
            "{} in {:.3} s = {} GB/s",
            human_bytes(o.io_bytes),
            o.runtime_ms as f64 / 1e3,
            fmt_gbps(o.bw_bytes / 1e9)
        ),
        Err(e) => format!("error: {e}"),
    };
    for r in rows {
        for (i, round) in r.rounds.iter().enumerate() {
            let head = format!("  {} {} r{}", size_label(r.size), r.engine.name(), i + 1);
            match &round.store {
                Ok((p, g)) => {
                    let _ = writeln!(s, "{head}: put {}; get {}", phase(p), phase(g));
                }
                Err(e) => {
                    let _ = writeln!(s, "{head}: store error: {e}");
                }
            }
            if let FioRun::Ran { write, read } = &round.fio {
                let _ = writeln!(
                    s,
                    "{head}: fio write {}; fio read {}",
                    fio_side(write),
                    fio_side(read)
                );
            }
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Keys, payloads and the machine

/// A realistic key whose one-link chain comes from `seed` (distinct seeds, distinct keys).
pub fn bench_key(seed: u64) -> PhysicalKey {
    let id = CacheIdentity::builder()
        .tenant(TENANT)
        .trust_domain("bench")
        .model_revision("meta-llama/Llama-3.1-8B-Instruct@0e9e39f2")
        .model_config(digest(u64::MAX))
        .tokenizer_revision("meta-llama/Llama-3.1-8B-Instruct@0e9e39f2:tokenizer")
        .kv_dtype(KvDtype::Bf16)
        .quant(QuantFormat::None)
        .layout("paged-nhd", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::Rope)
        .rope(RopeParams::new(500_000.0, RopeScaling::Llama3, 8.0, 8192).ok())
        .chain(vec![digest(seed)])
        .block_tokens(16)
        .valid_tokens(16)
        .build();
    match id {
        Ok(id) => PhysicalKey::new(id),
        Err(e) => panic!("the bench identity is invalid: {e}"),
    }
}

/// Flushes every dirty page to disk, so that the next phase starts without a writeback debt.
fn settle() {
    // SAFETY: sync(2) takes no arguments, touches no memory of ours and cannot fail.
    unsafe { libc::sync() };
}

/// `sync`, then asks the kernel to drop the page cache, dentries and inodes.
fn drop_caches() -> Result<(), String> {
    settle();
    fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("cannot write /proc/sys/vm/drop_caches (root needed): {e}"))
}

/// MemTotal from /proc/meminfo, in bytes.
fn mem_total_bytes() -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(KIB)
}

/// The type of the file system holding `path` (longest mount point that prefixes it).
fn filesystem_of(path: &Path) -> Option<String> {
    let path = fs::canonicalize(path).ok()?;
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, mount, fstype) = (f.next()?, f.next()?, f.next()?);
            // /proc/self/mounts escapes spaces as \040; bench paths rarely have them.
            let mount = mount.replace("\\040", " ");
            path.starts_with(&mount).then(|| (mount.len(), fstype.to_owned()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, fstype)| fstype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_admit_the_working_set() {
        let l = limits_for(4 * MIB, 2048);
        assert!(l.validate().is_ok());
        assert!(l.retained_bytes_max >= 4 * MIB * 2048);
        assert!(limits_for(128 * MIB, 4).validate().is_ok());
        assert!(limits_for(4 * KIB, 2_000_000).registrations_max >= 2_000_000);
    }

    #[test]
    fn table_prints_medians_ratios_and_dashes() {
        let phase =
            |bytes| Phase { ops: 1, bytes, elapsed: Duration::from_secs(1), complete: true };
        let outcome = |bw| fio::Outcome {
            bw_bytes: bw,
            io_bytes: 0,
            runtime_ms: 1000,
            lat_p50_ns: None,
            lat_p99_ns: None,
        };
        let round = |put: u64, fio_write: f64| Round {
            store: Ok((phase(put), phase(3_000_000_000))),
            fio: FioRun::Ran { write: Ok(outcome(fio_write)), read: Ok(outcome(4e9)) },
        };
        let rows = vec![
            Row {
                size: MIB,
                engine: Engine::Uring,
                rounds: vec![
                    round(1_000_000_000, 2e9),
                    round(4_000_000_000, 1e9),
                    round(2_000_000_000, 8e9),
                ],
            },
            Row {
                size: 64 * KIB,
                engine: Engine::Psync,
                rounds: vec![
                    Round { store: Ok((phase(500_000_000), phase(500_000_000))), fio: FioRun::Off },
                    Round { store: Err("boom".into()), fio: FioRun::Off },
                ],
            },
        ];
        let t = table(&rows);
        // put median 2.00, fio write median 2.00, ratios 0.5, 4 and 0.25: median 0.50.
        assert!(t.contains("| 1M | uring | 2.00 | 3.00 | 2.00 | 4.00 | 0.50 | 0.75 |"), "{t}");
        assert!(t.contains("| 64K | psync | 0.50 | 0.50 | - | - | - | - |"), "{t}");
        let d = details(&rows);
        assert!(d.contains("64K psync r2: store error: boom"), "{d}");
        assert_eq!(median(vec![3.0, 1.0]), Some(2.0));
        assert_eq!(median(Vec::new()), None);
    }

    #[test]
    fn bench_keys_are_distinct() {
        assert_ne!(bench_key(1).digest(), bench_key(2).digest());
    }
}
