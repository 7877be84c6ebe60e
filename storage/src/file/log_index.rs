//! The block log's index, written when a store closes cleanly: every live record's place and
//! header, so that the next open reads one file instead of the head of every record.
//!
//! `log/INDEX` carries the store's epoch at close. Every open of the store writes a new epoch to
//! the store record before it changes anything, and so does every epoch bump, so an index whose
//! epoch is the store record's newest describes the log exactly as it is: nothing ran on the
//! store since it was written. Any other index (an older epoch, a damaged or foreign file, a
//! segment it names that is gone) is ignored, and the open reads every record's head instead,
//! as it does after a crash.
//!
//! The index holds what the open would otherwise derive record by record: the records come
//! oldest commit first, one per key (as the catalog keeps them), each with its key's digest and
//! logical digest, so the open neither sorts them, nor looks for older versions of a key, nor
//! hashes a key. The file's checksum covers those digests as it covers the keys. An index of
//! another format version (the first one held no digests and no order) is ignored like a
//! damaged one.
//!
//! Format 2: `GPCLIDX2`, the epoch, the entries, their count, and a checksum (XXH3-64) of
//! everything before it. An entry is the record's segment, offset and bytes, its payload's
//! offset and length, the payload's checksum, the commit sequence (eight bytes each), the key's
//! digest and logical digest (32 bytes each), the key's length (four bytes) and the key. The
//! count comes last so that the file is written in one pass, a piece at a time, never held
//! whole in memory. The open maps the file, checks its checksum, and decodes a large index in
//! two halves at once.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use gpucache_dataplane::checksum::{Checksum, ChecksumBuilder};
use gpucache_dataplane::key::KEY_BYTES_MAX;
use gpucache_dataplane::key::{KeyDecoder, KeyDigest, KnownDigests, PhysicalKey};
use memmap2::Mmap;

use super::block_log::{self, Found, LOG_DIR, LogSlot, Scanned};
use super::layout::{self, BlockHeader};

/// The index's name in the log directory.
pub(crate) const INDEX_FILE: &str = "INDEX";
/// The magic of the index's format version 2 (version 1, `GPCLIDX1`, is not read any more).
pub(crate) const INDEX_MAGIC: [u8; 8] = *b"GPCLIDX2";
/// Bytes of an entry before its key: segment, record, record bytes, payload offset, payload
/// length, checksum, sequence (eight bytes each), the key's digest and logical digest (32
/// each), key length (four).
const ENTRY_FIXED_BYTES: usize = 7 * 8 + 2 * 32 + 4;
/// Bytes an entry takes at least (a physical key's sixteen framed fields and chain link take
/// more than 128): bounds what the open reserves for an index of a given length.
const ENTRY_BYTES_MIN: usize = ENTRY_FIXED_BYTES + 128;
/// Bytes of the index before its entries (magic, epoch) and after them (count, checksum).
const HEAD_BYTES: usize = 16;
const TAIL_BYTES: usize = 16;
/// Bytes the index is written and read by at a time.
const IO_CHUNK_BYTES: usize = 1 << 20;

/// The index file being written or read, and the checksum of the bytes that went through.
struct Summed<F> {
    io: F,
    check: ChecksumBuilder,
}

impl<W: Write> Summed<W> {
    /// Writes `bytes` to the index and takes them into the checksum.
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.check.update(bytes);
        self.io.write_all(bytes)
    }
}

/// One live record, as the index keeps it.
pub(crate) struct Entry<'a> {
    pub slot: LogSlot,
    pub payload_at: u64,
    pub payload_len: u64,
    pub checksum: Checksum,
    pub seq: u64,
    pub key: &'a PhysicalKey,
}

/// Writes the index of `entries` (one per key, oldest commit first) for a store whose newest
/// epoch is `epoch` (temporary name, flush, rename, directory flush).
pub(crate) fn write<'a>(
    root: &Path,
    epoch: u64,
    entries: impl Iterator<Item = Entry<'a>>,
) -> io::Result<()> {
    let dir = root.join(LOG_DIR);
    let tmp = dir.join(format!("{INDEX_FILE}.tmp"));
    let file = File::create(&tmp)?;
    let mut out = Summed {
        io: BufWriter::with_capacity(IO_CHUNK_BYTES, file),
        check: ChecksumBuilder::default(),
    };
    out.put(&INDEX_MAGIC)?;
    out.put(&epoch.to_le_bytes())?;
    let mut count = 0u64;
    for e in entries {
        let mut fixed = [0u8; ENTRY_FIXED_BYTES];
        let words = [
            e.slot.segment,
            e.slot.record,
            e.slot.bytes,
            e.payload_at,
            e.payload_len,
            e.checksum.0,
            e.seq,
        ];
        for (i, word) in words.iter().enumerate() {
            fixed[8 * i..8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
        fixed[56..88].copy_from_slice(&e.key.digest().0);
        fixed[88..120].copy_from_slice(&e.key.logical_digest().0);
        let key = e.key.encoded();
        let key_len = u32::try_from(key.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a key too long to index"))?;
        fixed[120..].copy_from_slice(&key_len.to_le_bytes());
        out.put(&fixed)?;
        out.put(key)?;
        count += 1;
    }
    out.put(&count.to_le_bytes())?;
    let check = out.check.finish().0;
    out.io.write_all(&check.to_le_bytes())?;
    let file = out.io.into_inner().map_err(io::IntoInnerError::into_error)?;
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

/// The live records the index names, oldest commit first, when it was written at `epoch` and
/// every segment it names is among `segments`. The headers it rebuilds carry `epoch`, which no
/// block's own epoch exceeds.
///
/// The file is mapped and its checksum checked before any entry is decoded; a large index is
/// then decoded in two halves at once (the open's first long step, on two cores).
fn read(root: &Path, epoch: u64, segments: &BTreeSet<u64>) -> Option<Vec<Found>> {
    let dir = root.join(LOG_DIR);
    let file = File::open(dir.join(INDEX_FILE)).ok()?;
    // SAFETY: the map is read-only and lives only for this call. The store holds its LOCK, so
    // no other process of ours writes the index meanwhile, and this open writes it only after
    // it is read; every byte is checked against the trailing checksum before it is used.
    let map = unsafe { Mmap::map(&file) }.ok()?;
    let bytes: &[u8] = &map;
    let entries_end = bytes.len().checked_sub(TAIL_BYTES)?;
    if entries_end < HEAD_BYTES || bytes[..8] != INDEX_MAGIC || word(bytes, 8) != epoch {
        return None;
    }
    // Nothing read is trusted until the checksum vouches for all of it.
    if Checksum::of(&bytes[..entries_end + 8]).0 != word(bytes, entries_end + 8) {
        return None;
    }
    let entries = &bytes[HEAD_BYTES..entries_end];
    let count = usize::try_from(word(bytes, entries_end)).ok()?;
    let split = if count >= SPLIT_ENTRIES_MIN { middle_entry(entries)? } else { entries.len() };
    let (first, second) = entries.split_at(split);
    let (mut found, rest) = std::thread::scope(|s| {
        let helper = (!second.is_empty())
            .then(|| {
                std::thread::Builder::new()
                    .name("gpucache-index".into())
                    .spawn_scoped(s, || decode_entries(second, epoch, &dir, segments))
                    .ok()
            })
            .flatten();
        let found = decode_entries(first, epoch, &dir, segments);
        let rest = match helper {
            Some(h) => h.join().ok()?,
            None => decode_entries(second, epoch, &dir, segments),
        };
        Some((found?, rest?))
    })?;
    // In commit order across the halves too.
    if let (Some(last), Some(next)) = (found.last(), rest.first())
        && next.header.seq <= last.header.seq
    {
        return None;
    }
    found.extend(rest);
    (found.len() == count).then_some(found)
}

/// Entries of an index at least this many decode in two halves at once.
const SPLIT_ENTRIES_MIN: usize = 64 * 1024;

/// Where the first entry at or past the middle of `entries` starts; `None` when an entry's
/// length runs past the end.
fn middle_entry(entries: &[u8]) -> Option<usize> {
    let mut at = 0;
    while at < entries.len() / 2 {
        at = next_entry(entries, at)?;
    }
    Some(at)
}

/// Where the entry after the one at `at` starts.
fn next_entry(entries: &[u8], at: usize) -> Option<usize> {
    let len_at = at.checked_add(ENTRY_FIXED_BYTES - 4)?;
    let key_len = u32::from_le_bytes(entries.get(len_at..len_at + 4)?.try_into().ok()?);
    let next = at.checked_add(ENTRY_FIXED_BYTES)?.checked_add(usize::try_from(key_len).ok()?)?;
    (next <= entries.len()).then_some(next)
}

/// The records of `entries` (whole entries, in the index's format), in commit order and each in
/// one of `segments` (in the log directory `dir`); `None` at the first that is not.
fn decode_entries(
    entries: &[u8],
    epoch: u64,
    dir: &Path,
    segments: &BTreeSet<u64>,
) -> Option<Vec<Found>> {
    let mut found = Vec::with_capacity(entries.len() / ENTRY_BYTES_MIN);
    let mut decoder = KeyDecoder::new();
    // The records of one segment share its path.
    let mut segment: Option<(u64, Arc<Path>)> = None;
    let mut last_seq = 0;
    let mut at = 0;
    while at < entries.len() {
        let next = next_entry(entries, at)?;
        let fixed = &entries[at..at + ENTRY_FIXED_BYTES];
        let key_bytes = &entries[at + ENTRY_FIXED_BYTES..next];
        let w = |i: usize| word(fixed, 8 * i);
        let slot = LogSlot { segment: w(0), record: w(1), bytes: w(2) };
        let (payload_at, payload_len, checksum, seq) = (w(3), w(4), w(5), w(6));
        let digest = |at: usize| KeyDigest(fixed[at..at + 32].try_into().unwrap_or_default());
        let known = KnownDigests { digest: digest(56), logical: digest(88) };
        if key_bytes.len() > KEY_BYTES_MAX {
            return None;
        }
        let key = decoder.decode(key_bytes, Some(known)).ok()?;
        // Out of commit order, or a segment that is gone: not an index this build wrote for
        // this log.
        if seq <= last_seq || !segments.contains(&slot.segment) {
            return None;
        }
        last_seq = seq;
        let header = BlockHeader {
            header_len: layout::header_len_for(key.encoded().len()) as u64,
            payload_len,
            checksum: Checksum(checksum),
            seq,
            epoch,
            key,
        };
        let path = match &segment {
            Some((n, path)) if *n == slot.segment => Arc::clone(path),
            _ => {
                let path: Arc<Path> = block_log::segment_path(dir, slot.segment).into();
                segment = Some((slot.segment, Arc::clone(&path)));
                path
            }
        };
        found.push(Found { header, path, payload_at, slot: Some(slot) });
        at = next;
    }
    Some(found)
}

/// The little-endian word at `at` of `bytes` (which holds it).
fn word(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::testing::fixture;

    use super::*;

    /// Keys whose one chain link is each of `links`.
    fn keys(links: &[u8]) -> Vec<PhysicalKey> {
        links.iter().map(|l| fixture::key(0, &[*l], KvDtype::F16, 16)).collect()
    }

    /// Writes the index of `keys` at commit sequences `seqs`, their records in segment 1.
    fn write_at(root: &Path, keys: &[PhysicalKey], seqs: &[u64]) {
        fs::create_dir_all(root.join(LOG_DIR)).expect("log dir");
        let entries = keys.iter().zip(seqs).enumerate().map(|(i, (key, seq))| Entry {
            slot: LogSlot { segment: 1, record: i as u64 * 8192, bytes: 8192 },
            payload_at: i as u64 * 8192 + 4128,
            payload_len: 4096,
            checksum: Checksum(*seq * 7),
            seq: *seq,
            key,
        });
        write(root, 9, entries).expect("write the index");
    }

    fn index_bytes(root: &Path) -> Vec<u8> {
        fs::read(root.join(LOG_DIR).join(INDEX_FILE)).expect("the index")
    }

    /// Replaces the index by `body` and a checksum that matches it.
    fn rewrite(root: &Path, mut body: Vec<u8>) {
        let check = Checksum::of(&body).0;
        body.extend_from_slice(&check.to_le_bytes());
        fs::write(root.join(LOG_DIR).join(INDEX_FILE), body).expect("rewrite the index");
    }

    fn segment_one() -> BTreeSet<u64> {
        [1].into_iter().collect()
    }

    #[test]
    fn an_index_gives_back_its_records_oldest_first_with_their_keys_and_digests() {
        let dir = tempfile::tempdir().expect("temp dir");
        let keys = keys(&[1, 2, 3]);
        write_at(dir.path(), &keys, &[4, 5, 9]);
        let found = read(dir.path(), 9, &segment_one()).expect("a sound index is read");
        assert_eq!(found.len(), 3);
        for (f, (key, seq)) in found.iter().zip(keys.iter().zip([4, 5, 9])) {
            assert_eq!(&f.header.key, key);
            assert_eq!(f.header.key.identity(), key.identity());
            assert_eq!(KnownDigests::of(&f.header.key), KnownDigests::of(key));
            assert_eq!(f.header.key.shape_digest(), key.shape_digest());
            assert_eq!((f.header.seq, f.header.checksum), (seq, Checksum(seq * 7)));
        }
        assert!(read(dir.path(), 10, &segment_one()).is_none(), "another epoch's index");
        assert!(read(dir.path(), 9, &BTreeSet::new()).is_none(), "a segment that is gone");
    }

    /// An index large enough to be decoded in two halves gives back every record in order, and
    /// one whose halves are each in commit order but not across the split is refused.
    #[test]
    fn a_large_index_decodes_in_two_halves_and_checks_the_order_across_them() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let n = SPLIT_ENTRIES_MIN + 5;
        let keys: Vec<PhysicalKey> =
            (0..n).map(|i| fixture::key(0, &i.to_be_bytes()[5..], KvDtype::F16, 16)).collect();
        let seqs: Vec<u64> = (1..=n as u64).collect();
        write_at(root, &keys, &seqs);
        let found = read(root, 9, &segment_one()).expect("a sound large index is read");
        assert_eq!(found.len(), n);
        assert!(found.iter().zip(&keys).all(|(f, k)| &f.header.key == k));
        assert!(found.iter().zip(&seqs).all(|(f, s)| f.header.seq == *s));

        // The second half's sequences start again below the first half's last.
        let entries = &index_bytes(root)[HEAD_BYTES..];
        let split = middle_entry(entries).expect("a middle entry");
        assert!(split > 0 && split < entries.len() - TAIL_BYTES);
        let first_in_second = {
            let mut at = 0;
            let mut i = 0;
            while at < split {
                at = next_entry(entries, at).expect("an entry");
                i += 1;
            }
            i
        };
        let restarted: Vec<u64> = (0..n)
            .map(|i| if i < first_in_second { i + 10 } else { i - first_in_second + 1 } as u64)
            .collect();
        write_at(root, &keys, &restarted);
        assert!(read(root, 9, &segment_one()).is_none(), "out of order across the halves");
    }

    /// An index the checksum does not vouch for, one cut short, one of the first format (no
    /// digests), and one whose records are not in commit order (not one this build wrote) are
    /// all ignored: the open then scans the segments.
    #[test]
    fn a_damaged_older_or_unordered_index_is_ignored() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        write_at(root, &keys(&[1, 2]), &[4, 5]);
        let sound = index_bytes(root);

        let mut damaged = sound.clone();
        damaged[40] ^= 1;
        fs::write(root.join(LOG_DIR).join(INDEX_FILE), &damaged).expect("damage the index");
        assert!(read(root, 9, &segment_one()).is_none(), "a checksum that fails");

        fs::write(root.join(LOG_DIR).join(INDEX_FILE), &sound[..sound.len() - 20])
            .expect("cut the index short");
        assert!(read(root, 9, &segment_one()).is_none(), "an index cut short");

        let mut older = sound[..sound.len() - 8].to_vec();
        older[..8].copy_from_slice(b"GPCLIDX1");
        rewrite(root, older);
        assert!(read(root, 9, &segment_one()).is_none(), "format version 1");

        write_at(root, &keys(&[1, 2]), &[5, 4]);
        assert!(read(root, 9, &segment_one()).is_none(), "records out of commit order");
        write_at(root, &keys(&[1, 2]), &[5, 5]);
        assert!(read(root, 9, &segment_one()).is_none(), "two records of one commit");
    }
}
