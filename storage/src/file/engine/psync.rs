//! The portable engine: positional read and write system calls, looping over partial
//! transfers, on the calling thread.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use std::sync::{Arc, OnceLock};

use super::contract::{BufferPool, IoEngine, Staging};

/// Aligned staging buffers shared by every psync engine in the process.
fn staging_pool() -> &'static Arc<BufferPool> {
    static POOL: OnceLock<Arc<BufferPool>> = OnceLock::new();
    POOL.get_or_init(Arc::default)
}

/// pread/pwrite/fsync on the calling thread.
#[derive(Debug, Clone, Copy, Default)]
pub struct PsyncEngine;

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn write_all_at(&self, file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
        file.write_all_at(data, offset)
    }

    fn read_exact_at(&self, file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        file.read_exact_at(buf, offset)
    }

    fn sync(&self, file: &File) -> io::Result<()> {
        file.sync_all()
    }

    fn staging(&self, len: usize) -> io::Result<Staging> {
        Ok(Staging::Pooled(staging_pool().take(len)?))
    }
}
