//! `store.kind = "dpu"`: turns a validated `[dpu]` section into a running DPU agent, and words
//! the agent's offload report for the start line and the metrics exporter.
//!
//! Owns only the wiring and the wording (the build of the service puts the agent in front of
//! the file store). What the agent really runs (host threads, pinning achieved, the epoch) comes
//! from the agent itself; nothing here may claim more than [`Agent::offload`] says.

use std::time::Duration;

use gpucache_dpu::{
    Agent, AgentConfig, DpuError, Offload, PinPolicy, Pinning, QueueId, QueueKind, QueueSpec,
    ReactorId, ReactorSpec, SlabConfig,
};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::host::pool::{HugePagePolicy, Tier};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::config::{DpuBackendName, DpuSection, PinName};

/// Why the agent `[dpu]` describes did not start. Display starts with the key it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DpuStartError {
    /// `dpu.backend` names a native backend this binary was built without.
    #[error(
        "dpu.backend: {backend} backend unavailable: built without the {backend} feature \
         (cargo build -p gpucache-cli --features {backend})"
    )]
    NotBuilt { backend: &'static str },
    /// The agent refused to start: a native backend failed closed, a core could not be pinned
    /// under `dpu.pin = "required"`, the state dir is unwritable.
    #[error("{key}: {source}")]
    Agent { key: &'static str, source: DpuError },
}

impl DpuStartError {
    /// The key path the error is about.
    pub fn key(&self) -> &'static str {
        match self {
            Self::NotBuilt { .. } => "dpu.backend",
            Self::Agent { key, .. } => key,
        }
    }
}

/// How long an idle reactor parks before it looks at its queues again.
const IDLE_PARK: Duration = Duration::from_millis(1);

// The native backends' queues: each is built from `[dpu]` with its feature, and refused as not
// built without it. Each pair offers the same function.
#[cfg(feature = "doca")]
use doca_real as doca;
#[cfg(not(feature = "doca"))]
use doca_unavailable as doca;
#[cfg(feature = "spdk")]
use spdk_real as spdk;
#[cfg(not(feature = "spdk"))]
use spdk_unavailable as spdk;

/// SPDK queues: an NVMe controller by PCI address.
#[cfg(feature = "spdk")]
mod spdk_real {
    use gpucache_dpu::{QueueKind, SpdkConfig};

    use crate::config::DpuSection;

    /// `None`: this build has no such queues.
    pub(super) fn queue_kind(dpu: &DpuSection) -> Option<QueueKind> {
        Some(QueueKind::Spdk(SpdkConfig {
            pci_addr: dpu.spdk_pci_addr.clone().unwrap_or_default(),
        }))
    }
}

/// A build without the `spdk` feature refuses SPDK queues.
#[cfg(not(feature = "spdk"))]
mod spdk_unavailable {
    use gpucache_dpu::QueueKind;

    use crate::config::DpuSection;

    /// `None`: this build has no such queues.
    pub(super) fn queue_kind(_dpu: &DpuSection) -> Option<QueueKind> {
        None
    }
}

/// DOCA queues: a BlueField device by name.
#[cfg(feature = "doca")]
mod doca_real {
    use gpucache_dpu::{DocaConfig, QueueKind};

    use crate::config::DpuSection;

    /// `None`: this build has no such queues.
    pub(super) fn queue_kind(dpu: &DpuSection) -> Option<QueueKind> {
        Some(QueueKind::Doca(DocaConfig { device: dpu.doca_device.clone().unwrap_or_default() }))
    }
}

/// A build without the `doca` feature refuses DOCA queues.
#[cfg(not(feature = "doca"))]
mod doca_unavailable {
    use gpucache_dpu::QueueKind;

    use crate::config::DpuSection;

    /// `None`: this build has no such queues.
    pub(super) fn queue_kind(_dpu: &DpuSection) -> Option<QueueKind> {
        None
    }
}

/// The agent configuration `[dpu]` describes: reactors in file order, `queues_per_reactor`
/// queues each (ids numbered across all reactors), every queue of the configured backend. A
/// native backend this binary was built without is refused ([`DpuStartError::NotBuilt`]).
pub fn agent_config(dpu: &DpuSection) -> Result<AgentConfig, DpuStartError> {
    let reactors: Vec<ReactorSpec> = dpu
        .reactors
        .iter()
        .map(|r| ReactorSpec {
            id: ReactorId(r.id),
            core: r.core.and_then(|c| usize::try_from(c).ok()),
        })
        .collect();
    let mut queues = Vec::new();
    for r in &reactors {
        for _ in 0..dpu.queues_per_reactor {
            let n = u32::try_from(queues.len()).unwrap_or(u32::MAX);
            let kind = match dpu.backend {
                DpuBackendName::IoUring => QueueKind::Host {
                    root: dpu.state_dir.join("queues").join(n.to_string()),
                    // io_uring was asked for: the queue fails with the engine's reason when the
                    // kernel refuses it, never falling back to pread/pwrite unannounced.
                    engine: EngineChoice::Uring,
                    sync: true,
                },
                DpuBackendName::Spdk => {
                    spdk::queue_kind(dpu).ok_or(DpuStartError::NotBuilt { backend: "spdk" })?
                }
                DpuBackendName::Doca => {
                    doca::queue_kind(dpu).ok_or(DpuStartError::NotBuilt { backend: "doca" })?
                }
            };
            queues.push(QueueSpec {
                id: QueueId(n),
                owner: r.id,
                depth_max: usize::try_from(dpu.queue_depth).unwrap_or(usize::MAX),
                kind,
            });
        }
    }
    Ok(AgentConfig {
        state_dir: dpu.state_dir.clone(),
        reactors,
        queues,
        pin: match dpu.pin {
            PinName::BestEffort => PinPolicy::BestEffort,
            PinName::Required => PinPolicy::Required,
        },
        slab: SlabConfig {
            slots: usize::try_from(dpu.slab_slots).unwrap_or(usize::MAX),
            slot_bytes: usize::try_from(dpu.slab_slot_bytes).unwrap_or(usize::MAX),
            lease_ms: dpu.slab_lease_ms,
            // 2 MiB pages at best: 1 GiB pages would round a small slab up to a whole GiB.
            policy: HugePagePolicy::default().prefer(Tier::Huge2M),
        },
        idle_park: IDLE_PARK,
    })
}

/// Starts the agent `[dpu]` describes. A native backend fails closed here, naming what is
/// missing; the error names the key that caused it.
pub fn start_agent(dpu: &DpuSection) -> Result<Agent, DpuStartError> {
    agent_config(dpu)?.start().map_err(|source| {
        let key = match &source {
            DpuError::NativeUnavailable { .. } => "dpu.backend",
            DpuError::PinRefused { .. } => "dpu.pin",
            DpuError::Io { .. } => "dpu.state_dir",
            DpuError::Engine(_) => "dpu.backend",
            _ => "dpu",
        };
        DpuStartError::Agent { key, source }
    })
}

/// The offload mode's one word: `host-threads`, `simulated` or `active`.
pub fn offload_mode(offload: &Offload) -> &'static str {
    match offload {
        Offload::HostThreads { .. } => "host-threads",
        Offload::Simulated { .. } => "simulated",
        Offload::Active { .. } => "active",
    }
}

/// The cores reactors are really pinned to (read back by the agent), comma-separated, or
/// `none`.
pub fn pinned_cores(agent: &Agent) -> String {
    let cores: Vec<String> = agent
        .reactors()
        .iter()
        .filter_map(|r| match r.pinning {
            Pinning::Pinned { core } => Some(core.to_string()),
            _ => None,
        })
        .collect();
    if cores.is_empty() { "none".to_owned() } else { cores.join(",") }
}

/// The start line's fields: `offload=host-threads reactors=2 pinned=0,1 agent_epoch=3`
/// (`offload=simulated seed=S ...`, `offload=active backend=B ...` where those are true).
pub fn offload_fields(agent: &Agent) -> String {
    let offload = agent.offload();
    let extra = match &offload {
        Offload::Simulated { seed, .. } => format!(" seed={seed}"),
        Offload::Active { backend } => format!(" backend={backend}"),
        Offload::HostThreads { .. } => String::new(),
    };
    format!(
        "offload={}{extra} reactors={} pinned={} agent_epoch={}",
        offload_mode(&offload),
        agent.reactors().len(),
        pinned_cores(agent),
        agent.epoch().0
    )
}

/// One line per reactor: where it runs and what pinning it got (a refusal with its reason).
pub fn reactor_lines(agent: &Agent) -> Vec<String> {
    agent
        .reactors()
        .iter()
        .map(|r| {
            let queues: Vec<String> = r.queues.iter().map(ToString::to_string).collect();
            let pinning = match &r.pinning {
                Pinning::Pinned { core } => format!("pinned to core {core}"),
                Pinning::Refused { core, detail } => {
                    format!("unpinned (core {core} refused: {detail})")
                }
                Pinning::NotRequested => "unpinned (no core configured)".to_owned(),
            };
            format!("{} {pinning}, queues {}", r.id, queues.join(","))
        })
        .collect()
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct OffloadLabels {
    mode: &'static str,
    reactors: String,
    pinned_cores: String,
}

/// A registry holding the agent's offload report, for [`crate::metered::Metrics`]
/// to add the store metrics to: `gpucache_dpu_offload_info{mode,reactors,pinned_cores}`,
/// `gpucache_dpu_offload_active` (1 only for a native backend, which this build cannot run)
/// and `gpucache_dpu_agent_epoch`. All fixed for the agent's life.
pub fn offload_registry(agent: &Agent) -> Registry {
    let mut registry = Registry::default();
    let offload = agent.offload();
    registry.register(
        "gpucache_dpu_offload",
        "What runs the DPU agent's queues: host-threads, simulated, or active (native offload)",
        Info::new(OffloadLabels {
            mode: offload_mode(&offload),
            reactors: agent.reactors().len().to_string(),
            pinned_cores: pinned_cores(agent),
        }),
    );
    let active = Gauge::<i64>::default();
    active.set(i64::from(offload.active()));
    registry.register(
        "gpucache_dpu_offload_active",
        "1 when storage queues run off the host CPU, 0 when they run on host threads",
        active,
    );
    let epoch = Gauge::<i64>::default();
    epoch.set(i64::try_from(agent.epoch().0).unwrap_or(i64::MAX));
    registry.register(
        "gpucache_dpu_agent_epoch",
        "The DPU agent's persisted epoch, bumped at every start",
        epoch,
    );
    registry
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "spdk")]
    #[test]
    fn spdk_queues_name_the_configured_controller() {
        let dpu = DpuSection {
            backend: DpuBackendName::Spdk,
            spdk_pci_addr: Some("0000:3b:00.0".into()),
            ..DpuSection::default()
        };
        let c = agent_config(&dpu).expect("spdk is built");
        assert!(!c.queues.is_empty());
        for q in &c.queues {
            assert!(format!("{:?}", q.kind).contains("0000:3b:00.0"), "{:?}", q.kind);
        }
    }

    #[cfg(not(feature = "spdk"))]
    #[test]
    fn spdk_queues_are_refused_as_not_built() {
        let dpu = DpuSection { backend: DpuBackendName::Spdk, ..DpuSection::default() };
        let e = agent_config(&dpu).expect_err("spdk is not built");
        assert!(matches!(e, DpuStartError::NotBuilt { backend: "spdk" }), "{e:?}");
    }

    #[cfg(feature = "doca")]
    #[test]
    fn doca_queues_name_the_configured_device() {
        let dpu = DpuSection {
            backend: DpuBackendName::Doca,
            doca_device: Some("mlx5_0".into()),
            ..DpuSection::default()
        };
        let c = agent_config(&dpu).expect("doca is built");
        assert!(!c.queues.is_empty());
        for q in &c.queues {
            assert!(format!("{:?}", q.kind).contains("mlx5_0"), "{:?}", q.kind);
        }
    }

    #[cfg(not(feature = "doca"))]
    #[test]
    fn doca_queues_are_refused_as_not_built() {
        let dpu = DpuSection { backend: DpuBackendName::Doca, ..DpuSection::default() };
        let e = agent_config(&dpu).expect_err("doca is not built");
        assert!(matches!(e, DpuStartError::NotBuilt { backend: "doca" }), "{e:?}");
    }

    use super::*;

    #[test]
    fn queues_are_numbered_across_reactors_and_owned_by_theirs() {
        let dpu = DpuSection {
            reactors: vec![
                crate::config::DpuReactorConfig { id: 4, core: Some(0) },
                crate::config::DpuReactorConfig { id: 7, core: None },
            ],
            queues_per_reactor: 2,
            ..DpuSection::default()
        };
        let c = agent_config(&dpu).expect("io_uring is always built");
        let owners: Vec<(u32, u16)> = c.queues.iter().map(|q| (q.id.0, q.owner.0)).collect();
        assert_eq!(owners, [(0, 4), (1, 4), (2, 7), (3, 7)]);
        assert_eq!(c.reactors[0].core, Some(0));
        assert_eq!(c.reactors[1].core, None);
        assert!(
            matches!(&c.queues[3].kind, QueueKind::Host { root, .. } if root.ends_with("queues/3"))
        );
    }

    #[test]
    fn a_host_agent_reports_host_threads_never_active() {
        let dir = tempfile::tempdir().expect("temp dir");
        let dpu = DpuSection {
            state_dir: dir.path().to_owned(),
            slab_slots: 2,
            slab_slot_bytes: 1 << 16,
            ..DpuSection::default()
        };
        let agent = agent_config(&dpu).expect("config").start().expect("start agent");
        let fields = offload_fields(&agent);
        assert!(fields.starts_with("offload=host-threads reactors=1 pinned=none"), "{fields}");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &offload_registry(&agent))
            .expect("encode");
        assert!(text.contains("gpucache_dpu_offload_active 0"), "{text}");
        assert!(text.contains("mode=\"host-threads\""), "{text}");
    }
}
