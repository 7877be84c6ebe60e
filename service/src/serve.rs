//! `gpucache serve`: runs the service a configuration describes until SIGINT or SIGTERM.
//!
//! Loads and validates the configuration (the embedded default without `--config`), blocks the
//! stop signals (so every thread the build starts inherits the mask and only the main thread
//! receives them), builds the service ([`ValidConfig::build`]: store, listeners, staging, DPU
//! agent, HTTP, readiness), logs its start lines, waits for a signal, and stops it. Everything
//! it says goes through `tracing` (the start line at info), so `--log-format json` covers it.
//! Exit status: 0 after a clean stop, 1 when connection threads did not stop in time, 2 when the
//! configuration is refused or the service could not start.

use std::path::Path;
use std::process::ExitCode;

use crate::config::{ServeConfig, StoreKind, ValidConfig};

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a sigset_t we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

fn fail(what: &str, e: impl std::fmt::Display) -> ExitCode {
    tracing::error!("gpucache serve: {what}: {e}");
    ExitCode::from(2)
}

/// `gpucache dpu-agent`: `serve` for a configuration of `store.kind = "dpu"` only.
pub fn run_agent(config_path: &Path) -> ExitCode {
    match ValidConfig::load(config_path) {
        Ok(c) if c.store.kind == StoreKind::Dpu => serve(c),
        Ok(c) => fail(
            "store.kind",
            format!("dpu-agent runs store.kind = \"dpu\" only, this file has {:?}", c.store.kind),
        ),
        Err(e) => fail("invalid configuration", e),
    }
}

/// `gpucache serve [--config FILE]`.
pub fn run(config_path: Option<&Path>) -> ExitCode {
    let config = match config_path {
        Some(p) => ValidConfig::load(p),
        None => ServeConfig::default().validate(),
    };
    match config {
        Ok(c) => serve(c),
        Err(e) => fail("invalid configuration", e),
    }
}

/// Builds the service a validated configuration describes and runs it until SIGINT or SIGTERM.
fn serve(config: ValidConfig) -> ExitCode {
    let signals = stop_signals();
    // SAFETY: blocks two signals for this thread (and the threads it starts); no memory shared.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut()) } != 0 {
        return fail("signals", std::io::Error::last_os_error());
    }
    let service = match config.build() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("gpucache serve: {e}");
            return ExitCode::from(2);
        }
    };
    for line in service.start_lines() {
        tracing::info!("{line}");
    }
    let mut signal: libc::c_int = 0;
    // SAFETY: waits for one of the blocked signals; `signal` is a valid out pointer.
    let waited = unsafe { libc::sigwait(&signals, &mut signal) };
    if waited != 0 {
        return fail("waiting for a stop signal", std::io::Error::from_raw_os_error(waited));
    }
    tracing::info!("signal {signal}, shutting down");
    let left = service.stop();
    if left > 0 {
        tracing::error!("{left} connection threads did not stop in time");
        return ExitCode::from(1);
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}
