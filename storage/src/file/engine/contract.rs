//! What every engine implements ([`IoEngine`]) and what it moves bytes through: aligned
//! buffers, staging memory and its pool, registered slots, and the engine settings. The
//! engines and the choice among them (the parent module) all build on it.

use std::fmt;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;

/// Alignment of offsets, lengths and memory for O_DIRECT I/O.
pub const DIRECT_ALIGN: usize = 4096;

/// Which engine a FileStore uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    /// Probe io_uring once; fall back to psync with one log line.
    Auto,
    /// io_uring, or fail to open.
    Uring,
    /// pread/pwrite.
    Psync,
}

/// Tuning shared by the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most I/O requests in flight at once per call (io_uring submission batch).
    pub queue_depth: u32,
    /// Bytes per I/O request when a transfer is split.
    pub chunk_bytes: usize,
    /// Bytes of aligned staging memory kept for O_DIRECT (registered with io_uring).
    pub staging_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { queue_depth: 32, chunk_bytes: 256 << 10, staging_bytes: 64 << 20 }
    }
}

/// A memory buffer aligned to [`DIRECT_ALIGN`], for O_DIRECT transfers.
pub struct AlignedBuf {
    pub(super) ptr: std::ptr::NonNull<u8>,
    len: usize,
    layout: std::alloc::Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to [`DIRECT_ALIGN`].
    pub fn zeroed(len: usize) -> io::Result<Self> {
        let len = round_up(len.max(1), DIRECT_ALIGN);
        let layout = std::alloc::Layout::from_size_align(len, DIRECT_ALIGN)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a nonzero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Self { ptr, len, layout })
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of len initialized bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

pub fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// Whether an O_DIRECT transfer can use `buf` as it is: its address and length are multiples
/// of [`DIRECT_ALIGN`] (so nothing has to be padded or staged).
pub fn direct_ready(buf: &[u8]) -> bool {
    buf.as_ptr().addr().is_multiple_of(DIRECT_ALIGN) && buf.len().is_multiple_of(DIRECT_ALIGN)
}

/// One read of an [`IoEngine::read_batch`]: fill all of `buf` from `offset` of `file`.
#[derive(Debug)]
pub struct BatchRead<'a> {
    pub file: &'a File,
    pub offset: u64,
    pub buf: &'a mut [u8],
}

/// Moves bytes between memory and files. Calls are synchronous to the caller: when one returns,
/// with success or an error, the engine has stopped touching the caller's buffers.
pub trait IoEngine: Send + Sync + fmt::Debug {
    /// "uring", "psync", or a wrapper's name.
    fn name(&self) -> &'static str;

    /// Writes all of `data` at `offset`. For a file opened with O_DIRECT the offset, the length
    /// and the memory must be aligned to [`DIRECT_ALIGN`]. A write that makes no progress is
    /// an error (`WriteZero`), never a silent short write.
    fn write_all_at(&self, file: &File, offset: u64, data: &[u8]) -> io::Result<()>;

    /// Fills `buf` from `offset`; end of file first is `UnexpectedEof`.
    fn read_exact_at(&self, file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// [`IoEngine::read_exact_at`] for each request, answered per request and in order: one
    /// request's failure never fails another. An engine that can keep many requests in flight
    /// at once does so (io_uring: up to its queue depth); the default reads one after another.
    /// When the call returns the engine touches none of the requests' buffers any more, whatever
    /// the answers.
    fn read_batch(&self, reads: &mut [BatchRead<'_>]) -> Vec<io::Result<()>> {
        self.read_batch_then(reads, &mut |_, _| {})
    }

    /// [`IoEngine::read_batch`], handing each request that succeeded to `done` (its index and
    /// its filled buffer) once, as soon as the engine is done with that buffer: io_uring does
    /// so while the batch's other reads are still in flight, so that the caller's work on one
    /// block overlaps the reading of the next. The default reads one after another and hands
    /// each over after its read.
    fn read_batch_then(
        &self,
        reads: &mut [BatchRead<'_>],
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Vec<io::Result<()>> {
        reads
            .iter_mut()
            .enumerate()
            .map(|(i, r)| {
                let result = self.read_exact_at(r.file, r.offset, r.buf);
                if result.is_ok() {
                    done(i, r.buf);
                }
                result
            })
            .collect()
    }

    /// Makes a file's data and metadata durable (fsync).
    fn sync(&self, file: &File) -> io::Result<()>;

    /// Removes a file's name (unlink). The FileStore removes invalidated blocks through here, so
    /// that a test layer can fail it.
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    /// Makes a directory's entries durable (fsync of the directory), e.g. after an unlink.
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    /// An aligned buffer of at least `len` bytes for O_DIRECT transfers. Engines with
    /// registered memory hand out slices of it (io_uring fixed buffers); the default allocates.
    fn staging(&self, len: usize) -> io::Result<Staging> {
        Ok(Staging::Owned(AlignedBuf::zeroed(len)?))
    }

    /// [`IoEngine::staging`] for a read that fills every byte of the buffer before any is
    /// used: its bytes may be whatever its last user left (saving a pass over the memory).
    /// The default hands out what [`IoEngine::staging`] does.
    fn staging_for_read(&self, len: usize) -> io::Result<Staging> {
        self.staging(len)
    }
}

/// A shared engine is an engine (so test wrappers can wrap what [`build`] returns).
impl<E: IoEngine + ?Sized> IoEngine for Arc<E> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn write_all_at(&self, file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
        (**self).write_all_at(file, offset, data)
    }
    fn read_exact_at(&self, file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        (**self).read_exact_at(file, offset, buf)
    }
    fn read_batch(&self, reads: &mut [BatchRead<'_>]) -> Vec<io::Result<()>> {
        (**self).read_batch(reads)
    }
    fn read_batch_then(
        &self,
        reads: &mut [BatchRead<'_>],
        done: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Vec<io::Result<()>> {
        (**self).read_batch_then(reads, done)
    }
    fn sync(&self, file: &File) -> io::Result<()> {
        (**self).sync(file)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        (**self).remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        (**self).sync_dir(dir)
    }
    fn staging(&self, len: usize) -> io::Result<Staging> {
        (**self).staging(len)
    }
    fn staging_for_read(&self, len: usize) -> io::Result<Staging> {
        (**self).staging_for_read(len)
    }
}

/// Aligned staging memory for one O_DIRECT transfer.
pub enum Staging {
    /// Freshly allocated, not registered with any engine.
    Owned(AlignedBuf),
    /// A slot of an engine's registered arena; the slot returns to the engine on drop.
    Registered(Box<dyn RegisteredSlot>),
    /// A recycled unregistered buffer; it returns to its pool on drop.
    Pooled(PooledBuf),
}

/// Most bytes of aligned buffers a [`BufferPool`] keeps for reuse.
pub const POOLED_STAGING_BYTES_MAX: usize = 64 << 20;

/// A bounded pool of aligned buffers, so that O_DIRECT transfers on engines without registered
/// memory do not allocate and fault in a fresh buffer every time.
#[derive(Debug, Default)]
pub struct BufferPool {
    free: std::sync::Mutex<Vec<AlignedBuf>>,
}

impl BufferPool {
    /// A buffer of at least `len` bytes: a kept one no more than twice that size, or a new one.
    pub fn take(self: &Arc<Self>, len: usize) -> io::Result<PooledBuf> {
        let kept = self.free.lock().ok().and_then(|mut free| {
            let i =
                free.iter().position(|b| b.len() >= len && b.len() <= len.max(DIRECT_ALIGN) * 2)?;
            Some(free.swap_remove(i))
        });
        let buf = match kept {
            Some(b) => b,
            None => AlignedBuf::zeroed(len)?,
        };
        Ok(PooledBuf { buf: Some(buf), pool: Arc::clone(self) })
    }

    /// Bytes of buffers kept for reuse right now.
    pub fn kept_bytes(&self) -> usize {
        self.free.lock().map(|free| free.iter().map(|b| b.len()).sum()).unwrap_or(0)
    }

    fn give(&self, buf: AlignedBuf) {
        if let Ok(mut free) = self.free.lock() {
            let kept: usize = free.iter().map(|b| b.len()).sum();
            if kept + buf.len() <= POOLED_STAGING_BYTES_MAX {
                free.push(buf);
            }
        }
    }
}

/// A buffer lent by a [`BufferPool`]. Its bytes are whatever the last user left; staging users
/// write every byte they later read.
#[derive(Debug)]
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<BufferPool>,
}

impl PooledBuf {
    /// Address of the lent buffer (tests check reuse).
    pub fn buf_addr(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.as_ptr().addr())
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give(buf);
        }
    }
}

/// A slot of registered staging memory (see [`uring`]).
pub trait RegisteredSlot: Send + Sync {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl std::ops::Deref for Staging {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Staging::Owned(b) => b,
            Staging::Registered(s) => s.bytes(),
            Staging::Pooled(p) => p.buf.as_deref().unwrap_or(&[]),
        }
    }
}

impl std::ops::DerefMut for Staging {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Staging::Owned(b) => b,
            Staging::Registered(s) => s.bytes_mut(),
            Staging::Pooled(p) => p.buf.as_deref_mut().unwrap_or(&mut []),
        }
    }
}

impl fmt::Debug for Staging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Staging::Owned(b) => write!(f, "Staging::Owned({} bytes)", b.len()),
            Staging::Registered(s) => write!(f, "Staging::Registered({} bytes)", s.bytes().len()),
            Staging::Pooled(p) => {
                write!(f, "Staging::Pooled({} bytes)", p.buf.as_ref().map_or(0, |b| b.len()))
            }
        }
    }
}
