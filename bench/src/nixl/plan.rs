//! What a run of `bench nixl` measures (its plan: sizes, iterations, paths) and the bounds every
//! path and the peer keep to; the paths, the report and the transfers all read it.

use std::time::Duration;

use gpucache_service::units::MIB;

/// One path the bench can measure, as `--paths` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathName {
    Nixl,
    NixlRaw,
    Tcp,
    Memcpy,
}

impl PathName {
    pub(super) fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "nixl" => Ok(Self::Nixl),
            "nixl-raw" => Ok(Self::NixlRaw),
            "tcp" => Ok(Self::Tcp),
            "memcpy" => Ok(Self::Memcpy),
            other => Err(format!("unknown path {other:?} (use nixl, nixl-raw, tcp, memcpy)")),
        }
    }
}

/// The run's parameters, resolved from the arguments.
#[derive(Debug, Clone)]
pub struct Plan {
    pub sizes: Vec<u64>,
    pub iterations: u32,
    pub warmup: u32,
    pub paths: Vec<PathName>,
}

impl Plan {
    pub fn largest(&self) -> u64 {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    pub fn wants(&self, p: PathName) -> bool {
        self.paths.contains(&p)
    }
}

/// Largest block the bench moves (and the peer registers).
pub const BLOCK_BYTES_MAX: u64 = 64 * MIB;
/// Most agents' metadata a peer accepts from its parent (this process has two).
pub const PEER_METADATA_MAX: usize = 8;

/// How long every control step (peer start, one control frame, service start) may take.
pub const CONTROL_DEADLINE: Duration = Duration::from_secs(60);
