//! The `gpucache` command-line tool.
//!
//! Owns argument parsing and wiring backends together from validated configuration; no data
//! path logic lives here: it runs the service (`serve`) and the DPU agent (`dpu-agent`),
//! inspects keys (`key`), checks a FileStore directory (`fsck`), shows or changes a cluster's
//! view (`cluster`), works on an s3 tier's bucket (`cold`), and talks to a running service
//! (`put`, `get`, `stat`). The benchmarks are a binary of their own, `gpucache-bench`
//! (src/bin/gpucache-bench.rs), so none of them is linked into this one.
mod client_cmd;
mod cluster_cmd;
mod cold_cmd;
mod fsck;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpucache_dataplane::key::{KeyDecodeError, LogicalKey, PhysicalKey};
use gpucache_service::logging::{self, LogArgs};

#[derive(Debug, Parser)]
#[command(name = "gpucache", version, about = "GPUCache: a shared tier for LLM KV-cache blocks")]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode a GPCK (physical) or GPCL (logical) key given in hex and print its fields.
    Key {
        /// The encoded key, as hexadecimal.
        hex: String,
    },
    /// Verify every block file of a FileStore directory (headers and payload checksums).
    ///
    /// The store must not be open. Exit status: 0 when every block is sound, 1 when bad files
    /// were found (also when `--repair` removed them), 2 on a usage or I/O error.
    Fsck {
        /// The FileStore root directory (the one holding STORE, blocks/ and tmp/).
        dir: PathBuf,
        /// Remove bad block files and leftover temporaries.
        #[arg(long)]
        repair: bool,
    },
    /// Run the service: the configured store behind its listeners, until SIGINT or SIGTERM.
    ///
    /// Without --config it uses the embedded default: a tiered store, memory (a quarter of RAM,
    /// at most 4 GiB) over a FileStore under ./gpucache-data, both evicting by the prefix
    /// policy, and these listeners, each set in [listen] (the start line on stderr says where each one is):
    ///
    ///   native   127.0.0.1:7470   GPCW, the native protocol of `gpucache put/get/stat` and the
    ///                             client library (listen.native)
    ///   local    ./gpucache-data/gpucache.sock   a Unix socket for clients on this host: GPCW
    ///                             with payloads in shared memory, `--shm` (listen.local; with a
    ///                             memory store, none unless set)
    ///   resp     127.0.0.1:7471   the Redis protocol (RESP2, RESP3 after HELLO 3) for
    ///                             redis-cli, redis-py and other Redis clients (listen.resp)
    ///   metrics  127.0.0.1:7472   HTTP: /metrics (Prometheus), /livez, /readyz and /healthz
    ///                             (listen.metrics)
    #[command(verbatim_doc_comment)]
    Serve {
        /// A TOML configuration (see gpucache.example.toml and docs/OPERATIONS.md).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Run the DPU agent as its own process: `serve` with a configuration whose
    /// `[store] kind = "dpu"` (any other kind is refused, exit status 2). GET and PUT are served
    /// over the same GPCW and RESP listeners; the start line reports the offload truthfully.
    DpuAgent {
        /// A TOML configuration with `[store] kind = "dpu"` and a `[dpu]` section.
        #[arg(long)]
        config: PathBuf,
    },
    /// Store a value under a plain NAME in a running service (from FILE, or standard input).
    ///
    /// Values are create-only: storing the same value again succeeds ("already stored"), and
    /// another value under a NAME that holds one is refused. A value larger than the service's
    /// object limit is refused before it is read.
    Put {
        /// The plain name to store under (any bytes; the same name `redis-cli GET` reads).
        name: String,
        /// The file holding the value; standard input when absent.
        file: Option<PathBuf>,
        #[command(flatten)]
        target: client_cmd::PutTarget,
    },
    /// Write the value under a plain NAME to standard output (exit status 3 on a miss).
    Get {
        /// The plain name to read (the same name `gpucache put` and `redis-cli SET` store).
        name: String,
        #[command(flatten)]
        target: client_cmd::GetTarget,
    },
    /// Print a running service's store counters.
    Stat {
        #[command(flatten)]
        target: client_cmd::StatTarget,
    },
    /// Show or change a cluster's view in etcd: status, drain, undrain, finish, isolate,
    /// rebalance (exit status 1 when the rules refuse the change, 2 when etcd cannot be asked).
    Cluster(cluster_cmd::ClusterArgs),
    /// Work on an s3 tier's bucket from the service's configuration: status, retire a
    /// tenant, reclaim (exit status 1 when a reclaim left objects, 2 when the bucket cannot be
    /// reached).
    Cold(cold_cmd::ColdArgs),
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return Err(format!("odd number of hex digits ({})", s.len()));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| format!("at {i}: {e}")))
        .collect()
}

fn describe(bytes: &[u8]) -> Result<String, KeyDecodeError> {
    if bytes.starts_with(b"GPCL") {
        let k = LogicalKey::decode(bytes)?;
        return Ok(format!("logical key {:?}\n{:#?}", k.digest(), k.parts()));
    }
    let k = PhysicalKey::decode(bytes)?;
    Ok(format!("physical key {:?}\n{:#?}", k.digest(), k.identity()))
}

fn key_command(hex: &str) -> ExitCode {
    let result = unhex(hex)
        .map_err(|e| format!("not hex: {e}"))
        .and_then(|bytes| describe(&bytes).map_err(|e| format!("not a valid key: {e}")));
    match result {
        Ok(text) => {
            #[allow(clippy::print_stdout)]
            {
                println!("{text}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpucache key: {e}");
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_filter = match cli.command {
        Command::Serve { .. } | Command::DpuAgent { .. } => logging::SERVICE_FILTER,
        _ => logging::TOOL_FILTER,
    };
    if let Err(e) = cli.log.init(default_filter) {
        eprintln!("gpucache: {e}");
        return ExitCode::from(2);
    }
    match cli.command {
        Command::Key { hex } => key_command(&hex),
        Command::Fsck { dir, repair } => fsck::run(&dir, repair),
        Command::Serve { config } => gpucache_service::serve::run(config.as_deref()),
        Command::DpuAgent { config } => gpucache_service::serve::run_agent(&config),
        Command::Put { name, file, target } => client_cmd::put(&target, &name, file.as_ref()),
        Command::Get { name, target } => client_cmd::get(&target, &name),
        Command::Stat { target } => client_cmd::stat(&target),
        Command::Cluster(args) => cluster_cmd::run(&args),
        Command::Cold(args) => cold_cmd::run(&args),
    }
}
