//! Readiness: whether the service can serve right now, as named checks. `/readyz` (and its alias
//! `/healthz`) answers 200 when every check passes and 503 naming each failing one; the
//! `gpucache_ready` and `gpucache_ready_check{check}` gauges report the same verdicts at scrape
//! time. Liveness (`/livez`) is only that the process answers, and needs no check.
//!
//! A check reads what its component already tracks (the store's last I/O outcome, a `statvfs`,
//! the executor's health state, whether the agent's reactor threads run, whether the staging
//! memory is registered); none of them touches the data path or waits.

use std::fmt;
use std::sync::Arc;

use gpucache_dataplane::store::Store;
use gpucache_dpu::Agent;
use gpucache_executor::{Executor, HealthState};
use gpucache_wire::staging::BlockStaging;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// The answer of one check: `Err` says why the service cannot serve.
pub type CheckResult = Result<(), String>;

/// One named readiness check.
pub struct Check {
    name: &'static str,
    probe: Box<dyn Fn() -> CheckResult + Send + Sync>,
}

impl fmt::Debug for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Check").field("name", &self.name).finish_non_exhaustive()
    }
}

impl Check {
    /// A check named `name` (a label value: lower case and underscores).
    pub fn new(
        name: &'static str,
        probe: impl Fn() -> CheckResult + Send + Sync + 'static,
    ) -> Self {
        Self { name, probe: Box::new(probe) }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// `store_io`: the store's latest write and latest read on its medium succeeded (a store
    /// that does not track its I/O passes).
    pub fn store_io(store: Arc<dyn Store>) -> Self {
        Self::new("store_io", move || match store.condition().io_failure {
            Some(Some(error)) => Err(format!("the store's latest I/O failed, {error}")),
            _ => Ok(()),
        })
    }

    /// `disk_room`: the store's medium has room for a PUT of `put_bytes_max` payload bytes (the
    /// object limit) with the store's own overhead. A store without a disk passes.
    pub fn disk_room(store: Arc<dyn Store>, put_bytes_max: u64) -> Self {
        Self::new("disk_room", move || {
            let condition = store.condition();
            let Some(free) = condition.free_bytes else { return Ok(()) };
            let needed = put_bytes_max.saturating_add(condition.block_overhead_bytes);
            if free >= needed {
                Ok(())
            } else {
                Err(format!(
                    "the disk has {free} bytes free; a PUT of the object limit ({put_bytes_max} \
                     bytes) needs {needed}"
                ))
            }
        })
    }

    /// `executor`: the engine-facing executor admits work (not cooling down or probing after an
    /// outage) and holds no quarantined operation.
    pub fn executor(executor: Arc<Executor>) -> Self {
        Self::new("executor", move || {
            match executor.health().state {
                HealthState::Healthy => {}
                HealthState::CoolingDown { until_ms } => {
                    return Err(format!("the executor is cooling down until {until_ms} ms"));
                }
                HealthState::Probing { since_ms } => {
                    return Err(format!("the executor is probing recovery since {since_ms} ms"));
                }
            }
            match executor.quarantined().len() {
                0 => Ok(()),
                n => Err(format!("the executor holds {n} quarantined operations")),
            }
        })
    }

    /// `dpu_reactors`: every reactor thread of the DPU agent runs.
    pub fn dpu_reactors(agent: Arc<Agent>) -> Self {
        Self::new("dpu_reactors", move || {
            let stopped = agent.reactors_stopped();
            if stopped.is_empty() {
                return Ok(());
            }
            let ids: Vec<String> = stopped.iter().map(ToString::to_string).collect();
            Err(format!(
                "{} of {} dpu reactors stopped ({})",
                stopped.len(),
                agent.reactors().len(),
                ids.join(", ")
            ))
        })
    }

    /// `nixl`: the block staging memory is registered with the transport.
    pub fn staging(staging: Arc<dyn BlockStaging>) -> Self {
        Self::new("nixl", move || {
            if staging.registered() {
                Ok(())
            } else {
                Err("the staging memory is not registered with NIXL (a fence's re-registration \
                     failed)"
                    .to_owned())
            }
        })
    }
}

/// One check's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub check: &'static str,
    /// Why it failed; `None` when it passed.
    pub failure: Option<String>,
}

/// Every check's verdict at one moment, with the store's name and epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    pub store: &'static str,
    pub epoch: u64,
    pub verdicts: Vec<Verdict>,
}

impl Readiness {
    pub fn ready(&self) -> bool {
        self.verdicts.iter().all(|v| v.failure.is_none())
    }

    /// The body `/readyz` answers: a first line with the verdict (naming the failing checks),
    /// then one line per check.
    pub fn body(&self) -> String {
        let failing: Vec<&str> =
            self.verdicts.iter().filter(|v| v.failure.is_some()).map(|v| v.check).collect();
        let mut body = if failing.is_empty() {
            format!("ready store={} epoch={}\n", self.store, self.epoch)
        } else {
            format!(
                "not ready store={} epoch={} failing={}\n",
                self.store,
                self.epoch,
                failing.join(",")
            )
        };
        for v in &self.verdicts {
            match &v.failure {
                None => body.push_str(&format!("ok {}\n", v.check)),
                Some(why) => body.push_str(&format!("fail {}: {why}\n", v.check)),
            }
        }
        body
    }
}

/// The checks of one service and the store they answer for.
pub struct Probe {
    store: Arc<dyn Store>,
    checks: Vec<Check>,
}

impl fmt::Debug for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Probe").field("checks", &self.checks).finish_non_exhaustive()
    }
}

impl Probe {
    pub fn new(store: Arc<dyn Store>, checks: Vec<Check>) -> Self {
        Self { store, checks }
    }

    /// Runs every check now.
    pub fn run(&self) -> Readiness {
        Readiness {
            store: self.store.info().name,
            epoch: self.store.epoch().0,
            verdicts: self
                .checks
                .iter()
                .map(|c| Verdict { check: c.name, failure: (c.probe)().err() })
                .collect(),
        }
    }

    /// Registers `gpucache_ready` and `gpucache_ready_check{check}`, computed at each scrape.
    pub fn register(self: &Arc<Self>, registry: &mut Registry) {
        registry.register_collector(Box::new(ReadinessGauges(Arc::clone(self))));
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CheckLabels {
    check: &'static str,
}

#[derive(Debug)]
struct ReadinessGauges(Arc<Probe>);

impl Collector for ReadinessGauges {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let readiness = self.0.run();
        let ready = ConstGauge::new(i64::from(readiness.ready()));
        ready.encode(encoder.encode_descriptor(
            "gpucache_ready",
            "1 when every readiness check passes (what /readyz answers 200 for), else 0",
            None,
            ready.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "gpucache_ready_check",
            "1 when this readiness check passes, 0 when it fails (the reason is in /readyz)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for v in &readiness.verdicts {
            let gauge = ConstGauge::new(i64::from(v.failure.is_none()));
            gauge.encode(family.encode_family(&CheckLabels { check: v.check })?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use gpucache_client::{ClientConfig, TcpStore};
    use gpucache_dataplane::clock::ManualClock;
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::limits::ResourceLimits;
    use gpucache_dataplane::testing::fixture;
    use gpucache_executor::testing;
    use gpucache_storage::MemoryStore;

    use super::*;

    fn memory() -> Arc<dyn Store> {
        Arc::new(
            MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
                .expect("limits"),
        )
    }

    #[test]
    fn the_body_names_every_failing_check_and_the_verdict_needs_all() {
        let store = memory();
        let probe = Probe::new(
            Arc::clone(&store),
            vec![
                Check::new("first", || Ok(())),
                Check::new("second", || Err("broken".to_owned())),
                Check::new("third", || Err("also broken".to_owned())),
                Check::store_io(Arc::clone(&store)),
                // A store without a disk has room by definition.
                Check::disk_room(store, u64::MAX),
            ],
        );
        let readiness = probe.run();
        assert!(!readiness.ready());
        assert_eq!(
            readiness.body(),
            "not ready store=memory epoch=1 failing=second,third\nok first\nfail second: broken\n\
             fail third: also broken\nok store_io\nok disk_room\n"
        );
    }

    #[test]
    fn an_executor_cooling_down_after_an_outage_is_not_ready() {
        // Nothing listens on port 1: every call is a transport failure, an outage.
        let config = ClientConfig::new("127.0.0.1:1".parse().expect("addr"), fixture::caller(0));
        let unreachable: Arc<dyn Store> = Arc::new(TcpStore::new(config));
        let (exec, _host) = testing::executor(unreachable, 1, 64);
        let exec = Arc::new(exec);
        let check = Check::executor(Arc::clone(&exec));
        assert_eq!((check.probe)(), Ok(()), "a fresh executor admits work");
        let op = exec.submit_query(vec![fixture::key(0, &[1], KvDtype::F16, 16)]).expect("queued");
        let _ = testing::wait_for(&exec, op, Duration::from_secs(30));
        let why = (check.probe)().expect_err("an executor cooling down is not ready");
        assert!(why.contains("cooling down"), "{why}");
    }
}
