//! `gpucache-bench trace` end to end on a handmade trace whose hit ratios are worked out by
//! hand: the wiring of the subcommand, its JSON, its chart, and its refusals.

mod common;

/// Five one-block requests, [1] [2] [1] [3] [1]: three distinct blocks. At 67% (two blocks):
/// LRU stores 1 and 2, hits 1 (touching it), evicts 2 for 3, hits 1 again: 2 of 5. FIFO evicts
/// 1, the oldest commit, for 3, so the last 1 misses: 1 of 5. Belady never admits 2 or 3 at the
/// cost of 1: 2 of 5, as the offline LRU.
const TRACE: &str =
    "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}
{\"hash_ids\": [2]}
{\"hash_ids\": [1]}
{\"hash_ids\": [3]}
{\"hash_ids\": [1]}
";

fn row<'a>(doc: &'a serde_json::Value, policy: &str) -> &'a serde_json::Value {
    doc["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["policy"] == policy)
        .unwrap_or_else(|| panic!("no {policy} row: {doc}"))
}

#[test]
fn a_handmade_trace_gives_its_worked_out_ratios_in_both_stores() {
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("hand.jsonl");
    std::fs::write(&trace, TRACE).expect("write trace");
    for store in ["memory", "file"] {
        let json = dir.path().join(format!("{store}.json"));
        let svg = dir.path().join(format!("{store}.svg"));
        let (code, out, err) = common::gpucache_bench(&[
            "trace",
            "--trace",
            trace.to_str().expect("utf-8"),
            "--capacity",
            "67%",
            "--policy",
            "fifo,lru",
            "--store",
            store,
            "--json",
            json.to_str().expect("utf-8"),
            "--svg",
            svg.to_str().expect("utf-8"),
            "--svg-capacities",
            "67%",
        ]);
        assert_eq!(code, 0, "{store}: stdout:\n{out}\nstderr:\n{err}");
        assert!(out.contains("LRU-offline") && out.contains("hand"), "{out}");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).expect("read JSON"))
                .expect("JSON");
        assert!(doc["command"].as_array().is_some_and(|c| c.len() > 2), "{doc}");
        assert!(doc["machine"]["loadavg_start"].is_string(), "{doc}");
        let rows = doc["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 2, "{store}: one row per policy at the one capacity: {doc}");
        let lru = row(&doc, "lru");
        let fifo = row(&doc, "fifo");
        assert_eq!(lru["capacity_blocks"], 2);
        assert_eq!(lru["replay"]["hits"], 2, "{store}: {lru}");
        assert_eq!(fifo["replay"]["hits"], 1, "{store}: {fifo}");
        assert_eq!(lru["replay"]["refs"], 5);
        assert_eq!(lru["belady"]["hits"], 2);
        assert_eq!(lru["lru_offline"]["hits"], 2);
        assert_eq!(lru["replay"]["verified_get_bytes"], 2 * 4096, "{lru}");
        assert_eq!(lru["replay"]["mismatches"], 0);
        // FIFO's ratio over the best of the reference policies (here LRU alone): 1/5 / 2/5.
        assert_eq!(fifo["vs_best"].as_f64(), Some(0.5), "{fifo}");
        let chart = std::fs::read_to_string(&svg).expect("read SVG");
        assert_eq!(chart.matches("<circle class=\"point\"").count(), 4, "{chart}");
    }
}

#[test]
fn nonsense_is_refused_with_exit_status_2() {
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("hand.jsonl");
    std::fs::write(&trace, TRACE).expect("write trace");
    let path = trace.to_str().expect("utf-8");
    for (args, says) in [
        (vec!["--capacity", "0%"], "percentage"),
        (vec!["--policy", "mru"], "unknown eviction policy"),
        (vec!["--block-size", "0"], "--block-size"),
        (vec!["--limit-requests", "0"], "--limit-requests"),
    ] {
        let mut all = vec!["trace", "--trace", path];
        all.extend(args.iter().copied());
        let (code, _, err) = common::gpucache_bench(&all);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let missing = dir.path().join("absent.jsonl");
    let (code, _, err) =
        common::gpucache_bench(&["trace", "--trace", missing.to_str().expect("utf-8")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("absent.jsonl"), "{err}");
}
