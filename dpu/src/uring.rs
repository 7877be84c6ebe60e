//! The host queue backend: one file per block under the queue's root, moved by the backends'
//! I/O engine (io_uring when the kernel allows it).
//!
//! Why the engine and not a FileStore shard: a queue moves numbered blocks and owns no keys,
//! tenants or lifecycle, so it needs the engine (io_uring submission, short-write handling)
//! without the catalog. [`crate::DpuStore`] puts a whole store behind the queues instead.
//!
//! A block file is a header (magic, agent epoch, length, xxh3 of the payload) then the payload.
//! The reactor writes it to `<block>.<epoch>.<seq>.tmp`; the submitter renames it into place
//! when it reaps the completion, so an unreaped write never becomes readable. Temporary files
//! of earlier runs are removed at open. A read checks the header and the checksum; anything
//! wrong is a clean miss.

use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpucache_dataplane::registry::Epoch;
use gpucache_storage::file::engine::{self, EngineChoice, EngineConfig, IoEngine};

use crate::error::{DpuError, io_at};
use crate::queue::{BlockId, Done, Fault, MissCause, QueueBackend, Staged};

/// Bytes of a block file's header.
pub const BLOCK_HEADER_BYTES: usize = 32;
/// io_uring ring entries of one host queue: its reactor runs one submission at a time.
const HOST_QUEUE_RING_DEPTH: u32 = 8;
const MAGIC: [u8; 8] = *b"GCDPUB01";

#[derive(Debug)]
pub(crate) struct HostQueue {
    root: PathBuf,
    engine: Arc<dyn IoEngine>,
    sync: bool,
    epoch: Epoch,
}

impl HostQueue {
    pub(crate) fn open(
        root: &Path,
        choice: EngineChoice,
        sync: bool,
        epoch: Epoch,
    ) -> Result<Self, DpuError> {
        fs::create_dir_all(root).map_err(io_at(root))?;
        for entry in fs::read_dir(root).map_err(io_at(root))? {
            let path = entry.map_err(io_at(root))?.path();
            if path.extension().is_some_and(|e| e == "tmp") {
                fs::remove_file(&path).map_err(io_at(&path))?;
            }
        }
        let config = EngineConfig {
            queue_depth: HOST_QUEUE_RING_DEPTH,
            staging_bytes: 0,
            ..EngineConfig::default()
        };
        let engine = engine::build(choice, config).map_err(|e| DpuError::Engine(e.to_string()))?;
        Ok(Self { root: root.to_owned(), engine, sync, epoch })
    }

    fn path(&self, block: BlockId) -> PathBuf {
        self.root.join(format!("{:016x}.blk", block.0))
    }
}

fn header(epoch: Epoch, data: &[u8]) -> [u8; BLOCK_HEADER_BYTES] {
    let mut h = [0u8; BLOCK_HEADER_BYTES];
    h[..8].copy_from_slice(&MAGIC);
    h[8..16].copy_from_slice(&epoch.0.to_le_bytes());
    h[16..24].copy_from_slice(&(data.len() as u64).to_le_bytes());
    h[24..32].copy_from_slice(&gpucache_dataplane::checksum::Checksum::of(data).0.to_le_bytes());
    h
}

impl QueueBackend for HostQueue {
    fn name(&self) -> &'static str {
        self.engine.name()
    }
    fn simulated(&self) -> Option<u64> {
        None
    }
    fn next_fault(&mut self) -> Fault {
        Fault::None
    }
    fn write(&mut self, block: BlockId, data: &[u8], tag: u64) -> Result<Staged, String> {
        let dst = self.path(block);
        let tmp = self.root.join(format!("{:016x}.{}.{tag}.tmp", block.0, self.epoch.0));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        let result = self
            .engine
            .write_all_at(&file, 0, &header(self.epoch, data))
            .and_then(|()| self.engine.write_all_at(&file, BLOCK_HEADER_BYTES as u64, data))
            .and_then(|()| if self.sync { self.engine.sync(&file) } else { Ok(()) });
        if let Err(e) = result {
            let _ = fs::remove_file(&tmp);
            return Err(format!("{}: {e}", tmp.display()));
        }
        Ok(Staged::File { tmp, dst })
    }
    fn publish(&mut self, staged: Staged) -> Result<(), String> {
        let Staged::File { tmp, dst } = staged else {
            return Err("foreign staged write".into());
        };
        fs::rename(&tmp, &dst).map_err(|e| format!("{}: {e}", dst.display()))
    }
    fn discard(&mut self, staged: Staged) {
        if let Staged::File { tmp, .. } = staged {
            let _ = fs::remove_file(&tmp);
        }
    }
    fn read(&mut self, block: BlockId, dst: &mut [u8]) -> Result<Done, String> {
        let path = self.path(block);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Done::Miss(MissCause::Absent));
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let mut h = [0u8; BLOCK_HEADER_BYTES];
        if self.engine.read_exact_at(&file, 0, &mut h).is_err() || h[..8] != MAGIC {
            return Ok(Done::Miss(MissCause::Corrupt));
        }
        let word = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[r]);
            u64::from_le_bytes(b)
        };
        let (len, sum) = (word(16..24), word(24..32));
        let Some(len) = usize::try_from(len).ok().filter(|l| *l <= dst.len()) else {
            return Ok(Done::Miss(MissCause::Corrupt));
        };
        if self.engine.read_exact_at(&file, BLOCK_HEADER_BYTES as u64, &mut dst[..len]).is_err()
            || gpucache_dataplane::checksum::Checksum::of(&dst[..len]).0 != sum
        {
            dst[..len].fill(0);
            return Ok(Done::Miss(MissCause::Corrupt));
        }
        Ok(Done::Read { len })
    }
}
