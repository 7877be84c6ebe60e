//! The bench with NIXL built in: the whole run ([`run_inner`]) and the peer role
//! ([`peer_main`], in [`super::transfers`]).

use super::paths::{self, PathRun};
use super::plan::{NixlBenchArgs, PathName, Plan};
use super::{report, tcp, transfers};

pub(super) use super::transfers::peer_main;

/// Runs every planned path and reports them; `Ok(false)` when a path failed or a byte check did
/// not pass.
pub(super) fn run_inner(args: &NixlBenchArgs, plan: &Plan) -> Result<bool, String> {
    let load_start = crate::service::loadavg();
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
    let scratch = tempfile::Builder::new()
        .prefix("gpucache-bench-nixl-")
        .tempdir_in(&base)
        .map_err(|e| format!("cannot make a directory in {}: {e}", base.display()))?;
    let dir = scratch.path().to_owned();
    eprintln!("bench: working in {}", dir.display());

    let mut runs: Vec<PathRun> = Vec::new();
    let mut ucx_version = None;
    if plan.wants(PathName::Nixl) || plan.wants(PathName::NixlRaw) {
        match transfers::Session::start(&dir, plan) {
            Ok(mut session) => {
                ucx_version = session.ucx_version();
                runs.extend(session.measure(plan));
                session.finish();
            }
            Err(e) => {
                eprintln!("bench: nixl: {e}");
                for name in transfers::path_names(plan) {
                    runs.push(PathRun::failed(name, e.clone()));
                }
            }
        }
    }
    if plan.wants(PathName::Tcp) {
        runs.extend(tcp::measure(&dir, plan));
    }
    if plan.wants(PathName::Memcpy) {
        runs.push(paths::memcpy(plan));
    }

    let ucx_tls = std::env::var("UCX_TLS").ok();
    let context = report::Context {
        command: std::env::args().collect(),
        date: crate::service::utc_now(),
        commit: crate::service::git_commit(),
        machine: crate::service::machine(&load_start),
        ucx_tls,
        ucx_version,
    };
    let clean = runs.iter().all(PathRun::clean);
    #[allow(clippy::print_stdout)]
    {
        println!("{}", report::text(&context, plan, &runs).trim_end());
    }
    if let Some(path) = &args.json {
        let doc = report::json(&context, plan, &runs);
        let text = serde_json::to_string_pretty(&doc).map_err(|e| format!("JSON: {e}"))?;
        crate::service::write_file(path, &text)?;
        eprintln!("bench: JSON written to {}", path.display());
    }
    if args.keep_logs {
        let kept = scratch.keep();
        eprintln!("bench: logs kept in {}", kept.display());
    }
    Ok(clean)
}
