//! Writes the seed corpora under `fuzz/seeds/` (`gpucache_fuzz::seeds::all`), each one checked
//! against its target first. Run from `fuzz/`: `cargo run --example seeds`. Seed files that the
//! generator no longer makes are left alone; remove them by hand.

use std::fs;
use std::path::Path;

use gpucache_fuzz::{Outcome, TARGETS, seeds};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    for seed in seeds::all() {
        let target = TARGETS
            .iter()
            .find(|t| t.name == seed.target)
            .unwrap_or_else(|| panic!("seed {} names no target {}", seed.name, seed.target));
        assert_eq!(
            (target.run)(&seed.bytes),
            Outcome::Accepted,
            "seed {}/{} is refused by its target",
            seed.target,
            seed.name
        );
        let dir = root.join(seed.target);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        let path = dir.join(seed.name);
        fs::write(&path, &seed.bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        println!("{} ({} bytes)", path.display(), seed.bytes.len());
    }
}
