//! The metrics as operators get them: `gpucache serve` (a file store and a DPU store) answers
//! traffic (PUT, GET hits and misses, a refused PUT), its `/metrics` scrape passes
//! `promtool check metrics` without a single warning, and every series in it is listed in
//! docs/OPERATIONS.md. The shipped alert rules pass `promtool check rules` and their unit tests
//! (`promtool test rules`), and the Grafana dashboard and the rules query only documented series.
//!
//! promtool comes with Debian's `prometheus` package (scripts/test.sh installs it). Without it
//! the promtool tests say so and pass, unless `GPUCACHE_REQUIRE_PROMETHEUS=1`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::store::{Get, Lookup, Put, Store};
use gpucache_dataplane::testing::fixture::{key, payload};
use gpucache_dataplane::testing::process::promtool;

mod common;

use common::{Serve, http_get};

/// The largest block the servers under test accept, so one PUT can be refused.
const OBJECT_BYTES_MAX: usize = 1 << 20;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(relative: &str) -> String {
    let path = repo().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// A configuration for `kind` under `dir`: every listener on a free port, a small block limit.
fn config(dir: &Path, kind: &str) -> PathBuf {
    let path = dir.join("gpucache.toml");
    let dpu = if kind == "dpu" {
        format!("\n[dpu]\nstate_dir = \"{}\"\nslab_slots = 8\n", dir.join("agent").display())
    } else {
        String::new()
    };
    // The tiered store keeps its file tier's blocks in the block log, whose series it shows.
    let layout = if kind == "tiered" { "log" } else { "files" };
    let text = format!(
        "[store]\nkind = \"{kind}\"\nroot = \"{}\"\ndurability = \"per-block\"\n\
         layout = \"{layout}\"\n\n\
         [limits]\nobject_bytes_max = {OBJECT_BYTES_MAX}\n\n\
         [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
         [[tenants]]\nname = \"tenant-a\"\nrights = [\"read\", \"write\"]\n{dpu}",
        dir.join("data").display(),
    );
    std::fs::write(&path, text).expect("write config");
    path
}

/// PUTs, GET hits and misses, a lookup and a refused PUT, so that the histograms and the
/// labelled counters all have samples; answers the scrape that follows.
fn scrape_after_traffic(serve: &Serve) -> String {
    let c = Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(serve.native(), c.clone()));
    let mut buf = vec![0u8; OBJECT_BYTES_MAX];
    for i in 0..4u8 {
        let k = key(0, &[5, i], KvDtype::Bf16, 16);
        let data = payload(u64::from(i), 4096 * (usize::from(i) + 1));
        assert!(matches!(client.put(&c, &k, &data, None).expect("put"), Put::Committed(_)));
        assert!(matches!(client.get_into(&c, &k, &mut buf).expect("get"), Get::Hit { .. }));
    }
    let absent = key(0, &[6], KvDtype::Bf16, 16);
    assert!(matches!(client.get_into(&c, &absent, &mut buf).expect("get"), Get::Miss(_)));
    assert!(matches!(client.lookup(&c, &absent).expect("lookup"), Lookup::Miss(_)));
    let big = payload(9, OBJECT_BYTES_MAX + 1);
    assert!(matches!(client.put(&c, &absent, &big, None).expect("put"), Put::Refused(_)));

    let reply = http_get(serve.metrics(), "/metrics");
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The traffic above is in the scrape: the checks below lint real samples.
    for line in [
        r#"gpucache_ops_total{op="put",outcome="committed"} 4"#,
        r#"gpucache_ops_total{op="put",outcome="refused"} 1"#,
        r#"gpucache_ops_total{op="get",outcome="hit"} 4"#,
        r#"gpucache_refusals_total{reason="object_too_large"} 1"#,
        r#"gpucache_op_seconds_count{op="get"} 5"#,
    ] {
        assert!(body.lines().any(|l| l == line), "no {line:?} in the scrape:\n{body}");
    }
    body.to_owned()
}

/// The names on the scrape's `# TYPE` lines (a histogram's family name, a counter's `_total`).
fn type_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// The series docs/OPERATIONS.md lists: every backquoted `gpucache_*` name in the first column
/// of a table row, labels (`{a,b}`) left off.
fn documented() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in read("docs/OPERATIONS.md").lines() {
        let Some(row) = line.strip_prefix('|') else { continue };
        let first = row.split('|').next().unwrap_or_default();
        for (i, quoted) in first.split('`').enumerate() {
            if i % 2 == 1 && quoted.starts_with("gpucache_") {
                names.insert(quoted.split('{').next().unwrap_or(quoted).to_owned());
            }
        }
    }
    assert!(names.len() > 20, "docs/OPERATIONS.md lists only {names:?}");
    names
}

/// Lints the scrape with promtool and checks that the docs list each of its series.
fn check_scrape(scrape: &str) {
    let undocumented: Vec<String> = type_names(scrape).difference(&documented()).cloned().collect();
    assert!(
        undocumented.is_empty(),
        "series missing from the table in docs/OPERATIONS.md: {undocumented:?}"
    );
    let Some((ok, printed)) = promtool(&["check", "metrics"], &repo(), scrape) else { return };
    assert!(ok, "promtool check metrics failed:\n{printed}\n--- scrape ---\n{scrape}");
    assert!(
        printed.is_empty(),
        "promtool check metrics warned:\n{printed}\n--- scrape ---\n{scrape}"
    );
}

#[test]
fn a_file_store_scrape_passes_promtool_and_every_series_is_documented() {
    let dir = tempfile::tempdir().expect("temp dir");
    let serve = Serve::start(&config(dir.path(), "file"));
    let scrape = scrape_after_traffic(&serve);
    for name in ["gpucache_errors_total", "gpucache_limit_retained_bytes", "gpucache_store_info"] {
        assert!(type_names(&scrape).contains(name), "no {name} in the scrape:\n{scrape}");
    }
    check_scrape(&scrape);
    serve.stop();
}

#[test]
fn a_tiered_store_scrape_counts_each_tier_and_passes_promtool() {
    let dir = tempfile::tempdir().expect("temp dir");
    let serve = Serve::start(&config(dir.path(), "tiered"));
    let scrape = scrape_after_traffic(&serve);
    // Each PUT was written through and copied up, so each GET was a memory hit; the absent key
    // missed both tiers.
    for line in [
        r#"gpucache_tier_hits_total{tier="memory"} 4"#,
        r#"gpucache_tier_hits_total{tier="file"} 0"#,
        "gpucache_tier_misses_total 1",
        "gpucache_tier_written_up_total 4",
        r#"gpucache_tier_blocks{tier="memory"} 4"#,
        r#"gpucache_tier_blocks{tier="file"} 4"#,
        "gpucache_tier_log_compactions_total 0",
    ] {
        assert!(scrape.lines().any(|l| l == line), "no {line:?} in the scrape:\n{scrape}");
    }
    check_scrape(&scrape);
    serve.stop();
}

#[test]
fn a_dpu_store_scrape_passes_promtool_and_every_series_is_documented() {
    let dir = tempfile::tempdir().expect("temp dir");
    let serve = Serve::start(&config(dir.path(), "dpu"));
    let scrape = scrape_after_traffic(&serve);
    assert!(type_names(&scrape).contains("gpucache_dpu_offload_info"), "{scrape}");
    check_scrape(&scrape);
    serve.stop();
}

/// The metric names an expression reads: its `gpucache_*` identifiers outside quoted strings,
/// a histogram's `_bucket`, `_sum` and `_count` series under the histogram's name.
fn names_in(expr: &str, documented: &BTreeSet<String>) -> Vec<String> {
    let mut unquoted = String::new();
    let mut quote = None;
    for ch in expr.chars() {
        match quote {
            Some(q) if ch == q => quote = None,
            Some(_) => {}
            None if ch == '"' || ch == '\'' || ch == '`' => quote = Some(ch),
            None => unquoted.push(ch),
        }
    }
    unquoted
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("gpucache_"))
        .map(|w| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .filter_map(|s| w.strip_suffix(s))
                .find(|base| documented.contains(*base))
                .unwrap_or(w)
                .to_owned()
        })
        .collect()
}

/// Every string under an `expr` or `query` key of the dashboard, at any depth.
fn dashboard_queries(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match v {
                    serde_json::Value::String(s) if k == "expr" || k == "query" => {
                        out.push(s.clone());
                    }
                    _ => dashboard_queries(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_queries(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_queries_only_documented_series() {
    let text = read("deploy/grafana/gpucache.json");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    assert_eq!(dashboard["title"], "GPUCache", "{dashboard:#}");
    let panels = dashboard["panels"].as_array().expect("panels");
    let titles: Vec<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for wanted in
        ["Throughput", "Latency", "Hit ratio", "Refusals", "Quarantine", "Disk use", "Readiness"]
    {
        assert!(titles.iter().any(|t| t.starts_with(wanted)), "no {wanted} panel in {titles:?}");
    }
    let mut ids = BTreeSet::new();
    for p in panels {
        let id = p["id"].as_u64().expect("every panel has a numeric id");
        assert!(ids.insert(id), "panel id {id} used twice");
        assert!(p["gridPos"]["w"].as_u64().is_some(), "panel {id} has no gridPos");
    }

    let mut queries = Vec::new();
    dashboard_queries(&dashboard, &mut queries);
    let documented = documented();
    let mut used = BTreeSet::new();
    for q in &queries {
        for name in names_in(q, &documented) {
            assert!(
                documented.contains(&name),
                "the dashboard queries {name} ({q}), which docs/OPERATIONS.md does not list"
            );
            used.insert(name);
        }
    }
    for name in ["gpucache_bytes_total", "gpucache_op_seconds", "gpucache_ready"] {
        assert!(used.contains(name), "the dashboard never queries {name}");
    }
}

/// The `expr:` of every rule in the alert file (each written on one line).
fn alert_exprs(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix("expr:"))
        .map(|e| e.trim().to_owned())
        .collect()
}

#[test]
fn the_alert_rules_query_only_documented_series() {
    let text = read("deploy/prometheus/alerts.yml");
    let exprs = alert_exprs(&text);
    assert!(exprs.len() >= 4, "too few rules: {exprs:?}");
    let documented = documented();
    let mut used = BTreeSet::new();
    for e in &exprs {
        assert!(!e.is_empty() && !e.starts_with(['|', '>']), "write each expr on its line: {e}");
        for name in names_in(e, &documented) {
            assert!(documented.contains(&name), "a rule queries {name} ({e}), not documented");
            used.insert(name);
        }
    }
    for name in ["gpucache_ready", "gpucache_quarantined_regions", "gpucache_refusals_total"] {
        assert!(used.contains(name), "no rule on {name}");
    }
}

#[test]
fn promtool_accepts_the_alert_rules_and_their_unit_tests() {
    let Some((ok, printed)) =
        promtool(&["check", "rules", "deploy/prometheus/alerts.yml"], &repo(), "")
    else {
        return;
    };
    assert!(ok, "promtool check rules:\n{printed}");
    assert!(printed.contains("SUCCESS"), "promtool check rules:\n{printed}");
    let Some((ok, printed)) =
        promtool(&["test", "rules", "deploy/prometheus/alerts_test.yml"], &repo(), "")
    else {
        return;
    };
    assert!(ok, "promtool test rules:\n{printed}");
}

#[test]
fn names_are_read_outside_quotes_and_histogram_series_map_to_their_family() {
    let documented: BTreeSet<String> =
        ["gpucache_op_seconds".to_owned(), "gpucache_ready_check".to_owned()].into();
    let names = names_in(
        r#"histogram_quantile(0.99, sum by (le) (rate(gpucache_op_seconds_bucket{op="gpucache_x"}[5m]))) + gpucache_ready_check{check='disk_room'}"#,
        &documented,
    );
    assert_eq!(names, ["gpucache_op_seconds", "gpucache_ready_check"]);
    assert_eq!(names_in("gpucache_misses_count", &documented), ["gpucache_misses_count"]);
    let exprs = alert_exprs("rules:\n  - alert: A\n    expr: gpucache_ready == 0\n    for: 5m\n");
    assert_eq!(exprs, ["gpucache_ready == 0"]);
}
