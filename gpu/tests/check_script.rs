//! scripts/gpu-check.sh cannot run its GPU steps here; its dry run must still name every step,
//! so a renamed or dropped step shows up in CI rather than on the lent GPU machine.

use std::path::Path;
use std::process::Command;

#[test]
fn the_dry_run_plan_names_every_step() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh");
    let out = Command::new("bash").arg(&script).arg("--dry-run").output().expect("bash runs");
    assert!(out.status.success(), "dry run failed: {}", String::from_utf8_lossy(&out.stderr));
    let plan = String::from_utf8(out.stdout).expect("utf-8 plan");
    for step in ["1. build", "2. gpu", "3. probe", "4. e2e", "5. bench", "6. summary"] {
        assert!(plan.contains(step), "plan lacks {step:?}:\n{plan}");
    }
    for needle in
        ["GPUCACHE_REQUIRE_GPU=1", "gpucache-gpu-bench", "pinned vs pageable", "pool_conformance"]
    {
        assert!(plan.contains(needle), "plan lacks {needle:?}:\n{plan}");
    }
    let bad = Command::new("bash").arg(&script).arg("--bogus").output().expect("bash runs");
    assert_eq!(bad.status.code(), Some(64), "an unknown flag is refused");
}
