//! scripts/gpu-check.sh cannot run its GPU steps here; its dry run must still name every step,
//! so a renamed or dropped step shows up in CI rather than on the lent GPU machine, and a run
//! over stub binaries must report each step's PASS, FAIL or SKIPPED as it happened.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh")
}

#[test]
fn the_dry_run_plan_names_every_step() {
    let out = Command::new("bash").arg(script()).arg("--dry-run").output().expect("bash runs");
    assert!(out.status.success(), "dry run failed: {}", String::from_utf8_lossy(&out.stderr));
    let plan = String::from_utf8(out.stdout).expect("utf-8 plan");
    for step in ["1. build", "2. gpu", "3. probe", "4. e2e", "5. nixl", "6. bench", "7. summary"] {
        assert!(plan.contains(step), "plan lacks {step:?}:\n{plan}");
    }
    for needle in [
        "GPUCACHE_REQUIRE_GPU=1",
        "gpucache-gpu-bench",
        "pinned vs pageable",
        "pool_conformance",
        "--features nixl --test nixl_vram",
        "UCX_MODULES=^ib",
    ] {
        assert!(plan.contains(needle), "plan lacks {needle:?}:\n{plan}");
    }
    let bad = Command::new("bash").arg(script()).arg("--bogus").output().expect("bash runs");
    assert_eq!(bad.status.code(), Some(64), "an unknown flag is refused");
}

/// A folder of stub binaries named as the prebuilt ones, each a shell script with `body`.
fn stubs(dir: &Path, bodies: &[(&str, &str)]) {
    for name in ["e2e", "probe", "pool_conformance", "gpucache-gpu-bench", "nixl_vram"] {
        let body = bodies.iter().find(|(n, _)| *n == name).map_or("exit 0", |(_, b)| *b);
        let path = dir.join(name);
        fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("stub written");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("stub executable");
    }
}

/// Runs the check over the prebuilt stubs in `bin`, with NIXL's libraries in `nixl_libs` (or a
/// NIXL venv that does not exist, and no packed libraries, when `None`).
fn check(bin: &Path, nixl_libs: Option<&Path>) -> (Output, String) {
    let mut cmd = Command::new("bash");
    cmd.arg(script())
        .env("GPUCACHE_GPU_CHECK_CARGO", "0")
        .env("GPUCACHE_GPU_PREBUILT", bin)
        .env("GPUCACHE_NIXL_VENV", bin.join("no-such-venv"))
        .env_remove("GPUCACHE_NIXL_LIBS");
    if let Some(libs) = nixl_libs {
        cmd.env("GPUCACHE_NIXL_LIBS", libs);
    }
    let out = cmd.output().expect("bash runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text.split("== summary").nth(1).unwrap_or_default().to_owned();
    (out, summary)
}

#[test]
fn a_stub_run_reports_each_step_and_runs_nixl_with_its_libraries() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (bin, libs) = (dir.path().join("bin"), dir.path().join("libs"));
    fs::create_dir_all(&bin).expect("bin folder");
    fs::create_dir_all(&libs).expect("libs folder");
    fs::write(libs.join("libnixl_capi.so"), b"").expect("library stand-in");
    // The NIXL stub fails unless it was started the way the script promises.
    let nixl = format!(
        "case \"$LD_LIBRARY_PATH\" in {}*) ;; *) exit 7 ;; esac\n\
         [ \"$UCX_MODULES\" = '^ib' ] && [ \"$GPUCACHE_REQUIRE_NIXL\" = 1 ] || exit 8",
        libs.display()
    );
    stubs(&bin, &[("e2e", "exit 3"), ("nixl_vram", &nixl)]);
    let (out, summary) = check(&bin, Some(&libs));
    assert_eq!(out.status.code(), Some(1), "a failed step fails the check:\n{summary}");
    for line in ["probe: PASS", "pool: PASS", "e2e: FAIL (exit 3)", "nixl: PASS", "bench: PASS"] {
        assert!(summary.contains(line), "summary lacks {line:?}:\n{summary}");
    }
}

#[test]
fn nixl_is_skipped_without_its_libraries_or_when_its_test_skips() {
    let dir = tempfile::tempdir().expect("temp dir");
    stubs(dir.path(), &[]);
    let (out, summary) = check(dir.path(), None);
    assert!(summary.contains("nixl: SKIPPED (no NIXL libraries"), "{summary}");
    assert_eq!(out.status.code(), Some(0), "a missing NIXL fails nothing:\n{summary}");

    let libs = dir.path().join("libs");
    fs::create_dir_all(&libs).expect("libs folder");
    fs::write(libs.join("libnixl_capi.so"), b"").expect("library stand-in");
    stubs(dir.path(), &[("nixl_vram", "echo 'SKIP VRAM registration: no agent (stub)'")]);
    let (out, summary) = check(dir.path(), Some(&libs));
    assert!(summary.contains("nixl: SKIPPED (NIXL test: no agent (stub))"), "{summary}");
    assert_eq!(out.status.code(), Some(0), "{summary}");
}
