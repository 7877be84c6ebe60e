//! The `gpucache-bench` command-line tool: the benchmark harnesses of the gpucache-bench crate,
//! kept out of the operators' `gpucache` binary. It measures the FileStore against fio (`file`),
//! the DPU agent beside both (`dpu`), the service beside its peers (`service`), NIXL beside our
//! TCP path and memcpy (`nixl`), the Python package beside the Rust client and Mooncake
//! (`python`), eviction policies on prefix-reuse traces (`trace`), and the cold tier on S3
//! beside plain objects (`cold`).
//!
//! The harnesses that run our service start the `gpucache` binary installed beside this one
//! (`gpucache serve`), so both come from one build: `cargo build -p gpucache-cli` or
//! `cargo install --path cli`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpucache_service::logging::{self, LogArgs};

#[derive(Debug, Parser)]
#[command(
    name = "gpucache-bench",
    version,
    about = "GPUCache benchmarks: each backend and path beside its peers"
)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// FileStore PUT and GET per engine and block size, beside fio with the same parameters.
    File(gpucache_bench::file::FileBenchArgs),
    /// GET and PUT through the DPU agent (DpuStore and its own io_uring queues) beside the
    /// FileStore used directly and fio, 64 KiB to 4 MiB; JSON on stdout, a table on stderr.
    Dpu(gpucache_bench::dpu::DpuBenchArgs),
    /// Our service beside Redis, Mooncake Store, iperf3 and memcpy, with ratios and aims.
    Service(gpucache_bench::service::ServiceBenchArgs),
    /// Blocks over NIXL (ours and bare) beside our TCP path and memcpy, 64 KiB to 4 MiB.
    /// Needs a build with the `nixl` feature and libnixl_capi.so; exit status 2 without them.
    Nixl(gpucache_bench::nixl::NixlBenchArgs),
    /// The peer process of `gpucache-bench nixl` (started by it).
    #[command(hide = true)]
    NixlPeer(gpucache_bench::nixl::NixlPeerArgs),
    /// The Python package's batch calls beside the Rust client and Mooncake Store's Python
    /// client, 128 x 64 KiB and 16 x 1 MiB, over TCP and the same-host path.
    Python(gpucache_bench::python::PythonBenchArgs),
    /// Prefix-reuse traces replayed through a store per eviction policy and capacity, beside
    /// Belady's bound and an offline LRU: hit ratios, verified GET GB/s and requests/s.
    Trace(gpucache_bench::trace::TraceBenchArgs),
    /// The cold tier on an S3 endpoint beside plain objects in the same bucket, 64 KiB and
    /// 1 MiB blocks: pack/unpack, store and refill throughput, refill p50/p99, ratios; every
    /// refilled block checked. JSON on stdout, a summary on stderr.
    Cold(gpucache_bench::cold::ColdBenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = cli.log.init(logging::TOOL_FILTER) {
        eprintln!("gpucache-bench: {e}");
        return ExitCode::from(2);
    }
    match cli.command {
        Command::File(args) => gpucache_bench::file::run(&args),
        Command::Dpu(args) => gpucache_bench::dpu::run(&args),
        Command::Service(args) => gpucache_bench::service::run(&args),
        Command::Nixl(args) => gpucache_bench::nixl::run(&args),
        Command::NixlPeer(args) => gpucache_bench::nixl::peer(&args),
        Command::Python(args) => gpucache_bench::python::run(&args),
        Command::Trace(args) => gpucache_bench::trace::run(&args),
        Command::Cold(args) => gpucache_bench::cold::run(&args),
    }
}
