//! Block I/O engines for the FileStore: io_uring ([`uring`]) and portable pread/pwrite
//! ([`psync`]) behind one trait, plus a seeded faulty-disk layer ([`faulty`]) that wraps either.
//!
//! Engines move bytes between memory and an open file; they know nothing about blocks, keys or
//! durability policy. Every call either completes entirely or returns an error after which the
//! engine no longer touches the caller's memory (engines are synchronous to their caller, so a
//! returned call is a retired call). A batch call ([`IoEngine::read_batch`]) answers per
//! request, and the same holds for it as a whole: when it returns, with whatever answers, the
//! engine touches none of its requests' buffers any more.

mod contract;
pub mod faulty;
pub mod psync;
pub mod uring;

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;

pub use contract::{
    AlignedBuf, BatchRead, BufferPool, DIRECT_ALIGN, EngineChoice, EngineConfig, IoEngine,
    POOLED_STAGING_BYTES_MAX, PooledBuf, RegisteredSlot, Staging, direct_ready, round_up,
};

/// Builds the engine `choice` asks for. `Auto` probes io_uring once and falls back to psync,
/// logging the choice; `Uring` fails when io_uring cannot run.
pub fn build(choice: EngineChoice, config: EngineConfig) -> io::Result<Arc<dyn IoEngine>> {
    build_explained(choice, config).map(|(engine, _)| engine)
}

/// [`build`], with the reason the engine was chosen, in words for the operator's start line:
/// "configured", "probed", or why io_uring could not run (the kernel's own error).
pub fn build_explained(
    choice: EngineChoice,
    config: EngineConfig,
) -> io::Result<(Arc<dyn IoEngine>, String)> {
    match choice {
        EngineChoice::Psync => Ok((Arc::new(psync::PsyncEngine), "configured".to_owned())),
        EngineChoice::Uring => {
            Ok((Arc::new(uring::UringEngine::new(config)?), "configured".to_owned()))
        }
        EngineChoice::Auto => match uring::UringEngine::new(config) {
            Ok(e) => {
                tracing::info!(engine = "uring", "file I/O engine: io_uring");
                Ok((Arc::new(e), "probed".to_owned()))
            }
            Err(err) => {
                tracing::warn!(engine = "psync", error = %err, "io_uring unavailable; file I/O falls back to pread/pwrite");
                Ok((Arc::new(psync::PsyncEngine), format!("io_uring unavailable: {err}")))
            }
        },
    }
}

/// Which way an I/O call moved bytes. Reads and writes are watched apart, so that a medium
/// that still reads but no longer writes (a file system remounted read-only, a directory the
/// process may no longer write) stays failing however many reads succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoSide {
    Read,
    /// Writing, flushing, creating, renaming or removing.
    Write,
}

/// The outcome of the latest call of one [`IoSide`].
#[derive(Debug, Default)]
struct Latest {
    /// Set while the latest call failed: a success then takes the lock once to clear it.
    failing: std::sync::atomic::AtomicBool,
    failure: std::sync::Mutex<Option<String>>,
}

impl Latest {
    fn record<T>(&self, result: &io::Result<T>) {
        use std::sync::atomic::Ordering;
        match result {
            Err(e)
                if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::UnexpectedEof) => {}
            Ok(_) if !self.failing.load(Ordering::Relaxed) => {}
            Ok(_) => {
                *self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                self.failing.store(false, Ordering::Relaxed);
            }
            Err(e) => {
                *self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Some(e.to_string());
                self.failing.store(true, Ordering::Relaxed);
            }
        }
    }

    fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// The outcome of the latest read and the latest write of a store's medium, for the store's
/// readiness: the engine's calls (through [`Watched`]) and the steps the store takes itself
/// (creating, renaming and flushing block files and directories).
#[derive(Debug, Default)]
pub struct IoWatch {
    reads: Latest,
    writes: Latest,
}

impl IoWatch {
    /// Records a call's outcome. A name already gone (`NotFound`) or a file shorter than its
    /// header says (`UnexpectedEof`, a damaged block the store drops) is the caller's to judge,
    /// not a failing medium, and changes nothing.
    pub fn record<T>(&self, side: IoSide, result: &io::Result<T>) {
        match side {
            IoSide::Read => self.reads.record(result),
            IoSide::Write => self.writes.record(result),
        }
    }

    /// What failed, when the latest write or the latest read failed (the write first); `None`
    /// when both succeeded (or none ran).
    pub fn failure(&self) -> Option<String> {
        if let Some(e) = self.writes.failure() {
            return Some(format!("writing: {e}"));
        }
        self.reads.failure().map(|e| format!("reading: {e}"))
    }
}

/// An engine that records every call's outcome in an [`IoWatch`]; it moves no byte itself.
#[derive(Debug)]
pub struct Watched {
    inner: Arc<dyn IoEngine>,
    watch: Arc<IoWatch>,
}

impl Watched {
    pub fn new(inner: Arc<dyn IoEngine>) -> Self {
        Self { inner, watch: Arc::default() }
    }

    pub fn watch(&self) -> Arc<IoWatch> {
        Arc::clone(&self.watch)
    }
}

impl IoEngine for Watched {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn write_all_at(&self, file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
        let r = self.inner.write_all_at(file, offset, data);
        self.watch.record(IoSide::Write, &r);
        r
    }
    fn read_exact_at(&self, file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let r = self.inner.read_exact_at(file, offset, buf);
        self.watch.record(IoSide::Read, &r);
        r
    }
    fn read_batch(&self, reads: &mut [BatchRead<'_>]) -> Vec<io::Result<()>> {
        let results = self.inner.read_batch(reads);
        for r in &results {
            self.watch.record(IoSide::Read, r);
        }
        results
    }
    fn read_batch_then(
        &self,
        reads: &mut [BatchRead<'_>],
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Vec<io::Result<()>> {
        let results = self.inner.read_batch_then(reads, done);
        for r in &results {
            self.watch.record(IoSide::Read, r);
        }
        results
    }
    fn sync(&self, file: &File) -> io::Result<()> {
        let r = self.inner.sync(file);
        self.watch.record(IoSide::Write, &r);
        r
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let r = self.inner.remove_file(path);
        self.watch.record(IoSide::Write, &r);
        r
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let r = self.inner.sync_dir(dir);
        self.watch.record(IoSide::Write, &r);
        r
    }
    fn staging(&self, len: usize) -> io::Result<Staging> {
        let r = self.inner.staging(len);
        self.watch.record(IoSide::Write, &r);
        r
    }
    fn staging_for_read(&self, len: usize) -> io::Result<Staging> {
        let r = self.inner.staging_for_read(len);
        self.watch.record(IoSide::Read, &r);
        r
    }
}
