//! On-disk layout of a FileStore directory and the block file format (ADR 0008).
//!
//! ```text
//! ROOT/STORE                         store record: magic, format, epoch (atomic replace)
//! ROOT/LOCK                          flock held by the open store
//! ROOT/tmp/<region>.tmp              blocks being written; removed at open
//! ROOT/blocks/<d0d1>/<digest>-<seq>.blk   committed blocks
//! ROOT/log/<n>.log                   block-log segments (`Layout::Log`, `block_log`)
//! ROOT/WRITEBACK                     write-back journal (`journal`)
//! ```
//!
//! A block file is a header padded to a multiple of 4 KiB, then the payload padded to a
//! multiple of 4 KiB, so that both O_DIRECT and buffered engines read it. The header names the
//! block completely (its GPCK key), carries the payload length and checksum, its commit
//! sequence and its own checksum. Opening a store reads headers only.
//!
//! The block header's format is public ([`BlockHeader`], [`encode_header`], [`decode_header`]),
//! so that tools and the fuzz targets can read and write headers without a store; the rest of
//! the layout is the store's own.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use gpucache_dataplane::checksum::{Checksum, ChecksumBuilder};
use gpucache_dataplane::key::{KEY_BYTES_MAX, KeyDecoder, PhysicalKey};

use super::engine::{DIRECT_ALIGN, round_up};

/// First bytes of every block file.
pub const BLOCK_MAGIC: [u8; 4] = *b"GPCB";
/// The block format this build writes and the only one it reads.
pub const BLOCK_FORMAT: u16 = 1;
pub(crate) const STORE_MAGIC: [u8; 8] = *b"GPCSTOR1";
/// Bytes of the fixed part of a block header; the GPCK key follows it.
pub const FIXED_HEADER_BYTES: usize = 56;
/// Where the header's own checksum sits in the fixed part (8 bytes, computed with it zero).
pub const HEADER_CHECKSUM_AT: usize = 48;
pub(crate) const BLOCK_SUFFIX: &str = "blk";
/// Largest payload a block file may declare (far above any object limit; keeps size arithmetic
/// from overflowing on a crafted header).
pub const PAYLOAD_BYTES_MAX: u64 = 1 << 40;

/// Why a block file is not a usable committed block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockFileError {
    #[error("file name is not <digest>-<seq>.blk")]
    Name,
    #[error("header is shorter than its fixed part ({len} bytes)")]
    Short { len: usize },
    #[error("not a block file (magic {found:02x?})")]
    Foreign { found: [u8; 4] },
    #[error("block format {found} is not supported (this build reads {supported})")]
    Format { found: u16, supported: u16 },
    #[error("header length {header_len} is not a sane multiple of 4 KiB for a {key_len}-byte key")]
    HeaderLength { header_len: u32, key_len: u32 },
    #[error("header checksum mismatch")]
    HeaderChecksum,
    #[error("key does not decode: {0}")]
    Key(String),
    #[error("key digest or sequence differs from the file name")]
    NameMismatch,
    #[error("file is {actual} bytes, the header says {expected}")]
    Size { actual: u64, expected: u64 },
    #[error("payload checksum mismatch")]
    PayloadChecksum,
    #[error("payload length {len} exceeds the format's limit {max}")]
    PayloadLength { len: u64, max: u64 },
    #[error("I/O error: {0}")]
    Io(String),
}

impl BlockFileError {
    /// A stable label for grouping: the same kind of damage gets the same label whatever the
    /// bytes or sizes involved.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Name => "file name is not <digest>-<seq>.blk",
            Self::Short { .. } => "header is short",
            Self::Foreign { .. } => "not a block file",
            Self::Format { .. } => "unsupported block format",
            Self::HeaderLength { .. } => "header length is not sane",
            Self::HeaderChecksum => "header checksum mismatch",
            Self::Key(_) => "key does not decode",
            Self::NameMismatch => "key digest or sequence differs from the file name",
            Self::Size { .. } => "file is truncated or extended",
            Self::PayloadChecksum => "payload checksum mismatch",
            Self::PayloadLength { .. } => "payload length over the limit",
            Self::Io(_) => "io error",
        }
    }
}

/// A parsed block header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader {
    /// Bytes of the header, padding included: [`header_len_for`] of the key's length.
    pub header_len: u64,
    /// Bytes of the payload, without its padding.
    pub payload_len: u64,
    /// Checksum of the payload.
    pub checksum: Checksum,
    /// Commit sequence (also in the file name).
    pub seq: u64,
    /// Epoch of the store that wrote the block.
    pub epoch: u64,
    pub key: PhysicalKey,
}

impl BlockHeader {
    /// Total file length: header and payload, each padded to 4 KiB.
    pub fn file_len(&self) -> u64 {
        self.header_len + padded(self.payload_len)
    }
}

/// `len` rounded up to a multiple of 4 KiB.
pub fn padded(len: u64) -> u64 {
    len.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64
}

/// Bytes of the header of a block whose GPCK key is `key_len` bytes: the fixed part and the
/// key, rounded up to a multiple of 4 KiB.
pub fn header_len_for(key_len: usize) -> usize {
    round_up(FIXED_HEADER_BYTES + key_len, DIRECT_ALIGN)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Writes the header of a block into the first [`header_len_for`] (the key's encoded length)
/// bytes of `out`, flags and padding zero, the header checksum last. Panics when `out` is
/// shorter.
pub fn encode_header(
    out: &mut [u8],
    key: &PhysicalKey,
    payload_len: u64,
    checksum: Checksum,
    seq: u64,
    epoch: u64,
) {
    let encoded = key.encoded();
    let header_len = header_len_for(encoded.len());
    let out = &mut out[..header_len];
    out.fill(0);
    out[0..4].copy_from_slice(&BLOCK_MAGIC);
    out[4..6].copy_from_slice(&BLOCK_FORMAT.to_le_bytes());
    // 6..8: flags, zero.
    out[8..12].copy_from_slice(&u32::try_from(header_len).unwrap_or(u32::MAX).to_le_bytes());
    out[12..16].copy_from_slice(&u32::try_from(encoded.len()).unwrap_or(u32::MAX).to_le_bytes());
    out[16..24].copy_from_slice(&payload_len.to_le_bytes());
    out[24..32].copy_from_slice(&checksum.0.to_le_bytes());
    out[32..40].copy_from_slice(&seq.to_le_bytes());
    out[40..48].copy_from_slice(&epoch.to_le_bytes());
    out[FIXED_HEADER_BYTES..FIXED_HEADER_BYTES + encoded.len()].copy_from_slice(encoded);
    let sum = Checksum::of(out);
    out[HEADER_CHECKSUM_AT..HEADER_CHECKSUM_AT + 8].copy_from_slice(&sum.0.to_le_bytes());
}

/// The header length a file's first bytes declare, for reading the rest of a long header.
pub fn declared_header_len(first: &[u8]) -> Result<usize, BlockFileError> {
    if first.len() < FIXED_HEADER_BYTES {
        return Err(BlockFileError::Short { len: first.len() });
    }
    let magic = [first[0], first[1], first[2], first[3]];
    if magic != BLOCK_MAGIC {
        return Err(BlockFileError::Foreign { found: magic });
    }
    let format = u16_at(first, 4);
    if format != BLOCK_FORMAT {
        return Err(BlockFileError::Format { found: format, supported: BLOCK_FORMAT });
    }
    let header_len = u32_at(first, 8);
    let key_len = u32_at(first, 12);
    let sane = usize::try_from(key_len)
        .is_ok_and(|k| k <= KEY_BYTES_MAX && header_len_for(k) == header_len as usize);
    if !sane {
        return Err(BlockFileError::HeaderLength { header_len, key_len });
    }
    Ok(header_len as usize)
}

/// Parses and checks a whole header: magic, format, header and key lengths, header checksum,
/// payload length and key. Reads only the first `header_len` bytes of `bytes`; whatever follows
/// (the payload) is not looked at.
pub fn decode_header(bytes: &[u8]) -> Result<BlockHeader, BlockFileError> {
    decode_header_with(bytes, &mut KeyDecoder::new())
}

/// [`decode_header`] of one of many headers read in a row, whose keys `keys` decodes (sharing
/// what consecutive keys have in common).
pub(crate) fn decode_header_with(
    bytes: &[u8],
    keys: &mut KeyDecoder,
) -> Result<BlockHeader, BlockFileError> {
    let header_len = declared_header_len(bytes)?;
    if bytes.len() < header_len {
        return Err(BlockFileError::Short { len: bytes.len() });
    }
    let header = &bytes[..header_len];
    let stored = u64_at(header, HEADER_CHECKSUM_AT);
    // The checksum of the header with its checksum field zeroed, without copying it.
    let mut check = ChecksumBuilder::default();
    check.update(&header[..HEADER_CHECKSUM_AT]);
    check.update(&[0; 8]);
    check.update(&header[HEADER_CHECKSUM_AT + 8..]);
    if check.finish().0 != stored {
        return Err(BlockFileError::HeaderChecksum);
    }
    let payload_len = u64_at(header, 16);
    if payload_len > PAYLOAD_BYTES_MAX {
        return Err(BlockFileError::PayloadLength { len: payload_len, max: PAYLOAD_BYTES_MAX });
    }
    let key_len = u32_at(header, 12) as usize;
    let key = keys
        .decode(&header[FIXED_HEADER_BYTES..FIXED_HEADER_BYTES + key_len], None)
        .map_err(|e| BlockFileError::Key(e.to_string()))?;
    Ok(BlockHeader {
        header_len: header_len as u64,
        payload_len,
        checksum: Checksum(u64_at(header, 24)),
        seq: u64_at(header, 32),
        epoch: u64_at(header, 40),
        key,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `blocks/<first byte>/<digest>-<seq>.blk` under `root`.
pub(crate) fn block_path(root: &Path, key: &PhysicalKey, seq: u64) -> PathBuf {
    let digest = hex(&key.digest().0);
    root.join("blocks").join(&digest[..2]).join(format!("{digest}-{seq}.{BLOCK_SUFFIX}"))
}

/// The digest (hex) and sequence a block file's name claims.
pub(crate) fn parse_block_name(path: &Path) -> Result<(String, u64), BlockFileError> {
    let name = path.file_name().and_then(|n| n.to_str()).ok_or(BlockFileError::Name)?;
    let stem = name.strip_suffix(&format!(".{BLOCK_SUFFIX}")).ok_or(BlockFileError::Name)?;
    let (digest, seq) = stem.split_once('-').ok_or(BlockFileError::Name)?;
    if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(BlockFileError::Name);
    }
    let seq = seq.parse().map_err(|_| BlockFileError::Name)?;
    Ok((digest.to_owned(), seq))
}

/// Checks that a decoded header matches the name its file has.
pub(crate) fn check_name(path: &Path, header: &BlockHeader) -> Result<(), BlockFileError> {
    let (digest, seq) = parse_block_name(path)?;
    if digest != hex(&header.key.digest().0) || seq != header.seq {
        return Err(BlockFileError::NameMismatch);
    }
    Ok(())
}

pub(crate) fn tmp_path(root: &Path, region: u64) -> PathBuf {
    root.join("tmp").join(format!("{region}.tmp"))
}

/// Encodes the store record (epoch) with its checksum.
pub(crate) fn encode_store_record(epoch: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(24);
    v.extend_from_slice(&STORE_MAGIC);
    v.extend_from_slice(&epoch.to_le_bytes());
    let sum = Checksum::of(&v);
    v.extend_from_slice(&sum.0.to_le_bytes());
    v
}

/// Decodes the store record; `None` when it is damaged or foreign.
pub(crate) fn decode_store_record(bytes: &[u8]) -> Option<u64> {
    if bytes.len() != 24 || bytes[..8] != STORE_MAGIC {
        return None;
    }
    (Checksum::of(&bytes[..16]).0 == u64_at(bytes, 16)).then(|| u64_at(bytes, 8))
}

/// Reads and checks one file's header and size (not its payload).
pub(crate) fn read_header(path: &Path) -> Result<BlockHeader, BlockFileError> {
    use std::os::unix::fs::FileExt;
    let io = |e: io::Error| BlockFileError::Io(e.to_string());
    parse_block_name(path)?;
    let file = File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.size();
    let mut first = vec![0u8; DIRECT_ALIGN];
    let n = read_up_to(&file, &mut first, 0).map_err(io)?;
    first.truncate(n);
    let header_len = declared_header_len(&first)?;
    if header_len > first.len() {
        let mut whole = vec![0u8; header_len];
        file.read_exact_at(&mut whole, 0)
            .map_err(|_| BlockFileError::Short { len: first.len() })?;
        first = whole;
    }
    let header = decode_header(&first)?;
    check_name(path, &header)?;
    if size != header.file_len() {
        return Err(BlockFileError::Size { actual: size, expected: header.file_len() });
    }
    Ok(header)
}

fn read_up_to(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
