//! `gpucache-bench nixl`: one block moved over NIXL, beside the same block through our TCP
//! service and beside memcpy, in one run.
//!
//! For each block size it measures, one path after another on the same machine:
//!
//! - **nixl-write** / **nixl-read**: our [`NixlTransfers`] between this process and a peer
//!   process (this executable re-executed as the hidden `gpucache-bench nixl-peer`), with the
//!   registration contract's bookkeeping in every iteration: check a slot out, move the block,
//!   return the slot. The peer's block stays lent for the whole run; metadata and block
//!   descriptors travel over a loopback TCP control connection.
//! - **nixl-raw-write** / **nixl-raw-read**: the same peer memory through a second, bare
//!   nixl-sys agent in this process: one transfer request made once per size and reposted, no
//!   pool, no lease, no deadline bookkeeping, so the cost of our layer shows.
//! - **tcp-put** / **tcp-get**: a `gpucache serve` child (memory store, 127.0.0.1 ports, stopped
//!   by PID) through one [`TcpStore`], distinct keys per PUT, GETs of those keys.
//! - **memcpy**: one block copied between two host buffers of the block's size, in process.
//!
//! The first NIXL transfer to a peer sets its connection up; it and the warm-up iterations are
//! not timed. Every path's bytes are checked (a checksum on both sides) once per size, outside
//! the timed loop.
//!
//! [`NixlTransfers`]: gpucache_nic::nixl::NixlTransfers
//! [`TcpStore`]: gpucache_client::TcpStore

// Without the `nixl` feature the run stops at the probe (fail closed), so the paths and the
// report are compiled (and unit-tested) but never called.
#![cfg_attr(not(feature = "nixl"), allow(dead_code))]

mod paths;
mod plan;
#[cfg(feature = "nixl")]
mod real;
mod report;
mod tcp;
#[cfg(feature = "nixl")]
mod transfers;
#[cfg(not(feature = "nixl"))]
mod unavailable;

// The run and the peer: over NIXL in `real` with the feature, refused as not built in
// `unavailable` without it. Both offer the same functions.
#[cfg(feature = "nixl")]
use real as built;
#[cfg(not(feature = "nixl"))]
use unavailable as built;

use std::process::ExitCode;

use clap::Args;

use gpucache_service::units::{parse_size_list, size_label};
pub use paths::PathRun;
pub use plan::{
    BLOCK_BYTES_MAX, CONTROL_DEADLINE, NixlBenchArgs, PEER_METADATA_MAX, PathName, Plan,
};

/// Largest number of timed iterations per size and path.
const ITERATIONS_MAX: u32 = 100_000;

/// The hidden peer role: `gpucache-bench nixl-peer --connect PORT --slot-bytes N`.
#[derive(Debug, Args)]
pub struct NixlPeerArgs {
    /// The parent's control port on 127.0.0.1.
    #[arg(long)]
    connect: u16,
    /// Bytes of the peer's one registered block.
    #[arg(long)]
    slot_bytes: usize,
}

fn plan(args: &NixlBenchArgs) -> Result<Plan, String> {
    let sizes = parse_size_list(&args.sizes)?;
    if sizes.is_empty() {
        return Err("--sizes names no size".into());
    }
    if let Some(&s) = sizes.iter().find(|&&s| !(1..=BLOCK_BYTES_MAX).contains(&s)) {
        return Err(format!("block size {s} is outside 1 B..={}", size_label(BLOCK_BYTES_MAX)));
    }
    if args.iterations == 0 || args.iterations > ITERATIONS_MAX {
        return Err(format!("--iterations must be in 1..={ITERATIONS_MAX}"));
    }
    if args.warmup > ITERATIONS_MAX {
        return Err(format!("--warmup must be at most {ITERATIONS_MAX}"));
    }
    let mut paths = Vec::new();
    for p in args.paths.split(',').filter(|p| !p.trim().is_empty()) {
        let p = PathName::parse(p)?;
        if !paths.contains(&p) {
            paths.push(p);
        }
    }
    if paths.is_empty() {
        return Err("--paths names no path".into());
    }
    if let Some(tls) = &args.ucx_tls
        && (tls.is_empty() || tls.contains(char::is_whitespace))
    {
        return Err(format!("--ucx-tls {tls:?} must be a UCX transport list without spaces"));
    }
    Ok(Plan { sizes, iterations: args.iterations, warmup: args.warmup, paths })
}

/// Exit status: 0 when every path ran and every byte check passed, 1 when a path failed or a
/// check did not pass, 2 on a usage error or when NIXL is unavailable (fail closed: no partial
/// run without NIXL).
pub fn run(args: &NixlBenchArgs) -> ExitCode {
    let plan = match plan(args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("gpucache-bench nixl: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(tls) = &args.ucx_tls {
        // SAFETY: nothing else runs yet: no thread has been started in this process and no
        // NIXL or UCX library is loaded, so no one reads the environment concurrently.
        unsafe { std::env::set_var("UCX_TLS", tls) };
    }
    if let Err(reason) = gpucache_nic::nixl::probe() {
        eprintln!("gpucache-bench nixl: NIXL unavailable: {reason}");
        return ExitCode::from(2);
    }
    match built::run_inner(args, &plan) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpucache-bench nixl: {e}");
            ExitCode::from(2)
        }
    }
}

/// The hidden peer role. Exit status 0 after the parent said goodbye, 2 otherwise.
pub fn peer(args: &NixlPeerArgs) -> ExitCode {
    match built::peer_main(args.connect, args.slot_bytes) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpucache-bench nixl-peer: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_service::units::MIB;

    fn args(extra: &[&str]) -> NixlBenchArgs {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Wrap {
            #[command(flatten)]
            a: NixlBenchArgs,
        }
        let mut argv = vec!["x"];
        argv.extend_from_slice(extra);
        Wrap::parse_from(argv).a
    }

    #[test]
    fn plans_resolve_defaults_and_refuse_nonsense() {
        let p = plan(&args(&[])).expect("plan");
        assert_eq!(p.sizes, vec![64 << 10, 256 << 10, MIB, 4 * MIB]);
        assert_eq!((p.iterations, p.warmup), (200, 10));
        assert_eq!(
            p.paths,
            vec![PathName::Nixl, PathName::NixlRaw, PathName::Tcp, PathName::Memcpy]
        );
        assert_eq!(p.largest(), 4 * MIB);
        let q =
            plan(&args(&["--sizes", "1M", "--paths", "memcpy,nixl,memcpy", "--iterations", "3"]))
                .expect("plan");
        assert_eq!(q.sizes, vec![MIB]);
        assert_eq!(q.paths, vec![PathName::Memcpy, PathName::Nixl]);
        assert!(plan(&args(&["--paths", "rdma"])).is_err());
        assert!(plan(&args(&["--iterations", "0"])).is_err());
        assert!(plan(&args(&["--sizes", "128M"])).is_err());
        assert!(plan(&args(&["--ucx-tls", "tcp, shm"])).is_err());
        assert!(plan(&args(&["--ucx-tls", "tcp"])).is_ok());
    }
}
