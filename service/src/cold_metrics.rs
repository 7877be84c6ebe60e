//! The cold tier as metrics, read at scrape time: the sink's queue depth and what its drain
//! rounds did, refills by outcome (hits, and misses by reason), bytes each way, what the layer
//! moved between the tiers, and whether refills are degraded now.

use std::fmt;
use std::sync::Arc;

use gpucache_cold::{ColdMiss, ColdTiered};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// See the module documentation.
#[derive(Debug)]
pub struct ColdSeries {
    layer: Arc<ColdTiered>,
}

impl ColdSeries {
    pub fn register(registry: &mut Registry, layer: Arc<ColdTiered>) {
        registry.register_collector(Box::new(Self { layer }));
    }
}

fn family<M: EncodeMetric>(
    e: &mut DescriptorEncoder<'_>,
    (name, help): (&str, &str),
    series: &[(Vec<(&str, &str)>, u64)],
    make: fn(u64) -> M,
) -> fmt::Result {
    let mut f = e.encode_descriptor(name, help, None, make(0).metric_type())?;
    for (labels, v) in series {
        make(*v).encode(f.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

impl Collector for ColdSeries {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> fmt::Result {
        let e = &mut e;
        let counter = ConstCounter::<u64>::new;
        let depth = self.layer.sink().depth();
        let sink = self.layer.sink().counters();
        let cold = self.layer.cold().stats();
        let moved = self.layer.counters();
        let n = |v: usize| v as u64;
        family(
            e,
            ("gpucache_cold_queue_jobs", "Jobs the cold sink holds now, by state"),
            &[
                (vec![("state", "open")], n(depth.open_packs)),
                (vec![("state", "pending")], n(depth.pending)),
                (vec![("state", "failed")], n(depth.failed)),
            ],
            gauge,
        )?;
        family(
            e,
            ("gpucache_cold_queue_bytes", "Payload bytes the cold sink holds now"),
            &[(vec![], depth.bytes)],
            gauge,
        )?;
        family(
            e,
            (
                "gpucache_cold_drain_jobs",
                "Jobs the drain rounds finished with, by outcome: stored, retried (a temporary \
                 failure, back to the queue) or failed (to the failed queue)",
            ),
            &[
                (vec![("outcome", "stored")], sink.jobs_stored),
                (vec![("outcome", "retried")], sink.jobs_retried),
                (vec![("outcome", "failed")], sink.jobs_failed),
            ],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_cold_sink_blocks",
                "Blocks offered to the cold sink, by outcome: taken, or refused (full or a \
                 retired tenant; dropped, a clean miss later)",
            ),
            &[
                (vec![("outcome", "taken")], sink.blocks_taken),
                (vec![("outcome", "refused")], sink.blocks_refused),
            ],
            counter,
        )?;
        let mut refills = vec![(vec![("outcome", "hit"), ("reason", "")], cold.refill_hits)];
        for (m, v) in ColdMiss::ALL.iter().zip(cold.refill_misses) {
            refills.push((vec![("outcome", "miss"), ("reason", m.name())], v));
        }
        family(
            e,
            (
                "gpucache_cold_refills",
                "Blocks the cold tier was asked to refill, by outcome and, for misses, reason",
            ),
            &refills,
            counter,
        )?;
        family(
            e,
            ("gpucache_cold_bytes", "Bytes moved to and from the object store, by direction"),
            &[
                (vec![("direction", "up")], cold.bytes_up),
                (vec![("direction", "down")], cold.bytes_down),
            ],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_cold_demotions",
                "File-tier evictions handed to the cold tier, by outcome: taken by the sink, \
                 already_cold (the cold tier holds the block), refused by the sink, or \
                 unreadable (dropped)",
            ),
            &[
                (vec![("outcome", "taken")], moved.demoted),
                (vec![("outcome", "already_cold")], moved.demote_already_cold),
                (vec![("outcome", "refused")], moved.demote_refused),
                (vec![("outcome", "unreadable")], moved.demote_unreadable),
            ],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_cold_hits",
                "GETs the cold tier served (and, copied up, the upper tiers took)",
            ),
            &[
                (
                    vec![("moved_up", "false")],
                    moved.cold_hits - moved.refilled_up.min(moved.cold_hits),
                ),
                (vec![("moved_up", "true")], moved.refilled_up),
            ],
            counter,
        )?;
        family(
            e,
            ("gpucache_cold_blocks", "Blocks the cold tier's index holds now"),
            &[(vec![], cold.blocks)],
            gauge,
        )?;
        family(
            e,
            ("gpucache_cold_manifests", "Manifests (one per pack) the cold tier's index holds now"),
            &[(vec![], cold.manifests)],
            gauge,
        )?;
        family(
            e,
            (
                "gpucache_cold_reclaimed",
                "Objects reclaimed (deleted, and proven gone by a head), by kind",
            ),
            &[
                (vec![("kind", "manifest")], cold.reclaimed_manifests),
                (vec![("kind", "pack")], cold.reclaimed_packs),
            ],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_cold_degraded",
                "1 while refills are misses that call nothing, after the object store failed one",
            ),
            &[(vec![], u64::from(cold.degraded))],
            gauge,
        )
    }
}
