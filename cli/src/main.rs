//! The `gpucache` command-line tool.
//!
//! Owns argument parsing and wiring backends together from validated configuration; no data
//! path logic lives here. Today it inspects keys; `serve`, `put`, `get`, `stat`, `fsck` and
//! `bench` arrive with the service.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpucache_dataplane::key::{KeyDecodeError, LogicalKey, PhysicalKey};

#[derive(Debug, Parser)]
#[command(name = "gpucache", version, about = "GPUCache: a shared tier for LLM KV-cache blocks")]
struct Cli {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Key { hex } => {
            let result = unhex(&hex)
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
    }
}
