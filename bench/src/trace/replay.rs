//! Replaying a trace through a real [`Store`].
//!
//! Block `i` of a request is the key whose identity chain is the request's ids `0..=i` (each id
//! a 32-byte link drawn from it), under one tenant. Per request: GET blocks in order into one
//! caller buffer until the first miss, verifying each hit byte for byte against the block's
//! content (from its id and the block size); the leading verified hits are the request's prefix
//! hits. A hit whose bytes differ is counted as a mismatch and ends the prefix like a miss. Then
//! every block from the first miss to the end is PUT (`AlreadyCommitted` is fine).

use std::time::{Duration, Instant};

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::identity::Digest32;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, MissReason, Put, Store};
use serde::Serialize;

use super::load::{BLOCK_TOKENS, Trace};
use crate::file::solo_identity;
use crate::fixtures::digest;
use crate::stats;

/// The tenant of the in-process stores, and of a server run unless `--tenant` says otherwise.
pub(super) const TENANT: &str = "default";
/// Failed calls after which a replay stops (a dead server would otherwise fail every call).
pub(super) const ERRORS_MAX: u64 = 1000;
/// Mixed into every id to seed its block's content.
const CONTENT_SEED: u64 = 0x7ace_b10c_c0de_0001;

/// What one replay measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Replay {
    pub requests: u64,
    pub refs: u64,
    /// Verified leading hits over all requests.
    pub hits: u64,
    /// GETs that answered a hit whose bytes were not the block's.
    pub mismatches: u64,
    /// GETs the store answered as a corrupt miss (it found the damage itself).
    pub corrupt_misses: u64,
    pub puts_committed: u64,
    pub puts_already_committed: u64,
    /// PUTs answered Busy or Refused.
    pub puts_not_stored: u64,
    /// Calls that returned an error.
    pub errors: u64,
    pub first_error: Option<String>,
    /// Whether the replay stopped early after [`ERRORS_MAX`] errors.
    pub aborted: bool,
    pub verified_get_bytes: u64,
    /// Time in GET calls.
    pub get_seconds: f64,
    /// Time in this store's calls and in verifying its hits (not in making keys).
    pub seconds: f64,
}

impl Replay {
    pub fn ratio(&self) -> f64 {
        stats::share(self.hits, self.refs)
    }

    /// Verified GET bytes per second of GET calls, in GB/s.
    pub fn get_gbps(&self) -> f64 {
        stats::gbps(self.verified_get_bytes, self.get_seconds)
    }

    /// Requests per second of the store's own time.
    pub fn requests_per_second(&self) -> f64 {
        stats::per_second(self.requests, self.seconds)
    }

    /// Whether nothing went wrong: no mismatch, no corrupt block, no error, no PUT turned away.
    pub fn clean(&self) -> bool {
        self.mismatches == 0
            && self.corrupt_misses == 0
            && self.errors == 0
            && self.puts_not_stored == 0
            && !self.aborted
    }

    fn error(&mut self, what: String) {
        self.errors += 1;
        self.first_error.get_or_insert(what);
        self.aborted = self.errors >= ERRORS_MAX;
    }
}

/// The key of `tenant`'s block whose chain is `links`, in `namespace` (a run against a shared
/// server uses a fresh one, so that earlier runs' blocks are not found).
pub(super) fn key(tenant: &str, namespace: &str, links: &[Digest32], tokens: u32) -> PhysicalKey {
    // 512-token blocks, as the traces' ids stand for; a namespace of its own per run.
    let id = solo_identity(tenant)
        .trust_domain("bench-trace")
        .model_revision(&format!("trace/{namespace}"))
        .chain(links.to_vec())
        .block_tokens(BLOCK_TOKENS)
        .valid_tokens(tokens)
        .build();
    match id {
        Ok(id) => PhysicalKey::new(id),
        Err(e) => panic!("the trace identity is invalid: {e}"),
    }
}

/// The content of the block with trace id `id` at `dst.len()` bytes.
pub(super) fn content(id: u64, dst: &mut [u8]) {
    let size = u64::try_from(dst.len()).unwrap_or(u64::MAX);
    SplitMix64::new(id ^ CONTENT_SEED ^ size.rotate_left(32)).fill_bytes(dst);
}

/// Replays `trace` through every store of `stores` in lockstep, with blocks of `block` bytes:
/// each request's keys are built once and then walked through each store in turn, so that the
/// client-side cost of making keys is shared and each store's own time is what its calls (and
/// the verification of its hits) took. `progress` hears the number of requests done.
pub fn replay(
    stores: &[&dyn Store],
    caller: &Caller,
    trace: &Trace,
    namespace: &str,
    block: usize,
    progress: &mut dyn FnMut(usize),
) -> Vec<Replay> {
    let mut outs = vec![Replay::default(); stores.len()];
    let mut times = vec![(Duration::ZERO, Duration::ZERO); stores.len()];
    let mut dst = vec![0u8; block];
    let mut expect = vec![0u8; block];
    for (n, ids) in trace.ids.iter().enumerate() {
        let links: Vec<Digest32> = ids.iter().map(|&id| digest(id)).collect();
        let keys: Vec<PhysicalKey> = (0..ids.len())
            .map(|i| {
                let tokens = if i + 1 == ids.len() { trace.last_tokens[n] } else { BLOCK_TOKENS };
                key(caller.tenant.as_str(), namespace, &links[..=i], tokens)
            })
            .collect();
        for ((store, out), (get_time, all_time)) in stores.iter().zip(&mut outs).zip(&mut times) {
            if out.aborted {
                continue;
            }
            let start = Instant::now();
            request(*store, caller, ids, &keys, &mut dst, &mut expect, out, get_time);
            *all_time += start.elapsed();
        }
        progress(n + 1);
        if outs.iter().all(|o| o.aborted) {
            break;
        }
    }
    for (out, (get_time, all_time)) in outs.iter_mut().zip(times) {
        out.get_seconds = get_time.as_secs_f64();
        out.seconds = all_time.as_secs_f64();
    }
    outs
}

/// One request through one store: GETs until the first miss, then PUTs to the end.
#[allow(clippy::too_many_arguments)]
fn request(
    store: &dyn Store,
    caller: &Caller,
    ids: &[u64],
    keys: &[PhysicalKey],
    dst: &mut [u8],
    expect: &mut [u8],
    out: &mut Replay,
    get_time: &mut Duration,
) {
    out.requests += 1;
    out.refs += ids.len() as u64;
    let mut first_miss = ids.len();
    for (i, (&id, k)) in ids.iter().zip(keys).enumerate() {
        let t = Instant::now();
        let got = store.get_into(caller, k, dst);
        *get_time += t.elapsed();
        let hit = match got {
            Ok(Get::Hit { len, .. }) => {
                content(id, expect);
                if len == dst.len() as u64 && *dst == *expect {
                    out.verified_get_bytes += len;
                    true
                } else {
                    out.mismatches += 1;
                    false
                }
            }
            Ok(Get::Miss(MissReason::Corrupt)) => {
                out.corrupt_misses += 1;
                false
            }
            Ok(Get::Miss(_)) => false,
            Err(e) => {
                out.error(format!("GET: {e}"));
                false
            }
        };
        if !hit {
            first_miss = i;
            break;
        }
        out.hits += 1;
    }
    for (&id, k) in ids.iter().zip(keys).skip(first_miss) {
        content(id, expect);
        match store.put(caller, k, expect, None) {
            Ok(Put::Committed(_)) => out.puts_committed += 1,
            Ok(Put::AlreadyCommitted) => out.puts_already_committed += 1,
            Ok(other @ (Put::Busy | Put::Refused(_))) => {
                out.puts_not_stored += 1;
                out.first_error.get_or_insert_with(|| format!("PUT: {other:?}"));
            }
            Err(e) => out.error(format!("PUT: {e}")),
        }
        if out.aborted {
            return;
        }
    }
}
