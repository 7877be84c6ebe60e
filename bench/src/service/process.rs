//! Child processes of the benchmark: every peer is started as a child, on 127.0.0.1 and a free
//! port, and stopped by its PID (or its process group) when its guard drops, on every path.

use std::fs::File;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a stopped child gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How often readiness and exit are polled.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// A running child that is stopped (SIGTERM, then SIGKILL after [`STOP_GRACE`]) and reaped when
/// dropped. With `group`, the child leads a new process group and the signals go to the whole
/// group, so what it started goes too. If the benchmark itself dies without unwinding (SIGKILL,
/// an unhandled SIGINT), the kernel sends the child SIGTERM (`PR_SET_PDEATHSIG`), so no peer
/// outlives the run.
#[derive(Debug)]
pub(crate) struct ChildGuard {
    name: String,
    child: Child,
    group: bool,
    reaped: Option<ExitStatus>,
}

impl ChildGuard {
    /// Starts `command` with its standard output and error appended to `log`.
    pub(crate) fn spawn(
        name: &str,
        mut command: Command,
        log: &Path,
        group: bool,
    ) -> Result<Self, String> {
        let out = File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| format!("{}: {e}", log.display()))?;
        command.stdin(Stdio::null()).stdout(out).stderr(err);
        if group {
            command.process_group(0);
        }
        let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        // SAFETY: what runs between fork and exec is only prctl(2), getppid(2) and _exit(2),
        // which are async-signal-safe, and touches no memory shared with the parent.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before the prctl: then nobody will stop this child.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Self { name: name.to_owned(), child, group, reaped: None })
    }

    #[cfg(test)]
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status when the child has ended.
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        if self.reaped.is_none() {
            self.reaped = self.child.try_wait().ok().flatten();
        }
        self.reaped
    }

    /// Waits for the child to end by itself until `deadline`; `None` when it is still running.
    pub(crate) fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Polls a TCP connect to `addr` until it succeeds, the child exits or `deadline` passes.
    pub(crate) fn wait_listening(
        &mut self,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(), String> {
        loop {
            if let Some(status) = self.exited() {
                return Err(format!("{} exited ({status}) before listening on {addr}", self.name));
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("{} did not listen on {addr} in time", self.name));
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    fn signal(&self, signal: libc::c_int) {
        let Ok(pid) = libc::pid_t::try_from(self.child.id()) else { return };
        let target = if self.group { -pid } else { pid };
        // SAFETY: kill(2) with a PID (or group) of our own child; it touches no memory of ours.
        unsafe {
            libc::kill(target, signal);
        }
    }

    /// Stops the child (and its group) and reaps it.
    pub(crate) fn stop(&mut self) {
        if self.exited().is_none() {
            self.signal(libc::SIGTERM);
            if self.wait_until(Instant::now() + STOP_GRACE).is_none() {
                self.signal(libc::SIGKILL);
                self.reaped = self.child.wait().ok();
            }
        }
        // The leader may be gone while the rest of its group is not.
        if self.group {
            self.signal(libc::SIGKILL);
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port on 127.0.0.1 that was free a moment ago (the OS picks it; the listener is closed
/// before returning, so another process could take it in between: a start that fails on it
/// is reported, not retried).
pub(crate) fn free_port() -> Result<u16, String> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port on 127.0.0.1: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| format!("free port: {e}"))
}

pub(crate) fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Whether `program` runs (`program --version` or the given probe exits at all).
pub(crate) fn found_on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// The first line of `program args` (stdout, then stderr), for reporting versions.
pub(crate) fn version_line(program: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).stdin(Stdio::null()).output().ok()?;
    let text = if out.stdout.is_empty() { out.stderr } else { out.stdout };
    String::from_utf8_lossy(&text).lines().next().map(|l| l.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_guard_stops_its_child() {
        let dir = tempfile::tempdir().expect("dir");
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        let guard = ChildGuard::spawn("sleep", cmd, &dir.path().join("log"), true).expect("spawn");
        let pid = guard.pid();
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        drop(guard);
        // Reaped: no zombie left under our PID.
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
    }

    #[test]
    fn waiting_for_a_port_notices_an_exited_child() {
        let dir = tempfile::tempdir().expect("dir");
        let cmd = Command::new("true");
        let mut guard =
            ChildGuard::spawn("true", cmd, &dir.path().join("log"), false).expect("spawn");
        let port = free_port().expect("port");
        let e = guard
            .wait_listening(loopback(port), Instant::now() + Duration::from_secs(10))
            .expect_err("nothing listens");
        assert!(e.contains("exited"), "{e}");
    }
}
