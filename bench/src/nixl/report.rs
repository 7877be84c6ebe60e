//! The report: a table per path and size, the ratios, and the same as JSON.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::paths::PathRun;
use super::plan::Plan;
use crate::stats::{self, cell};
use gpucache_service::units::size_label;

/// What the run was, beside its figures.
#[derive(Debug)]
pub(super) struct Context {
    pub command: Vec<String>,
    pub date: String,
    pub commit: String,
    pub machine: Value,
    /// UCX_TLS as this process (and the peer) saw it; `None`: UCX chose.
    pub ucx_tls: Option<String>,
    pub ucx_version: Option<String>,
}

/// The ratios reported per size: (name, numerator row, denominator row).
pub(super) const RATIOS: [(&str, &str, &str); 6] = [
    ("nixl-write/memcpy", "nixl-write", "memcpy"),
    ("nixl-read/memcpy", "nixl-read", "memcpy"),
    ("nixl-write/tcp-put", "nixl-write", "tcp-put"),
    ("nixl-read/tcp-get", "nixl-read", "tcp-get"),
    ("nixl-write/raw", "nixl-write", "nixl-raw-write"),
    ("nixl-read/raw", "nixl-read", "nixl-raw-read"),
];

/// A row's rate at `size`, only when its bytes were checked and matched: a ratio never rests on
/// a transfer that moved the wrong bytes.
fn gib(runs: &[PathRun], name: &str, size: u64) -> Option<f64> {
    let point = runs.iter().find(|r| r.name == name)?.point(size)?;
    point.gib_s.filter(|_| point.verified)
}

fn ratio(runs: &[PathRun], num: &str, den: &str, size: u64) -> Option<f64> {
    stats::ratio(gib(runs, num, size)?, gib(runs, den, size)?)
}

pub(super) fn text(ctx: &Context, plan: &Plan, runs: &[PathRun]) -> String {
    let mut out = String::new();
    let m = &ctx.machine;
    let s = |k: &str| m.get(k).and_then(Value::as_str).unwrap_or("?").to_owned();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# gpucache-bench nixl");
    let _ = writeln!(out, "command: {}", ctx.command.join(" "));
    let _ = writeln!(
        out,
        "ended: {}; commit: {}; machine: {} CPUs, kernel {}, load average {} at the start and {} \
         at the end",
        ctx.date,
        ctx.commit,
        m.get("nproc").and_then(Value::as_u64).unwrap_or(0),
        s("kernel"),
        s("loadavg_start"),
        s("loadavg_end"),
    );
    let _ = writeln!(
        out,
        "UCX {}; UCX_TLS={}; {} timed iterations per size and path after {} warm-up; GiB/s = \
         2^30 B/s over the sum of the timed blocks; p50/p99 per block in us",
        ctx.ucx_version.as_deref().unwrap_or("(version not found)"),
        ctx.ucx_tls.as_deref().unwrap_or("(unset: UCX's choice)"),
        plan.iterations,
        plan.warmup,
    );
    for r in runs {
        match &r.error {
            Some(e) => {
                let _ = writeln!(out, "- {}: did not run: {e}", r.name);
            }
            None => {
                let _ = writeln!(out, "- {}: {}", r.name, r.note);
            }
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| size | path | GiB/s | p50 us | p99 us | bytes checked |\n|---|---|---:|---:|---:|---|"
    );
    for &size in &plan.sizes {
        for r in runs.iter().filter(|r| r.error.is_none()) {
            let Some(p) = r.point(size) else { continue };
            let checked = match (&p.error, p.verified) {
                (Some(e), _) => format!("failed: {e}"),
                (None, true) => "yes".to_owned(),
                (None, false) => "MISMATCH".to_owned(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                size_label(size),
                r.name,
                cell(p.gib_s, 2),
                cell(p.p50_us, 1),
                cell(p.p99_us, 1),
                checked
            );
        }
    }
    let _ = writeln!(out);
    let mut head = String::from("| size |");
    let mut rule = String::from("|---|");
    for (name, _, _) in RATIOS {
        let _ = write!(head, " {name} |");
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{head}\n{rule}");
    for &size in &plan.sizes {
        let mut row = format!("| {} |", size_label(size));
        for (_, num, den) in RATIOS {
            let _ = write!(row, " {} |", cell(ratio(runs, num, den, size), 2));
        }
        let _ = writeln!(out, "{row}");
    }
    out
}

pub(super) fn json(ctx: &Context, plan: &Plan, runs: &[PathRun]) -> Value {
    let ratios: Vec<Value> = plan
        .sizes
        .iter()
        .map(|&size| {
            let mut row = serde_json::Map::new();
            row.insert("size".into(), json!(size));
            for (name, num, den) in RATIOS {
                row.insert(name.into(), json!(ratio(runs, num, den, size)));
            }
            Value::Object(row)
        })
        .collect();
    json!({
        "command": ctx.command,
        "date": ctx.date,
        "git_commit": ctx.commit,
        "machine": ctx.machine,
        "ucx_tls": ctx.ucx_tls,
        "ucx_version": ctx.ucx_version,
        "params": {
            "sizes": plan.sizes,
            "iterations": plan.iterations,
            "warmup": plan.warmup,
            "gib": "2^30 bytes per second over the sum of the timed blocks",
        },
        "paths": runs,
        "ratios": ratios,
    })
}

#[cfg(test)]
mod tests {
    use super::super::paths::Point;
    use super::*;

    #[test]
    fn ratios_divide_rows_and_the_table_names_every_path() {
        let point = |size, gib| Point {
            size,
            iterations: 1,
            gib_s: Some(gib),
            p50_us: Some(1.0),
            p99_us: Some(2.0),
            verified: true,
            error: None,
        };
        let mut w = PathRun::new("nixl-write", "n");
        w.points.push(point(1024, 4.0));
        let mut m = PathRun::new("memcpy", "m");
        m.points.push(point(1024, 8.0));
        let runs = vec![w, m];
        assert_eq!(ratio(&runs, "nixl-write", "memcpy", 1024), Some(0.5));
        assert_eq!(ratio(&runs, "nixl-read", "memcpy", 1024), None);
        // A row whose bytes did not match gives no ratio.
        let mut bad = runs.clone();
        bad[0].points[0].verified = false;
        assert_eq!(ratio(&bad, "nixl-write", "memcpy", 1024), None);
        let plan = Plan {
            sizes: vec![1024],
            iterations: 1,
            warmup: 0,
            paths: vec![super::super::PathName::Nixl],
        };
        let ctx = Context {
            command: vec!["gpucache".into()],
            date: "d".into(),
            commit: "c".into(),
            machine: json!({}),
            ucx_tls: None,
            ucx_version: None,
        };
        let t = text(&ctx, &plan, &runs);
        assert!(t.contains("| 1K | nixl-write | 4.00 |"), "{t}");
        assert!(t.contains("| 1K | 0.50 |"), "{t}");
        let j = json(&ctx, &plan, &runs);
        assert_eq!(j["ratios"][0]["nixl-write/memcpy"], json!(0.5));
        assert_eq!(j["paths"][1]["name"], json!("memcpy"));
    }
}
