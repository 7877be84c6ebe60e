//! `gpucache cluster`: the cluster's view in etcd, and the control plane's changes to it.
//! Each change is one compare-and-swap of the view (the epoch advances by one); a change the
//! rules refuse (the last member, an unknown node or domain) changes nothing and exits 1.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use gpucache_cluster::{ClusterError, Coordinator, EtcdConfig};
use gpucache_dataplane::shard::{ClusterView, NodeId};

#[derive(Debug, Args)]
pub(crate) struct ClusterArgs {
    /// etcd client URLs, comma-separated (every member of the etcd cluster).
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    etcd: Vec<String>,
    /// The cluster's name (`cluster.name` of its nodes).
    #[arg(long, default_value = "gpucache")]
    name: String,
    #[command(subcommand)]
    command: ClusterCommand,
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Print the view: its epoch, and per member its node, address, fault domain, state,
    /// node epoch and whether its registration is live.
    Status,
    /// Start draining NODE for an upgrade: it keeps serving its keys and admits nothing new.
    Drain { node: u64 },
    /// Roll a drain of NODE back before it finished: it admits again.
    Undrain { node: u64 },
    /// Finish a drain: NODE leaves the view and its keys move to their next choices.
    Finish { node: u64 },
    /// Remove every member of fault domain DOMAIN (refused when none, or all, are in it).
    Isolate { domain: String },
    /// Rebuild the view from the members whose registration is live, fencing every fill.
    Rebalance,
}

fn view_text(coordinator: &Coordinator, view: &ClusterView) -> String {
    use std::fmt::Write;
    let live = coordinator.live_members().unwrap_or_default();
    let mut out = format!("epoch {} members {}\n", view.epoch, view.members.len());
    for m in &view.members {
        let alive = live.iter().any(|l| l.node == m.node && l.node_epoch == m.node_epoch);
        let _ = writeln!(
            out,
            "node {} address {} domain {} state {} node_epoch {} registration {}",
            m.node.0,
            m.address,
            m.fault_domain,
            m.state.name(),
            m.node_epoch,
            if alive { "live" } else { "lapsed" }
        );
    }
    out
}

pub(crate) fn run(args: &ClusterArgs) -> ExitCode {
    let coordinator = match Coordinator::connect(EtcdConfig::new(args.etcd.clone(), &args.name)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpucache cluster: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match &args.command {
        ClusterCommand::Status => coordinator.view().map(|(v, _)| v),
        ClusterCommand::Drain { node } => {
            coordinator.change(|v| gpucache_cluster::drain(v, NodeId(*node)))
        }
        ClusterCommand::Undrain { node } => {
            coordinator.change(|v| gpucache_cluster::undrain(v, NodeId(*node)))
        }
        ClusterCommand::Finish { node } => {
            coordinator.change(|v| gpucache_cluster::finish(v, NodeId(*node)))
        }
        ClusterCommand::Isolate { domain } => {
            coordinator.change(|v| gpucache_cluster::isolate(v, domain))
        }
        ClusterCommand::Rebalance => coordinator
            .live_members()
            .and_then(|live| coordinator.change(|v| gpucache_cluster::rebalance(v, &live))),
    };
    match result {
        Ok(view) => {
            use std::io::Write;
            match std::io::stdout().write_all(view_text(&coordinator, &view).as_bytes()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gpucache cluster: stdout: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Err(ClusterError::Refused(e)) => {
            eprintln!("gpucache cluster: refused: {e}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("gpucache cluster: {e}");
            ExitCode::from(2)
        }
    }
}
