//! Full verification of a FileStore directory: every header and every payload checksum, of the
//! block files and of the live records of the block log. Opening a store reads headers only;
//! `fsck` is the slow, complete check an operator runs.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use gpucache_dataplane::checksum::ChecksumBuilder;

use super::layout::{BlockFileError, read_header};

/// Bytes read per step while checksumming a payload.
const FSCK_READ_BYTES: usize = 1 << 20;

/// What a full check found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsckReport {
    /// Block files checked.
    pub files: u64,
    /// Live block-log records checked.
    pub records: u64,
    /// Log segments that end in a record cut short (never acknowledged; an open passes over it).
    pub torn_segments: u64,
    pub ok: u64,
    pub ok_bytes: u64,
    /// Bad files and records by kind of damage ([`BlockFileError::kind`]), with their paths (a
    /// record as `<segment>@<offset>`; removed or marked removed when `repair` was asked for);
    /// the detail of each is logged.
    pub bad: BTreeMap<String, Vec<PathBuf>>,
    /// Leftover unfinished writes in `tmp/`.
    pub tmp_files: u64,
    pub repaired: u64,
}

impl FsckReport {
    pub fn bad_count(&self) -> u64 {
        self.bad.values().map(|v| v.len() as u64).sum()
    }
}

fn verify_payload(path: &Path, header_len: u64, len: u64, want: u64) -> Result<(), BlockFileError> {
    let io = |e: io::Error| BlockFileError::Io(e.to_string());
    let file = fs::File::open(path).map_err(io)?;
    let mut sum = ChecksumBuilder::default();
    let mut buf = vec![0u8; FSCK_READ_BYTES];
    let mut done = 0u64;
    while done < len {
        let step =
            usize::try_from((len - done).min(FSCK_READ_BYTES as u64)).unwrap_or(FSCK_READ_BYTES);
        file.read_exact_at(&mut buf[..step], header_len + done).map_err(io)?;
        sum.update(&buf[..step]);
        done += step as u64;
    }
    if sum.finish().0 == want { Ok(()) } else { Err(BlockFileError::PayloadChecksum) }
}

/// Checks every block file under `root` (a store that is not open). `progress(done, total)` is
/// called after each file. With `repair`, bad files and leftover temporaries are removed.
pub fn fsck(
    root: &Path,
    repair: bool,
    mut progress: impl FnMut(u64, u64),
) -> io::Result<FsckReport> {
    if !root.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} is not a store directory", root.display()),
        ));
    }
    // Hold the store's lock for the whole check: an open store may be writing.
    let lock_path = root.join("LOCK");
    let _lock = match fs::OpenOptions::new().write(true).open(&lock_path) {
        Ok(f) => {
            // SAFETY: flock on an fd we own; no memory is shared with the kernel.
            let held = unsafe {
                libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX | libc::LOCK_NB)
            };
            if held != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} is open by a running store", root.display()),
                ));
            }
            Some(f)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    let mut report = FsckReport::default();
    let mut paths = Vec::new();
    let blocks = root.join("blocks");
    if blocks.is_dir() {
        for sub in fs::read_dir(&blocks)? {
            let sub = sub?.path();
            if sub.is_dir() {
                for entry in fs::read_dir(&sub)? {
                    paths.push(entry?.path());
                }
            } else {
                paths.push(sub);
            }
        }
    }
    paths.sort();
    let total = paths.len() as u64;
    for (i, path) in paths.into_iter().enumerate() {
        report.files += 1;
        let verdict = read_header(&path).and_then(|h| {
            verify_payload(&path, h.header_len, h.payload_len, h.checksum.0).map(|()| h.payload_len)
        });
        match verdict {
            Ok(len) => {
                report.ok += 1;
                report.ok_bytes += len;
            }
            Err(reason) => {
                tracing::warn!(path = %path.display(), %reason, "fsck: bad block file");
                let label = reason.kind().to_owned();
                if repair && fs::remove_file(&path).is_ok() {
                    report.repaired += 1;
                }
                report.bad.entry(label).or_default().push(path);
            }
        }
        progress(i as u64 + 1, total);
    }
    let scanned = super::block_log::scan(root)?;
    report.torn_segments = scanned.torn;
    let log_dir = root.join(super::block_log::LOG_DIR);
    for found in &scanned.blocks {
        let Some(slot) = found.slot else { continue };
        report.records += 1;
        let segment = super::block_log::segment_path(&log_dir, slot.segment);
        let h = &found.header;
        match verify_payload(&segment, found.payload_at, h.payload_len, h.checksum.0) {
            Ok(()) => {
                report.ok += 1;
                report.ok_bytes += h.payload_len;
            }
            Err(reason) => {
                let at = format!("{}@{}", segment.display(), slot.record);
                tracing::warn!(record = %at, %reason, "fsck: bad block-log record");
                if repair && super::block_log::kill_at(root, slot).is_ok() {
                    report.repaired += 1;
                }
                report.bad.entry(reason.kind().to_owned()).or_default().push(PathBuf::from(at));
            }
        }
    }
    if repair && report.repaired > 0 {
        // An index from the last clean close may name a record just marked removed.
        super::log_index::remove(root)?;
    }
    let tmp = root.join("tmp");
    if tmp.is_dir() {
        for entry in fs::read_dir(&tmp)? {
            let path = entry?.path();
            report.tmp_files += 1;
            if repair && fs::remove_file(&path).is_ok() {
                report.repaired += 1;
            }
        }
    }
    Ok(report)
}
