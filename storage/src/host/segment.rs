//! Shared-memory segments for the same-host fast path (ADR 0013).
//!
//! A client creates one sealed memfd segment, maps it, and hands its descriptor to the server
//! over a Unix socket (`SCM_RIGHTS`). Payloads then move through the segment: the server reads a
//! GET straight into it and takes a PUT straight from it, and only small frames cross the
//! socket. The seals are what make mapping a peer's memory safe: a segment that could shrink
//! would make the server fault (`SIGBUS`) on a later access, so one without the shrink and grow
//! seals is refused, and so is anything that is not a sealable memfd.
//!
//! The bytes in a segment are the peer's: it may change them at any time. So nothing read from a
//! segment is trusted without a checksum, the server only ever copies into or out of it (never
//! keeps a reference past one request), and every offset a peer names is checked against the
//! mapped length before it is used.
//!
//! [`SharedArena`] hands out [`SharedBuf`]s, caller-owned buffers inside the segment: a GET into
//! one is served without any copy on the client side.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::{MmapOptions, MmapRaw};

/// Smallest segment either side accepts.
pub const SEGMENT_BYTES_MIN: u64 = 1 << 20;
/// Largest segment a server maps for one connection.
pub const SEGMENT_BYTES_MAX: u64 = 64 << 30;
/// Allocation unit of [`SharedArena`]: buffers start on a page.
pub const ARENA_ALIGN: u64 = 4096;
/// Huge page size used for `MFD_HUGETLB` segments; their length is rounded up to it.
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;
/// Descriptors one received message may carry; any beyond the first are closed at once.
const FDS_PER_MESSAGE_MAX: u32 = 4;
/// Bytes of one descriptor in a control message.
#[allow(clippy::cast_possible_truncation)] // 4: the size of a C int
const FD_BYTES: u32 = std::mem::size_of::<libc::c_int>() as u32;

/// What backs a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// Ordinary 4 KiB shared memory.
    Normal,
    /// 2 MiB huge pages (`MFD_HUGETLB`); needs reserved huge pages (`vm.nr_hugepages`).
    Huge,
}

impl Pages {
    pub fn name(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::Huge => "huge",
        }
    }
}

/// Why a segment could not be created, attached or used.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("shared segment of {len} bytes is outside {min}..={max}")]
    BadSize { len: u64, min: u64, max: u64 },
    #[error(
        "the descriptor is not a memfd sealed against shrinking and growing (seals {seals:#x}); \
         mapping a peer's memory that can shrink could fault the server"
    )]
    NotSealed { seals: i32 },
    #[error("range {offset}+{len} is outside the {segment}-byte shared segment")]
    OutOfRange { offset: u64, len: u64, segment: u64 },
    #[error("{op}: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl ShmError {
    /// The system's error kind, for a failed system call.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            Self::Os { source, .. } => Some(source.kind()),
            _ => None,
        }
    }
}

fn os(op: &'static str) -> impl FnOnce(io::Error) -> ShmError {
    move |source| ShmError::Os { op, source }
}

fn last_os(op: &'static str) -> ShmError {
    ShmError::Os { op, source: io::Error::last_os_error() }
}

/// Seals a segment must carry before a server maps it.
const REQUIRED_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// A mapped, sealed shared-memory segment.
#[derive(Debug)]
pub struct Segment {
    map: MmapRaw,
    file: File,
    pages: Pages,
}

impl Segment {
    /// Creates and maps a sealed memfd of `len` bytes (rounded up to the page size).
    pub fn create(len: u64, pages: Pages) -> Result<Self, ShmError> {
        let unit = if pages == Pages::Huge { HUGE_PAGE_BYTES } else { ARENA_ALIGN };
        let len = len.div_ceil(unit).saturating_mul(unit);
        check_size(len)?;
        let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        if pages == Pages::Huge {
            flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
        }
        // SAFETY: the name is a NUL-terminated literal; memfd_create only reads it.
        let fd = unsafe { libc::memfd_create(c"gpucache-shm".as_ptr(), flags) };
        if fd < 0 {
            return Err(last_os("memfd_create"));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len).map_err(os("ftruncate"))?;
        // SAFETY: F_ADD_SEALS takes an int argument and touches no memory of ours.
        let rc = unsafe {
            libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS | libc::F_SEAL_SEAL)
        };
        if rc < 0 {
            return Err(last_os("fcntl(F_ADD_SEALS)"));
        }
        let map = MmapOptions::new().populate().map_raw(&file).map_err(os("mmap"))?;
        Ok(Self { map, file, pages })
    }

    /// Maps a segment a peer sent, after checking it is a memfd sealed against shrinking and
    /// growing and that its size is within the limits.
    pub fn attach(fd: OwnedFd) -> Result<Self, ShmError> {
        // SAFETY: F_GET_SEALS takes no argument; it fails with EINVAL on anything but a memfd
        // (or other sealable shmem file), which is refused below.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(ShmError::NotSealed { seals });
        }
        let file = File::from(fd);
        let len = file.metadata().map_err(os("fstat"))?.len();
        check_size(len)?;
        let map = MmapOptions::new().map_raw(&file).map_err(os("mmap"))?;
        // Huge-page segments are rounded to 2 MiB; the server does not need to know which.
        Ok(Self { map, file, pages: Pages::Normal })
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn pages(&self) -> Pages {
        self.pages
    }

    /// The descriptor to send to a server.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The offset of `bytes` inside this mapping when all of it lies inside.
    pub fn offset_of(&self, bytes: &[u8]) -> Option<u64> {
        let base = self.map.as_ptr() as usize;
        let start = (bytes.as_ptr() as usize).checked_sub(base)?;
        let end = start.checked_add(bytes.len())?;
        (end <= self.map.len()).then_some(start as u64)
    }

    /// Whether `len` bytes at `offset` lie inside the segment.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), ShmError> {
        self.checked(offset, len).map(|_| ())
    }

    fn checked(&self, offset: u64, len: u64) -> Result<(usize, usize), ShmError> {
        let out = || ShmError::OutOfRange { offset, len, segment: self.len() };
        let end = offset.checked_add(len).ok_or_else(out)?;
        if end > self.len() {
            return Err(out());
        }
        Ok((usize::try_from(offset).map_err(|_| out())?, usize::try_from(len).map_err(|_| out())?))
    }

    /// Runs `f` over `len` bytes at `offset`, read-only.
    ///
    /// The bytes belong to the peer, which may change them while `f` runs: `f` must treat them
    /// as untrusted input (copy them and check a checksum) and must not keep the slice.
    pub fn with_bytes<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ShmError> {
        let (at, len) = self.checked(offset, len)?;
        // SAFETY: `at + len` is within the live mapping (checked above), which outlives the
        // call. Within this process nothing else holds a reference to these bytes while `f`
        // runs: the server touches a range only inside one request on one thread. A peer in
        // another process may write them concurrently; that is why callers treat the bytes as
        // untrusted and verify a checksum over what they copied.
        let bytes = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), len) };
        Ok(f(bytes))
    }

    /// Runs `f` over `len` writable bytes at `offset`; the same rules as [`Self::with_bytes`].
    pub fn with_bytes_mut<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, ShmError> {
        let (at, len) = self.checked(offset, len)?;
        // SAFETY: as in `with_bytes`; the range is in bounds and no other reference to it
        // exists in this process while `f` runs.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), len) };
        Ok(f(bytes))
    }
}

fn check_size(len: u64) -> Result<(), ShmError> {
    if (SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&len) {
        Ok(())
    } else {
        Err(ShmError::BadSize { len, min: SEGMENT_BYTES_MIN, max: SEGMENT_BYTES_MAX })
    }
}

/// Sends `bytes` with `fd` attached (`SCM_RIGHTS`). The descriptor arrives with the first of
/// these bytes; the caller must send all of them (this loops until done).
pub fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    let mut control = vec![0u8; cmsg_space(1)];
    let mut iov =
        libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; every pointer set below points at live locals that outlive
    // the sendmsg call, and the control buffer is sized by CMSG_SPACE for one descriptor.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            return Err(io::Error::other("no room for the control message"));
        }
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(FD_BYTES) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), raw);
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let sent = sent as usize;
    if sent < bytes.len() {
        io::Write::write_all(&mut &*stream, &bytes[sent..])?;
    }
    Ok(())
}

fn cmsg_space(fds: u32) -> usize {
    // SAFETY: CMSG_SPACE is pure arithmetic.
    unsafe { libc::CMSG_SPACE(fds * FD_BYTES) as usize }
}

/// Reads like `read(2)`, and also takes any descriptors that arrived with the bytes. At most
/// one descriptor is returned; extra ones are closed, and a truncated control message is an
/// error (a descriptor may have been lost).
pub fn recv_with_fd(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut control = vec![0u8; cmsg_space(FDS_PER_MESSAGE_MAX)];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: as in `send_with_fd`; the kernel writes at most `msg_controllen` control bytes
    // and `buf.len()` data bytes.
    let (n, msg) = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() as _;
        let n = libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        (n, msg)
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut received = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `control` with the CMSG
    // macros, which stay within `msg_controllen`; each SCM_RIGHTS payload is an array of ints.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let header = data.offset_from(cmsg.cast::<u8>()) as usize;
                let count = ((*cmsg).cmsg_len as usize).saturating_sub(header)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    if fd >= 0 {
                        received.push(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("descriptors were truncated in transit"));
    }
    let mut received = received.into_iter();
    let first = received.next();
    // Extra descriptors are dropped (closed) here.
    Ok((n as usize, first))
}

/// A shared segment cut into caller-owned buffers.
///
/// Allocation is first fit over a free list ordered by offset, with neighbours merged on free,
/// in units of [`ARENA_ALIGN`]; its size is bounded by the segment. A range whose fate is
/// unknown (a request that failed while the server may still have been writing it) is
/// quarantined: it never returns to the free list.
#[derive(Debug, Clone)]
pub struct SharedArena {
    inner: Arc<ArenaInner>,
}

#[derive(Debug)]
struct ArenaInner {
    segment: Segment,
    /// offset -> length of every free range.
    free: Mutex<BTreeMap<u64, u64>>,
    quarantined_bytes: AtomicU64,
}

impl SharedArena {
    pub fn new(segment: Segment) -> Self {
        let mut free = BTreeMap::new();
        free.insert(0, segment.len());
        Self {
            inner: Arc::new(ArenaInner {
                segment,
                free: Mutex::new(free),
                quarantined_bytes: AtomicU64::new(0),
            }),
        }
    }

    pub fn segment(&self) -> &Segment {
        &self.inner.segment
    }

    fn free_list(&self) -> MutexGuard<'_, BTreeMap<u64, u64>> {
        self.inner.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A buffer of `len` bytes (zero-filled on first use of the pages, otherwise holding what
    /// the last user left), or `None` when no free range is large enough.
    pub fn alloc(&self, len: usize) -> Option<SharedBuf> {
        let want = (len.max(1) as u64).div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
        let mut free = self.free_list();
        let (&offset, &size) = free.iter().find(|(_, size)| **size >= want)?;
        free.remove(&offset);
        if size > want {
            free.insert(offset + want, size - want);
        }
        Some(SharedBuf { arena: self.clone(), offset, len, reserved: want })
    }

    fn release(&self, offset: u64, reserved: u64) {
        let mut free = self.free_list();
        let mut start = offset;
        let mut size = reserved;
        if let Some((&prev, &prev_size)) = free.range(..offset).next_back()
            && prev + prev_size == offset
        {
            free.remove(&prev);
            start = prev;
            size += prev_size;
        }
        if let Some(next_size) = free.remove(&(offset + reserved)) {
            size += next_size;
        }
        free.insert(start, size);
    }

    /// Bytes currently free.
    pub fn free_bytes(&self) -> u64 {
        self.free_list().values().sum()
    }

    /// Bytes withheld for good after failed requests.
    pub fn quarantined_bytes(&self) -> u64 {
        self.inner.quarantined_bytes.load(Ordering::Relaxed)
    }
}

/// A caller-owned buffer inside a [`SharedArena`]'s segment. It derefs to its bytes; a GET
/// into it (or a PUT from it) through a shared-memory connection moves no bytes through the
/// socket and needs no copy on the client side. Dropping it returns the range to the arena.
#[derive(Debug)]
pub struct SharedBuf {
    arena: SharedArena,
    offset: u64,
    len: usize,
    reserved: u64,
}

impl SharedBuf {
    /// Where the buffer starts inside the segment.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Keeps the range out of the arena for good (its fate after a failed request is unknown).
    pub fn quarantine(mut self) {
        self.arena.inner.quarantined_bytes.fetch_add(self.reserved, Ordering::Relaxed);
        self.reserved = 0;
    }
}

impl SharedBuf {
    fn ptr(&self) -> *mut u8 {
        // The arena carved `offset..offset + len` out of the segment, so the offset is in
        // bounds of the mapping (and fits a usize, the mapping being in memory).
        let offset = usize::try_from(self.offset).unwrap_or(usize::MAX);
        self.arena.segment().map.as_mut_ptr().wrapping_add(offset)
    }
}

impl std::ops::Deref for SharedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range is inside the live mapping, which the arena keeps alive as long as
        // this buffer. The arena never hands a range out twice, so within this process only
        // this buffer refers to it; the server writes it only during a call that holds `&mut`
        // to it.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }
}

impl std::ops::DerefMut for SharedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, with `&mut self` proving exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl Drop for SharedBuf {
    fn drop(&mut self) {
        if self.reserved > 0 {
            self.arena.release(self.offset, self.reserved);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_allocates_first_fit_and_merges_on_free() {
        let arena = SharedArena::new(Segment::create(1 << 20, Pages::Normal).unwrap());
        let total = arena.free_bytes();
        let a = arena.alloc(5000).unwrap();
        let b = arena.alloc(4096).unwrap();
        let c = arena.alloc(100).unwrap();
        assert_eq!((a.offset(), b.offset(), c.offset()), (0, 8192, 12288));
        assert_eq!(a.len(), 5000);
        drop(b);
        // The hole left by b is reused by a request that fits it.
        let d = arena.alloc(4000).unwrap();
        assert_eq!(d.offset(), 8192);
        drop((a, c, d));
        assert_eq!(arena.free_bytes(), total);
        // Everything merged back: the whole segment can be taken at once again.
        assert!(arena.alloc(usize::try_from(total).unwrap()).is_some());
    }

    #[test]
    fn arena_refuses_when_full_and_quarantine_never_returns() {
        let arena = SharedArena::new(Segment::create(1 << 20, Pages::Normal).unwrap());
        let all = arena.alloc(1 << 20).unwrap();
        assert!(arena.alloc(1).is_none());
        all.quarantine();
        assert_eq!(arena.quarantined_bytes(), 1 << 20);
        assert!(arena.alloc(1).is_none());
    }

    #[test]
    fn buffers_are_visible_through_a_second_mapping() {
        let seg = Segment::create(1 << 20, Pages::Normal).unwrap();
        let peer = Segment::attach(seg.fd().try_clone_to_owned().unwrap()).unwrap();
        let arena = SharedArena::new(seg);
        let mut buf = arena.alloc(10_000).unwrap();
        buf.fill(7);
        let off = buf.offset();
        assert_eq!(arena.segment().offset_of(&buf), Some(off));
        peer.with_bytes(off, 10_000, |b| assert!(b.iter().all(|&x| x == 7))).unwrap();
        peer.with_bytes_mut(off, 3, |b| b.copy_from_slice(b"abc")).unwrap();
        assert_eq!(&buf[..4], b"abc\x07");
        assert!(matches!(
            peer.with_bytes(peer.len() - 1, 2, |_| ()),
            Err(ShmError::OutOfRange { .. })
        ));
        assert!(matches!(peer.with_bytes(u64::MAX, 2, |_| ()), Err(ShmError::OutOfRange { .. })));
        assert_eq!(arena.segment().offset_of(&[0u8; 4]), None);
    }

    #[test]
    fn attach_refuses_unsealed_and_non_memfd_descriptors() {
        let file = tempfile_in_tmp();
        file.set_len(1 << 20).unwrap();
        assert!(matches!(Segment::attach(OwnedFd::from(file)), Err(ShmError::NotSealed { .. })));
        // A memfd without the seals.
        // SAFETY: literal name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh descriptor.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(1 << 20).unwrap();
        assert!(matches!(Segment::attach(OwnedFd::from(file)), Err(ShmError::NotSealed { .. })));
        // A sealed segment cannot be shrunk by its creator either.
        let seg = Segment::create(1 << 20, Pages::Normal).unwrap();
        let f = File::from(seg.fd().try_clone_to_owned().unwrap());
        assert!(f.set_len(4096).is_err());
    }

    #[test]
    fn sizes_outside_the_limits_are_refused() {
        assert!(matches!(Segment::create(4096, Pages::Normal), Err(ShmError::BadSize { .. })));
        assert!(matches!(
            Segment::create(SEGMENT_BYTES_MAX + 1, Pages::Normal),
            Err(ShmError::BadSize { .. })
        ));
    }

    #[test]
    fn descriptors_cross_a_unix_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let seg = Segment::create(1 << 20, Pages::Normal).unwrap();
        seg.with_bytes_mut(100, 5, |x| x.copy_from_slice(b"hello")).unwrap();
        send_with_fd(&a, b"frame", seg.fd()).unwrap();
        let mut buf = [0u8; 16];
        let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"frame");
        let peer = Segment::attach(fd.unwrap()).unwrap();
        assert_eq!(peer.len(), 1 << 20);
        peer.with_bytes(100, 5, |x| assert_eq!(x, b"hello")).unwrap();
        // Plain bytes carry no descriptor.
        io::Write::write_all(&mut &a, b"more").unwrap();
        let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!((&buf[..n], fd.is_none()), (&b"more"[..], true));
    }

    #[test]
    fn huge_page_segments_are_sealed_and_shared_when_huge_pages_are_reserved() {
        // Huge pages exist only where an operator reserved them (vm.nr_hugepages); without
        // them creation must fail with the OS error, never fall back silently.
        match Segment::create(3 << 20, Pages::Huge) {
            Ok(seg) => {
                assert_eq!(seg.len(), 4 << 20, "rounded up to whole 2 MiB pages");
                assert_eq!(seg.pages(), Pages::Huge);
                let peer = Segment::attach(seg.fd().try_clone_to_owned().unwrap()).unwrap();
                seg.with_bytes_mut(3 << 20, 4, |b| b.copy_from_slice(b"huge")).unwrap();
                peer.with_bytes(3 << 20, 4, |b| assert_eq!(b, b"huge")).unwrap();
            }
            Err(e) => assert!(matches!(e, ShmError::Os { .. }), "{e}"),
        }
    }

    fn tempfile_in_tmp() -> File {
        let path = std::env::temp_dir().join(format!("gpucache-shm-test-{}", std::process::id()));
        let file =
            File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        file
    }
}
