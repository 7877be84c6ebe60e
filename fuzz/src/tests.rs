//! The seed replay: every target's body over every checked-in seed and a fixed neighbourhood of
//! each (every prefix, every single-byte change), on the stable toolchain. It checks that the
//! targets' code runs and its checks hold, that the seeds are still accepted and still what
//! [`crate::seeds`] makes, and that the targets, their binaries and their seed folders agree.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use crate::{Outcome, TARGETS, Target, seeds};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The files of `seeds/<target>/`, sorted by name.
fn seed_files(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = root().join("seeds").join(target);
    let mut out: Vec<(PathBuf, Vec<u8>)> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap_or_else(|e| panic!("{}: {e}", dir.display())).path();
            let bytes = fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, bytes)
        })
        .collect();
    out.sort();
    out
}

/// The names of the entries of `dir` whose names end in `suffix`, without it.
fn names_in(dir: &Path, suffix: &str) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(suffix).map(str::to_owned)
        })
        .collect()
}

#[test]
fn every_target_accepts_every_seed() {
    for Target { name, run } in TARGETS {
        let files = seed_files(name);
        assert!(files.len() >= 2, "{name}: expected at least two seeds, found {}", files.len());
        for (path, bytes) in files {
            assert_eq!(run(&bytes), Outcome::Accepted, "{} is refused", path.display());
        }
    }
}

#[test]
fn seed_files_are_what_the_generator_makes() {
    let all = seeds::all();
    for Target { name, .. } in TARGETS {
        assert!(all.iter().any(|s| s.target == *name), "the generator makes no seed for {name}");
    }
    for seed in all {
        let path = root().join("seeds").join(seed.target).join(seed.name);
        let on_disk = fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e} (run `cargo run --example seeds` in fuzz/)", path.display())
        });
        assert!(
            on_disk == seed.bytes,
            "{} differs from what the generator makes now (run `cargo run --example seeds` in \
             fuzz/)",
            path.display()
        );
    }
}

/// Every prefix of every seed and every seed with one byte inverted: mostly refused inputs,
/// some accepted ones (a changed byte the decoder does not check, a prefix that is a whole
/// message), all of which must pass the target's checks.
#[test]
fn seed_neighbourhoods_hold_the_checks() {
    let mut runs = 0usize;
    let mut accepted = 0usize;
    for Target { name, run } in TARGETS {
        for (path, bytes) in seed_files(name) {
            let mut check = |input: &[u8], what: &str| {
                runs += 1;
                let outcome = std::panic::catch_unwind(|| run(input))
                    .unwrap_or_else(|_| panic!("{}: a check failed on {what}", path.display()));
                if outcome == Outcome::Accepted {
                    accepted += 1;
                }
            };
            for len in 0..bytes.len() {
                check(&bytes[..len], &format!("its first {len} bytes"));
            }
            let mut changed = bytes.clone();
            for at in 0..changed.len() {
                changed[at] ^= 0xff;
                check(&changed, &format!("byte {at} inverted"));
                changed[at] ^= 0xff;
            }
        }
    }
    assert!(runs > 0 && accepted < runs, "{accepted} of {runs} neighbours accepted");
}

#[test]
fn targets_binaries_and_seed_folders_agree() {
    let listed: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
    let manifest = fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    // The `name` line that follows each `[[bin]]` header.
    let mut bins = Vec::new();
    let mut in_bin = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_bin = line == "[[bin]]";
        } else if in_bin && let Some(value) = line.strip_prefix("name = ") {
            bins.push(value.trim_matches('"').to_owned());
        }
    }
    assert_eq!(bins, listed, "the [[bin]] entries of fuzz/Cargo.toml differ from TARGETS");
    let sources = names_in(&root().join("fuzz_targets"), ".rs");
    let folders = names_in(&root().join("seeds"), "");
    let want: BTreeSet<String> = listed.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(sources, want, "fuzz_targets/*.rs differ from TARGETS");
    assert_eq!(folders, want, "the folders of seeds/ differ from TARGETS");
    for name in listed {
        let path = root().join("fuzz_targets").join(format!("{name}.rs"));
        let source = fs::read_to_string(&path).expect("target source");
        let call = format!("gpucache_fuzz::{name}::run(");
        assert!(source.contains(&call), "{} does not call {call}..)", path.display());
    }
}
