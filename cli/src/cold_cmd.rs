//! `gpucache cold`: the operator's commands on an s3 tier's bucket, from the same configuration
//! file the service runs with (the `[[store.tiers]] kind = "s3"` section and its credentials
//! from the environment). They work on the bucket alone: a running service learns of a retired
//! tenant at its next start, and reclaims on its own schedule.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use gpucache_dataplane::identity::TenantId;
use gpucache_service::config::ValidConfig;

#[derive(Debug, Args)]
pub(crate) struct ColdArgs {
    /// The service's configuration file; its store must have an s3 tier.
    #[arg(long)]
    config: PathBuf,
    #[command(subcommand)]
    command: ColdCommand,
}

#[derive(Debug, Subcommand)]
enum ColdCommand {
    /// What the bucket holds: manifests and blocks indexed, legacy and damaged manifests
    /// skipped, retired tenants.
    Status,
    /// Retire TENANT for good: its blocks are refused from now on (also after restarts), and
    /// the next reclaim deletes its packs.
    Retire { tenant: String },
    /// Delete every expired pack and every pack of a retired tenant now, each delete proven
    /// by a HEAD (exit status 1 when some object could not be removed).
    Reclaim,
}

/// Writes `line` to stdout; a stdout that cannot take it fails the command.
fn say(line: &str) -> ExitCode {
    use std::io::Write;
    match writeln!(std::io::stdout(), "{line}") {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(format!("stdout: {e}")),
    }
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("gpucache cold: {e}");
    ExitCode::from(2)
}

pub(crate) fn run(args: &ColdArgs) -> ExitCode {
    let config = match ValidConfig::load(&args.config) {
        Ok(c) => c,
        Err(e) => return fail(format!("invalid configuration: {e}")),
    };
    let (tier, report) = match config.open_cold_tier() {
        None => return fail("store.tiers: the configuration has no s3 tier"),
        Some(Err(e)) => return fail(e),
        Some(Ok(opened)) => opened,
    };
    match &args.command {
        ColdCommand::Status => {
            let s = tier.stats();
            say(&format!(
                "manifests={} blocks={} legacy_manifests={} damaged_manifests={} retired_tenants={}",
                s.manifests, s.blocks, report.legacy, report.damaged, report.retired_tenants
            ))
        }
        ColdCommand::Retire { tenant } => {
            let tenant = match TenantId::parse(tenant) {
                Ok(t) => t,
                Err(e) => return fail(format!("tenant {tenant:?}: {e}")),
            };
            match tier.retire(&tenant) {
                Ok(()) => {
                    let packs = tier.manifests_of(&tenant).len();
                    say(&format!("retired tenant={tenant} packs_to_reclaim={packs}"))
                }
                Err(e) => fail(e),
            }
        }
        ColdCommand::Reclaim => {
            let r = tier.reclaim();
            for (name, e) in &r.failed {
                eprintln!("gpucache cold: not reclaimed: {name}: {e}");
            }
            let said = say(&format!(
                "reclaimed manifests={} packs={} failed={}",
                r.manifests,
                r.packs,
                r.failed.len()
            ));
            if r.failed.is_empty() { said } else { ExitCode::from(1) }
        }
    }
}
