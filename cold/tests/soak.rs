//! The sink under seeded faults against moto for a minute (GPUCACHE_COLD_SOAK_S seconds): no
//! block the sink took is ever lost. Each one ends up stored (a fresh tier opened from the
//! bucket serves its exact bytes) after the failed jobs are tried again on a healed store.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use gpucache_cold::moto::{open, start};
use gpucache_cold::{
    ColdConfig, ColdSink, ColdTier, FaultPlan, FaultyObjects, RefillBudget, Refilled, SinkLimits,
    SinkRefused,
};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::UnixClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::testing::fixture;

/// Key digest -> (tenant, n, len) of every block the sink took.
type Taken = BTreeMap<[u8; 32], (usize, u64, usize)>;

/// A count of what happened (a block offered, a drain round done), to wait on with a deadline.
#[derive(Debug, Default)]
struct Events {
    count: Mutex<u64>,
    changed: Condvar,
}

impl Events {
    fn seen(&self) -> u64 {
        *self.count.lock().expect("events")
    }
    fn bump(&self) {
        *self.count.lock().expect("events") += 1;
        self.changed.notify_all();
    }
    /// Waits until something happened after `seen`, for at most `within`.
    fn wait_past(&self, seen: u64, within: Duration) {
        let count = self.count.lock().expect("events");
        let _ = self.changed.wait_timeout_while(count, within, |c| *c == seen).expect("events");
    }
}

fn seconds() -> u64 {
    std::env::var("GPUCACHE_COLD_SOAK_S").ok().and_then(|s| s.parse().ok()).unwrap_or(60)
}

fn block(tenant: usize, n: u64, len: usize) -> (PhysicalKey, Vec<u8>) {
    let key = fixture::key(tenant, &n.to_le_bytes(), KvDtype::F16, 16);
    (key, fixture::payload(n ^ ((tenant as u64) << 40), len))
}

#[test]
fn a_sink_under_faults_loses_no_block_it_took() {
    let Some(moto) = start("soak") else { return };
    let plan = FaultPlan {
        seed: 42,
        server_errors: 80,
        timeouts: 40,
        lost_acks: 80,
        torn_ranges: 0,
        slow: 30,
        latency_ms: 25,
    };
    let faulty = Arc::new(FaultyObjects::new(open(&moto, "soak"), plan));
    let (tier, _) =
        ColdTier::open(faulty.clone(), ColdConfig::default(), Arc::new(UnixClock)).expect("open");
    let tier = Arc::new(tier);
    let (healed, _) =
        ColdTier::open(Arc::new(open(&moto, "soak")), ColdConfig::default(), Arc::new(UnixClock))
            .expect("open healed");
    let limits = SinkLimits {
        jobs_max: 32,
        bytes_max: 8 << 20,
        drain_jobs_max: 8,
        pack_bytes_target: 512 << 10,
        pack_blocks_target: 32,
        pack_open_ms_max: 100,
    };
    let sink = Arc::new(ColdSink::new(limits));
    let stop = Arc::new(AtomicBool::new(false));
    let taken: Arc<Mutex<Taken>> = Arc::default();
    let refused = Arc::new(Mutex::new(0u64));
    let events = Arc::new(Events::default());

    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (tier, sink, stop) = (tier.clone(), sink.clone(), stop.clone());
            let (taken, refused, events) = (taken.clone(), refused.clone(), events.clone());
            std::thread::spawn(move || {
                let mut rng = SplitMix64::new(1000 + w);
                let mut n = w << 32;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let tenant = (rng.next_u64() % 3) as usize;
                    let len = 1024 + (rng.next_u64() % (63 * 1024)) as usize;
                    let (key, bytes) = block(tenant, n, len);
                    let seen = events.seen();
                    match sink.offer(&tier, &key, &bytes, Checksum::of(&bytes)) {
                        Ok(()) => {
                            taken.lock().expect("taken").insert(key.digest().0, (tenant, n, len));
                            events.bump();
                        }
                        Err(SinkRefused::Full { .. }) => {
                            *refused.lock().expect("refused") += 1;
                            // Room comes with the next drain round: wait for it, or a second.
                            events.wait_past(seen, Duration::from_secs(1));
                        }
                        Err(e) => panic!("unexpected refusal {e:?}"),
                    }
                }
            })
        })
        .collect();

    let deadline = Instant::now() + Duration::from_secs(seconds());
    let (mut rounds, mut stored, mut retried, mut failed) = (0u64, 0usize, 0usize, 0usize);
    while Instant::now() < deadline {
        let seen = events.seen();
        let r = sink.drain_round(&tier);
        events.bump();
        rounds += 1;
        stored += r.stored;
        retried += r.retried;
        failed += r.failed;
        if r.attempted == 0 {
            // Nothing was due: wait for a writer's next block (or a tenth of a second).
            events.wait_past(seen, Duration::from_millis(100));
        }
        // Failed jobs go back for another set of tries while the faults go on.
        for f in sink.failed() {
            assert!(f.error.is_transient(), "only injected faults here: {f:?}");
            sink.retry_failed(f.id);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().expect("writer");
    }

    // Heal: the same bucket without faults (a tier opened before anything was stored, so
    // opening it read nothing), every job left tried until none is.
    sink.seal_open(&healed);
    for _ in 0..10_000 {
        for f in sink.failed() {
            sink.retry_failed(f.id);
        }
        let r = sink.drain_round(&healed);
        stored += r.stored;
        let d = sink.depth();
        if d.pending == 0 && d.failed == 0 && d.open_packs == 0 {
            break;
        }
    }
    let depth = sink.depth();
    assert_eq!((depth.pending, depth.failed, depth.open_packs, depth.bytes), (0, 0, 0, 0));
    let taken = taken.lock().expect("taken").clone();
    let refused = *refused.lock().expect("refused");
    eprintln!(
        "soak: {}s, {rounds} rounds, {} blocks taken, {refused} refused at the limits, {stored} jobs stored, {retried} retried, {failed} sent to the failed queue",
        seconds(),
        taken.len()
    );
    assert!(taken.len() > 100, "the writers got blocks in");
    assert!(retried > 0 && failed > 0, "the faults struck: {retried} retried, {failed} failed");
    assert!(faulty.faults().contains(&gpucache_cold::FaultKind::LostAck));

    // A tier opened from the bucket alone serves every block the sink took, byte for byte.
    let (fresh, report) =
        ColdTier::open(Arc::new(open(&moto, "soak")), ColdConfig::default(), Arc::new(UnixClock))
            .expect("open fresh");
    assert!(report.blocks >= taken.len() as u64, "{report:?} for {} blocks", taken.len());
    let budget = RefillBudget { bytes_max: 1 << 30, within: Duration::from_secs(60) };
    // In the order they were offered, so that a batch's blocks share few packs.
    let mut order: Vec<(usize, u64, usize)> = taken.values().copied().collect();
    order.sort_by_key(|&(tenant, n, _)| (tenant, n));
    let blocks: Vec<(usize, u64, PhysicalKey, Vec<u8>)> = order
        .into_iter()
        .map(|(tenant, n, len)| {
            let (key, bytes) = block(tenant, n, len);
            (tenant, n, key, bytes)
        })
        .collect();
    for tenant in 0..3 {
        let mine: Vec<&(usize, u64, PhysicalKey, Vec<u8>)> =
            blocks.iter().filter(|b| b.0 == tenant).collect();
        for part in mine.chunks(512) {
            let keys: Vec<&PhysicalKey> = part.iter().map(|b| &b.2).collect();
            let answers = fresh.refill(&fixture::caller(tenant), &keys, budget);
            for (b, a) in part.iter().zip(answers) {
                match a {
                    Ok(Refilled::Hit { bytes, .. }) => {
                        assert!(bytes == b.3, "block {} differs", b.1)
                    }
                    other => panic!("block {} of tenant {tenant} was lost: {other:?}", b.1),
                }
            }
        }
    }
}
