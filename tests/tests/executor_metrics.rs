//! The executor's Prometheus series in the same registry as
//! the store metrics: queued and running work, health, unproven retirement and counters, read at
//! scrape time without calling the store, labelled by deployment only, gone with the executor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::fixture::{key, payload};
use gpucache_dataplane::testing::process::promtool;
use gpucache_executor::HostRange;
use gpucache_executor::testing;
use gpucache_service::executor_metrics::{ExecutorLabels, register_executor};
use gpucache_service::metered::{ExpositionFormat, Metrics};
use gpucache_storage::MemoryStore;
use prometheus_client::registry::Registry;

fn value(text: &str, series: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// A series whose samples are fractional (the seconds ones).
fn float(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn executor_series_follow_its_work_and_vanish_with_it() {
    let store = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
            .expect("store"),
    );
    let (exec, host) = testing::executor(store, 4, 4096);
    let exec = Arc::new(exec);
    let mut registry = Registry::default();
    let labels =
        ExecutorLabels { model: "m".into(), role: "prefill".into(), dp_rank: 1, tp_rank: 2 };
    register_executor(&mut registry, &exec, labels);
    let metrics = Metrics::with_registry(registry);
    let scrape = || metrics.encode(ExpositionFormat::Prometheus);
    let who = "{model=\"m\",role=\"prefill\",dp_rank=\"1\",tp_rank=\"2\"}";

    let text = scrape();
    let state = |s: &str| {
        format!(
            "gpucache_executor_health_state{{model=\"m\",role=\"prefill\",dp_rank=\"1\",tp_rank=\"2\",state=\"{s}\"}}"
        )
    };
    assert_eq!(value(&text, &state("healthy")), Some(1), "{text}");
    assert_eq!(value(&text, &state("cooling_down")), Some(0), "{text}");
    assert_eq!(value(&text, &state("probing")), Some(0), "{text}");
    assert_eq!(value(&text, &format!("gpucache_executor_outages_total{who}")), Some(0));
    assert_eq!(float(&text, &format!("gpucache_executor_oldest_job_age_seconds{who}")), Some(0.0));
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
    // Both keys of the job went to the store in one batch call.
    assert_eq!(value(&text, &format!("gpucache_executor_backend_calls_total{who}")), Some(1));
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
    let put_seconds = |name: &str| float(&text, &put_series(name));
    assert_eq!(put_seconds("gpucache_executor_queue_wait_seconds_total"), Some(0.0), "{text}");
    assert_eq!(put_seconds("gpucache_executor_backend_seconds_total"), Some(0.0), "{text}");

    drop(exec);
    let text = scrape();
    assert!(!text.contains("gpucache_executor_"), "a dropped executor still reports: {text}");
}

#[test]
fn promtool_accepts_the_executor_series_without_a_warning() {
    let store = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
            .expect("store"),
    );
    let (exec, host) = testing::executor(store, 2, 4096);
    let exec = Arc::new(exec);
    let mut registry = Registry::default();
    let labels =
        ExecutorLabels { model: "m".into(), role: "decode".into(), dp_rank: 0, tp_rank: 0 };
    register_executor(&mut registry, &exec, labels);
    let metrics = Metrics::with_registry(registry);
    // One finished PUT, so the per-kind counters have a non-zero sample.
    let data = payload(5, 512);
    host.write(HostRange::new(0, 512), &data).expect("source");
    let put = exec
        .submit_put(vec![(key(0, &[7], KvDtype::F16, 16), HostRange::new(0, 512))])
        .expect("queued");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !exec.poll_wait(Duration::from_secs(20)).results.iter().any(|r| r.operation == put) {
        assert!(Instant::now() < deadline, "no result for {put}");
    }
    let text = metrics.encode(ExpositionFormat::Prometheus);
    assert!(text.contains("gpucache_executor_"), "no executor series to check: {text}");
    let Some((ok, printed)) = promtool(&["check", "metrics"], std::path::Path::new("."), &text)
    else {
        return;
    };
    assert!(
        ok && printed.is_empty(),
        "promtool check metrics said:\n{printed}\n--- scrape ---\n{text}"
    );
}
