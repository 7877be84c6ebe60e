//! Our service on the FileStore as a peer (`ours-file-*`): `gpucache serve` with
//! `store.kind = "file"` under a store directory of its own in the scratch directory, one per
//! point (removed after it), driven over loopback TCP exactly as `ours-tcp` is.
//!
//! Two durabilities on each of the two layouts, each with the page cache warm or cold for the
//! GET phase:
//!
//! - `ours-file-none`: `durability = "none"`, a file per block (a PUT is acknowledged after the
//!   rename, no flush);
//! - `ours-file-durable`: `durability = "per-block"` (the block file and its directory are
//!   flushed before the acknowledgement);
//! - `ours-log-none` and `ours-log-durable`: the same with `layout = "log"` (the block appended
//!   to a segment of the block log; durable: one shared flush of the log before the
//!   acknowledgement);
//! - warm: the GET phase starts right after the PUT phase, the blocks in the page cache;
//! - cold (`-cold`): between the phases, untimed, every file under the store directory is
//!   flushed (`fdatasync`) and dropped from the page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`),
//!   only those files, so the rest of a shared machine keeps its cache; what stays resident is
//!   measured with `mincore(2)` and, above [`COLD_RESIDENT_MAX`], the whole page cache is dropped
//!   (`sync`, `echo 3 > /proc/sys/vm/drop_caches`) when the bench runs as root, else the point
//!   fails. Each client then reads each of its keys once, so no GET is served from a page an
//!   earlier GET brought back.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use gpucache_service::units::human_bytes;

use super::load::{Between, LoadSpec, PointResult};
use super::ours::{self, StoreConfig, Transport};

/// The largest share of the store's bytes that may still be in the page cache when a cold GET
/// phase starts.
pub(crate) const COLD_RESIDENT_MAX: f64 = 0.02;
/// Free disk kept beyond a point's working set (the store's own files, the logs, other users).
const DISK_RESERVE_BYTES: u64 = 256 << 20;
/// Most files the cold step walks (the working set holds one per key, and keys are bounded by
/// the working set).
const FILES_MAX: usize = 1 << 22;

/// `store.durability` of a file row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FileDurability {
    None,
    PerBlock,
}

impl FileDurability {
    fn toml(self) -> &'static str {
        match self {
            FileDurability::None => "none",
            FileDurability::PerBlock => "per-block",
        }
    }
}

/// One file row: a durability, a layout (the block log, or a file per block), and whether the
/// GET phase starts with a cold page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileRow {
    pub durability: FileDurability,
    pub log: bool,
    pub cold: bool,
}

impl FileRow {
    /// Every file row, in report order.
    pub(crate) const ALL: [FileRow; 8] = {
        let mut rows = [FileRow { durability: FileDurability::None, log: false, cold: false }; 8];
        let mut i = 0;
        while i < 8 {
            rows[i] = FileRow {
                durability: if i & 2 == 0 {
                    FileDurability::None
                } else {
                    FileDurability::PerBlock
                },
                log: i & 4 != 0,
                cold: i & 1 != 0,
            };
            i += 1;
        }
        rows
    };

    pub(crate) fn peer_name(self) -> &'static str {
        match (self.log, self.durability, self.cold) {
            (false, FileDurability::None, false) => "ours-file-none",
            (false, FileDurability::None, true) => "ours-file-none-cold",
            (false, FileDurability::PerBlock, false) => "ours-file-durable",
            (false, FileDurability::PerBlock, true) => "ours-file-durable-cold",
            (true, FileDurability::None, false) => "ours-log-none",
            (true, FileDurability::None, true) => "ours-log-none-cold",
            (true, FileDurability::PerBlock, false) => "ours-log-durable",
            (true, FileDurability::PerBlock, true) => "ours-log-durable-cold",
        }
    }

    /// The `store.layout` of the row.
    fn layout(self) -> &'static str {
        if self.log { "log" } else { "files" }
    }

    pub(crate) fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.peer_name() == name)
    }

    pub(crate) fn note(self) -> String {
        let durability = match (self.log, self.durability) {
            (false, FileDurability::None) => {
                "a file per block, durability none (acknowledged after the rename, no flush)"
            }
            (false, FileDurability::PerBlock) => {
                "a file per block, durability per-block (block file and directory flushed before \
                 the acknowledgement)"
            }
            (true, FileDurability::None) => {
                "layout log, durability none (block appended to a log segment, no flush)"
            }
            (true, FileDurability::PerBlock) => {
                "layout log, durability per-block (block appended to a log segment, one shared \
                 flush of the log before the acknowledgement)"
            }
        };
        let cache = if self.cold {
            format!(
                "page cache cold: the store's files flushed and dropped (fadvise DONTNEED, at \
                 most {:.0} % left resident, checked with mincore) between the phases, and each \
                 key read once",
                COLD_RESIDENT_MAX * 100.0
            )
        } else {
            "page cache warm: GET right after PUT".to_owned()
        };
        format!(
            "gpucache serve, file store in a fresh directory per point, {durability}; {cache}; \
             one TcpStore per client thread, as ours-tcp"
        )
    }
}

/// Free bytes for an unprivileged writer on the file system holding `dir`.
pub(crate) fn free_bytes(dir: &Path) -> Result<u64, String> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: a NUL in the path", dir.display()))?;
    // SAFETY: statvfs(3) writes into the zeroed struct we own; the path is a valid C string.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &raw mut s) } != 0 {
        return Err(format!("statvfs {}: {}", dir.display(), std::io::Error::last_os_error()));
    }
    Ok(s.f_bavail.saturating_mul(s.f_frsize))
}

/// The bytes a point writes to disk at most: its whole working set, plus the reserve.
pub(crate) fn disk_needed(spec: &LoadSpec) -> u64 {
    spec.keys.saturating_mul(spec.value_bytes as u64).saturating_add(DISK_RESERVE_BYTES)
}

/// An error unless `dir` has room for `need` bytes.
pub(crate) fn ensure_room(dir: &Path, need: u64, what: &str) -> Result<(), String> {
    let free = free_bytes(dir)?;
    check_room(free, need, dir, what)
}

fn check_room(free: u64, need: u64, dir: &Path, what: &str) -> Result<(), String> {
    if free < need {
        return Err(format!(
            "not enough free disk for {what}: {} needed in {}, {} free (pass --dir on a larger \
             file system, or a smaller --working-set)",
            human_bytes(need),
            dir.display(),
            human_bytes(free)
        ));
    }
    Ok(())
}

/// The regular files under `root`, at most [`FILES_MAX`].
fn files_under(root: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries {
            let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
            let kind = entry.file_type().map_err(|e| format!("{}: {e}", dir.display()))?;
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if kind.is_file() {
                if out.len() >= FILES_MAX {
                    return Err(format!("more than {FILES_MAX} files under {}", root.display()));
                }
                out.push(entry.path());
            }
        }
    }
    Ok(out)
}

/// How much of the files under a directory the page cache holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Residency {
    pub files: u64,
    pub bytes: u64,
    pub resident_bytes: u64,
}

impl Residency {
    pub(crate) fn fraction(&self) -> f64 {
        crate::stats::share(self.resident_bytes, self.bytes)
    }
}

fn page_bytes() -> u64 {
    // SAFETY: sysconf(3) reads a constant of the system.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// The resident bytes of one open file of `len` bytes (`mincore(2)` over a read-only mapping,
/// which itself faults nothing in).
fn resident_of(file: &File, len: u64) -> std::io::Result<u64> {
    let Ok(map_len) = usize::try_from(len) else { return Ok(0) };
    if map_len == 0 {
        return Ok(0);
    }
    let page = page_bytes();
    // SAFETY: a fresh shared read-only mapping of a file we hold open; unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let pages = usize::try_from(len.div_ceil(page)).unwrap_or(0);
    let mut vec = vec![0u8; pages];
    // SAFETY: `addr` maps `map_len` bytes; `vec` has one byte per page of them.
    let rc = unsafe { libc::mincore(addr, map_len, vec.as_mut_ptr()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: the mapping made above, not used after this.
    unsafe {
        libc::munmap(addr, map_len);
    }
    if rc != 0 {
        return Err(err);
    }
    let resident = vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
    Ok((resident * page).min(len))
}

/// Measures how much of the files under `root` is resident.
pub(crate) fn residency(root: &Path) -> Result<Residency, String> {
    let mut r = Residency::default();
    for path in files_under(root)? {
        let file = File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let len = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
        r.files += 1;
        r.bytes += len;
        r.resident_bytes +=
            resident_of(&file, len).map_err(|e| format!("mincore {}: {e}", path.display()))?;
    }
    Ok(r)
}

/// Flushes every file under `root` and asks the kernel to drop its pages.
fn drop_files(root: &Path) -> Result<(), String> {
    for path in files_under(root)? {
        let file = File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Dirty pages are not dropped: write them back first.
        file.sync_data().map_err(|e| format!("fdatasync {}: {e}", path.display()))?;
        // SAFETY: posix_fadvise(2) on a descriptor we hold; no memory is passed.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(format!(
                "posix_fadvise {}: {}",
                path.display(),
                std::io::Error::from_raw_os_error(rc)
            ));
        }
    }
    Ok(())
}

/// Whether `dir` is on a tmpfs, whose pages are the files themselves and cannot be dropped.
pub(crate) fn is_tmpfs(dir: &Path) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: statfs(2) writes into the zeroed struct we own; the path is a valid C string.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statfs(c.as_ptr(), &raw mut s) };
    // `f_type` is 64 bits here but narrower on other targets.
    #[allow(clippy::useless_conversion)]
    let kind = i64::from(s.f_type);
    rc == 0 && kind == TMPFS_MAGIC
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no failure and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

/// The cold step: drops the store's files from the page cache and checks that at most
/// [`COLD_RESIDENT_MAX`] of their bytes stayed.
pub(crate) fn make_cold(root: &Path) -> Result<Residency, String> {
    if is_tmpfs(root) {
        return Err(format!(
            "{} is on a tmpfs, whose pages cannot be dropped: pass --dir on a disk",
            root.display()
        ));
    }
    drop_files(root)?;
    let mut r = residency(root)?;
    if r.fraction() > COLD_RESIDENT_MAX && is_root() {
        // SAFETY: sync(2) has no failure and touches no memory.
        unsafe { libc::sync() };
        std::fs::write("/proc/sys/vm/drop_caches", "3")
            .map_err(|e| format!("/proc/sys/vm/drop_caches: {e}"))?;
        r = residency(root)?;
    }
    if r.fraction() > COLD_RESIDENT_MAX {
        return Err(format!(
            "{:.1} % of the store's {} stayed in the page cache after the drop (at most {:.0} %)",
            r.fraction() * 100.0,
            human_bytes(r.bytes),
            COLD_RESIDENT_MAX * 100.0
        ));
    }
    Ok(r)
}

/// Measures one point of a file row on a service and store directory of its own, both removed
/// afterwards.
pub(crate) fn measure(
    row: FileRow,
    scratch: &Path,
    spec: LoadSpec,
    working_set_bytes: u64,
) -> PointResult {
    let size = spec.value_bytes as u64;
    let fail = |e: String| PointResult::failed(size, spec.clients, e);
    if let Err(e) = ensure_room(scratch, disk_needed(&spec), row.peer_name()) {
        return fail(e);
    }
    let tag = format!("{}-{}-{}", row.peer_name(), spec.value_bytes, spec.clients);
    let root = scratch.join(format!("store-{tag}"));
    let store =
        StoreConfig::File { root: &root, durability: row.durability.toml(), layout: row.layout() };
    let result = match ours::start_serve_store(scratch, &tag, size, working_set_bytes, None, &store)
    {
        Err(e) => fail(e),
        Ok(service) => {
            let hook = || {
                let r = make_cold(&root)?;
                eprintln!(
                    "bench: {tag}: page cache dropped for {} files ({}), {:.2} % left resident",
                    r.files,
                    human_bytes(r.bytes),
                    r.fraction() * 100.0
                );
                Ok(())
            };
            let between = row.cold.then_some(Between { hook: &hook, get_once: true });
            ours::run_on(Transport::Tcp, &service, spec, between)
        }
    };
    // The service is stopped by now (dropped above): its directory can go.
    if let Err(e) = std::fs::remove_dir_all(&root)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("bench: cannot remove {}: {e}", root.display());
    }
    result
}

/// What the `ours-default` row's note says.
pub(crate) const DEFAULT_NOTE: &str = "gpucache serve with no configuration, as the README's \
    first command runs it (the embedded default: memory over a FileStore under ./gpucache-data \
    in a fresh working directory per point, durability per-block, write-through), on its \
    default ports; one TcpStore per client thread as tenant default, as ours-tcp";

/// Measures one point of `ours-default`: `gpucache serve` on its embedded default in a working
/// directory of its own, removed afterwards with the store in it.
pub(crate) fn measure_default(scratch: &Path, spec: LoadSpec) -> PointResult {
    let size = spec.value_bytes as u64;
    let fail = |e: String| PointResult::failed(size, spec.clients, e);
    if let Err(e) = ensure_room(scratch, disk_needed(&spec), "ours-default") {
        return fail(e);
    }
    let tag = format!("ours-default-{}-{}", spec.value_bytes, spec.clients);
    let home = scratch.join(&tag);
    let result = match ours::start_default(&home, &tag, scratch) {
        Err(e) => fail(e),
        Ok(service) => ours::run_on(Transport::Tcp, &service, spec, None),
    };
    if let Err(e) = std::fs::remove_dir_all(&home)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("bench: cannot remove {}: {e}", home.display());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn row_names_round_trip() {
        for r in FileRow::ALL {
            assert_eq!(FileRow::parse(r.peer_name()), Some(r));
        }
        assert_eq!(FileRow::parse("ours-file"), None);
        assert!(FileRow::ALL[1].note().contains("cold"));
        assert!(FileRow::ALL[2].note().contains("per-block"));
        assert_eq!(FileRow::ALL[6].peer_name(), "ours-log-durable");
    }

    #[test]
    fn room_is_checked_against_the_working_set() {
        let spec = LoadSpec {
            value_bytes: 1 << 20,
            clients: 1,
            keys: 512,
            phase: std::time::Duration::from_secs(1),
        };
        assert_eq!(disk_needed(&spec), (512 << 20) + DISK_RESERVE_BYTES);
        let dir = Path::new("/scratch");
        assert!(check_room(1 << 40, disk_needed(&spec), dir, "x").is_ok());
        let e = check_room(100 << 20, disk_needed(&spec), dir, "ours-file-none").expect_err("full");
        assert!(
            e.contains("ours-file-none") && e.contains("/scratch") && e.contains("--dir"),
            "{e}"
        );
        let here = free_bytes(Path::new(".")).expect("statvfs");
        assert!(here > 0);
    }

    /// Every tmpfs mount of /proc/mounts is seen as one, and the root file system as what
    /// /proc/mounts says it is.
    #[test]
    fn tmpfs_mounts_are_recognised() {
        let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
        for line in mounts.lines() {
            let mut f = line.split_whitespace();
            let (Some(_), Some(at), Some(kind)) = (f.next(), f.next(), f.next()) else { continue };
            // Paths with spaces are escaped in /proc/mounts; those are left out.
            if at.contains('\\') || !Path::new(at).is_dir() {
                continue;
            }
            if kind == "tmpfs" || at == "/" {
                assert_eq!(is_tmpfs(Path::new(at)), kind == "tmpfs", "{line}");
            }
        }
    }

    /// A file just written is resident; after the cold step it is not (on a tmpfs, the step
    /// refuses instead).
    #[test]
    fn the_cold_step_empties_the_page_cache_of_the_files() {
        let dir = tempfile::tempdir().expect("dir");
        if is_tmpfs(dir.path()) {
            let e = make_cold(dir.path()).expect_err("a tmpfs cannot be made cold");
            assert!(e.contains("tmpfs") && e.contains("--dir"), "{e}");
            return;
        }
        let sub = dir.path().join("blocks").join("ab");
        std::fs::create_dir_all(&sub).expect("mkdir");
        for i in 0..3u8 {
            let mut f = File::create(sub.join(format!("{i}.blk"))).expect("create");
            f.write_all(&vec![i + 1; 1 << 20]).expect("write");
        }
        let before = residency(dir.path()).expect("residency");
        assert_eq!(before.files, 3);
        assert_eq!(before.bytes, 3 << 20);
        assert!(before.fraction() > 0.5, "{before:?}");
        let after = make_cold(dir.path()).expect("cold");
        assert_eq!(after.files, 3);
        assert!(after.fraction() <= COLD_RESIDENT_MAX, "{after:?}");
    }
}
