//! The block log's index, written when a store closes cleanly: every live record's place and
//! header, so that the next open reads one file instead of the head of every record.
//!
//! `log/INDEX` carries the store's epoch at close. Every open of the store writes a new epoch to
//! the store record before it changes anything, and so does every epoch bump, so an index whose
//! epoch is the store record's newest describes the log exactly as it is: nothing ran on the
//! store since it was written. Any other index (an older epoch, a damaged or foreign file, a
//! segment it names that is gone) is ignored, and the open reads every record's head instead,
//! as it does after a crash.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;

use super::block_log::{self, Found, LOG_DIR, LogSlot, Scanned};
use super::layout::{self, BlockHeader};

/// The index's name in the log directory.
pub(crate) const INDEX_FILE: &str = "INDEX";
const INDEX_MAGIC: [u8; 8] = *b"GPCLIDX1";
/// Bytes of an entry before its key: segment, record, record bytes, payload offset, payload
/// length, checksum, sequence (eight bytes each), key length (four).
const ENTRY_FIXED_BYTES: usize = 7 * 8 + 4;

/// One live record, as the index keeps it.
pub(crate) struct Entry<'a> {
    pub slot: LogSlot,
    pub payload_at: u64,
    pub payload_len: u64,
    pub checksum: Checksum,
    pub seq: u64,
    pub key: &'a PhysicalKey,
}

/// Writes the index of `entries` for a store whose newest epoch is `epoch` (temporary name,
/// flush, rename, directory flush).
pub(crate) fn write<'a>(
    root: &Path,
    epoch: u64,
    entries: impl Iterator<Item = Entry<'a>>,
) -> io::Result<()> {
    let dir = root.join(LOG_DIR);
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&INDEX_MAGIC);
    bytes.extend_from_slice(&epoch.to_le_bytes());
    let count_at = bytes.len();
    bytes.extend_from_slice(&0u64.to_le_bytes());
    let mut count = 0u64;
    for e in entries {
        for word in [
            e.slot.segment,
            e.slot.record,
            e.slot.bytes,
            e.payload_at,
            e.payload_len,
            e.checksum.0,
            e.seq,
        ] {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        let key = e.key.encoded();
        let key_len = u32::try_from(key.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a key too long to index"))?;
        bytes.extend_from_slice(&key_len.to_le_bytes());
        bytes.extend_from_slice(key);
        count += 1;
    }
    bytes[count_at..count_at + 8].copy_from_slice(&count.to_le_bytes());
    let check = Checksum::of(&bytes).0;
    bytes.extend_from_slice(&check.to_le_bytes());
    let tmp = dir.join(format!("{INDEX_FILE}.tmp"));
    let mut file = File::create(&tmp)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, dir.join(INDEX_FILE))?;
    super::sync::sync_dir(&dir)
}

/// Removes the index (after a change the open did not make through a store, such as a repair).
pub(crate) fn remove(root: &Path) -> io::Result<()> {
    match fs::remove_file(root.join(LOG_DIR).join(INDEX_FILE)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The block log as the index describes it, when the index was written at `epoch` (the store
/// record's newest) and every segment it names is there; `None` otherwise (then the open scans
/// the segments).
pub(crate) fn load(root: &Path, epoch: u64) -> Option<Scanned> {
    let (segments, next_segment) = block_log::segment_numbers(root).ok()?;
    let numbers: BTreeSet<u64> = segments.iter().copied().collect();
    let blocks = read(root, epoch, &numbers)?;
    Some(Scanned { blocks, segments, indexed: true, next_segment, ..Scanned::default() })
}

/// The live records the index names, when it was written at `epoch` and every segment it names
/// is among `segments`. The headers it rebuilds carry `epoch`, which no block's own epoch
/// exceeds.
fn read(root: &Path, epoch: u64, segments: &BTreeSet<u64>) -> Option<Vec<Found>> {
    let bytes = fs::read(root.join(LOG_DIR).join(INDEX_FILE)).ok()?;
    let (body, check) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
    let word = |b: &[u8], at: usize| -> Option<u64> {
        Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
    };
    if body.get(..8)? != INDEX_MAGIC
        || word(check, 0)? != Checksum::of(body).0
        || word(body, 8)? != epoch
    {
        return None;
    }
    let count = word(body, 16)?;
    let mut found = Vec::with_capacity(usize::try_from(count).ok()?.min(body.len() / 64));
    let mut at = 24;
    for _ in 0..count {
        let w = |i: usize| word(body, at + 8 * i);
        let slot = LogSlot { segment: w(0)?, record: w(1)?, bytes: w(2)? };
        let (payload_at, payload_len, checksum, seq) = (w(3)?, w(4)?, w(5)?, w(6)?);
        let key_len = u32::from_le_bytes(body.get(at + 56..at + 60)?.try_into().ok()?);
        let key_start = at + ENTRY_FIXED_BYTES;
        let key_end = key_start.checked_add(usize::try_from(key_len).ok()?)?;
        let key = PhysicalKey::decode(body.get(key_start..key_end)?).ok()?;
        if !segments.contains(&slot.segment) {
            return None;
        }
        let header = BlockHeader {
            header_len: layout::header_len_for(key.encoded().len()) as u64,
            payload_len,
            checksum: Checksum(checksum),
            seq,
            epoch,
            key,
        };
        found.push(Found { header, slot, payload_at });
        at = key_end;
    }
    (at == body.len()).then_some(found)
}
