//! `gpucache-bench cold`: the cold tier against a real S3 endpoint, beside plain objects on the
//! same endpoint and bucket, per block size.
//!
//! Per block size (`--blocks`), `--bytes` of payload in blocks of that size, one caller, one
//! call at a time:
//! - `pack` and `unpack`, in this process alone: the blocks pushed into packs as the sink
//!   packs them ([`PackBuilder::push`], sealed at the sink's default targets;
//!   [`PackBuilder::seal`] also validates what it made), then each manifest decoded against its
//!   name and every block's range checked against its checksum ([`Manifest::decode`] plus
//!   [`Checksum::of`]). Payload bytes per second.
//! - `cold store`: every block offered to a [`ColdSink`], then drain rounds until the sink is
//!   empty: each pack and its manifest PUT (create-only) into a [`ColdTier`]. Payload bytes
//!   over the wall time of the offers and the rounds.
//! - `cold refill`: a [`ColdTier`] opened afresh on the bucket (its index rebuilt by listing
//!   and fetching the manifests: `open` seconds), then [`ColdTier::refill`] of every stored
//!   key in batches of `--batch` consecutive keys, as they were stored. Payload bytes over the
//!   refill calls' own time, and each call's latency (p50/p99). Every block is compared byte
//!   for byte with what was offered.
//! - `plain put` / `plain get`: the same blocks, each its own object, through `object_store`'s
//!   S3 client (`put`, then `get` of each, compared byte for byte); the GETs are also timed in
//!   groups of `--batch` for a latency to set beside the refill's.
//!
//! Ratios: cold store / plain put and cold refill / plain get, in bytes per second. Objects go
//! under a fresh prefix per run and are deleted afterwards unless `--keep`. Output: a summary
//! on stderr, the JSON object on stdout (and in `--json` when given). Exit status 1 when a
//! block came back wrong or missing, 2 on a usage or setup error (the store cannot be reached).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use gpucache_cold::manifest::{Manifest, PackBuilder, SealedPack, name_digest};
use gpucache_cold::{
    ColdConfig, ColdObjects, ColdSink, ColdTier, REFILL_BYTES_MAX_DEFAULT, RefillBudget, Refilled,
    S3_REQUEST_TIMEOUT_MS_DEFAULT, S3Config, S3Objects, SinkLimits, SinkRefused,
};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::UnixClock;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_service::units::{SizeList, parse_size, size_label, size_list};
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload};
use serde_json::{Value, json};

use crate::file::{TENANT, solo_identity};
use crate::fixtures::digest;
use crate::service::{git_commit, loadavg, machine, utc_now, write_file};
use crate::stats::{self, cell, percentile_ms, sorted_nanos};

/// Most blocks one block size may move (the payloads are held in memory).
pub const BLOCKS_MAX: u64 = 1 << 20;
/// Most payload bytes one block size may move (held in memory, twice over while packing).
pub const BYTES_MAX: u64 = 4 << 30;
/// Most drain rounds the store phase runs before it calls the sink stuck.
const DRAIN_ROUNDS_MAX: usize = 10_000;

#[derive(Debug, Args)]
pub struct ColdBenchArgs {
    /// The S3-compatible endpoint, e.g. http://127.0.0.1:9000 (plain HTTP allowed, path-style
    /// addressing).
    #[arg(long)]
    endpoint: String,
    /// The bucket; it must exist.
    #[arg(long)]
    bucket: String,
    /// The bucket's region.
    #[arg(long, default_value = "us-east-1")]
    region: String,
    /// The access key (moto's test credentials by default).
    #[arg(long, default_value = "testing")]
    access_key_id: String,
    /// The secret key.
    #[arg(long, default_value = "testing")]
    secret_access_key: String,
    /// Block sizes, comma-separated (K, M, G are binary; KiB, MiB, GiB too).
    #[arg(long, default_value = "64KiB,1MiB", value_parser = size_list)]
    blocks: SizeList,
    /// Payload moved per block size: the block count is this over the size (at least one).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    bytes: u64,
    /// Keys per refill call (and per timed group of plain GETs).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// How long one refill call may take, in milliseconds (the cold tier's time budget).
    #[arg(long, default_value_t = 10_000)]
    refill_within_ms: u64,
    /// How long one object store call may take, in milliseconds (both paths).
    #[arg(long, default_value_t = S3_REQUEST_TIMEOUT_MS_DEFAULT)]
    request_timeout_ms: u64,
    /// The folder of the run's objects in the bucket. Default: a fresh one per run.
    #[arg(long)]
    prefix: Option<String>,
    /// Leave the run's objects in the bucket.
    #[arg(long)]
    keep: bool,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Exit status: 0 when every block came back right, 1 when one did not, 2 on a usage or setup
/// error.
pub fn run(args: &ColdBenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache-bench cold: {e}");
            ExitCode::from(2)
        }
    }
}

/// The two paths to one bucket: the cold tier's object layer and a plain `object_store`
/// client, with the runtime the plain one is driven on.
pub(crate) struct Targets {
    pub(crate) cold: Arc<dyn ColdObjects>,
    pub(crate) plain: Arc<dyn ObjectStore>,
    pub(crate) runtime: tokio::runtime::Runtime,
    pub(crate) timeout: Duration,
}

impl Targets {
    /// Runs one plain call within the timeout.
    fn call<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> Result<T, String> {
        match self.runtime.block_on(async { tokio::time::timeout(self.timeout, f).await }) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("plain {what}: {e}")),
            Err(_) => Err(format!("plain {what}: no answer within {:?}", self.timeout)),
        }
    }
}

/// A runtime like the cold tier's own: one worker thread.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("gpucache-bench-cold")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))
}

fn targets(args: &ColdBenchArgs) -> Result<Targets, String> {
    let timeout = Duration::from_millis(args.request_timeout_ms.max(1));
    let mut config = S3Config::new(&args.bucket);
    config.endpoint = Some(args.endpoint.clone());
    config.region.clone_from(&args.region);
    config.access_key_id = Some(args.access_key_id.clone());
    config.secret_access_key = Some(args.secret_access_key.clone());
    config.request_timeout_ms = args.request_timeout_ms.max(1);
    let cold = S3Objects::open(&config).map_err(|e| format!("the cold tier's client: {e}"))?;
    // The same builder the cold tier's client uses, so both paths see the same endpoint.
    let plain = AmazonS3Builder::from_env()
        .with_region(&args.region)
        .with_bucket_name(&args.bucket)
        .with_endpoint(&args.endpoint)
        .with_allow_http(args.endpoint.starts_with("http://"))
        .with_virtual_hosted_style_request(false)
        .with_access_key_id(&args.access_key_id)
        .with_secret_access_key(&args.secret_access_key)
        .build()
        .map_err(|e| format!("the plain client: {e}"))?;
    Ok(Targets { cold: Arc::new(cold), plain: Arc::new(plain), runtime: runtime()?, timeout })
}

/// What one size's run is asked to do.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) size: u64,
    pub(crate) count: u64,
    pub(crate) batch: usize,
    pub(crate) refill_within: Duration,
    /// This size's folder in the bucket.
    pub(crate) prefix: String,
    pub(crate) keep: bool,
    /// Seeds the blocks' keys and contents (distinct per run).
    pub(crate) nonce: u64,
}

/// One block of the run.
struct Block {
    key: PhysicalKey,
    payload: Vec<u8>,
    checksum: Checksum,
}

fn make_blocks(plan: &Plan) -> Result<Vec<Block>, String> {
    let len = usize::try_from(plan.size).map_err(|_| "a block size too large".to_owned())?;
    let revision = format!("bench-cold/{:016x}", plan.nonce);
    (0..plan.count)
        .map(|i| {
            let seed = SplitMix64::mix(&[plan.nonce, plan.size, i]);
            let id = solo_identity(TENANT)
                .model_revision(&revision)
                .chain(vec![digest(seed)])
                .build()
                .map_err(|e| format!("the bench identity is invalid: {e}"))?;
            let mut payload = vec![0u8; len];
            SplitMix64::new(seed).fill_bytes(&mut payload);
            let checksum = Checksum::of(&payload);
            Ok(Block { key: PhysicalKey::new(id), payload, checksum })
        })
        .collect()
}

/// Payload bytes moved in some seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Rate {
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
}

impl Rate {
    pub(crate) fn per_second(self) -> f64 {
        stats::per_second(self.bytes, self.seconds)
    }

    fn json(self) -> Value {
        json!({ "bytes": self.bytes, "seconds": self.seconds, "bytes_per_second": self.per_second() })
    }
}

/// Nearest-rank p50 and p99 of some latencies, in milliseconds.
fn p50_p99_ms(lat: &[Duration]) -> (Option<f64>, Option<f64>) {
    let ns = sorted_nanos(lat);
    (percentile_ms(&ns, 50.0), percentile_ms(&ns, 99.0))
}

/// What one block size measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct SizeRun {
    pub(crate) size: u64,
    pub(crate) count: u64,
    pub(crate) packs: usize,
    pub(crate) pack: Rate,
    pub(crate) unpack: Rate,
    pub(crate) store: Rate,
    pub(crate) bytes_up: u64,
    pub(crate) open_seconds: f64,
    pub(crate) manifests_found: u64,
    pub(crate) refill: Rate,
    pub(crate) refill_batches: Vec<Duration>,
    pub(crate) refill_verified: u64,
    /// Refill misses by reason name, and refusals.
    pub(crate) refill_missed: Vec<(String, u64)>,
    pub(crate) plain_put: Rate,
    pub(crate) plain_get: Rate,
    pub(crate) plain_batches: Vec<Duration>,
    pub(crate) plain_verified: u64,
    pub(crate) deleted_objects: usize,
    /// What went wrong with the blocks (each a failed run).
    pub(crate) problems: Vec<String>,
}

impl SizeRun {
    fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    fn store_ratio(&self) -> Option<f64> {
        let p = self.plain_put.per_second();
        (p > 0.0).then(|| self.store.per_second() / p)
    }

    fn refill_ratio(&self) -> Option<f64> {
        let p = self.plain_get.per_second();
        (p > 0.0).then(|| self.refill.per_second() / p)
    }

    fn json(&self) -> Value {
        let (rp50, rp99) = p50_p99_ms(&self.refill_batches);
        let (pp50, pp99) = p50_p99_ms(&self.plain_batches);
        json!({
            "block_bytes": self.size,
            "block": size_label(self.size),
            "blocks": self.count,
            "payload_bytes": self.size * self.count,
            "pack": { "packs": self.packs, "rate": self.pack.json() },
            "unpack": self.unpack.json(),
            "cold_store": { "rate": self.store.json(), "object_bytes_up": self.bytes_up },
            "cold_open": { "seconds": self.open_seconds, "manifests": self.manifests_found },
            "cold_refill": {
                "rate": self.refill.json(),
                "batches": self.refill_batches.len(),
                "batch_p50_ms": rp50,
                "batch_p99_ms": rp99,
                "verified_bytes": self.refill_verified,
                "missed": self.refill_missed.iter().map(|(k, n)| (k.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
            },
            "plain_put": self.plain_put.json(),
            "plain_get": {
                "rate": self.plain_get.json(),
                "batches": self.plain_batches.len(),
                "batch_p50_ms": pp50,
                "batch_p99_ms": pp99,
                "verified_bytes": self.plain_verified,
            },
            "ratio_store_cold_over_plain": self.store_ratio(),
            "ratio_refill_cold_over_plain": self.refill_ratio(),
            "deleted_objects": self.deleted_objects,
            "verified": self.ok(),
            "problems": self.problems,
        })
    }
}

fn caller() -> Result<Caller, String> {
    let tenant = TenantId::parse(TENANT).map_err(|e| format!("bench tenant: {e}"))?;
    Ok(Caller::new(tenant, Rights::READ_WRITE))
}

/// Packs `blocks` as the sink does (sealing at its default targets), timed.
fn pack(blocks: &[Block], prefix: &str) -> Result<(Vec<SealedPack>, Rate), String> {
    let limits = SinkLimits::default();
    let tenant = caller()?.tenant;
    let start = Instant::now();
    let mut sealed = Vec::new();
    let mut open = PackBuilder::new(tenant.clone());
    for b in blocks {
        let len = b.payload.len() as u64;
        if !open.is_empty()
            && (open.bytes() + len > limits.pack_bytes_target
                || open.len() >= limits.pack_blocks_target)
        {
            let full = std::mem::replace(&mut open, PackBuilder::new(tenant.clone()));
            sealed.push(full.seal(prefix, 0, u64::MAX).map_err(|e| format!("seal: {e}"))?);
        }
        open.push(b.key.clone(), &b.payload, b.checksum);
    }
    if !open.is_empty() {
        sealed.push(open.seal(prefix, 0, u64::MAX).map_err(|e| format!("seal: {e}"))?);
    }
    let bytes = blocks.iter().map(|b| b.payload.len() as u64).sum();
    Ok((sealed, Rate { bytes, seconds: start.elapsed().as_secs_f64() }))
}

/// Decodes every manifest against its name and checks every range, timed.
fn unpack(sealed: &[SealedPack]) -> Result<Rate, String> {
    let start = Instant::now();
    let mut bytes = 0u64;
    for s in sealed {
        let name = name_digest(&s.manifest_name).ok_or("a manifest name without a digest")?;
        let m = Manifest::decode(&s.manifest_bytes, &name).map_err(|e| format!("decode: {e}"))?;
        for e in &m.entries {
            let from = usize::try_from(e.offset).map_err(|_| "offset")?;
            let to = usize::try_from(e.offset + e.len).map_err(|_| "range")?;
            let range = s.pack.get(from..to).ok_or("a range outside its pack")?;
            if Checksum::of(range) != e.checksum {
                return Err("a packed block does not match its checksum".into());
            }
            bytes += e.len;
        }
    }
    Ok(Rate { bytes, seconds: start.elapsed().as_secs_f64() })
}

fn cold_config(prefix: &str) -> ColdConfig {
    ColdConfig { prefix: prefix.to_owned(), retention_s: 0, ..ColdConfig::default() }
}

/// Offers every block to a sink and drains it into a fresh tier, timed.
fn store(t: &Targets, blocks: &[Block], prefix: &str) -> Result<(Rate, u64), String> {
    let (tier, _) = ColdTier::open(Arc::clone(&t.cold), cold_config(prefix), Arc::new(UnixClock))
        .map_err(|e| format!("open the cold tier: {e}"))?;
    let sink = ColdSink::new(SinkLimits::default());
    let drain = |sink: &ColdSink| -> Result<(), String> {
        let r = sink.drain_round(&tier);
        match r.first_error {
            Some((_, e)) if r.failed > 0 => Err(format!("cold store: {e}")),
            _ => Ok(()),
        }
    };
    let start = Instant::now();
    for b in blocks {
        match sink.offer(&tier, &b.key, &b.payload, b.checksum) {
            Ok(()) => {}
            Err(SinkRefused::Full { .. }) => {
                // Over the sink's bounds: store what it holds, then offer again.
                drain(&sink)?;
                sink.offer(&tier, &b.key, &b.payload, b.checksum)
                    .map_err(|e| format!("the sink refused a block after a drain: {e}"))?;
            }
            Err(e) => return Err(format!("the sink refused a block: {e}")),
        }
    }
    let mut rounds = 0;
    loop {
        drain(&sink)?;
        let depth = sink.depth();
        if depth.pending == 0 && depth.open_packs == 0 {
            break;
        }
        rounds += 1;
        if rounds > DRAIN_ROUNDS_MAX {
            return Err(format!("the sink still holds {depth:?} after {rounds} drain rounds"));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let bytes = blocks.iter().map(|b| b.payload.len() as u64).sum();
    Ok((Rate { bytes, seconds }, tier.stats().bytes_up))
}

/// Opens the tier afresh and refills every block in batches, checking each.
fn refill(t: &Targets, blocks: &[Block], plan: &Plan, run: &mut SizeRun) -> Result<(), String> {
    let caller = caller()?;
    let start = Instant::now();
    let (tier, report) =
        ColdTier::open(Arc::clone(&t.cold), cold_config(&plan.prefix_cold()), Arc::new(UnixClock))
            .map_err(|e| format!("reopen the cold tier: {e}"))?;
    run.open_seconds = start.elapsed().as_secs_f64();
    run.manifests_found = report.manifests;
    let batch_bytes = plan.size.saturating_mul(plan.batch as u64);
    let budget = RefillBudget {
        bytes_max: REFILL_BYTES_MAX_DEFAULT.max(batch_bytes),
        within: plan.refill_within,
    };
    let mut missed: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    let mut spent = Duration::ZERO;
    for chunk in blocks.chunks(plan.batch.max(1)) {
        let keys: Vec<&PhysicalKey> = chunk.iter().map(|b| &b.key).collect();
        let t0 = Instant::now();
        let answers = tier.refill(&caller, &keys, budget);
        let took = t0.elapsed();
        spent += took;
        run.refill_batches.push(took);
        for (b, a) in chunk.iter().zip(answers) {
            match a {
                Ok(Refilled::Hit { bytes, .. }) if bytes == b.payload => {
                    run.refill_verified += bytes.len() as u64;
                }
                Ok(Refilled::Hit { bytes, .. }) => {
                    *missed.entry("wrong_bytes".into()).or_default() += 1;
                    note(run, format!("a refill of {} bytes came back wrong", bytes.len()));
                }
                Ok(Refilled::Miss(why)) => {
                    *missed.entry(why.name().into()).or_default() += 1;
                    note(run, format!("a refill missed: {}", why.name()));
                }
                Err(e) => {
                    *missed.entry("refused".into()).or_default() += 1;
                    note(run, format!("a refill was refused: {e}"));
                }
            }
        }
    }
    run.refill = Rate { bytes: run.refill_verified, seconds: spent.as_secs_f64() };
    run.refill_missed = missed.into_iter().collect();
    Ok(())
}

/// Records a problem, keeping the first few of a long run of them.
fn note(run: &mut SizeRun, what: String) {
    const KEPT: usize = 16;
    if run.problems.len() < KEPT {
        run.problems.push(what);
    } else if run.problems.len() == KEPT {
        run.problems.push("(more problems left out)".into());
    }
}

impl Plan {
    fn prefix_cold(&self) -> String {
        format!("{}/cold", self.prefix)
    }

    fn plain_path(&self, i: usize) -> Result<ObjectPath, String> {
        let name = format!("{}/plain/{i:08}", self.prefix);
        ObjectPath::parse(&name).map_err(|e| format!("object name {name:?}: {e}"))
    }
}

/// Each block as its own object: PUTs, then GETs checked byte for byte, timed.
fn plain(t: &Targets, blocks: &[Block], plan: &Plan, run: &mut SizeRun) -> Result<(), String> {
    let paths: Vec<ObjectPath> =
        (0..blocks.len()).map(|i| plan.plain_path(i)).collect::<Result<_, _>>()?;
    let bytes: u64 = blocks.iter().map(|b| b.payload.len() as u64).sum();
    let start = Instant::now();
    for (b, p) in blocks.iter().zip(&paths) {
        let payload = PutPayload::from(b.payload.clone());
        t.call("put", t.plain.put(p, payload))?;
    }
    run.plain_put = Rate { bytes, seconds: start.elapsed().as_secs_f64() };
    let mut spent = Duration::ZERO;
    for (chunk, chunk_paths) in
        blocks.chunks(plan.batch.max(1)).zip(paths.chunks(plan.batch.max(1)))
    {
        let mut took = Duration::ZERO;
        for (b, p) in chunk.iter().zip(chunk_paths) {
            let t0 = Instant::now();
            let got = t.call("get", async { t.plain.get(p).await?.bytes().await })?;
            took += t0.elapsed();
            if got[..] == b.payload[..] {
                run.plain_verified += got.len() as u64;
            } else {
                note(run, format!("a plain GET of {p} came back wrong ({} bytes)", got.len()));
            }
        }
        spent += took;
        run.plain_batches.push(took);
    }
    run.plain_get = Rate { bytes: run.plain_verified, seconds: spent.as_secs_f64() };
    if !plan.keep {
        for p in &paths {
            t.call("delete", t.plain.delete(p))?;
        }
        run.deleted_objects += paths.len();
    }
    Ok(())
}

/// Deletes what the cold tier wrote under the plan's prefix; how many objects.
fn clean_cold(t: &Targets, plan: &Plan) -> Result<usize, String> {
    let folder = format!("{}/", plan.prefix_cold());
    let names = t.cold.list(&folder).map_err(|e| format!("list {folder}: {e}"))?;
    for (name, _) in &names {
        t.cold.delete(name).map_err(|e| format!("delete {name}: {e}"))?;
    }
    Ok(names.len())
}

/// Everything one block size measures (see the module documentation).
pub(crate) fn measure(t: &Targets, plan: &Plan) -> Result<SizeRun, String> {
    let blocks = make_blocks(plan)?;
    let mut run = SizeRun { size: plan.size, count: plan.count, ..SizeRun::default() };
    let (sealed, rate) = pack(&blocks, &plan.prefix_cold())?;
    run.packs = sealed.len();
    run.pack = rate;
    run.unpack = unpack(&sealed)?;
    drop(sealed);
    let (rate, up) = store(t, &blocks, &plan.prefix_cold())?;
    run.store = rate;
    run.bytes_up = up;
    refill(t, &blocks, plan, &mut run)?;
    if !plan.keep {
        run.deleted_objects += clean_cold(t, plan)?;
    }
    plain(t, &blocks, plan, &mut run)?;
    Ok(run)
}

fn mbps(r: Rate) -> String {
    format!("{:.1}", r.per_second() / 1e6)
}

/// The summary table (MB/s = 1e6 payload bytes per second).
fn summary(runs: &[SizeRun]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>6} {:>7} {:>6} {:>9} {:>9} {:>10} {:>10} {:>6} {:>10} {:>10} {:>6} {:>17} {:>17}",
        "block",
        "blocks",
        "packs",
        "pack",
        "unpack",
        "cold put",
        "plain put",
        "ratio",
        "refill",
        "plain get",
        "ratio",
        "refill p50/p99 ms",
        "plain p50/p99 ms"
    );
    for r in runs {
        let (rp50, rp99) = p50_p99_ms(&r.refill_batches);
        let (pp50, pp99) = p50_p99_ms(&r.plain_batches);
        let _ = writeln!(
            s,
            "{:>6} {:>7} {:>6} {:>9} {:>9} {:>10} {:>10} {:>6} {:>10} {:>10} {:>6} {:>17} {:>17}",
            size_label(r.size),
            r.count,
            r.packs,
            mbps(r.pack),
            mbps(r.unpack),
            mbps(r.store),
            mbps(r.plain_put),
            cell(r.store_ratio(), 2),
            mbps(r.refill),
            mbps(r.plain_get),
            cell(r.refill_ratio(), 2),
            format!("{}/{}", cell(rp50, 1), cell(rp99, 1)),
            format!("{}/{}", cell(pp50, 1), cell(pp99, 1)),
        );
    }
    s
}

fn run_inner(args: &ColdBenchArgs) -> Result<bool, String> {
    if args.blocks.0.is_empty() {
        return Err("--blocks names no size".into());
    }
    if args.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    if args.bytes > BYTES_MAX {
        return Err(format!("--bytes is at most {}", size_label(BYTES_MAX)));
    }
    for &size in &args.blocks.0 {
        if size > gpucache_cold::manifest::PACK_BYTES_MAX {
            return Err(format!("--blocks {}: a block must fit a pack", size_label(size)));
        }
        if args.bytes.div_ceil(size) > BLOCKS_MAX {
            return Err(format!("--blocks {}: more than {BLOCKS_MAX} blocks", size_label(size)));
        }
    }
    let load_start = loadavg();
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos() & u128::from(u64::MAX)).unwrap_or(0));
    let base = args.prefix.clone().unwrap_or_else(|| format!("gpucache-bench-cold/{nonce:016x}"));
    let t = targets(args)?;
    eprintln!(
        "bench cold: {} bucket {} under {base}/, {} per block size, batch {} (load average {load_start})",
        args.endpoint,
        args.bucket,
        size_label(args.bytes),
        args.batch
    );
    let mut runs = Vec::new();
    for &size in &args.blocks.0 {
        let plan = Plan {
            size,
            count: args.bytes.div_ceil(size).max(1),
            batch: args.batch,
            refill_within: Duration::from_millis(args.refill_within_ms.max(1)),
            prefix: format!("{base}/{}", size_label(size)),
            keep: args.keep,
            nonce,
        };
        let start = Instant::now();
        let run = measure(&t, &plan)?;
        eprintln!(
            "bench cold: {} x {}: {:.1} s{}",
            plan.count,
            size_label(size),
            start.elapsed().as_secs_f64(),
            if run.ok() { String::new() } else { format!(", FAILED: {}", run.problems.join("; ")) }
        );
        runs.push(run);
    }
    let ok = runs.iter().all(SizeRun::ok);
    eprint!("{}", summary(&runs));
    eprintln!(
        "bench cold: MB/s = 1e6 payload bytes per second, one call at a time; pack/unpack in \
         process; ratio = cold / plain; p50/p99 per batch of {} keys (a refill call, or that \
         many plain GETs); load average {} at the end{}",
        args.batch,
        loadavg(),
        if ok { "" } else { "; SOME BLOCKS CAME BACK WRONG OR MISSING" }
    );
    let command: Vec<String> = std::env::args().collect();
    let doc = json!({
        "bench": "cold",
        "command": command,
        "date": utc_now(),
        "git_commit": git_commit(),
        "machine": machine(&load_start),
        "endpoint": args.endpoint,
        "bucket": args.bucket,
        "prefix": base,
        "bytes_per_size": args.bytes,
        "batch": args.batch,
        "refill_within_ms": args.refill_within_ms,
        "pack_targets": {
            "bytes": SinkLimits::default().pack_bytes_target,
            "blocks": SinkLimits::default().pack_blocks_target,
        },
        "verified": ok,
        "sizes": runs.iter().map(SizeRun::json).collect::<Vec<_>>(),
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| format!("JSON: {e}"))?;
    if let Some(path) = &args.json {
        write_file(path, &text)?;
        eprintln!("bench cold: JSON written to {}", path.display());
    }
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use std::ops::Range;

    use gpucache_cold::{ColdError, MemoryObjects};
    use object_store::memory::InMemory;

    use super::*;

    fn local(cold: Arc<dyn ColdObjects>) -> Targets {
        Targets {
            cold,
            plain: Arc::new(InMemory::new()),
            runtime: runtime().unwrap_or_else(|e| panic!("{e}")),
            timeout: Duration::from_secs(10),
        }
    }

    fn plan(size: u64, count: u64, batch: usize) -> Plan {
        Plan {
            size,
            count,
            batch,
            refill_within: Duration::from_secs(10),
            prefix: format!("t/{}", size_label(size)),
            keep: false,
            nonce: 7,
        }
    }

    #[test]
    fn every_block_comes_back_by_both_paths_and_the_bucket_is_left_empty() {
        let objects = Arc::new(MemoryObjects::new(1 << 30));
        let t = local(Arc::clone(&objects) as Arc<dyn ColdObjects>);
        // 300 blocks: two packs at the sink's 256-block target.
        let run = measure(&t, &plan(4096, 300, 32)).unwrap_or_else(|e| panic!("{e}"));
        assert!(run.ok(), "{:?}", run.problems);
        assert_eq!(run.packs, 2);
        assert_eq!(run.manifests_found, 2, "the reopened tier found both manifests");
        assert_eq!(run.refill_verified, 300 * 4096);
        assert_eq!(run.plain_verified, 300 * 4096);
        assert_eq!(run.refill_batches.len(), 10);
        assert_eq!(run.plain_batches.len(), 10);
        assert!(run.bytes_up > 300 * 4096, "packs and manifests went up");
        assert_eq!(run.deleted_objects, 4 + 300, "two packs, two manifests, 300 plain objects");
        assert!(objects.list("").unwrap_or_else(|e| panic!("{e}")).is_empty());
        let doc = run.json();
        assert_eq!(doc["verified"], json!(true));
        assert!(doc["ratio_refill_cold_over_plain"].as_f64().is_some());
        assert!(summary(&[run]).contains("4K"));
    }

    /// A store whose pack ranges come back with one byte flipped.
    struct Flipping(MemoryObjects);

    impl ColdObjects for Flipping {
        fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError> {
            self.0.put_new(key, bytes)
        }
        fn head(&self, key: &str) -> Result<Option<u64>, ColdError> {
            self.0.head(key)
        }
        fn get_range(
            &self,
            key: &str,
            range: Range<u64>,
            within: Duration,
        ) -> Result<Vec<u8>, ColdError> {
            let mut b = self.0.get_range(key, range, within)?;
            if key.contains("/packs/")
                && let Some(x) = b.first_mut()
            {
                *x ^= 1;
            }
            Ok(b)
        }
        fn delete(&self, key: &str) -> Result<(), ColdError> {
            self.0.delete(key)
        }
        fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError> {
            self.0.list(prefix)
        }
    }

    #[test]
    fn a_damaged_refill_fails_the_run() {
        let t = local(Arc::new(Flipping(MemoryObjects::new(1 << 30))));
        let run = measure(&t, &plan(1024, 8, 4)).unwrap_or_else(|e| panic!("{e}"));
        assert!(!run.ok());
        // The first block of each batch is the damaged one: the tier finds it corrupt.
        assert_eq!(run.refill_missed, vec![("corrupt".to_owned(), 2)]);
        assert_eq!(run.refill_verified, 6 * 1024);
        assert_eq!(run.plain_verified, 8 * 1024, "the plain path is unaffected");
    }

    #[test]
    fn rates_and_percentiles() {
        let r = Rate { bytes: 2_000_000, seconds: 0.5 };
        assert!((r.per_second() - 4e6).abs() < 1e-6);
        assert_eq!(Rate::default().per_second(), 0.0);
        let lat: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let (p50, p99) = p50_p99_ms(&lat);
        assert_eq!((p50, p99), (Some(50.0), Some(99.0)));
        assert_eq!(p50_p99_ms(&[]), (None, None));
    }
}
