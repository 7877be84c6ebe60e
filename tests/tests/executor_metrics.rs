//! The executor's Prometheus series (the seed's Observability section) in the same registry as
//! the store metrics: queued and running work, health, unproven retirement and counters, read at
//! scrape time without calling the store, labelled by deployment only, gone with the executor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_backends::MemoryStore;
use gpucache_backends::executor_metrics::{ExecutorLabels, register_executor};
use gpucache_backends::metered::{ExpositionFormat, Metrics};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::executor::HostRange;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::fixture::{self, key, payload};
use prometheus_client::registry::Registry;

fn value(text: &str, series: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn executor_series_follow_its_work_and_vanish_with_it() {
    let store = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
            .expect("store"),
    );
    let (exec, host) = fixture::executor(store, 4, 4096);
    let exec = Arc::new(exec);
    let mut registry = Registry::default();
    let labels =
        ExecutorLabels { model: "m".into(), role: "prefill".into(), dp_rank: 1, tp_rank: 2 };
    register_executor(&mut registry, &exec, labels);
    let metrics = Metrics::with_registry(registry);
    let scrape = || metrics.encode(ExpositionFormat::Prometheus);
    let who = "{model=\"m\",role=\"prefill\",dp_rank=\"1\",tp_rank=\"2\"}";

    let text = scrape();
    assert_eq!(value(&text, &format!("gpucache_executor_health_state{who}")), Some(0), "{text}");
    assert_eq!(value(&text, &format!("gpucache_executor_put_new_writes_total{who}")), Some(0));
    assert!(text.contains("gpucache_ops_total"), "the store metrics share the registry");
    assert!(!text.contains("gpc"), "no keys in the series");

    // One PUT of two keys, then its result: the counters move, nothing stays queued.
    let data = payload(3, 4096);
    host.write(HostRange::new(0, 4096), &data).expect("source");
    host.write(HostRange::new(4096, 100), &data[..100]).expect("source");
    let keys = [key(0, &[1], KvDtype::F16, 16), key(0, &[2], KvDtype::F16, 16)];
    let put = exec
        .submit_put(vec![
            (keys[0].clone(), HostRange::new(0, 4096)),
            (keys[1].clone(), HostRange::new(4096, 100)),
        ])
        .expect("queued");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no result for {put}");
        if exec.poll_wait(Duration::from_secs(20)).results.iter().any(|r| r.operation == put) {
            break;
        }
    }
    let text = scrape();
    assert_eq!(value(&text, &format!("gpucache_executor_put_new_writes_total{who}")), Some(2));
    assert_eq!(value(&text, &format!("gpucache_executor_put_new_bytes_total{who}")), Some(4196));
    assert_eq!(value(&text, &format!("gpucache_executor_backend_calls_total{who}")), Some(2));
    let queued_put = "gpucache_executor_queued_jobs{model=\"m\",role=\"prefill\",dp_rank=\"1\",tp_rank=\"2\",kind=\"put\"}";
    assert_eq!(value(&text, queued_put), Some(0), "{text}");
    assert_eq!(value(&text, &format!("gpucache_executor_unretired_operations{who}")), Some(0));
    let put_series = |name: &str| {
        format!("{name}{{model=\"m\",role=\"prefill\",dp_rank=\"1\",tp_rank=\"2\",kind=\"put\"}}")
    };
    assert_eq!(value(&text, &put_series("gpucache_executor_completed_jobs_total")), Some(1));
    assert_eq!(
        value(&text, &put_series("gpucache_executor_completed_payload_bytes_total")),
        Some(4196)
    );
    // The executor's clock is a manual one that never moved: no time queued or in the store.
    assert_eq!(value(&text, &put_series("gpucache_executor_queue_ms_total")), Some(0));
    assert_eq!(value(&text, &put_series("gpucache_executor_backend_ms_total")), Some(0));

    drop(exec);
    let text = scrape();
    assert!(!text.contains("gpucache_executor_"), "a dropped executor still reports: {text}");
}
