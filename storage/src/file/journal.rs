//! The write-back journal: a record, kept beside the blocks, of which acknowledged blocks have
//! no file yet, so that a restart after a crash can say how many acknowledged blocks it lost.
//!
//! A block committed without its bytes ([`super::FileStore::commit_deferred`]) appends an
//! *acknowledged* record before the PUT is answered; the block's file being written, or the
//! block leaving the catalog, appends a *settled* one. At the next open, every acknowledged
//! record without a settled one whose block file is not on disk is a block the crash lost.
//!
//! Records are appended with one `write` each and never flushed: they outlive a killed process
//! (the page cache holds them) but not a power loss, as write-back itself does. A record cut
//! short at the tail, or one whose check does not match, ends the reading there. The journal
//! is rewritten with only the blocks still waiting once it passes [`JOURNAL_BYTES_MAX`], and
//! removed at each open (nothing waits for its file in a store just opened).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpucache_dataplane::checksum::Checksum;

/// The journal's file name under the store root.
pub const JOURNAL_FILE: &str = "WRITEBACK";
/// The journal is rewritten with only the waiting blocks once it grows past this.
pub const JOURNAL_BYTES_MAX: u64 = 64 << 20;
/// Bytes of one record: tag, padding, commit sequence, payload length, check.
const RECORD_BYTES: usize = 32;
const ACKNOWLEDGED: u8 = b'A';
const SETTLED: u8 = b'S';

fn record(tag: u8, seq: u64, len: u64) -> [u8; RECORD_BYTES] {
    let mut r = [0u8; RECORD_BYTES];
    r[0] = tag;
    r[8..16].copy_from_slice(&seq.to_le_bytes());
    r[16..24].copy_from_slice(&len.to_le_bytes());
    let check = Checksum::of(&r[..24]).0;
    r[24..32].copy_from_slice(&check.to_le_bytes()[..8]);
    r
}

/// One whole record's tag, sequence and length; `None` when it is damaged.
fn parse(r: &[u8]) -> Option<(u8, u64, u64)> {
    let check = Checksum::of(&r[..24]).0;
    if r[24..32] != check.to_le_bytes()[..8] || !matches!(r[0], ACKNOWLEDGED | SETTLED) {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(r[at..at + 8].try_into().unwrap_or_default());
    Some((r[0], word(8), word(16)))
}

/// What an earlier run's journal says was lost: acknowledged blocks whose file is missing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Lost {
    pub blocks: u64,
    pub bytes: u64,
}

/// Reads the journal an earlier run left under `root` and removes it; `on_disk` tells which
/// commit sequences have a block file.
pub(super) fn recover(root: &Path, on_disk: &HashSet<u64>) -> io::Result<Lost> {
    let path = root.join(JOURNAL_FILE);
    let mut bytes = Vec::new();
    match File::open(&path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Lost::default()),
        Err(e) => return Err(e),
    }
    let mut waiting: HashMap<u64, u64> = HashMap::new();
    for r in bytes.chunks_exact(RECORD_BYTES) {
        match parse(r) {
            Some((ACKNOWLEDGED, seq, len)) => {
                waiting.insert(seq, len);
            }
            Some((_, seq, _)) => {
                waiting.remove(&seq);
            }
            None => break,
        }
    }
    let mut lost = Lost::default();
    for (seq, len) in waiting {
        if !on_disk.contains(&seq) {
            lost.blocks += 1;
            lost.bytes += len;
        }
    }
    fs::remove_file(&path)?;
    Ok(lost)
}

/// The journal of a running store; the file is made at the first acknowledged record.
#[derive(Debug)]
pub(super) struct Journal {
    path: PathBuf,
    file: Mutex<Option<(File, u64)>>,
}

impl Journal {
    pub(super) fn new(root: &Path) -> Self {
        Self { path: root.join(JOURNAL_FILE), file: Mutex::new(None) }
    }

    /// Records that the block committed under `seq` (`len` payload bytes) was acknowledged
    /// without its file. Past [`JOURNAL_BYTES_MAX`] the journal is first rewritten from
    /// `waiting`, which lists every block still waiting for its file.
    pub(super) fn acknowledged(
        &self,
        seq: u64,
        len: u64,
        waiting: impl FnOnce() -> Vec<(u64, u64)>,
    ) -> io::Result<()> {
        let mut file = self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if file.as_ref().is_none_or(|(_, written)| *written >= JOURNAL_BYTES_MAX) {
            *file = Some(self.rewrite(&waiting())?);
        }
        Self::append(&mut file, record(ACKNOWLEDGED, seq, len))
    }

    /// Records that the block committed under `seq` no longer waits: its file is written, or
    /// it left the catalog.
    pub(super) fn settled(&self, seq: u64) -> io::Result<()> {
        let mut file = self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Self::append(&mut file, record(SETTLED, seq, 0))
    }

    fn append(file: &mut Option<(File, u64)>, r: [u8; RECORD_BYTES]) -> io::Result<()> {
        let Some((f, written)) = file.as_mut() else { return Ok(()) };
        f.write_all(&r)?;
        *written += RECORD_BYTES as u64;
        Ok(())
    }

    /// A new journal listing `waiting`, in place of the old one.
    fn rewrite(&self, waiting: &[(u64, u64)]) -> io::Result<(File, u64)> {
        let tmp = self.path.with_extension("new");
        let mut f = OpenOptions::new().create(true).truncate(true).write(true).open(&tmp)?;
        let mut bytes = Vec::with_capacity(waiting.len() * RECORD_BYTES);
        for &(seq, len) in waiting {
            bytes.extend_from_slice(&record(ACKNOWLEDGED, seq, len));
        }
        f.write_all(&bytes)?;
        fs::rename(&tmp, &self.path)?;
        Ok((f, bytes.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_loses_the_acknowledged_blocks_that_are_neither_settled_nor_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        for seq in 1..=5 {
            journal.acknowledged(seq, seq * 100, Vec::new).unwrap();
        }
        journal.settled(2).unwrap();
        drop(journal);
        // Block 3's file made it to disk before its settled record: not lost.
        let lost = recover(dir.path(), &HashSet::from([3])).unwrap();
        assert_eq!(lost, Lost { blocks: 3, bytes: 100 + 400 + 500 });
        assert!(!dir.path().join(JOURNAL_FILE).exists(), "read once, then removed");
        assert_eq!(recover(dir.path(), &HashSet::new()).unwrap(), Lost::default());
    }

    #[test]
    fn a_damaged_tail_ends_the_reading_and_a_rewrite_keeps_only_the_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        journal.acknowledged(1, 10, Vec::new).unwrap();
        journal.acknowledged(2, 20, Vec::new).unwrap();
        drop(journal);
        let path = dir.path().join(JOURNAL_FILE);
        let mut bytes = fs::read(&path).unwrap();
        bytes[RECORD_BYTES + 9] ^= 1;
        bytes.extend_from_slice(&record(ACKNOWLEDGED, 3, 30)[..7]);
        fs::write(&path, &bytes).unwrap();
        assert_eq!(recover(dir.path(), &HashSet::new()).unwrap(), Lost { blocks: 1, bytes: 10 });

        let journal = Journal::new(dir.path());
        journal.acknowledged(7, 70, Vec::new).unwrap();
        if let Some((_, written)) = journal.file.lock().unwrap().as_mut() {
            *written = JOURNAL_BYTES_MAX;
        }
        journal.acknowledged(9, 90, || vec![(8, 80)]).unwrap();
        drop(journal);
        let lost = recover(dir.path(), &HashSet::new()).unwrap();
        assert_eq!(lost, Lost { blocks: 2, bytes: 80 + 90 }, "7 was not waiting at the rewrite");
    }
}
