//! What a run of `gpucache-bench nixl` measures (its plan: sizes, iterations, paths) and the
//! bounds every path and the peer keep to; the paths, the report and the transfers all read it.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

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

/// `gpucache-bench nixl`: what to run.
#[derive(Debug, Args)]
pub struct NixlBenchArgs {
    /// Block sizes, comma-separated (K, M, G are binary); at most 64M each.
    #[arg(long, default_value = "64K,256K,1M,4M")]
    pub(crate) sizes: String,
    /// Timed iterations per size and path.
    #[arg(long, default_value_t = 200)]
    pub(crate) iterations: u32,
    /// Untimed iterations per size and path before the timed ones (the connection set-up and
    /// the byte check are untimed as well).
    #[arg(long, default_value_t = 10)]
    pub(crate) warmup: u32,
    /// Paths to run, comma-separated: nixl, nixl-raw, tcp, memcpy.
    #[arg(long, default_value = "nixl,nixl-raw,tcp,memcpy")]
    pub(crate) paths: String,
    /// Sets UCX_TLS for this process and the peer (for example `tcp`, to put NIXL on loopback
    /// TCP beside our TCP path). Default: whatever UCX_TLS says, or UCX's own choice.
    #[arg(long)]
    pub(crate) ucx_tls: Option<String>,
    /// Write every measurement as JSON here.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Where the peers' logs and the service's configuration go (a fresh subdirectory, removed
    /// afterwards unless --keep-logs). Default: the system temporary directory.
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
    /// Keep the scratch directory.
    #[arg(long)]
    pub(crate) keep_logs: bool,
}
