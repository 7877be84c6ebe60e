//! Our TCP path: a `gpucache serve` child (memory store, 127.0.0.1 ports, stopped by PID when
//! its guard drops) and one [`TcpStore`] client: PUT of distinct keys, then GET of those keys.
//! Every size's first PUT and GET are checked (checksum) and untimed.

use std::path::Path;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Get, Put, Store};

use super::paths::{PathRun, Point, checksum, pattern, timed};
use super::plan::Plan;
use crate::service::ours::{Service, keys, start_serve};
use gpucache_service::units::{narrow, size_label};

const NOTE: &str = "gpucache serve (memory store) on 127.0.0.1, one TcpStore (one connection), \
                    Store::put of a distinct key per block / Store::get_into";

/// Keys one size uses: the checked one, the warm-up and the timed ones.
fn keys_per_size(plan: &Plan) -> u64 {
    1 + u64::from(plan.warmup) + u64::from(plan.iterations)
}

/// PUT and GET at every size; two rows (`tcp-put`, `tcp-get`).
pub(super) fn measure(scratch: &Path, plan: &Plan) -> Vec<PathRun> {
    let mut put = PathRun::new("tcp-put", NOTE);
    let mut get = PathRun::new("tcp-get", NOTE);
    let started = start(scratch, plan);
    let (_child, store, caller, keys) = match started {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench: tcp: {e}");
            return vec![PathRun::failed("tcp-put", e.clone()), PathRun::failed("tcp-get", e)];
        }
    };
    let per = keys_per_size(plan);
    for (n, &size) in plan.sizes.iter().enumerate() {
        eprintln!("bench: {}: tcp", size_label(size));
        let first = narrow(per * n as u64);
        let keys = &keys[first..first + narrow(per)];
        let (p, g) = one_size(&store, &caller, keys, size, plan);
        put.points.push(p);
        get.points.push(g);
    }
    vec![put, get]
}

fn one_size(
    store: &TcpStore,
    caller: &Caller,
    keys: &[PhysicalKey],
    size: u64,
    plan: &Plan,
) -> (Point, Point) {
    let len = narrow(size);
    let value = pattern(size ^ 0x7c9, len);
    let mut dst = vec![0u8; len];
    let put_one = |key: &PhysicalKey| match store.put(caller, key, &value, None) {
        Ok(Put::Committed(_)) => Ok(()),
        Ok(other) => Err(format!("PUT answered {other:?}")),
        Err(e) => Err(format!("PUT: {e}")),
    };
    let get_one = |key: &PhysicalKey, dst: &mut [u8]| match store.get_into(caller, key, dst) {
        Ok(Get::Hit { len: got, .. }) if got == size => Ok(()),
        Ok(Get::Hit { len: got, .. }) => Err(format!("GET returned {got} bytes, not {size}")),
        Ok(Get::Miss(reason)) => Err(format!("GET missed: {reason:?}")),
        Err(e) => Err(format!("GET: {e}")),
    };
    // The check: keys[0] goes in and comes back, untimed.
    let checked = put_one(&keys[0]).and_then(|()| get_one(&keys[0], &mut dst));
    let verified = match checked {
        Ok(()) => checksum(&dst) == checksum(&value),
        Err(e) => return (Point::failed(size, e.clone()), Point::failed(size, e)),
    };
    let rest = &keys[1..];
    let put_point = match timed(plan.warmup, plan.iterations, |i| put_one(&rest[narrow(i)])) {
        Ok(mut s) => Point::from_samples(size, &mut s, verified),
        Err(e) => {
            let failed = Point::failed(size, e.clone());
            return (failed, Point::failed(size, format!("no GET after a failed PUT: {e}")));
        }
    };
    let get_point =
        match timed(plan.warmup, plan.iterations, |i| get_one(&rest[narrow(i)], &mut dst)) {
            Ok(mut s) => Point::from_samples(size, &mut s, verified),
            Err(e) => Point::failed(size, e),
        };
    (put_point, get_point)
}

type Started = (Service, TcpStore, Caller, Vec<PhysicalKey>);

/// Starts the service with room for every key of the run and connects one client.
fn start(scratch: &Path, plan: &Plan) -> Result<Started, String> {
    let per = keys_per_size(plan);
    let bytes: u64 = plan.sizes.iter().map(|s| s * per).sum();
    let service = start_serve(scratch, "nixl-bench", plan.largest(), bytes, None)?;
    let mut config = ClientConfig::new(service.native, service.caller.clone());
    config.client_name = "gpucache-bench-nixl".to_owned();
    let store = TcpStore::new(config);
    let caller = service.caller.clone();
    let keys = keys(&caller.tenant, per * plan.sizes.len() as u64)?;
    Ok((service, store, caller, keys))
}
