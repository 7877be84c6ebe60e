//! Crash test: a child process (this test binary, re-executed) PUTs blocks into a FileStore and
//! acknowledges each one on stdout; the parent SIGKILLs it at a random point, reopens the store
//! and checks that nothing acknowledged was lost, nothing unfinished became readable with wrong
//! bytes, and nothing never attempted appeared.
//!
//! Rounds vary the durability policy (PerBlock mostly, GroupCommit and None too: kill -9 keeps
//! the page cache, so every policy must keep every acknowledged block), the layout (a file per
//! block, or the block log), the engine (psync, io_uring, io_uring with O_DIRECT) and the kill
//! point: right after the k-th acknowledgement,
//! or in the middle of a large (MiB-sized) block file being written or flushed (the parent
//! watches the block's temporary file grow, then kills).
//!
//! `GPUCACHE_CRASH_SEED` replays a run; `GPUCACHE_CRASH_ROUNDS` changes the number of rounds
//! (200 by default).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Lookup, MissReason, Put, Store};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, Layout, fsck};

/// Set in the child: `<dir>:<seed>:<round>:<big index>`.
const CHILD_ENV: &str = "GPUCACHE_CRASH_CHILD";
/// Key space of this test's blocks.
const SPACE: u8 = 0xC7;
/// The child stops by itself after this many puts (the parent always kills it long before).
const CHILD_PUTS_MAX: u16 = 10_000;
/// No big block in this round.
const NO_BIG: u16 = u16::MAX;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// How long the parent waits for the child's next line before declaring it stuck.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// What a round does: shared by parent and child, derived from the seed.

fn durability_of(round: u16) -> Durability {
    match round % 6 {
        3 => Durability::GroupCommit,
        4 => Durability::None,
        _ => Durability::PerBlock,
    }
}

/// Where the child's store keeps blocks in a round: the block log in some rounds of each
/// durability (never with O_DIRECT, which needs a file per block).
fn layout_of(round: u16) -> Layout {
    if matches!(round % 6, 1 | 4 | 5) && !engine_of(round).1 { Layout::Log } else { Layout::Files }
}

/// (engine, O_DIRECT) of the child in a round.
fn engine_of(round: u16) -> (EngineChoice, bool) {
    match round % 4 {
        0 | 2 => (EngineChoice::Psync, false),
        1 => (EngineChoice::Uring, false),
        _ => (EngineChoice::Uring, true),
    }
}

/// Payload length of block `index` of `round`: log-uniform over 1 B ..= 300 KiB, now and then
/// 1 ..= 3 MiB, and always large for the round's `big` index.
fn size_of(seed: u64, round: u16, index: u16, big: u16) -> usize {
    let mut r =
        SplitMix64::new(SplitMix64::mix(&[seed, 0x512E, u64::from(round), u64::from(index)]));
    let len = if index == big || r.chance(0.02) {
        r.range(MIB, 3 * MIB)
    } else {
        let bits = r.range(0, 18);
        r.range(1 << bits, ((2 << bits) - 1).min(300 * KIB))
    };
    usize::try_from(len).expect("length fits usize")
}

fn payload_of(seed: u64, round: u16, index: u16, big: u16) -> Vec<u8> {
    common::payload(
        SplitMix64::mix(&[seed, 0xDA7A, u64::from(round), u64::from(index)]),
        size_of(seed, round, index, big),
    )
}

fn key_of(round: u16, index: u16) -> PhysicalKey {
    common::block_key(SPACE, round, index)
}

// ---------------------------------------------------------------------------------------------
// Child

/// The child's body; a no-op unless this process was started as a crash child.
#[test]
fn child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let mut parts = spec.rsplitn(4, ':');
    let mut next = |what: &str| parts.next().unwrap_or_else(|| panic!("{CHILD_ENV}: no {what}"));
    let big: u16 = next("big index").parse().expect("big index");
    let round: u16 = next("round").parse().expect("round");
    let seed: u64 = next("seed").parse().expect("seed");
    let dir = next("dir").to_owned();

    let (engine, direct) = engine_of(round);
    let mut config = common::config(Path::new(&dir), engine, durability_of(round));
    config.direct_io = direct;
    config.layout = layout_of(round);
    let store = common::open(config);
    let mut out = std::io::stdout().lock();
    // libtest has printed "test child_entry ... " without a newline: start a fresh line.
    writeln!(out, "\nEPOCH {}", store.open_report().epoch).expect("stdout");
    out.flush().expect("stdout");
    for index in 0..CHILD_PUTS_MAX {
        let data = payload_of(seed, round, index, big);
        match store.put(&caller(0), &key_of(round, index), &data, None) {
            Ok(Put::Committed(_)) => {}
            other => panic!("crash child: put {round}/{index} answered {other:?}"),
        }
        // The parent has gone away: nothing left to do.
        if writeln!(out, "ACK {index}").and_then(|()| out.flush()).is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parent

#[derive(Debug)]
enum Line {
    Epoch(u64),
    Ack(u16),
}

/// Kills the child if the parent panics before it does.
struct Reaper(Option<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// When the parent kills the child.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// As soon as `acks` acknowledgements arrived.
    AfterAcks { acks: u16 },
    /// While block `index` (a big one) is being written: once its temporary file holds
    /// `bytes` bytes (or, if the window was missed, once it is acknowledged).
    MidWrite { index: u16, bytes: u64 },
}

fn spawn_child(root: &Path, seed: u64, round: u16, big: u16) -> (Reaper, Receiver<Line>) {
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{}:{seed}:{round}:{big}", root.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn crash child");
    let stdout = child.stdout.take().expect("child stdout");
    let (tx, rx) = mpsc::channel();
    // Reads the child's lines until EOF (the kill closes the pipe); libtest's own lines are
    // ignored.
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let parsed = if let Some(i) = line.strip_prefix("ACK ") {
                Line::Ack(i.trim().parse().expect("ack index"))
            } else if let Some(e) = line.strip_prefix("EPOCH ") {
                Line::Epoch(e.trim().parse().expect("epoch"))
            } else {
                continue;
            };
            if tx.send(parsed).is_err() {
                break;
            }
        }
    });
    (Reaper(Some(child)), rx)
}

/// Lines seen so far in a round.
#[derive(Debug, Default)]
struct Seen {
    epoch: Option<u64>,
    acks: Vec<u16>,
}

impl Seen {
    fn take(&mut self, line: Line) {
        match line {
            Line::Epoch(e) => self.epoch = Some(e),
            Line::Ack(i) => self.acks.push(i),
        }
    }
}

/// Waits (bounded) for the next line; panics if the child died or hung.
fn next_line(rx: &Receiver<Line>, reaper: &mut Reaper, what: &str) -> Line {
    match rx.recv_timeout(CHILD_DEADLINE) {
        Ok(line) => line,
        Err(RecvTimeoutError::Timeout) => {
            panic!("crash child silent for {CHILD_DEADLINE:?} ({what})")
        }
        Err(RecvTimeoutError::Disconnected) => {
            let status = reaper.0.take().map(|mut c| c.wait());
            panic!("crash child exited before the kill ({what}): {status:?}")
        }
    }
}

/// Runs the plan and kills the child. Returns every line the child wrote.
fn run_and_kill(root: &Path, plan: Plan, rx: &Receiver<Line>, reaper: &mut Reaper) -> Seen {
    let mut seen = Seen::default();
    let acked = |seen: &Seen| seen.acks.len() as u64;
    match plan {
        Plan::AfterAcks { acks } => {
            while acked(&seen) < u64::from(acks) {
                seen.take(next_line(rx, reaper, "waiting for acks"));
            }
        }
        Plan::MidWrite { index, bytes } => {
            while acked(&seen) < u64::from(index) {
                seen.take(next_line(rx, reaper, "waiting for the big block"));
            }
            // The child is now generating and writing the big block: watch its temporary file.
            let deadline = Instant::now() + CHILD_DEADLINE;
            'watch: loop {
                for tmp in common::tmp_files(root) {
                    if std::fs::metadata(&tmp).is_ok_and(|m| m.len() >= bytes) {
                        break 'watch;
                    }
                }
                match rx.try_recv() {
                    Ok(line) => {
                        seen.take(line);
                        // Missed the window (the block is already acknowledged): kill now.
                        if acked(&seen) > u64::from(index) {
                            break 'watch;
                        }
                    }
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Disconnected) => {
                        panic!("crash child exited while writing its big block")
                    }
                }
                assert!(Instant::now() < deadline, "crash child stuck on its big block");
            }
        }
    }
    let mut child = reaper.0.take().expect("child still owned");
    child.kill().expect("SIGKILL the child");
    let status = child.wait().expect("reap the child");
    assert_eq!(status.signal(), Some(9), "the child died of the kill, not by itself: {status:?}");
    // Everything the child wrote before dying is in the pipe; the reader stops at EOF.
    while let Ok(line) = rx.recv_timeout(CHILD_DEADLINE) {
        seen.take(line);
    }
    seen
}

/// Totals printed at the end.
#[derive(Debug, Default)]
struct Tally {
    rounds: u64,
    mid_write_rounds: u64,
    tmp_left: u64,
    in_flight_present: u64,
    in_flight_absent: u64,
    acked: u64,
    full_sweeps: u64,
}

#[test]
fn kill_9_never_loses_or_forges_a_block() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let seed = common::seed("GPUCACHE_CRASH_SEED");
    let rounds: u16 =
        std::env::var("GPUCACHE_CRASH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let mut rng = SplitMix64::new(seed);
    // Blocks that must read back byte-exact from now on: acknowledged ones, and in-flight ones
    // that turned out to be committed.
    let mut present: BTreeMap<(u16, u16), Vec<u8>> = BTreeMap::new();
    // In-flight blocks found absent: must stay absent.
    let mut absent: Vec<(u16, u16)> = Vec::new();
    let mut last_epoch = 0u64;
    let mut tally = Tally::default();

    for round in 0..rounds {
        let ctx = format!("seed {seed}, round {round}");
        let plan = if rng.chance(0.3) {
            let index = u16::try_from(rng.range(1, 10)).expect("small");
            let len = size_of(seed, round, index, index) as u64;
            // Somewhere in the payload: the header is one 4 KiB page for these keys.
            Plan::MidWrite { index, bytes: 4096 + rng.range(1, len) }
        } else {
            Plan::AfterAcks { acks: u16::try_from(rng.range(1, 12)).expect("small") }
        };
        let big = match plan {
            Plan::MidWrite { index, .. } => index,
            Plan::AfterAcks { .. } => NO_BIG,
        };
        let (mut reaper, rx) = spawn_child(root, seed, round, big);
        let seen = run_and_kill(root, plan, &rx, &mut reaper);

        // The child acknowledged 0, 1, ..., n-1 in order.
        let n = u16::try_from(seen.acks.len()).expect("ack count");
        assert!(seen.acks.iter().copied().eq(0..n), "{ctx}: acks out of order: {:?}", seen.acks);
        match plan {
            Plan::AfterAcks { acks } => assert!(n >= acks, "{ctx}: {n} acks, planned {acks}"),
            Plan::MidWrite { index, .. } => {
                assert!(n >= index, "{ctx}: {n} acks before the big block {index}");
                tally.mid_write_rounds += 1;
            }
        }
        let child_epoch = seen.epoch.unwrap_or_else(|| panic!("{ctx}: the child sent no epoch"));
        assert!(child_epoch > last_epoch, "{ctx}: child epoch {child_epoch} <= {last_epoch}");

        // Reopen in the parent (the other engine than the child's, buffered).
        let leftover = common::tmp_files(root).len() as u64;
        let parent_engine = match engine_of(round).0 {
            EngineChoice::Psync => EngineChoice::Uring,
            _ => EngineChoice::Psync,
        };
        let store = common::open(common::config(root, parent_engine, Durability::PerBlock));
        let report = store.open_report().clone();
        assert_eq!(report.tmp_removed, leftover, "{ctx}: tmp files removed at open: {report:?}");
        assert!(common::tmp_files(root).is_empty(), "{ctx}: tmp/ not emptied by open");
        assert!(report.skipped.is_empty(), "{ctx}: a crash left a bad block file: {report:?}");
        assert!(
            report.epoch > child_epoch,
            "{ctx}: epoch {} <= child's {child_epoch}",
            report.epoch
        );
        assert_eq!(store.epoch().0, report.epoch, "{ctx}: store epoch vs report");
        last_epoch = report.epoch;
        tally.tmp_left += u64::from(leftover > 0);

        // This round's acknowledged blocks: byte-exact.
        for index in 0..n {
            let want = payload_of(seed, round, index, big);
            common::assert_exact(
                &store,
                &key_of(round, index),
                &want,
                &format!("{ctx} ack {index}"),
            );
            present.insert((round, index), want);
        }
        tally.acked += u64::from(n);
        // The one put that may have been in flight: absent or byte-exact.
        let want = payload_of(seed, round, n, big);
        match common::get(&store, &key_of(round, n), want.len(), 0xEE) {
            (Get::Hit { len, .. }, buf) => {
                assert_eq!(len, want.len() as u64, "{ctx}: in-flight {n} length");
                assert!(buf == want, "{ctx}: in-flight block {n} readable with wrong bytes");
                present.insert((round, n), want);
                tally.in_flight_present += 1;
            }
            (Get::Miss(MissReason::Absent), buf) => {
                assert!(buf.iter().all(|b| *b == 0xEE), "{ctx}: a miss wrote into the buffer");
                absent.push((round, n));
                tally.in_flight_absent += 1;
            }
            (other, _) => panic!("{ctx}: in-flight block {n}: {other:?}"),
        }
        // Never attempted: absent.
        for index in n + 1..n + 6 {
            assert_eq!(
                store.lookup(&caller(0), &key_of(round, index)).expect("lookup"),
                Lookup::Miss(MissReason::Absent),
                "{ctx}: block {index} was never put but is there"
            );
        }
        // Earlier rounds: still there (full bytes on a sweep round), absent ones still absent.
        let sweep = round % 40 == 39 || round + 1 == rounds;
        for (&(r, i), want) in present.range(..(round, 0)) {
            if sweep {
                common::assert_exact(&store, &key_of(r, i), want, &format!("{ctx}: block {r}/{i}"));
            } else {
                assert_eq!(
                    store.lookup(&caller(0), &key_of(r, i)).expect("lookup"),
                    Lookup::Hit { len: want.len() as u64 },
                    "{ctx}: block {r}/{i} lost"
                );
            }
        }
        tally.full_sweeps += u64::from(sweep);
        for &(r, i) in &absent {
            assert_eq!(
                store.lookup(&caller(0), &key_of(r, i)).expect("lookup"),
                Lookup::Miss(MissReason::Absent),
                "{ctx}: unfinished block {r}/{i} came back"
            );
        }
        let stats = store.stats();
        assert_eq!(report.loaded, present.len() as u64, "{ctx}: blocks loaded at open");
        assert_eq!(stats.committed_blocks, present.len() as u64, "{ctx}: committed blocks");
        assert_eq!(stats.evictions, 0, "{ctx}: nothing may be evicted in this test");
        assert_eq!(stats.corrupt_dropped.total(), 0, "{ctx}: corrupt blocks after a crash");
        let bytes: u64 = present.values().map(|p| p.len() as u64).sum();
        assert_eq!(stats.usage.retained_bytes, bytes, "{ctx}: retained bytes");
        assert_eq!(stats.usage.inflight_requests, 0, "{ctx}: in-flight requests");
        // The LOCK must be free for the next child.
        drop(store);
        tally.rounds += 1;
    }

    let report = fsck(root, false, |_, _| {}).expect("fsck");
    assert_eq!(report.bad_count(), 0, "seed {seed}: fsck found bad files: {report:?}");
    assert_eq!(report.tmp_files, 0, "seed {seed}: fsck found tmp files");
    assert_eq!(report.ok, present.len() as u64, "seed {seed}: fsck ok count");
    assert_eq!(report.files + report.records, present.len() as u64, "seed {seed}: fsck count");
    eprintln!("{tally:?} in {:?}", started.elapsed());
    // The mid-write kills really landed in the middle of block files being written or flushed.
    if tally.mid_write_rounds >= 20 {
        assert!(tally.tmp_left > 0, "seed {seed}: no kill ever left a temporary file: {tally:?}");
    }
}
