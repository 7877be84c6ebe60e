//! `gpucache-bench file`: FileStore PUT and GET per engine and block size, with fio run in the
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
//!
//! `--rows` chooses what runs: `sizes` (the phases above), `batch` and `tcp`. A batch row
//! (`--batch COUNTxSIZE`) puts COUNT blocks into an O_DIRECT FileStore, then reads them
//! `--batch-passes` times each way, alternating which goes first: as one `Store::get_batch`
//! and one by one with `get_into` (with `--drop-caches`, the cache is dropped before every
//! pass); fio then reads the store's own block files with `--rw=randread` at the same queue
//! depth, one block per file, as many loops. A tcp row reads the same blocks through
//! `TcpStore` (one connection) from an in-process server on that store, the same two ways.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::{
    CacheIdentity, CacheIdentityBuilder, KvDtype, PositionEncoding, QuantFormat, RopeParams,
    RopeScaling, Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{BatchGet, Get, Put, Store};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::file::engine::psync::PsyncEngine;
use gpucache_storage::file::engine::uring::UringEngine;
use gpucache_storage::file::engine::{AlignedBuf, EngineChoice, EngineConfig, IoEngine};
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig, LOG_DIR, Layout, OpenReport};

use crate::fio;
use crate::fixtures::{digest, payload};
use crate::stats::{self, median};
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

/// What `--rows` can choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RowArg {
    /// Store PUT and GET per `--sizes`, beside fio's sequential jobs.
    Sizes,
    /// Each `--batch` read as one get_batch, one by one, and by fio's random reads.
    Batch,
    /// Each `--batch` through TcpStore from an in-process server on the same store.
    Tcp,
}

/// One batch of the batch and tcp rows: `count` blocks of `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSpec {
    pub count: u64,
    pub size: u64,
}

impl BatchSpec {
    fn label(self) -> String {
        format!("{}x{}", self.count, size_label(self.size))
    }
}

/// The `--batch` list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchList(pub Vec<BatchSpec>);

/// Most blocks one batch row reads.
const BATCH_BLOCKS_MAX: u64 = 1 << 16;
/// Most bytes one batch row reads (it keeps a destination for every block).
const BATCH_BYTES_MAX: u64 = 4 << 30;
/// Most timed passes per side of a batch row.
const BATCH_PASSES_MAX: u32 = 1000;

/// `COUNTxSIZE[,COUNTxSIZE...]`, e.g. `128x64K,32x1M`, as a clap `value_parser`.
pub fn batch_list(text: &str) -> Result<BatchList, String> {
    let specs = text
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let s = s.trim();
            let (count, size) = s
                .split_once(['x', 'X'])
                .ok_or_else(|| format!("{s:?} is not COUNTxSIZE (e.g. 128x64K)"))?;
            let count: u64 =
                count.trim().parse().map_err(|_| format!("{s:?}: {count:?} is not a count"))?;
            let size = parse_size(size)?;
            if count == 0 || size == 0 {
                return Err(format!("{s:?}: a batch needs at least one block of one byte"));
            }
            if count > BATCH_BLOCKS_MAX || count.saturating_mul(size) > BATCH_BYTES_MAX {
                return Err(format!(
                    "{s:?}: at most {BATCH_BLOCKS_MAX} blocks and {} per batch",
                    human_bytes(BATCH_BYTES_MAX)
                ));
            }
            Ok(BatchSpec { count, size })
        })
        .collect::<Result<Vec<_>, String>>()?;
    if specs.is_empty() {
        return Err(format!("{text:?} names no batch"));
    }
    Ok(BatchList(specs))
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

impl DurabilityArg {
    /// The name `--durability` takes for it.
    fn name(self) -> String {
        self.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default()
    }
}

impl From<DurabilityArg> for Durability {
    fn from(arg: DurabilityArg) -> Self {
        match arg {
            DurabilityArg::None => Durability::None,
            DurabilityArg::PerBlock => Durability::PerBlock,
            DurabilityArg::Group => Durability::GroupCommit,
        }
    }
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
    /// Keep small blocks in the block log (`layout = "log"`) instead of a file each.
    #[arg(long, conflicts_with = "direct")]
    log: bool,
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
    /// Internal: open the store of an --open-blocks run kept in this directory, close it, and
    /// print what the open took on one line. The timed reopens run this in a fresh process, as
    /// a server's start does, so that what the bench freed before does not weigh on the
    /// allocator the open uses.
    #[arg(long, hide = true, requires = "open_blocks")]
    open_existing: Option<PathBuf>,
    /// Which rows to run, comma-separated: sizes (PUT and GET per --sizes beside fio's
    /// sequential jobs), batch (each --batch as one get_batch, one by one, and by fio's random
    /// reads of the same files), tcp (each --batch through TcpStore from an in-process server
    /// on the same store).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sizes,batch,tcp")]
    rows: Vec<RowArg>,
    /// The batches of the batch and tcp rows, COUNTxSIZE, comma-separated; read with O_DIRECT.
    #[arg(long, default_value = "128x64K,32x1M", value_parser = batch_list)]
    batch: BatchList,
    /// Timed passes per side of each batch and tcp row (fio runs as many loops).
    #[arg(long, default_value_t = 10)]
    batch_passes: u32,
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
        stats::gbps(self.bytes, self.elapsed.as_secs_f64())
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
    deadline: Duration,
    file_bytes: u64,
    use_fio: bool,
    caller: Caller,
}

impl Ctx<'_> {
    /// The stores' durability policy, as `--durability` names it.
    fn durability(&self) -> Durability {
        self.args.durability.into()
    }
}

/// Exit status: 0 when every phase ran, 1 when a store phase, a fio job or the reopen failed
/// (the report still names it), 2 on a usage or setup error.
pub fn run(args: &FileBenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache-bench file: {e}");
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
    if !(1..=BATCH_PASSES_MAX).contains(&args.batch_passes) {
        return Err(format!(
            "--batch-passes {} must be in 1..={BATCH_PASSES_MAX}",
            args.batch_passes
        ));
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
    if let Some(dir) = &args.open_existing {
        return open_existing(args, dir).map(|line| {
            // The report of this run: the line the parent process reads.
            #[allow(clippy::print_stdout)]
            {
                println!("{line}");
            }
            true
        });
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

    let wants = |row: RowArg| !args.open_only && args.rows.contains(&row);
    let mut header = describe_setup(&ctx, fio_version.as_deref());
    if wants(RowArg::Batch) || wants(RowArg::Tcp) {
        header.push('\n');
        header.push_str(&describe_batches(&ctx, wants(RowArg::Batch), wants(RowArg::Tcp)));
    }
    eprintln!("bench: working in {}", ctx.root.display());
    let mut rows = Vec::new();
    let sizes: &[u64] = if wants(RowArg::Sizes) { &args.sizes.0 } else { &[] };
    for &size in sizes {
        for &engine in engines {
            rows.push(measure(&ctx, engine, size));
        }
    }
    let mut batch_rows = Vec::new();
    if wants(RowArg::Batch) || wants(RowArg::Tcp) {
        for &spec in &args.batch.0 {
            for &engine in engines {
                batch_rows.push(measure_batch(
                    &ctx,
                    engine,
                    spec,
                    wants(RowArg::Batch),
                    wants(RowArg::Tcp),
                ));
            }
        }
    }
    let open = args.open_blocks.map(|n| open_bench(&ctx, engines[0], n));

    let fio_failed = |f: &FioRun| match f {
        FioRun::Off => false,
        FioRun::Ran { write, read } => write.is_err() || read.is_err(),
    };
    let all_ran =
        rows.iter().flat_map(|r| &r.rounds).all(|r| r.store.is_ok() && !fio_failed(&r.fio))
            && batch_rows.iter().all(BatchRow::ran)
            && open.as_ref().is_none_or(Result::is_ok);
    let mut out = header;
    out.push_str("\n\n");
    if !rows.is_empty() {
        out.push_str(&table(&rows));
        out.push('\n');
        out.push_str(&details(&rows));
    }
    if !batch_rows.is_empty() {
        if !rows.is_empty() {
            out.push('\n');
        }
        if wants(RowArg::Batch) {
            out.push_str(&batch_table(&batch_rows));
            out.push('\n');
        }
        if wants(RowArg::Tcp) {
            out.push_str(&tcp_table(&batch_rows));
            out.push('\n');
        }
        out.push_str(&batch_details(&batch_rows));
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
    let _ = writeln!(s, "# gpucache-bench file");
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
        if ctx.durability() == Durability::None { "" } else { ", --fsync=1 on writes" }
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
    args: &FileBenchArgs,
    engine: Engine,
    dir: &Path,
    size: u64,
    blocks: u64,
) -> Result<FileStore, String> {
    let mut config = FileStoreConfig::new(dir);
    config.engine = engine.choice();
    config.engine_config.queue_depth = args.queue_depth;
    config.direct_io = args.direct;
    config.durability = args.durability.into();
    if args.log {
        config.layout = Layout::Log;
    }
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
    let store = open_store(ctx.args, engine, dir, size, blocks)?;
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
        fsync_each: ctx.durability() != Durability::None,
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
    let store = open_store(ctx.args, engine, &dir, size, n)?;
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
    eprintln!("bench: open: reopening, each time in a fresh process");
    let timed_open = || reopen_in_child(ctx, engine, &dir, n);
    let report = timed_open()?;
    let second_report = timed_open()?;
    let (first, second) = (report.elapsed, second_report.elapsed);
    if report.loaded != n || second_report.loaded != n {
        return Err(format!(
            "reopen loaded {} and then {} blocks of {n}",
            report.loaded, second_report.loaded
        ));
    }
    // The block log's index is a clean close's: an open after a crash reads every record.
    let unindexed = if ctx.args.log {
        let index = dir.join(LOG_DIR).join("INDEX");
        fs::remove_file(&index).map_err(|e| format!("remove {}: {e}", index.display()))?;
        let report = timed_open()?;
        if report.loaded != n || report.indexed {
            return Err(format!("an open without the index loaded {}: {report:?}", report.loaded));
        }
        Some(report.elapsed)
    } else {
        None
    };
    let rate = |d: Duration| stats::per_second(n, d.as_secs_f64());
    let mut s = String::new();
    let _ = writeln!(s, "## open of {n} blocks of {}", size_label(size));
    let _ = writeln!(
        s,
        "created: {n} puts in {:.2} s ({:.0} puts/s, durability {:?}, layout {}, engine {})",
        create.as_secs_f64(),
        rate(create),
        ctx.args.durability,
        if ctx.args.log { "log" } else { "files" },
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
        report.skipped,
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
    if let Some(d) = unindexed {
        let _ = writeln!(
            s,
            "open without the log's index (as after a crash; caches warm): {:.0} ms, {:.0} blocks/s",
            d.as_secs_f64() * 1e3,
            rate(d)
        );
    }
    if ctx.args.log {
        let _ = writeln!(
            s,
            "first and second open used the log's index: {}",
            report.indexed && second_report.indexed
        );
    }
    Ok(s)
}

/// What a timed reopen saw: the open's own time and what its report said. The child prints it
/// as one JSON line; the parent reads it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Reopened {
    elapsed: Duration,
    loaded: u64,
    loaded_bytes: u64,
    skipped: u64,
    tmp_removed: u64,
    elapsed_ms: u64,
    epoch: u64,
    indexed: bool,
}

impl Reopened {
    /// The last line of a child's standard output, which is its report.
    fn parse(stdout: &str) -> Result<Self, String> {
        let line = stdout.lines().next_back().unwrap_or_default();
        serde_json::from_str(line).map_err(|e| format!("a reopen's report {line:?}: {e}"))
    }
}

/// `--open-existing`: opens the store in `dir` as the --open-blocks run made it, times the open,
/// closes the store (which writes the log's index) and returns the line the parent reads.
fn open_existing(args: &FileBenchArgs, dir: &Path) -> Result<String, String> {
    let engine = match args.engine {
        EngineArg::Psync => Engine::Psync,
        EngineArg::Uring | EngineArg::Both => Engine::Uring,
    };
    let blocks = args.open_blocks.unwrap_or(1);
    let started = Instant::now();
    let store = open_store(args, engine, dir, args.open_block_size, blocks)?;
    let elapsed = started.elapsed();
    let report: OpenReport = store.open_report().clone();
    drop(store);
    let reopened = Reopened {
        elapsed,
        loaded: report.loaded,
        loaded_bytes: report.loaded_bytes,
        skipped: report.skipped.values().sum(),
        tmp_removed: report.tmp_removed,
        elapsed_ms: report.elapsed_ms,
        epoch: report.epoch,
        indexed: report.log.indexed,
    };
    serde_json::to_string(&reopened).map_err(|e| format!("the reopen's report: {e}"))
}

/// Opens the store in `dir` in a child process of this executable (`file --open-existing`), as
/// a server's start opens it: nothing this process allocated and freed weighs on that open.
fn reopen_in_child(
    ctx: &Ctx<'_>,
    engine: Engine,
    dir: &Path,
    blocks: u64,
) -> Result<Reopened, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let mut child = std::process::Command::new(&exe);
    child
        .arg("file")
        .arg("--open-existing")
        .arg(dir)
        .args(["--open-blocks", &blocks.to_string()])
        .args(["--open-block-size", &ctx.args.open_block_size.to_string()])
        .args(["--engine", engine.name(), "--queue-depth", &ctx.args.queue_depth.to_string()])
        .args(["--durability", &ctx.args.durability.name()]);
    if ctx.args.log {
        child.arg("--log");
    }
    if ctx.args.direct {
        child.arg("--direct");
    }
    let out = child.output().map_err(|e| format!("run {}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "the reopen in a child process failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Reopened::parse(&String::from_utf8_lossy(&out.stdout))
}

fn fmt_gbps(v: f64) -> String {
    if v >= 10.0 { format!("{v:.1}") } else { format!("{v:.2}") }
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
    let ratio = |v: Option<f64>| stats::cell(v, 2);
    for r in rows {
        let rates: Vec<RoundRates> = r.rounds.iter().map(round_rates).collect();
        let column = |pick: fn(&RoundRates) -> Option<f64>| {
            median(&rates.iter().filter_map(pick).collect::<Vec<_>>())
        };
        let ratios = |pick: fn(&RoundRates) -> (Option<f64>, Option<f64>)| {
            let per_round: Vec<f64> = rates
                .iter()
                .filter_map(|x| {
                    let (n, d) = pick(x);
                    stats::ratio(n?, d?)
                })
                .collect();
            median(&per_round)
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
// Batch rows

/// Timed passes of one way of reading a batch.
#[derive(Debug, Clone, Default)]
struct Passes {
    bytes_per_pass: u64,
    times: Vec<Duration>,
}

impl Passes {
    fn new(bytes_per_pass: u64) -> Self {
        Self { bytes_per_pass, times: Vec::new() }
    }

    /// Bytes of every pass over the time of every pass.
    fn gbps(&self) -> Option<f64> {
        let secs: f64 = self.times.iter().map(Duration::as_secs_f64).sum();
        let passes = u64::try_from(self.times.len()).unwrap_or(u64::MAX);
        (secs > 0.0).then(|| stats::gbps(self.bytes_per_pass.saturating_mul(passes), secs))
    }

    fn describe(&self) -> String {
        let ms: Vec<String> =
            self.times.iter().map(|t| format!("{:.2}", t.as_secs_f64() * 1e3)).collect();
        format!(
            "{} passes of {}, ms each: {}; {} GB/s",
            self.times.len(),
            human_bytes(self.bytes_per_pass),
            ms.join(" "),
            cell(self.gbps())
        )
    }
}

/// A batch read as one call and one by one.
#[derive(Debug)]
struct BatchSides {
    batch: Passes,
    single: Passes,
    /// The deepest the io_uring engine went during the batch passes (`None` for psync).
    max_in_flight: Option<u32>,
}

/// One batch on one engine: the store, fio on the store's files, and TCP.
#[derive(Debug)]
struct BatchRow {
    /// The batch read: `asked`, with fewer blocks when --file-mib is smaller.
    spec: BatchSpec,
    asked: BatchSpec,
    engine: Engine,
    /// The store read directly (`None` when the batch row was not asked for).
    store: Option<Result<BatchSides, String>>,
    /// fio's random reads of the same files (`None` when fio is off or the row not asked).
    fio: Option<Result<fio::Outcome, String>>,
    /// Through TcpStore (`None` when the tcp row was not asked for).
    tcp: Option<Result<BatchSides, String>>,
}

impl BatchRow {
    fn ran(&self) -> bool {
        self.store.as_ref().is_none_or(Result::is_ok)
            && self.fio.as_ref().is_none_or(Result::is_ok)
            && self.tcp.as_ref().is_none_or(Result::is_ok)
    }
}

/// What the batch rows do, for the report's header.
fn describe_batches(ctx: &Ctx<'_>, batch: bool, tcp: bool) -> String {
    let a = ctx.args;
    let specs: Vec<String> = a.batch.0.iter().map(|b| b.label()).collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "batch rows: {} read from an O_DIRECT FileStore (queue depth {}, its block files kept \
         open; at most --file-mib per batch) into page-aligned destinations (read in place when \
         a block is whole sectors), {} timed passes per side (fewer past --seconds), \
         the sides alternating which goes first",
        specs.join(", "),
        a.queue_depth,
        a.batch_passes
    );
    let _ = writeln!(
        s,
        "batch page cache: {}",
        if a.drop_caches {
            "dropped (sync + drop_caches) before every pass and before fio"
        } else {
            "not dropped between passes (no --drop-caches): O_DIRECT payload reads bypass it, \
             file metadata may stay cached"
        }
    );
    if batch {
        let _ = writeln!(
            s,
            "batch fio: {}",
            if ctx.use_fio {
                format!(
                    "one --rw=randread job over the store's own block files (one block each, from \
                     its header's end), --iodepth={} --direct=1, {} loops in the one job (no \
                     cache drop between its loops)",
                    a.queue_depth, a.batch_passes
                )
            } else {
                "not run".to_owned()
            }
        );
    }
    if tcp {
        let _ = writeln!(
            s,
            "tcp rows: the same blocks through one TcpStore connection to an in-process server \
             on loopback serving that FileStore; TcpStore::get_batch beside get_into one by one"
        );
    }
    s.trim_end().to_owned()
}

/// Puts the batch's blocks into a fresh O_DIRECT store and measures what `batch` and `tcp` ask.
fn measure_batch(
    ctx: &Ctx<'_>,
    engine: Engine,
    spec: BatchSpec,
    batch: bool,
    tcp: bool,
) -> BatchRow {
    // A batch holds at most the working set: a quick run (small --file-mib) reads fewer blocks.
    let fits = (ctx.file_bytes / spec.size).max(1);
    let asked = spec;
    let spec = BatchSpec { count: spec.count.min(fits), ..spec };
    eprintln!("bench: batch {} {}", spec.label(), engine.name());
    let mut row = BatchRow { spec, asked, engine, store: None, fio: None, tcp: None };
    let dir = ctx.root.join(format!("batch-{}-{}", engine.name(), spec.label()));
    let prepared = (|| -> Result<_, String> {
        let (store, uring) = open_batch_store(ctx, engine, &dir, spec)?;
        let src = payload(narrow(spec.size));
        let keys: Vec<PhysicalKey> =
            (0..spec.count).map(|i| bench_key((3 << 60) | (spec.size << 20) | i)).collect();
        for key in &keys {
            put_one(&store, &ctx.caller, key, &src)?;
        }
        settle();
        Ok((store, uring, src, keys))
    })();
    let (store, uring, src, keys) = match prepared {
        Ok(p) => p,
        Err(e) => {
            let failed = format!("setup: {e}");
            if batch {
                row.store = Some(Err(failed.clone()));
            }
            if tcp {
                row.tcp = Some(Err(failed));
            }
            return row;
        }
    };
    // One destination per block, its pages faulted in before any clock starts.
    // Page-aligned, as pinned host buffers are: an O_DIRECT read of a whole number of sectors
    // lands in them without staging.
    let mut bufs = Vec::with_capacity(keys.len());
    for _ in &keys {
        match AlignedBuf::zeroed(narrow(spec.size)) {
            Ok(mut b) => {
                b.fill(1);
                bufs.push(b);
            }
            Err(e) => {
                row.store = batch.then(|| Err(format!("destinations: {e}")));
                row.tcp = tcp.then(|| Err(format!("destinations: {e}")));
                return row;
            }
        }
    }
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..narrow(spec.size)]).collect();
    if batch {
        row.store =
            Some(read_passes(ctx, &*store, uring.as_deref(), &keys, &mut dsts, &src, spec.size));
        let loops = row.store.as_ref().and_then(|x| x.as_ref().ok()).map(|x| x.batch.times.len());
        if ctx.use_fio {
            let loops = u32::try_from(loops.unwrap_or(1)).unwrap_or(ctx.args.batch_passes);
            row.fio = Some(batch_fio(ctx, engine, &store, &keys, spec, loops));
        }
    }
    if tcp {
        row.tcp = Some(tcp_passes(ctx, &store, &keys, &mut dsts, &src, spec.size));
    }
    row
}

/// An O_DIRECT store with room for the batch, on an engine the bench holds (to read its depth).
fn open_batch_store(
    ctx: &Ctx<'_>,
    engine: Engine,
    dir: &Path,
    spec: BatchSpec,
) -> Result<(Arc<FileStore>, Option<Arc<UringEngine>>), String> {
    let mut config = FileStoreConfig::new(dir);
    config.direct_io = true;
    config.durability = ctx.durability();
    config.limits = limits_for(spec.size, spec.count);
    // Every block of the batch stays open (fio keeps its files open too).
    config.open_files_max = narrow(spec.count).max(config.open_files_max);
    let engine_config =
        EngineConfig { queue_depth: ctx.args.queue_depth, ..EngineConfig::default() };
    let (io, uring): (Arc<dyn IoEngine>, _) = match engine {
        Engine::Uring => {
            let u =
                Arc::new(UringEngine::new(engine_config).map_err(|e| format!("io_uring: {e}"))?);
            (Arc::clone(&u) as Arc<dyn IoEngine>, Some(u))
        }
        Engine::Psync => (Arc::new(PsyncEngine), None),
    };
    let store = FileStore::open_with_engine(config, io, Arc::new(MonotonicClock::default()))
        .map_err(|e| format!("open store: {e}"))?;
    Ok((Arc::new(store), uring))
}

/// `--batch-passes` timed passes of `store` reading every key as one batch and one by one;
/// fewer once the passes have taken `--seconds` (at least one each way).
fn read_passes(
    ctx: &Ctx<'_>,
    store: &dyn Store,
    uring: Option<&UringEngine>,
    keys: &[PhysicalKey],
    dsts: &mut [&mut [u8]],
    src: &[u8],
    size: u64,
) -> Result<BatchSides, String> {
    let bytes = wide(keys.len()) * size;
    let mut sides =
        BatchSides { batch: Passes::new(bytes), single: Passes::new(bytes), max_in_flight: None };
    let started = Instant::now();
    for pass in 0..ctx.args.batch_passes {
        if pass > 0 && started.elapsed() >= ctx.deadline {
            break;
        }
        let order = if pass % 2 == 0 { [true, false] } else { [false, true] };
        for as_batch in order {
            if ctx.args.drop_caches {
                drop_caches()?;
            }
            scribble(dsts);
            if as_batch {
                if let Some(u) = uring {
                    u.reset_max_in_flight();
                }
                sides.batch.times.push(timed_batch(store, &ctx.caller, keys, dsts, size)?);
                if let Some(u) = uring {
                    sides.max_in_flight = sides.max_in_flight.max(Some(u.max_in_flight()));
                }
            } else {
                sides.single.times.push(timed_single(store, &ctx.caller, keys, dsts, size)?);
            }
            if let Some(i) = dsts.iter().position(|d| **d != *src) {
                let how = if as_batch { "get_batch" } else { "get_into" };
                return Err(format!("{how} delivered other bytes than were put (block {i})"));
            }
        }
    }
    Ok(sides)
}

/// Spoils the first and last byte of every destination, so that a read that delivers nothing
/// cannot pass the check after it.
fn scribble(dsts: &mut [&mut [u8]]) {
    for d in dsts {
        let ends = if d.len() > 1 { vec![0, d.len() - 1] } else { vec![0] };
        for i in ends {
            if let Some(b) = d.get_mut(i) {
                *b = !*b;
            }
        }
    }
}

fn timed_batch(
    store: &dyn Store,
    caller: &Caller,
    keys: &[PhysicalKey],
    dsts: &mut [&mut [u8]],
    size: u64,
) -> Result<Duration, String> {
    let mut items: Vec<BatchGet<'_>> = keys
        .iter()
        .zip(dsts.iter_mut())
        .map(|(key, dst)| BatchGet { key, dst: &mut dst[..] })
        .collect();
    let started = Instant::now();
    let answers = store.get_batch(caller, &mut items);
    let elapsed = started.elapsed();
    for (i, answer) in answers.iter().enumerate() {
        match answer {
            Ok(Get::Hit { len, .. }) if *len == size => {}
            other => return Err(format!("get_batch item {i}: {other:?}")),
        }
    }
    Ok(elapsed)
}

fn timed_single(
    store: &dyn Store,
    caller: &Caller,
    keys: &[PhysicalKey],
    dsts: &mut [&mut [u8]],
    size: u64,
) -> Result<Duration, String> {
    let started = Instant::now();
    for (i, (key, dst)) in keys.iter().zip(dsts.iter_mut()).enumerate() {
        match store.get_into(caller, key, dst) {
            Ok(Get::Hit { len, .. }) if len == size => {}
            other => return Err(format!("get_into block {i}: {other:?}")),
        }
    }
    Ok(started.elapsed())
}

/// fio's random reads of the store's own block files: one block per file, at the store's queue
/// depth, `--batch-passes` loops.
fn batch_fio(
    ctx: &Ctx<'_>,
    engine: Engine,
    store: &FileStore,
    keys: &[PhysicalKey],
    spec: BatchSpec,
    loops: u32,
) -> Result<fio::Outcome, String> {
    let mut offset = None;
    for key in keys {
        let (_, header_len) =
            store.block_location(key).ok_or_else(|| "a block has no file".to_owned())?;
        if *offset.get_or_insert(header_len) != header_len {
            return Err("the block files' headers differ in length".to_owned());
        }
    }
    // fio opens every file below the store's block directories: exactly the batch's blocks.
    let blocks = store.root().join("blocks");
    let found = count_files(&blocks).map_err(|e| format!("{}: {e}", blocks.display()))?;
    if found != wide(keys.len()) {
        return Err(format!(
            "{} holds {found} files, not the batch's {}",
            blocks.display(),
            keys.len()
        ));
    }
    if ctx.args.drop_caches {
        drop_caches()?;
    }
    eprintln!("bench: batch {} {}: fio", spec.label(), engine.name());
    fio::FilesJob {
        dir: &blocks,
        files: wide(keys.len()),
        ioengine: engine.fio_ioengine(),
        offset: offset.unwrap_or(0),
        block_bytes: spec.size,
        queue_depth: ctx.args.queue_depth,
        direct: true,
        loops,
        runtime: ctx.deadline,
    }
    .run()
}

/// Regular files below `dir`, at any depth.
fn count_files(dir: &Path) -> std::io::Result<u64> {
    let mut n = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            n += count_files(&entry.path())?;
        } else if kind.is_file() {
            n += 1;
        }
    }
    Ok(n)
}

/// The batch through TcpStore from an in-process server on `store`.
fn tcp_passes(
    ctx: &Ctx<'_>,
    store: &Arc<FileStore>,
    keys: &[PhysicalKey],
    dsts: &mut [&mut [u8]],
    src: &[u8],
    size: u64,
) -> Result<BatchSides, String> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let server = Server::start(
        ServerConfig::new(addr, vec![ctx.caller.clone()]),
        Arc::clone(store) as Arc<dyn Store>,
    )
    .map_err(|e| format!("start the server: {e}"))?;
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), ctx.caller.clone()));
    let measured = read_passes(ctx, &client, None, keys, dsts, src, size);
    drop(client);
    let left = server.shutdown();
    if left > 0 {
        eprintln!("bench: {left} server threads were still running at shutdown");
    }
    measured
}

/// A GB/s cell: `-`, or the figure as [`fmt_gbps`] writes it.
fn cell(v: Option<f64>) -> String {
    stats::cell_with(v, fmt_gbps)
}

fn ratio_cell(n: Option<f64>, d: Option<f64>) -> String {
    stats::cell(n.zip(d).and_then(|(n, d)| stats::ratio(n, d)), 2)
}

/// The batch table (markdown): GB/s over all passes of each side, and the ratios.
fn batch_table(rows: &[BatchRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| batch | engine | batch GB/s | one-by-one GB/s | fio randread GB/s | batch/fio | \
         batch/one-by-one | max in flight |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for r in rows {
        let sides = r.store.as_ref().and_then(|x| x.as_ref().ok());
        let (batch, single) =
            (sides.and_then(|x| x.batch.gbps()), sides.and_then(|x| x.single.gbps()));
        let fio = r.fio.as_ref().and_then(|f| f.as_ref().ok()).map(|o| o.bw_bytes / 1e9);
        let depth =
            sides.and_then(|x| x.max_in_flight).map_or_else(|| "-".to_owned(), |d| d.to_string());
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {depth} |",
            r.spec.label(),
            r.engine.name(),
            cell(batch),
            cell(single),
            cell(fio),
            ratio_cell(batch, fio),
            ratio_cell(batch, single)
        );
    }
    s
}

/// The tcp table (markdown): the same batch through TcpStore.
fn tcp_table(rows: &[BatchRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| batch | engine | tcp batch GB/s | tcp one-by-one GB/s | tcp batch/one-by-one | \
         tcp batch/store batch |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for r in rows {
        let tcp = r.tcp.as_ref().and_then(|x| x.as_ref().ok());
        let (batch, single) = (tcp.and_then(|x| x.batch.gbps()), tcp.and_then(|x| x.single.gbps()));
        let store = r.store.as_ref().and_then(|x| x.as_ref().ok()).and_then(|x| x.batch.gbps());
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            r.spec.label(),
            r.engine.name(),
            cell(batch),
            cell(single),
            ratio_cell(batch, single),
            ratio_cell(batch, store)
        );
    }
    s
}

/// Every pass of every batch row, and every error.
fn batch_details(rows: &[BatchRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "batch details:");
    let sides =
        |s: &mut String, head: &str, what: &str, x: &Option<Result<BatchSides, String>>| match x {
            None => {}
            Some(Ok(x)) => {
                let _ = writeln!(s, "{head}: {what} batch {}", x.batch.describe());
                let _ = writeln!(s, "{head}: {what} one by one {}", x.single.describe());
            }
            Some(Err(e)) => {
                let _ = writeln!(s, "{head}: {what} error: {e}");
            }
        };
    for r in rows {
        let head = format!("  {} {}", r.spec.label(), r.engine.name());
        if r.spec != r.asked {
            let _ =
                writeln!(s, "{head}: {} asked, fewer blocks to fit --file-mib", r.asked.label());
        }
        sides(&mut s, &head, "store", &r.store);
        match &r.fio {
            None => {}
            Some(Ok(o)) => {
                let _ = writeln!(
                    s,
                    "{head}: fio randread {} in {:.3} s = {} GB/s",
                    human_bytes(o.io_bytes),
                    o.runtime_ms as f64 / 1e3,
                    fmt_gbps(o.bw_bytes / 1e9)
                );
            }
            Some(Err(e)) => {
                let _ = writeln!(s, "{head}: fio error: {e}");
            }
        }
        sides(&mut s, &head, "tcp", &r.tcp);
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Keys, payloads and the machine

/// An 8B-class model on one unsharded GPU, bf16 KV, paged layout, Llama-3 RoPE scaling and
/// 16-token blocks, under `tenant`: every field but the chain, which the caller adds.
pub fn solo_identity(tenant: &str) -> CacheIdentityBuilder {
    CacheIdentity::builder()
        .tenant(tenant)
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
        .block_tokens(16)
        .valid_tokens(16)
}

/// A realistic key whose one-link chain comes from `seed` (distinct seeds, distinct keys).
pub fn bench_key(seed: u64) -> PhysicalKey {
    let id = solo_identity(TENANT).chain(vec![digest(seed)]).build();
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

    /// The line a reopen child prints is read back field for field, and a line with a field
    /// missing or of the wrong kind is an error, not zeros.
    #[test]
    fn a_reopen_line_round_trips_and_a_damaged_one_is_refused() {
        let r = Reopened {
            elapsed: Duration::from_nanos(1_234_567_891),
            loaded: 1_000_000,
            loaded_bytes: 4 << 30,
            skipped: 3,
            tmp_removed: 1,
            elapsed_ms: 1234,
            epoch: 7,
            indexed: true,
        };
        let line = serde_json::to_string(&r).expect("a report");
        assert_eq!(Reopened::parse(&format!("{line}\n")), Ok(r));
        assert!(Reopened::parse("").is_err());
        assert!(Reopened::parse(&line.replace("\"loaded\":1000000,", "")).is_err());
        assert!(Reopened::parse(&line.replace("\"epoch\":7", "\"epoch\":\"x\"")).is_err());
    }

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
        assert_eq!(median(&[3.0, 1.0]), Some(2.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn batch_lists_parse_and_refuse_nonsense() {
        assert_eq!(
            batch_list("128x64K, 32X1M").expect("parses").0,
            [BatchSpec { count: 128, size: 64 * KIB }, BatchSpec { count: 32, size: MIB }]
        );
        for bad in ["", "128", "0x64K", "4x0", "ax1M", "70000x1K", "8192x1M"] {
            assert!(batch_list(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn batch_tables_show_gbps_ratios_and_dashes() {
        let passes = |ms: &[u64]| Passes {
            bytes_per_pass: 1_000_000_000,
            times: ms.iter().map(|m| Duration::from_millis(*m)).collect(),
        };
        let outcome = fio::Outcome {
            bw_bytes: 2e9,
            io_bytes: 0,
            runtime_ms: 1000,
            lat_p50_ns: None,
            lat_p99_ns: None,
        };
        let spec = BatchSpec { count: 128, size: 64 * KIB };
        let rows = vec![
            BatchRow {
                spec,
                asked: spec,
                engine: Engine::Uring,
                // 2 GB in 1.25 s and in 5 s.
                store: Some(Ok(BatchSides {
                    batch: passes(&[500, 750]),
                    single: passes(&[2500, 2500]),
                    max_in_flight: Some(32),
                })),
                fio: Some(Ok(outcome)),
                tcp: Some(Ok(BatchSides {
                    batch: passes(&[1000]),
                    single: passes(&[4000]),
                    max_in_flight: None,
                })),
            },
            BatchRow {
                spec,
                asked: BatchSpec { count: 256, ..spec },
                engine: Engine::Psync,
                store: Some(Err("boom".into())),
                fio: None,
                tcp: None,
            },
        ];
        let t = batch_table(&rows);
        assert!(t.contains("| 128x64K | uring | 1.60 | 0.40 | 2.00 | 0.80 | 4.00 | 32 |"), "{t}");
        assert!(t.contains("| 128x64K | psync | - | - | - | - | - | - |"), "{t}");
        let t = tcp_table(&rows);
        assert!(t.contains("| 128x64K | uring | 1.00 | 0.25 | 4.00 | 0.62 |"), "{t}");
        let d = batch_details(&rows);
        assert!(d.contains("128x64K psync: store error: boom"), "{d}");
        assert!(d.contains("256x64K asked"), "{d}");
        assert!(rows[0].ran() && !rows[1].ran());
    }

    #[test]
    fn bench_keys_are_distinct() {
        assert_ne!(bench_key(1).digest(), bench_key(2).digest());
    }
}
