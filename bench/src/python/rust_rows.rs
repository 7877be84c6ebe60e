//! The Rust client's rows of `gpucache-bench python`: one [`TcpStore`] in this process, over
//! TCP or the same-host path, moving a pool batch by batch with `put_batch` / `get_batch` the
//! way the Python driver (`bench/peers/gpucache_py_bench.py`) moves it with `batch_put_from` /
//! `batch_get_into`: the same names, the same pool and destination, the same phases.

use std::time::{Duration, Instant};

use gpucache_client::{ClientConfig, LocalConfig, TcpStore};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{BatchGet, BatchPut, Get, Put, Store};
use gpucache_service::resp::IdentityTemplate;
use gpucache_storage::host::segment::SharedBuf;

use super::types::{Buffers, Measurement, Point};
use crate::service::load::{PhaseStats, ValuePattern};
use crate::service::ours::Service;
use crate::stats::{self, nanos};

/// Segment of a same-host client whose buffers are not in it (bounce space only).
pub(super) const BOUNCE_SEGMENT_BYTES: u64 = 64 << 20;
/// Room beyond the pool and the destination in a segment that holds both.
pub(super) const SEGMENT_SLACK_BYTES: u64 = 8 << 20;

/// How many batches the pool of a point holds.
pub(super) fn batches(point: Point, working_set_bytes: u64) -> usize {
    let batch = (point.items as u64) * point.size;
    usize::try_from((working_set_bytes / batch).max(1)).unwrap_or(1)
}

/// The names of a measurement's values, `<prefix>-k<i>`, as plain keys of the tenant.
pub(super) fn keys(
    ns: &IdentityTemplate,
    prefix: &str,
    count: usize,
) -> Result<Vec<PhysicalKey>, String> {
    (0..count)
        .map(|i| ns.key_for(format!("{prefix}-k{i}").as_bytes()).map_err(|e| format!("key: {e}")))
        .collect()
}

/// Client memory: plain host memory, or a range of the segment shared with the server.
enum Buf {
    Host(Vec<u8>),
    Shared(SharedBuf),
}

impl Buf {
    fn bytes(&self) -> &[u8] {
        match self {
            Buf::Host(v) => v,
            Buf::Shared(s) => s,
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Buf::Host(v) => v,
            Buf::Shared(s) => s,
        }
    }
}

fn phase_stats(mut lat_ns: Vec<u64>, ok_items: u64, size: u64, seconds: f64) -> PhaseStats {
    lat_ns.sort_unstable();
    PhaseStats {
        ops: lat_ns.len() as u64,
        bytes: ok_items * size,
        seconds,
        p50_us: stats::percentile_us(&lat_ns, 50.0),
        p99_us: stats::percentile_us(&lat_ns, 99.0),
        errors: 0,
    }
}

/// One measurement of the Rust client at `point`.
#[allow(clippy::too_many_arguments)]
pub(super) fn measure(
    service: &Service,
    local: bool,
    buffers: Buffers,
    point: Point,
    working_set_bytes: u64,
    phase: Duration,
    prefix: &str,
    ns: &IdentityTemplate,
) -> Result<Measurement, String> {
    let (n, size) = (point.items, gpucache_service::units::narrow(point.size));
    let batch_bytes = n * size;
    let batches = batches(point, working_set_bytes);
    let pool_bytes = batches * batch_bytes;
    let mut config = ClientConfig::new(service.native, service.caller.clone());
    config.client_name = "gpucache-bench-python".into();
    config.deadline = Duration::from_secs(60);
    if local {
        let mut l = LocalConfig::negotiated();
        l.segment_bytes = match buffers {
            Buffers::Segment => (pool_bytes + batch_bytes) as u64 + SEGMENT_SLACK_BYTES,
            Buffers::Host => BOUNCE_SEGMENT_BYTES,
        };
        config.local = Some(l);
    }
    let store = TcpStore::new(config);
    store.handshake(&service.caller).map_err(|e| format!("connect: {e}"))?;
    let (mut pool, mut dst) = match buffers {
        Buffers::Host => (Buf::Host(vec![0; pool_bytes]), Buf::Host(vec![1; batch_bytes])),
        Buffers::Segment => {
            let no_room = || "the segment has no room for the pool".to_owned();
            let p = store.shared_buffer(pool_bytes).ok_or_else(no_room)?;
            let mut d = store.shared_buffer(batch_bytes).ok_or_else(no_room)?;
            d.fill(1);
            (Buf::Shared(p), Buf::Shared(d))
        }
    };
    let pattern = ValuePattern::new(size);
    let base = pattern.buffer();
    for (i, value) in pool.bytes_mut().chunks_exact_mut(size).enumerate() {
        value.copy_from_slice(&base);
        ValuePattern::stamp(value, i as u64);
    }
    let keys = keys(ns, prefix, batches * n)?;
    let caller = &service.caller;

    // PUT: each batch of the pool once, until the deadline.
    let mut lat = Vec::with_capacity(batches);
    let mut stored = 0usize;
    let start = Instant::now();
    let deadline = start + phase;
    let src = pool.bytes();
    for j in 0..batches {
        if Instant::now() >= deadline {
            break;
        }
        let t0 = Instant::now();
        let items: Vec<BatchPut<'_>> = (0..n)
            .map(|i| {
                let at = (j * n + i) * size;
                BatchPut { key: &keys[j * n + i], src: &src[at..at + size], request: None }
            })
            .collect();
        let answers = store.put_batch(caller, &items);
        lat.push(nanos(t0.elapsed()));
        if let Some((i, a)) =
            answers.iter().enumerate().find(|(_, a)| !matches!(a, Ok(Put::Committed(_))))
        {
            return Err(format!("PUT batch {j} item {i}: {a:?}"));
        }
        stored += 1;
    }
    let put = phase_stats(lat, (stored * n) as u64, point.size, start.elapsed().as_secs_f64());
    if stored == 0 {
        return Err("no PUT batch ran before the deadline".into());
    }

    // GET: the stored batches in a cycle, until the deadline.
    let mut lat = Vec::new();
    let mut j = 0usize;
    let start = Instant::now();
    let deadline = start + phase;
    while Instant::now() < deadline {
        let b = j % stored;
        let t0 = Instant::now();
        let answers = read_batch(&store, caller, &keys[b * n..(b + 1) * n], dst.bytes_mut(), size);
        lat.push(nanos(t0.elapsed()));
        check_gets(&answers, size).map_err(|e| format!("GET batch {b}: {e}"))?;
        j += 1;
    }
    let get = phase_stats(lat, (j * n) as u64, point.size, start.elapsed().as_secs_f64());

    // Verify: the last batch read, again into a zeroed destination, byte for byte.
    let last = (j.max(1) - 1) % stored;
    dst.bytes_mut().fill(0);
    let answers =
        read_batch(&store, caller, &keys[last * n..(last + 1) * n], dst.bytes_mut(), size);
    let same = check_gets(&answers, size).is_ok()
        && *dst.bytes() == pool.bytes()[last * batch_bytes..(last + 1) * batch_bytes];
    let stats = store.shared_stats();
    Ok(Measurement {
        put: Some(put),
        get: Some(get),
        verified: if same { n as u64 } else { 0 },
        mismatches: if same { 0 } else { n as u64 },
        direct_items: local.then_some(stats.direct_items),
        bounced_items: local.then_some(stats.bounced_items),
        layer_us: None,
    })
}

/// One `get_batch` of `keys` into consecutive `size`-byte values of `dst`.
fn read_batch(
    store: &TcpStore,
    caller: &gpucache_dataplane::caller::Caller,
    keys: &[PhysicalKey],
    dst: &mut [u8],
    size: usize,
) -> Vec<Result<Get, gpucache_dataplane::store::StoreError>> {
    let mut items: Vec<BatchGet<'_>> =
        dst.chunks_exact_mut(size).zip(keys).map(|(d, key)| BatchGet { key, dst: d }).collect();
    store.get_batch(caller, &mut items)
}

fn check_gets(
    answers: &[Result<Get, gpucache_dataplane::store::StoreError>],
    size: usize,
) -> Result<(), String> {
    for (i, a) in answers.iter().enumerate() {
        match a {
            Ok(Get::Hit { len, .. }) if usize::try_from(*len) == Ok(size) => {}
            other => return Err(format!("item {i}: {other:?}")),
        }
    }
    Ok(())
}

/// Removes a measurement's values (untimed, between measurements), so the server holds at most
/// one pool at a time.
pub(super) fn remove_all(service: &Service, keys: &[PhysicalKey]) -> Result<(), String> {
    let mut config = ClientConfig::new(service.native, service.caller.clone());
    config.client_name = "gpucache-bench-python-janitor".into();
    let store = TcpStore::new(config);
    for chunk in keys.chunks(gpucache_wire::BATCH_ITEMS_MAX) {
        let refs: Vec<&PhysicalKey> = chunk.iter().collect();
        for a in store.invalidate_batch(&service.caller, &refs) {
            a.map_err(|e| format!("remove: {e}"))?;
        }
    }
    Ok(())
}
