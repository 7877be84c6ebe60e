//! `gpucache-bench file` runs end to end on a small working set and prints its table. This is a
//! smoke check of the harness: it asserts the output's structure, never a speed.

mod common;

fn bench(args: &[&str]) -> (i32, String, String) {
    common::gpucache_bench(&[&["file"], args].concat())
}

fn cells(line: &str) -> Vec<String> {
    line.trim().trim_matches('|').split('|').map(|c| c.trim().to_owned()).collect()
}

#[test]
fn small_psync_run_prints_a_row_with_positive_throughput() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = bench(&[
        "--sizes",
        "64K",
        "--seconds",
        "1",
        "--no-fio",
        "--file-mib",
        "8",
        "--engine",
        "psync",
        "--open-blocks",
        "50",
        "--dir",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let header = out.lines().find(|l| l.starts_with("| size |")).expect("table header");
    assert_eq!(cells(header).len(), 8, "{header}");
    let row = out.lines().find(|l| l.starts_with("| 64K | psync |")).expect("table row");
    let row = cells(row);
    assert_eq!(row.len(), 8, "{row:?}");
    for (name, cell) in [("put", &row[2]), ("get", &row[3])] {
        let gbps: f64 = cell.parse().unwrap_or_else(|e| panic!("{name} cell {cell:?}: {e}"));
        assert!(gbps > 0.0, "{name} GB/s is {gbps}");
    }
    assert_eq!(&row[4..], ["-", "-", "-", "-"], "fio columns stay empty with --no-fio");
    assert!(out.contains("64K psync r1: put ") && out.contains("; get "), "{out}");
    assert!(out.contains("open of 50 blocks") && out.contains("loaded 50"), "{out}");
    // The batch rows run by default, with batches cut down to the 8 MiB working set.
    for lead in ["| 128x64K | psync |", "| 8x1M | psync |"] {
        let row = row_of(&out, "| batch | engine | batch GB/s", lead);
        measured(&row[2], "batch");
        measured(&row[3], "one-by-one");
        let tcp = row_of(&out, "| batch | engine | tcp batch GB/s", lead);
        measured(&tcp[2], "tcp batch");
    }
    assert!(out.contains("32x1M asked, fewer blocks to fit --file-mib"), "{out}");
    // The scratch directory is removed afterwards.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The row of `table` (a markdown table starting with `header`) whose first cells are `lead`.
fn row_of(out: &str, header: &str, lead: &str) -> Vec<String> {
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with(header))
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert!(!table.is_empty(), "no table {header:?} in:\n{out}");
    let row = table
        .iter()
        .find(|l| l.starts_with(lead))
        .unwrap_or_else(|| panic!("no row {lead:?} in:\n{out}"));
    cells(row)
}

/// A measured cell: a number (never `-`); its size is the machine's business, not the test's.
fn measured(cell: &str, what: &str) -> f64 {
    let v: f64 = cell.parse().unwrap_or_else(|e| panic!("{what} cell {cell:?}: {e}"));
    assert!(v.is_finite() && v >= 0.0, "{what} is {v}");
    v
}

#[test]
fn batch_and_tcp_rows_run_on_tiny_batches() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = bench(&[
        "--rows",
        "batch,tcp",
        "--batch",
        "8x64K,2x1M",
        "--batch-passes",
        "2",
        // Long enough that both passes always run (the passes stop early past it).
        "--seconds",
        "60",
        "--no-fio",
        "--engine",
        "both",
        "--dir",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(!out.contains("| size |"), "the sizes rows were not asked for:\n{out}");
    for (batch, engine) in
        [("8x64K", "uring"), ("8x64K", "psync"), ("2x1M", "uring"), ("2x1M", "psync")]
    {
        let lead = format!("| {batch} | {engine} |");
        let row = row_of(&out, "| batch | engine | batch GB/s", &lead);
        assert_eq!(row.len(), 8, "{row:?}");
        measured(&row[2], "batch");
        measured(&row[3], "one-by-one");
        assert_eq!(&row[4..6], ["-", "-"], "fio columns stay empty with --no-fio");
        measured(&row[6], "batch/one-by-one");
        if engine == "uring" {
            // The batch had several reads in flight at once (8 one-chunk reads, or 2 reads of 4
            // chunks each), one by one never more than a single read's chunks.
            let depth: u32 = row[7].parse().unwrap_or_else(|e| panic!("depth {:?}: {e}", row[7]));
            assert!(depth > 1, "{row:?}");
        } else {
            assert_eq!(row[7], "-", "{row:?}");
        }
        let tcp = row_of(&out, "| batch | engine | tcp batch GB/s", &lead);
        assert_eq!(tcp.len(), 6, "{tcp:?}");
        measured(&tcp[2], "tcp batch");
        measured(&tcp[3], "tcp one-by-one");
        measured(&tcp[4], "tcp batch/one-by-one");
        measured(&tcp[5], "tcp batch/store batch");
        assert!(out.contains(&format!("  {batch} {engine}: store batch 2 passes of ")), "{out}");
        assert!(out.contains(&format!("  {batch} {engine}: tcp one by one ")), "{out}");
    }
    assert!(out.contains("page cache: not dropped between passes"), "{out}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn bad_arguments_exit_2() {
    let (code, _, err) = bench(&["--sizes", "64X", "--no-fio"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown unit"), "{err}");
    let (code, _, err) = bench(&["--seconds", "0", "--no-fio"]);
    assert_eq!(code, 2);
    assert!(err.contains("--seconds"), "{err}");
    let (code, _, err) = bench(&["--batch", "128", "--no-fio"]);
    assert_eq!(code, 2);
    assert!(err.contains("COUNTxSIZE"), "{err}");
    let (code, _, err) = bench(&["--rows", "sizes,nope", "--no-fio"]);
    assert_eq!(code, 2);
    assert!(err.contains("nope"), "{err}");
}
