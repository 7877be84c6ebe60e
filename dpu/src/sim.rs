//! The simulated DPU queue: blocks kept in memory, completions disturbed by seeded faults
//! (lost, late, duplicated, error completions, queue stalls). The same seed, configuration
//! and calls give the same faults, so a failing test replays from its seed.
//!
//! It is a simulation and says so: its backend name is `"sim-dpu"`, an agent with a simulated
//! queue reports [`crate::Offload::Simulated`] with the seed, and its slab is marked simulated.

use gpucache_dataplane::rng::SplitMix64;
use std::collections::{BTreeMap, VecDeque};

use crate::queue::{BlockId, Done, MissCause, QueueBackend, Staged};

pub use crate::queue::Fault;

/// Most blocks one simulated queue keeps.
pub const SIM_BLOCKS_MAX: usize = 1 << 16;
/// Most scripted faults one simulated queue accepts.
pub const SIM_SCRIPT_MAX: usize = 1024;

/// Fault rates in parts per million of submissions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultRates {
    pub lost_ppm: u32,
    pub late_ppm: u32,
    pub duplicated_ppm: u32,
    pub error_ppm: u32,
    pub stall_ppm: u32,
}

/// How to build a simulated queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    pub seed: u64,
    pub rates: FaultRates,
    /// Faults for the next submissions, in order, ahead of the seeded draws.
    pub script: Vec<Fault>,
    /// Longest a late completion or a stall lasts, in reactor polls.
    pub polls_max: u32,
    /// Most blocks kept (beyond it a write fails with an error completion).
    pub blocks_max: usize,
}

impl SimConfig {
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            rates: FaultRates::default(),
            script: Vec::new(),
            polls_max: 4,
            blocks_max: 4096,
        }
    }
}

/// A draw below `n` (at least 1) from the seeded generator, as a `u32`.
fn below(rng: &mut SplitMix64, n: u32) -> u32 {
    // The remainder is below n, so it fits u32.
    u32::try_from(rng.below(u64::from(n.max(1)))).unwrap_or(0)
}

/// The simulated queue backend.
#[derive(Debug)]
pub(crate) struct SimQueue {
    config: SimConfig,
    rng: SplitMix64,
    script: VecDeque<Fault>,
    blocks: BTreeMap<BlockId, Vec<u8>>,
}

impl SimQueue {
    pub(crate) fn new(config: SimConfig) -> Self {
        let mut script: VecDeque<Fault> = config.script.iter().copied().collect();
        script.truncate(SIM_SCRIPT_MAX);
        Self { rng: SplitMix64::new(config.seed), script, blocks: BTreeMap::new(), config }
    }
}

impl QueueBackend for SimQueue {
    fn name(&self) -> &'static str {
        "sim-dpu"
    }
    fn simulated(&self) -> Option<u64> {
        Some(self.config.seed)
    }
    fn next_fault(&mut self) -> Fault {
        if let Some(f) = self.script.pop_front() {
            return f;
        }
        let r = self.config.rates;
        let polls = 1 + below(&mut self.rng, self.config.polls_max.max(1));
        let draw = below(&mut self.rng, 1_000_000);
        let mut edge = 0u32;
        for (ppm, fault) in [
            (r.lost_ppm, Fault::Lost),
            (r.late_ppm, Fault::Late { polls }),
            (r.duplicated_ppm, Fault::Duplicated),
            (r.error_ppm, Fault::Error),
            (r.stall_ppm, Fault::Stall { polls }),
        ] {
            edge = edge.saturating_add(ppm);
            if draw < edge {
                return fault;
            }
        }
        Fault::None
    }
    fn write(&mut self, block: BlockId, data: &[u8], _tag: u64) -> Result<Staged, String> {
        let cap = self.config.blocks_max.min(SIM_BLOCKS_MAX);
        if self.blocks.len() >= cap && !self.blocks.contains_key(&block) {
            return Err(format!("simulated queue holds {cap} blocks, its limit"));
        }
        Ok(Staged::Sim { block, bytes: data.to_vec() })
    }
    fn publish(&mut self, staged: Staged) -> Result<(), String> {
        let Staged::Sim { block, bytes } = staged else {
            return Err("foreign staged write".into());
        };
        self.blocks.insert(block, bytes);
        Ok(())
    }
    fn discard(&mut self, _staged: Staged) {}
    fn read(&mut self, block: BlockId, dst: &mut [u8]) -> Result<Done, String> {
        match self.blocks.get(&block) {
            None => Ok(Done::Miss(MissCause::Absent)),
            Some(b) if b.len() > dst.len() => Ok(Done::Miss(MissCause::Corrupt)),
            Some(b) => {
                dst[..b.len()].copy_from_slice(b);
                Ok(Done::Read { len: b.len() })
            }
        }
    }
}
