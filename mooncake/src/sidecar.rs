//! The Python sidecar process and the socket to it.
//!
//! Owns the child process (started with the venv's Python, killed by PID on drop), its private
//! folder (the socket and the log) and every wait on it, each with a deadline. It relays raw
//! answers; it does not interpret result codes ([`super::results`] does).

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::num::NonZeroUsize;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::MooncakeError;
use super::results::Raw;
use super::wire::{self, Op};

/// The sidecar's source, run with `python -c`-free `python FILE` from the private folder.
const SIDECAR_PY: &str = include_str!("sidecar.py");
/// How often startup checks for the socket.
const STARTUP_POLL: Duration = Duration::from_millis(20);
/// Bytes of the sidecar log quoted in a startup error.
const LOG_TAIL_BYTES: usize = 2048;

/// A validated Mooncake venv: its Python, with `mooncake.store` installed, and the three
/// binaries of the wheel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeVenv {
    root: PathBuf,
}

impl MooncakeVenv {
    /// The three programs the wheel installs into `bin/`.
    pub const BINARIES: [&'static str; 3] =
        ["mooncake_master", "mooncake_http_metadata_server", "mooncake_client"];

    /// Checks that `root` holds a Python, the `mooncake` package and the three binaries.
    pub fn at(root: &Path) -> Result<Self, MooncakeError> {
        let unavailable = |reason: String| MooncakeError::Unavailable { reason };
        let python = root.join("bin").join("python");
        if !python.is_file() {
            return Err(unavailable(format!(
                "{} not found (scripts/setup.sh mooncake makes the venv)",
                python.display()
            )));
        }
        for b in Self::BINARIES {
            let path = root.join("bin").join(b);
            if !path.is_file() {
                return Err(unavailable(format!(
                    "{} not found: mooncake-transfer-engine-non-cuda is not installed in {}",
                    path.display(),
                    root.display()
                )));
            }
        }
        if !has_package(root) {
            return Err(unavailable(format!(
                "no mooncake package under {}/lib/python*/site-packages",
                root.display()
            )));
        }
        Ok(Self { root: root.to_owned() })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn python(&self) -> PathBuf {
        self.root.join("bin").join("python")
    }

    /// The path of one of [`Self::BINARIES`].
    pub fn binary(&self, name: &str) -> PathBuf {
        self.root.join("bin").join(name)
    }
}

fn has_package(root: &Path) -> bool {
    let Ok(entries) = fs::read_dir(root.join("lib")) else { return false };
    entries.flatten().any(|e| {
        e.file_name().to_string_lossy().starts_with("python")
            && e.path().join("site-packages").join("mooncake").is_dir()
    })
}

/// Where the sidecar connects and how much it may hold.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    pub venv: MooncakeVenv,
    /// `http://HOST:PORT/metadata` of a running `mooncake_http_metadata_server`.
    pub metadata_url: String,
    /// `HOST:PORT` of a running `mooncake_master`.
    pub master: String,
    /// The sidecar's registered buffer: the largest object (payload plus header) it moves.
    pub buffer_bytes: NonZeroUsize,
    /// Memory the sidecar itself contributes to the store (0: the data lives elsewhere).
    pub segment_bytes: u64,
    /// Deadline for setup, registration and the first connection.
    pub startup_ms: u64,
    /// Deadline for one request and its reply.
    pub call_ms: u64,
}

/// Why one exchange with the sidecar failed. After any of these the connection is out of
/// step and the sidecar is not used again.
#[derive(Debug)]
pub(crate) enum Transport {
    Io(io::Error),
    Deadline { call_ms: u64 },
    Reply(wire::ReplyError),
    TooLarge { body: usize, max: usize },
}

impl Transport {
    /// The system's error kind, for a failure of the socket itself.
    pub(crate) fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            Self::Io(e) => Some(e.kind()),
            _ => None,
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "sidecar socket: {e}"),
            Self::Deadline { call_ms } => write!(f, "no sidecar reply within {call_ms} ms"),
            Self::Reply(e) => write!(f, "malformed sidecar reply: {e:?}"),
            Self::TooLarge { body, max } => {
                write!(f, "sidecar reply of {body} bytes exceeds {max}")
            }
        }
    }
}

/// A running sidecar with its one connection.
pub(crate) struct Sidecar {
    child: Child,
    conn: UnixStream,
    dir: PathBuf,
    call_ms: u64,
    reply_bytes_max: usize,
}

static SIDECARS: AtomicU64 = AtomicU64::new(0);

impl Sidecar {
    pub(crate) fn start(config: &SidecarConfig) -> Result<Self, MooncakeError> {
        let n = SIDECARS.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("gpucache-mooncake-{}-{n}", std::process::id()));
        let startup = |detail: String| MooncakeError::Startup { detail };
        fs::create_dir_all(&dir).map_err(|e| startup(format!("{}: {e}", dir.display())))?;
        let started = Self::spawn(config, &dir);
        if started.is_err() {
            let _ = fs::remove_dir_all(&dir);
        }
        started
    }

    fn spawn(config: &SidecarConfig, dir: &Path) -> Result<Self, MooncakeError> {
        let startup = |detail: String| MooncakeError::Startup { detail };
        let script = dir.join("sidecar.py");
        let socket = dir.join("s.sock");
        let log = dir.join("sidecar.log");
        fs::write(&script, SIDECAR_PY)
            .map_err(|e| startup(format!("{}: {e}", script.display())))?;
        let out = File::create(&log).map_err(|e| startup(format!("{}: {e}", log.display())))?;
        let mut command = Command::new(config.venv.python());
        command
            .arg(&script)
            .arg("--socket")
            .arg(&socket)
            .arg("--metadata-url")
            .arg(&config.metadata_url)
            .arg("--master")
            .arg(&config.master)
            .arg("--buffer-bytes")
            .arg(config.buffer_bytes.get().to_string())
            .arg("--segment-bytes")
            .arg(config.segment_bytes.to_string())
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(|e| startup(e.to_string()))?)
            .stderr(out);
        let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        // SAFETY: between fork and exec this runs only prctl(2), getppid(2) and _exit(2), which
        // are async-signal-safe, and touches no memory shared with the parent.
        unsafe {
            command.pre_exec(move || {
                // The sidecar must not outlive us even if drop never runs.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .map_err(|e| startup(format!("cannot run {}: {e}", config.venv.python().display())))?;
        let deadline = Instant::now() + Duration::from_millis(config.startup_ms);
        let conn = loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(startup(format!("sidecar exited with {status}: {}", log_tail(&log))));
            }
            if let Ok(conn) = UnixStream::connect(&socket) {
                break conn;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(startup(format!(
                    "sidecar not ready within {} ms: {}",
                    config.startup_ms,
                    log_tail(&log)
                )));
            }
            std::thread::sleep(STARTUP_POLL);
        };
        Ok(Self {
            child,
            conn,
            dir: dir.to_owned(),
            call_ms: config.call_ms,
            reply_bytes_max: wire::REPLY_HEAD_BYTES + config.buffer_bytes.get(),
        })
    }

    /// The sidecar's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one request and waits, until the call deadline, for its reply.
    pub(crate) fn call(
        &mut self,
        op: Op,
        key: &str,
        argument: u64,
        payload: &[&[u8]],
    ) -> Result<(Raw, Vec<u8>), Transport> {
        let deadline = Instant::now() + Duration::from_millis(self.call_ms);
        let extra: usize = payload.iter().map(|p| p.len()).sum();
        let mut frame = wire::request(op, key, argument, &[]);
        // The prefix counts the payload pieces that follow the head.
        let body = frame.len() - wire::PREFIX_BYTES + extra;
        frame[..wire::PREFIX_BYTES]
            .copy_from_slice(&u32::try_from(body).unwrap_or(u32::MAX).to_le_bytes());
        self.send(&frame, deadline)?;
        for piece in payload {
            self.send(piece, deadline)?;
        }
        let mut prefix = [0_u8; wire::PREFIX_BYTES];
        self.recv(&mut prefix, deadline)?;
        let len = u32::from_le_bytes(prefix) as usize;
        if len > self.reply_bytes_max {
            return Err(Transport::TooLarge { body: len, max: self.reply_bytes_max });
        }
        let mut body = vec![0_u8; len];
        self.recv(&mut body, deadline)?;
        let (raw, data) = wire::reply(&body, op, argument).map_err(Transport::Reply)?;
        let data = data.to_vec();
        Ok((raw, data))
    }

    fn remaining(&self, deadline: Instant) -> Result<Duration, Transport> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() { Err(Transport::Deadline { call_ms: self.call_ms }) } else { Ok(left) }
    }

    fn send(&mut self, mut bytes: &[u8], deadline: Instant) -> Result<(), Transport> {
        while !bytes.is_empty() {
            let left = self.remaining(deadline)?;
            self.conn.set_write_timeout(Some(left)).map_err(Transport::Io)?;
            match self.conn.write(bytes) {
                Ok(0) => return Err(Transport::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => {
                    return Err(Transport::Deadline { call_ms: self.call_ms });
                }
                Err(e) => return Err(Transport::Io(e)),
            }
        }
        Ok(())
    }

    fn recv(&mut self, mut buf: &mut [u8], deadline: Instant) -> Result<(), Transport> {
        while !buf.is_empty() {
            let left = self.remaining(deadline)?;
            self.conn.set_read_timeout(Some(left)).map_err(Transport::Io)?;
            match self.conn.read(buf) {
                Ok(0) => return Err(Transport::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => {
                    return Err(Transport::Deadline { call_ms: self.call_ms });
                }
                Err(e) => return Err(Transport::Io(e)),
            }
        }
        Ok(())
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

fn log_tail(path: &Path) -> String {
    let text = fs::read(path).unwrap_or_default();
    let from = text.len().saturating_sub(LOG_TAIL_BYTES);
    String::from_utf8_lossy(&text[from..]).trim().to_owned()
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        // Killed by its own PID; a clean exit on EOF is not waited for, so that a wedged SDK
        // call cannot hold up the drop.
        let _ = self.conn.shutdown(std::net::Shutdown::Both);
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
