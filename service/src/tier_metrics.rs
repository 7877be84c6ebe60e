//! The tiers of a tiered store as metrics, read at scrape time: hits and bytes per tier,
//! promotions, demotions and evictions by reason.

use std::fmt;
use std::sync::Arc;

use gpucache_dataplane::store::Store;
use gpucache_storage::tiered::TieredStore;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// See the module documentation.
#[derive(Debug)]
pub struct TierSeries {
    store: Arc<TieredStore>,
    memory_capacity: u64,
    file_capacity: u64,
}

impl TierSeries {
    /// Registers the series of `store`, whose tiers hold at most the two capacities.
    pub fn register(
        registry: &mut Registry,
        store: Arc<TieredStore>,
        memory_capacity: u64,
        file_capacity: u64,
    ) {
        registry.register_collector(Box::new(Self { store, memory_capacity, file_capacity }));
    }
}

type Series<'a> = &'a [(&'a [(&'a str, &'a str)], u64)];

fn family<M: EncodeMetric>(
    e: &mut DescriptorEncoder<'_>,
    (name, help): (&str, &str),
    series: Series<'_>,
    make: fn(u64) -> M,
) -> fmt::Result {
    let mut f = e.encode_descriptor(name, help, None, make(0).metric_type())?;
    for (labels, v) in series {
        make(*v).encode(f.encode_family(labels)?)?;
    }
    Ok(())
}

const MEMORY: &[(&str, &str)] = &[("tier", "memory")];
const FILE: &[(&str, &str)] = &[("tier", "file")];

impl Collector for TierSeries {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> fmt::Result {
        let c = self.store.counters();
        let memory = self.store.memory().stats();
        let file = self.store.file().stats();
        let e = &mut e;
        let counter = ConstCounter::<u64>::new;
        family(
            e,
            ("gpucache_tier_hits", "GETs served by each tier"),
            &[(MEMORY, c.memory_hits), (FILE, c.file_hits)],
            counter,
        )?;
        family(
            e,
            ("gpucache_tier_misses", "GETs that neither tier could serve"),
            &[(&[], c.misses)],
            counter,
        )?;
        family(
            e,
            ("gpucache_tier_promotions", "Blocks copied up into memory after a file-tier hit"),
            &[(&[], c.promotions)],
            counter,
        )?;
        family(
            e,
            ("gpucache_tier_written_up", "Blocks copied into memory as they were written"),
            &[(&[], c.written_up)],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_tier_demotions",
                "Blocks the memory tier's policy gave up to the file tier: written down then \
                 when PUTs write back, already there when they write through",
            ),
            &[(&[], c.demotions)],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_tier_written_back",
                "Write-back: blocks whose file was written after their PUT was acknowledged \
                 (at a demotion, a flush, or because memory could not take them)",
            ),
            &[(&[], c.written_back)],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_tier_write_back_lost",
                "Write-back: acknowledged blocks lost before their file was written (the write \
                 failed, the only copy was found damaged, or the process stopped first: counted \
                 at the next start)",
            ),
            &[(&[], c.write_back_lost)],
            counter,
        )?;
        family(
            e,
            (
                "gpucache_tier_write_back_dirty_blocks",
                "Write-back: acknowledged blocks whose file is not written yet (what a crash now \
                 would lose)",
            ),
            &[(&[], c.dirty_blocks)],
            gauge,
        )?;
        family(
            e,
            (
                "gpucache_tier_write_back_dirty_bytes",
                "Write-back: payload bytes of acknowledged blocks whose file is not written yet",
            ),
            &[(&[], c.dirty_bytes)],
            gauge,
        )?;
        family(
            e,
            (
                "gpucache_tier_evictions",
                "Blocks each tier gave up, by reason: capacity (its policy made room) or \
                 file_gave_up (a memory copy dropped because the file tier let the block go)",
            ),
            &[
                (&[("tier", "memory"), ("reason", "capacity")], memory.evictions),
                (&[("tier", "memory"), ("reason", "file_gave_up")], c.dropped_with_file),
                (&[("tier", "file"), ("reason", "capacity")], file.evictions),
            ],
            counter,
        )?;
        family(
            e,
            ("gpucache_tier_bytes", "Bytes of blocks each tier holds now"),
            &[(MEMORY, memory.usage.retained_bytes), (FILE, file.usage.retained_bytes)],
            gauge,
        )?;
        family(
            e,
            ("gpucache_tier_blocks", "Committed blocks each tier holds now"),
            &[(MEMORY, memory.committed_blocks), (FILE, file.committed_blocks)],
            gauge,
        )?;
        family(
            e,
            ("gpucache_tier_capacity_bytes", "Bytes each tier may hold"),
            &[(MEMORY, self.memory_capacity), (FILE, self.file_capacity)],
            gauge,
        )?;
        let Some(log) = self.store.file().log_usage() else { return Ok(()) };
        family(
            e,
            (
                "gpucache_tier_log_segment_bytes",
                "layout log: bytes of the block log's segments on disk (live records, removed \
                 ones not reclaimed yet, and the unwritten rest of the active segment)",
            ),
            &[(&[], log.segment_bytes)],
            gauge,
        )?;
        family(
            e,
            ("gpucache_tier_log_live_bytes", "layout log: bytes of live records in the block log"),
            &[(&[], log.live_bytes)],
            gauge,
        )?;
        family(
            e,
            (
                "gpucache_tier_log_compactions",
                "layout log: segments compacted (their live blocks appended again, then deleted)",
            ),
            &[(&[], log.compactions)],
            counter,
        )
    }
}

fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}
