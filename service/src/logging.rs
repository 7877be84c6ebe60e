//! Where the `gpucache` and `gpucache-bench` binaries' log goes: every `tracing` event of this crate and of the
//! libraries below it (the FileStore's engine fallback, a key file that failed to reload, a pool
//! that could not lock its pages, DPU reactors that did not stop, NIXL quarantines) is written to
//! standard error, as text or as one JSON object per line. `RUST_LOG` selects what is written
//! (an `EnvFilter` directive such as `warn` or `gpucache_service=debug`); without it, `info`
//! for the service ([`SERVICE_FILTER`]) and `warn` for the one-shot commands ([`TOOL_FILTER`]),
//! whose own output is the answer.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event: time, level, target, message and fields.
    #[default]
    Text,
    /// One JSON object per event (time, level, target, fields), for a log collector.
    Json,
}

/// The filter `serve` and `dpu-agent` use when `RUST_LOG` is unset.
pub const SERVICE_FILTER: &str = "info";
/// The filter the other commands (put, get, stat, fsck, key, and gpucache-bench's harnesses) use
/// when `RUST_LOG` is unset.
pub const TOOL_FILTER: &str = "warn";

/// The `--log-format` option of every binary, flattened into its arguments.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct LogArgs {
    /// How log lines on standard error are written: text, or one JSON object per line. What is
    /// logged follows RUST_LOG (an EnvFilter directive, e.g. `warn`); info without it.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// [`init`] in the format asked for.
    pub fn init(self, default: &str) -> Result<(), LoggingError> {
        init(self.log_format, default)
    }
}

/// Why the log could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("RUST_LOG is not a valid filter: {0}")]
    Filter(#[from] tracing_subscriber::filter::ParseError),
    #[error("RUST_LOG is not valid Unicode")]
    NotUnicode,
    #[error("a global log subscriber is already installed: {0}")]
    Installed(String),
}

/// The filter `RUST_LOG` asks for, or `default`. A malformed `RUST_LOG` is an error, not
/// silently ignored.
pub fn filter_from_env(default: &str) -> Result<EnvFilter, LoggingError> {
    match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => Ok(EnvFilter::try_new(directives)?),
        Ok(_) | Err(std::env::VarError::NotPresent) => Ok(EnvFilter::try_new(default)?),
        Err(std::env::VarError::NotUnicode(_)) => Err(LoggingError::NotUnicode),
    }
}

/// Installs the process's subscriber: `RUST_LOG` (or `default`) to standard error in `format`.
/// Colour only when standard error is a terminal.
pub fn init(format: LogFormat, default: &str) -> Result<(), LoggingError> {
    let filter = filter_from_env(default)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    installed.map_err(|e| LoggingError::Installed(e.to_string()))
}
