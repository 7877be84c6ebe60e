//! `gpucache-bench dpu`: PUT and GET through the DPU agent beside the FileStore used directly
//! and beside fio, in one run, on the same directory kind, engine (io_uring) and block sizes.
//!
//! Paths, each measured per block size with one caller (queue depth one), PUTs first, then GETs
//! of the same blocks, every GET checked byte for byte:
//! - `dpu-store`: a [`DpuStore`] driven in-process: each call runs on the reactor that owns the
//!   key's queue, against a FileStore (io_uring) the agent fronts;
//! - `agent-queue`: the agent's own block API ([`Agent::submit_write`] / [`Agent::submit_read`])
//!   on its affined host io_uring queues (fsync per block);
//! - `filestore`: the same FileStore configuration, called directly;
//! - `fio`: sequential write then read of one file, `--ioengine=io_uring --iodepth=1`, with
//!   `--fsync=1` when the stores sync per block.
//!
//! Reads follow writes, so every path reads from the page cache alike. Output: JSON on stdout
//! (every path, throughput, p50/p99, verified bytes, ratios agent/FileStore and agent/fio), a
//! table on stderr. Exit status 1 when a GET came back wrong, 2 on a usage or setup error.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_dpu::{Agent, BlockId, DpuStore, DpuStoreConfig, Outcome, QueueKind};
use gpucache_service::config::{DpuReactorConfig, DpuSection};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig};
use serde_json::{Value, json};

use crate::file::{TENANT, bench_key, limits_for};
use crate::fio;
use crate::service::load::ValuePattern;
use crate::stats::{self, percentile_us, ratio, sorted_nanos};
use gpucache_service::units::{SizeList, narrow, size_label, size_list};

/// Longest a single agent call may wait for its completion.
const OP_DEADLINE: Duration = Duration::from_secs(30);
/// Slab slots of the bench agent: one caller holds one at a time.
const SLAB_SLOTS: u32 = 8;

#[derive(Debug, Args)]
pub struct DpuBenchArgs {
    /// Where the stores, the agent's state and fio's file go; a fresh subdirectory is made there
    /// and removed afterwards. Default: the system temporary directory.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Block sizes, comma-separated (K, M, G are binary).
    #[arg(long, default_value = "64K,256K,1M,4M", value_parser = size_list)]
    sizes: SizeList,
    /// MiB written (then read) per path and block size; at least one block each.
    #[arg(long, default_value_t = 64)]
    mib: u64,
    /// Agent reactors, pinned best effort to the cores this process may use, in order.
    #[arg(long, default_value_t = 2)]
    reactors: u16,
    /// Queues per reactor.
    #[arg(long, default_value_t = 1)]
    queues_per_reactor: u32,
    /// Skip fio (its entries then say why).
    #[arg(long)]
    no_fio: bool,
    /// Acknowledge PUTs without fsync (the stores' `none` durability; fio without --fsync).
    #[arg(long)]
    no_sync: bool,
}

/// One direction of one path.
#[derive(Debug, Clone, Copy, Default)]
struct Phase {
    bytes: u64,
    secs: f64,
    p50_us: f64,
    p99_us: f64,
}

impl Phase {
    /// `bytes` moved by calls that took `lat`: the rate is over the calls' own time (payload
    /// stamping and byte checks between calls are not in it), the percentiles nearest-rank.
    fn from_latencies(bytes: u64, lat: Vec<Duration>) -> Self {
        let secs = lat.iter().map(Duration::as_secs_f64).sum();
        let nanos = sorted_nanos(&lat);
        let pick = |p| percentile_us(&nanos, p).unwrap_or(0.0);
        Self { bytes, secs, p50_us: pick(50.0), p99_us: pick(99.0) }
    }

    fn gbps(&self) -> f64 {
        stats::gbps(self.bytes, self.secs)
    }

    fn json(&self) -> Value {
        json!({
            "bytes": self.bytes,
            "seconds": self.secs,
            "gbps": self.gbps(),
            "p50_us": self.p50_us,
            "p99_us": self.p99_us,
        })
    }
}

/// PUT and GET of one path at one size.
#[derive(Debug, Clone, Copy)]
struct PathRun {
    put: Phase,
    get: Phase,
    verified_bytes: u64,
}

struct Ctx {
    root: PathBuf,
    caller: Caller,
    blocks: u64,
    sync: bool,
    args_reactors: u16,
    queues_per_reactor: u32,
}

pub fn run(args: &DpuBenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache-bench dpu: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_inner(args: &DpuBenchArgs) -> Result<bool, String> {
    if args.mib == 0 {
        return Err("--mib must be at least 1".into());
    }
    if args.reactors == 0 {
        return Err("--reactors must be at least 1".into());
    }
    if args.sizes.0.is_empty() {
        return Err("--sizes names no size".into());
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let scratch = tempfile::Builder::new()
        .prefix("gpucache-bench-dpu-")
        .tempdir_in(&parent)
        .map_err(|e| format!("--dir {}: {e}", parent.display()))?;
    let tenant = TenantId::parse(TENANT).map_err(|e| format!("bench tenant: {e}"))?;
    let fio_version = if args.no_fio { None } else { fio::version() };
    let mut rows = Vec::new();
    let mut all_ok = true;
    for &size in &args.sizes.0 {
        let blocks = (args.mib << 20).div_ceil(size).max(1);
        let ctx = Ctx {
            root: scratch.path().join(size_label(size)),
            caller: Caller::new(tenant.clone(), Rights::READ_WRITE),
            blocks,
            sync: !args.no_sync,
            args_reactors: args.reactors,
            queues_per_reactor: args.queues_per_reactor,
        };
        std::fs::create_dir_all(&ctx.root).map_err(|e| format!("{}: {e}", ctx.root.display()))?;
        let (agent, dpu_store) = open_agent(&ctx, size)?;
        let offload = crate_dpu_fields(&agent);
        let dpu = store_path(&ctx, &dpu_store, size)?;
        let queue = agent_queue_path(&ctx, &agent, size)?;
        drop(dpu_store);
        drop(agent);
        let file =
            store_path(&ctx, &open_file_store(&ctx, &ctx.root.join("filestore"), size)?, size)?;
        let fio_run = if args.no_fio {
            Err("skipped (--no-fio)".to_owned())
        } else if fio_version.is_none() {
            Err("skipped: fio is not on PATH".to_owned())
        } else {
            fio_path(&ctx, size)
        };
        let expected = blocks * size;
        for (name, r) in [("dpu-store", &dpu), ("agent-queue", &queue), ("filestore", &file)] {
            if r.verified_bytes != expected {
                all_ok = false;
                eprintln!(
                    "gpucache-bench dpu: {} {name}: verified {} of {expected} bytes",
                    size_label(size),
                    r.verified_bytes
                );
            }
        }
        rows.push(Row { size, blocks, offload, dpu, queue, file, fio: fio_run });
        // Keep the disk use to one size at a time.
        let _ = std::fs::remove_dir_all(&ctx.root);
    }
    eprint!("{}", table(&rows));
    let report = json!({
        "bench": "dpu",
        "engine": "io_uring",
        "queue_depth": 1,
        "sync_per_block": !args.no_sync,
        "reactors": args.reactors,
        "queues_per_reactor": args.queues_per_reactor,
        "mib_per_path": args.mib,
        "fio_version": fio_version,
        "dir": parent.display().to_string(),
        "verified": all_ok,
        "sizes": rows.iter().map(Row::json).collect::<Vec<_>>(),
    });
    let text = serde_json::to_string_pretty(&report).map_err(|e| format!("json: {e}"))?;
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
    Ok(all_ok)
}

fn crate_dpu_fields(agent: &Agent) -> String {
    gpucache_service::dpu::offload_fields(agent)
}

struct Row {
    size: u64,
    blocks: u64,
    offload: String,
    dpu: PathRun,
    queue: PathRun,
    file: PathRun,
    fio: Result<(Phase, Phase), String>,
}

impl Row {
    fn json(&self) -> Value {
        let path = |r: &PathRun| {
            json!({
                "put": r.put.json(),
                "get": r.get.json(),
                "verified_bytes": r.verified_bytes,
                "verified": r.verified_bytes == self.blocks * self.size,
            })
        };
        let fio = match &self.fio {
            Ok((w, r)) => json!({ "put": w.json(), "get": r.json(), "verified": Value::Null }),
            Err(why) => json!({ "skipped": why }),
        };
        let pair = |a: &PathRun, put: f64, get: f64| {
            json!({
                "put_gbps": ratio(a.put.gbps(), put),
                "get_gbps": ratio(a.get.gbps(), get),
            })
        };
        let (fio_put, fio_get) =
            self.fio.as_ref().map_or((0.0, 0.0), |(w, r)| (w.gbps(), r.gbps()));
        json!({
            "size": self.size,
            "size_label": size_label(self.size),
            "blocks": self.blocks,
            "offload": self.offload,
            "paths": {
                "dpu-store": path(&self.dpu),
                "agent-queue": path(&self.queue),
                "filestore": path(&self.file),
                "fio": fio,
            },
            "ratios": {
                "dpu-store/filestore": pair(&self.dpu, self.file.put.gbps(), self.file.get.gbps()),
                "dpu-store/fio": pair(&self.dpu, fio_put, fio_get),
                "agent-queue/fio": pair(&self.queue, fio_put, fio_get),
            },
        })
    }
}

fn open_file_store(ctx: &Ctx, root: &Path, size: u64) -> Result<FileStore, String> {
    let mut config = FileStoreConfig::new(root);
    config.engine = EngineChoice::Uring;
    config.durability = if ctx.sync { Durability::PerBlock } else { Durability::None };
    config.limits = limits_for(size, ctx.blocks);
    config
        .open(Arc::new(MonotonicClock::default()))
        .map_err(|e| format!("open file store {}: {e}", root.display()))
}

/// The agent as `[dpu]` would start it: io_uring queues, reactors pinned best effort to the
/// cores this process may use, a slab of slots as large as the block.
fn open_agent(ctx: &Ctx, size: u64) -> Result<(Arc<Agent>, DpuStore), String> {
    let cores = gpucache_dpu::allowed_cores();
    let section = DpuSection {
        state_dir: ctx.root.join("agent"),
        reactors: (0..ctx.args_reactors)
            .map(|i| DpuReactorConfig {
                id: i,
                core: (!cores.is_empty()).then(|| cores[usize::from(i) % cores.len()] as u64),
            })
            .collect(),
        queues_per_reactor: ctx.queues_per_reactor,
        slab_slots: SLAB_SLOTS,
        slab_slot_bytes: size.max(4096),
        ..DpuSection::default()
    };
    let mut config =
        gpucache_service::dpu::agent_config(&section).map_err(|e| format!("agent: {e}"))?;
    // The service's queues always fsync; here they follow --no-sync like every other path.
    for queue in &mut config.queues {
        if let QueueKind::Host { sync, .. } = &mut queue.kind {
            *sync = ctx.sync;
        }
    }
    let agent = Arc::new(config.start().map_err(|e| format!("agent: {e}"))?);
    let backing = open_file_store(ctx, &ctx.root.join("dpu-store"), size)?;
    let store = DpuStore::new(
        Arc::clone(&agent),
        Arc::new(backing),
        DpuStoreConfig { op_deadline: OP_DEADLINE },
    );
    Ok((agent, store))
}

/// One path at one size: every block PUT, then every block read back and checked. Each call is
/// timed on its own and the rate is over those times only; block `i` carries `i` in its first
/// bytes ([`ValuePattern`]), so a block served under another's key fails the check. `get`
/// answers the length read, or what it got instead (a miss: counted unverified and printed);
/// `Err` from either stops the path.
fn timed_path(
    ctx: &Ctx,
    size: u64,
    mut put: impl FnMut(u64, &[u8]) -> Result<(), String>,
    mut get: impl FnMut(u64, &mut [u8]) -> Result<Result<u64, String>, String>,
) -> Result<PathRun, String> {
    let pattern = ValuePattern::new(narrow(size));
    let mut data = pattern.buffer();
    let mut lat = Vec::with_capacity(narrow(ctx.blocks));
    for i in 0..ctx.blocks {
        ValuePattern::stamp(&mut data, i);
        let t = Instant::now();
        put(i, &data)?;
        lat.push(t.elapsed());
    }
    let put = Phase::from_latencies(ctx.blocks * size, lat);
    let mut lat = Vec::with_capacity(narrow(ctx.blocks));
    let mut buf = vec![0u8; narrow(size)];
    let mut verified = 0u64;
    for i in 0..ctx.blocks {
        let t = Instant::now();
        let got = get(i, &mut buf)?;
        lat.push(t.elapsed());
        match got {
            Ok(len) if len == size && pattern.matches(&buf, i) => verified += len,
            Ok(len) => eprintln!("gpucache-bench dpu: get {i}: {len} bytes or wrong bytes"),
            Err(other) => eprintln!("gpucache-bench dpu: get {i}: {other}"),
        }
    }
    let get = Phase::from_latencies(ctx.blocks * size, lat);
    Ok(PathRun { put, get, verified_bytes: verified })
}

fn store_path(ctx: &Ctx, store: &dyn Store, size: u64) -> Result<PathRun, String> {
    // Made before the timed calls, as the agent's queues name blocks by index.
    let keys: Vec<PhysicalKey> = (0..ctx.blocks).map(bench_key).collect();
    let key = |i: u64| &keys[narrow(i)];
    timed_path(
        ctx,
        size,
        |i, data| match store.put(&ctx.caller, key(i), data, None) {
            Ok(Put::Committed(_)) => Ok(()),
            Ok(other) => Err(format!("put {i}: not committed: {other:?}")),
            Err(e) => Err(format!("put {i}: {e}")),
        },
        |i, buf| match store.get_into(&ctx.caller, key(i), buf) {
            Ok(Get::Hit { len, .. }) => Ok(Ok(len)),
            Ok(other) => Ok(Err(format!("{other:?}"))),
            Err(e) => Err(format!("get {i}: {e}")),
        },
    )
}

fn agent_queue_path(ctx: &Ctx, agent: &Agent, size: u64) -> Result<PathRun, String> {
    timed_path(
        ctx,
        size,
        |i, data| {
            let (reactor, queue) = agent.route(i);
            let ticket = agent
                .submit_write(reactor, queue, BlockId(i), data)
                .map_err(|e| format!("submit_write {i}: {e}"))?;
            match agent.wait(ticket, Instant::now() + OP_DEADLINE, &mut [0u8; 0]) {
                Ok(Outcome::Written) => Ok(()),
                Ok(other) => Err(format!("write {i}: {other:?}")),
                Err(e) => Err(format!("write {i}: {e}")),
            }
        },
        |i, buf| {
            let (reactor, queue) = agent.route(i);
            let ticket = agent
                .submit_read(reactor, queue, BlockId(i))
                .map_err(|e| format!("submit_read {i}: {e}"))?;
            match agent.wait(ticket, Instant::now() + OP_DEADLINE, buf) {
                Ok(Outcome::Read { len }) => Ok(Ok(len as u64)),
                Ok(other) => Ok(Err(format!("{other:?}"))),
                Err(e) => Err(format!("read {i}: {e}")),
            }
        },
    )
}

fn fio_path(ctx: &Ctx, size: u64) -> Result<(Phase, Phase), String> {
    let file = ctx.root.join("fio.dat");
    let job = |direction| fio::Job {
        file: &file,
        direction,
        ioengine: "io_uring",
        block_bytes: size,
        total_bytes: ctx.blocks * size,
        queue_depth: 1,
        direct: false,
        fsync_each: ctx.sync,
        runtime: Duration::from_secs(600),
    };
    let phase = |o: fio::Outcome| Phase {
        bytes: o.io_bytes,
        secs: o.runtime_ms as f64 / 1e3,
        p50_us: o.lat_p50_ns.map_or(0.0, |n| n as f64 / 1e3),
        p99_us: o.lat_p99_ns.map_or(0.0, |n| n as f64 / 1e3),
    };
    let w = job(fio::Direction::Write).run()?;
    let r = job(fio::Direction::Read).run()?;
    // fio's own bandwidth (it excludes its setup), with the phase's bytes and time beside it.
    let mut put = phase(w);
    let mut get = phase(r);
    put.secs = if w.bw_bytes > 0.0 { w.io_bytes as f64 / w.bw_bytes } else { put.secs };
    get.secs = if r.bw_bytes > 0.0 { r.io_bytes as f64 / r.bw_bytes } else { get.secs };
    Ok((put, get))
}

fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| size | path | put GB/s | put p50/p99 us | get GB/s | get p50/p99 us | verified |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let mut line = |name: &str, p: Option<(&Phase, &Phase)>, verified: &str| {
            let cells = match p {
                Some((w, g)) => format!(
                    "{:.3} | {:.0}/{:.0} | {:.3} | {:.0}/{:.0}",
                    w.gbps(),
                    w.p50_us,
                    w.p99_us,
                    g.gbps(),
                    g.p50_us,
                    g.p99_us
                ),
                None => "- | - | - | -".to_owned(),
            };
            out.push_str(&format!("| {} | {name} | {cells} | {verified} |\n", size_label(r.size)));
        };
        let v = |p: &PathRun| format!("{}", p.verified_bytes == r.blocks * r.size);
        line("dpu-store", Some((&r.dpu.put, &r.dpu.get)), &v(&r.dpu));
        line("agent-queue", Some((&r.queue.put, &r.queue.get)), &v(&r.queue));
        line("filestore", Some((&r.file.put, &r.file.get)), &v(&r.file));
        match &r.fio {
            Ok((w, g)) => line("fio", Some((w, g)), "n/a"),
            Err(why) => line("fio", None, why),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_and_the_rate_is_over_call_time() {
        let lat: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let p = Phase::from_latencies(5050, lat);
        assert_eq!((p.p50_us.round(), p.p99_us.round()), (50.0, 99.0));
        // 5050 bytes over 5050 us of calls: 1e6 B/s.
        assert!((p.gbps() - 1e-3).abs() < 1e-9, "{}", p.gbps());
        let one = Phase::from_latencies(1, vec![Duration::from_micros(7)]);
        assert_eq!((one.p50_us.round(), one.p99_us.round()), (7.0, 7.0));
    }
}
