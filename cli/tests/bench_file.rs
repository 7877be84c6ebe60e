//! `gpucache bench file` runs end to end on a small working set and prints its table. This is a
//! smoke check of the harness: it asserts the output's structure, never a speed.

mod common;

fn bench(args: &[&str]) -> (i32, String, String) {
    common::gpucache(&[&["bench", "file"], args].concat())
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
    // The scratch directory is removed afterwards.
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
}
