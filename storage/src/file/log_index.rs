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
//! count comes last so that the file is written and read in one pass, a piece at a time, never
//! held whole in memory.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

use gpucache_dataplane::checksum::{Checksum, ChecksumBuilder};
use gpucache_dataplane::key::KEY_BYTES_MAX;
use gpucache_dataplane::key::{KeyDecoder, KeyDigest, KnownDigests, PhysicalKey};

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
fn read(root: &Path, epoch: u64, segments: &BTreeSet<u64>) -> Option<Vec<Found>> {
    let file = File::open(root.join(LOG_DIR).join(INDEX_FILE)).ok()?;
    let len = file.metadata().ok()?.len();
    let entries_end = len.checked_sub(TAIL_BYTES as u64)?;
    let mut input = Summed {
        io: BufReader::with_capacity(IO_CHUNK_BYTES, file),
        check: ChecksumBuilder::default(),
    };
    let mut head = [0u8; HEAD_BYTES];
    input.take(&mut head)?;
    if head[..8] != INDEX_MAGIC || word(&head, 8) != epoch {
        return None;
    }
    let room = usize::try_from(entries_end.checked_sub(HEAD_BYTES as u64)?).ok()?;
    let mut found = Vec::with_capacity(room / ENTRY_BYTES_MIN);
    let mut decoder = KeyDecoder::new();
    let mut key = Vec::new();
    let mut last_seq = 0;
    let mut at = HEAD_BYTES as u64;
    while at < entries_end {
        let mut fixed = [0u8; ENTRY_FIXED_BYTES];
        input.take(&mut fixed)?;
        let w = |i: usize| word(&fixed, 8 * i);
        let slot = LogSlot { segment: w(0), record: w(1), bytes: w(2) };
        let (payload_at, payload_len, checksum, seq) = (w(3), w(4), w(5), w(6));
        let digest = |at: usize| KeyDigest(fixed[at..at + 32].try_into().unwrap_or_default());
        let known = KnownDigests { digest: digest(56), logical: digest(88) };
        let key_len = usize::try_from(u32::from_le_bytes(fixed[120..].try_into().ok()?)).ok()?;
        if key_len > KEY_BYTES_MAX {
            return None;
        }
        key.resize(key_len, 0);
        input.take(&mut key)?;
        let key = decoder.decode(&key, Some(known)).ok()?;
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
        found.push(Found { header, slot, payload_at });
        at += (ENTRY_FIXED_BYTES + key_len) as u64;
    }
    let mut count = [0u8; 8];
    input.take(&mut count)?;
    let summed = input.check.finish().0;
    let mut check = [0u8; 8];
    input.io.read_exact(&mut check).ok()?;
    // Nothing read is trusted until the checksum vouches for all of it.
    let sound =
        at == entries_end && word(&count, 0) == found.len() as u64 && word(&check, 0) == summed;
    sound.then_some(found)
}

/// The little-endian word at `at` of `bytes` (which holds it).
fn word(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default())
}

impl<R: Read> Summed<R> {
    /// Fills `buf` from the index and takes it into the checksum; `None` past its end.
    fn take(&mut self, buf: &mut [u8]) -> Option<()> {
        self.io.read_exact(buf).ok()?;
        self.check.update(buf);
        Some(())
    }
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
