//! Write-back's window and its losses. A tiered store that writes back holds at most
//! `dirty_bytes_max` acknowledged bytes without a file and writes each block's file within
//! `dirty_age_max_ms`; after a kill -9 the restart counts exactly the acknowledged blocks whose
//! files were never written (from the write-back journal), and serves every other one whole.
//!
//! The crash test re-executes this binary as a child that PUTs and prints each acknowledgement;
//! the parent kills it with SIGKILL after a seeded number of them. `GPUCACHE_WRITE_BACK_SEED`
//! replays a run. Both tests run with a file per block and with the block log.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use gpucache_dataplane::clock::{ManualClock, MonotonicClock};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig, Layout};
use gpucache_storage::tiered::{MemoryTier, TieredStore, WriteBackWindow, WriteMode};

/// Set in the child: `<dir>:<seed>:<round>`.
const CHILD_ENV: &str = "GPUCACHE_WRITE_BACK_CHILD";
const SPACE: u8 = 0xB4;
const ROUNDS: u16 = 6;
/// The child stops by itself after this many PUTs (the parent kills it long before).
const CHILD_PUTS_MAX: u16 = 5_000;
/// How long the parent waits for the child's next line.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);

fn key_of(round: u16, index: u16) -> PhysicalKey {
    common::block_key(SPACE, round, index)
}

fn payload_of(seed: u64, round: u16, index: u16) -> Vec<u8> {
    let mut r = SplitMix64::new(SplitMix64::mix(&[seed, u64::from(round), u64::from(index)]));
    let len = usize::try_from(r.range(1, 40_000)).expect("fits");
    common::payload(seed ^ (u64::from(round) << 20) ^ u64::from(index), len)
}

/// The memory tier of a round: a large one (nothing written before the kill), or a small one
/// whose evictions write files down; some rounds with an age bound short enough that the
/// flusher writes files while the child runs.
fn tier_of(round: u16) -> MemoryTier {
    let memory = if round.is_multiple_of(2) { 64 << 20 } else { 256 << 10 };
    let age = if round % 3 == 2 { 20 } else { 600_000 };
    MemoryTier {
        write: WriteMode::Back,
        window: WriteBackWindow { dirty_bytes_max: 1 << 30, dirty_age_max_ms: age },
        ..MemoryTier::new(memory, PolicyKind::Lru)
    }
}

/// The file tier of a round: a file per block in half of the rounds, the block log in the
/// other half (crossed with the memory tier's two sizes).
fn file_config(root: &Path, round: u16) -> FileStoreConfig {
    let mut file = FileStoreConfig::new(root);
    file.engine = EngineChoice::Psync;
    file.durability = Durability::None;
    file.layout = if round % 4 >= 2 { Layout::Log } else { Layout::Files };
    file
}

#[test]
fn the_window_bounds_the_bytes_and_the_age_of_what_is_not_on_disk() {
    // Round 0 keeps a file per block, round 2 the block log.
    for round in [0, 2] {
        window_bounds_what_is_not_on_disk(round);
    }
}

fn window_bounds_what_is_not_on_disk(round: u16) {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = Arc::new(ManualClock::default());
    let window = WriteBackWindow { dirty_bytes_max: 10_000, dirty_age_max_ms: 1_000 };
    let memory =
        MemoryTier { write: WriteMode::Back, window, ..MemoryTier::new(64 << 20, PolicyKind::Lru) };
    let store =
        TieredStore::open(file_config(dir.path(), round), memory, clock.clone()).expect("opens");
    let mut model = Vec::new();
    for i in 0..12u16 {
        let data = common::payload(u64::from(i), 3_000);
        let key = key_of(99, i);
        assert!(matches!(store.put(&caller(0), &key, &data, None), Ok(Put::Committed(_))));
        let c = store.counters();
        // Three blocks fit the window; each later one is written at once.
        assert_eq!(
            (c.dirty_blocks, c.dirty_bytes),
            (u64::from(i.min(2)) + 1, u64::from(i.min(2) + 1) * 3_000),
            "after PUT {i}"
        );
        assert_eq!(store.file().is_deferred(&key), i < 3, "PUT {i}");
        clock.advance_ms(10);
        model.push((key, data));
    }
    assert_eq!(store.flush_aged(), 0, "nothing has waited 1 s yet");
    clock.advance_ms(1_000);
    assert_eq!(store.flush_aged(), 3, "the three waiting blocks are written once they are old");
    let c = store.counters();
    assert_eq!((c.dirty_blocks, c.dirty_bytes, c.write_back_lost), (0, 0, 0));
    for (key, data) in &model {
        let mut buf = vec![0u8; data.len()];
        assert!(matches!(store.file().get_into(&caller(0), key, &mut buf), Ok(Get::Hit { .. })));
        assert_eq!(&buf, data);
    }
}

/// The child's body; a no-op unless this process was started as a write-back child.
#[test]
fn child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let mut parts = spec.rsplitn(3, ':');
    let round: u16 = parts.next().expect("round").parse().expect("round");
    let seed: u64 = parts.next().expect("seed").parse().expect("seed");
    let dir = parts.next().expect("dir").to_owned();
    let store = TieredStore::open(
        file_config(Path::new(&dir), round),
        tier_of(round),
        Arc::new(MonotonicClock::default()),
    )
    .expect("child opens");
    let store = Arc::new(store);
    store.start_flusher().expect("flusher");
    let mut out = std::io::stdout().lock();
    writeln!(out).expect("stdout");
    for index in 0..CHILD_PUTS_MAX {
        let data = payload_of(seed, round, index);
        match store.put(&caller(0), &key_of(round, index), &data, None) {
            Ok(Put::Committed(_)) => {}
            other => panic!("write-back child: put {index} answered {other:?}"),
        }
        if writeln!(out, "ACK {index}").and_then(|()| out.flush()).is_err() {
            return;
        }
    }
}

/// Runs a child for `round` and kills it after `acks` acknowledgements; returns every index it
/// acknowledged.
fn run_and_kill(root: &Path, seed: u64, round: u16, acks: usize) -> Vec<u16> {
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{}:{seed}:{round}", root.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(i) = line.strip_prefix("ACK ")
                && tx.send(i.trim().parse::<u16>().expect("index")).is_err()
            {
                break;
            }
        }
    });
    let mut acked = Vec::new();
    while acked.len() < acks {
        match rx.recv_timeout(CHILD_DEADLINE) {
            Ok(i) => acked.push(i),
            Err(e) => {
                let _ = child.kill();
                panic!("the child stopped answering ({e:?}) after {} acks", acked.len());
            }
        }
    }
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reap");
    assert_eq!(status.signal(), Some(9), "{status:?}");
    while let Ok(i) = rx.recv_timeout(CHILD_DEADLINE) {
        acked.push(i);
    }
    acked
}

#[test]
fn after_kill_9_the_restart_counts_exactly_the_acknowledged_blocks_it_lost() {
    let seed = std::env::var("GPUCACHE_WRITE_BACK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SplitMix64::mix(&[std::process::id().into()]));
    let mut rng = SplitMix64::new(seed);
    let (mut lost_total, mut kept_total) = (0, 0);
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir().expect("temp dir");
        let acks = usize::try_from(rng.range(20, 400)).expect("fits");
        let acked = run_and_kill(dir.path(), seed, round, acks);
        let store = TieredStore::open(
            file_config(dir.path(), round),
            tier_of(round),
            Arc::new(ManualClock::default()),
        )
        .expect("reopens");
        let mut missing = 0u64;
        for &i in &acked {
            let data = payload_of(seed, round, i);
            let mut buf = vec![0u8; data.len()];
            match store.get_into(&caller(0), &key_of(round, i), &mut buf) {
                Ok(Get::Hit { .. }) => {
                    assert_eq!(buf, data, "seed {seed} round {round}: block {i}")
                }
                Ok(Get::Miss(_)) => missing += 1,
                other => panic!("seed {seed} round {round}: block {i} answered {other:?}"),
            }
        }
        let reported = store.counters().write_back_lost;
        let report = store.file().open_report().write_back_lost;
        assert_eq!(report.blocks, reported, "the counter starts from the open's count");
        // The child may have acknowledged one block more than it printed before it died.
        assert!(
            reported == missing || reported == missing + 1,
            "seed {seed} round {round}: {missing} acknowledged blocks are missing, the restart \
             counted {reported} lost"
        );
        lost_total += missing;
        kept_total += acked.len() as u64 - missing;
    }
    eprintln!(
        "write-back crash rounds: {lost_total} acknowledged blocks lost and counted, {kept_total} kept (seed {seed})"
    );
    assert!(
        lost_total > 0 && kept_total > 0,
        "seed {seed}: the rounds must both lose and keep blocks"
    );
}
