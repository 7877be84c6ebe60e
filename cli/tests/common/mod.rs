//! What the cli's integration tests share: running the `gpucache` and `gpucache-bench` binaries,
//! and a `gpucache serve`
//! child that is stopped by PID (SIGTERM, checked) or, when a test fails first, killed on drop
//! so no server outlives its test.
// Each test binary uses part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// How long a stopped server may take to exit.
pub(crate) const STOP_PATIENCE: Duration = Duration::from_secs(20);
/// How long a starting server may take to print its start line.
pub(crate) const START_PATIENCE: Duration = Duration::from_secs(60);

/// How long one `gpucache` or `gpucache-bench` command a test runs may take before the test
/// fails.
pub(crate) const COMMAND_PATIENCE: Duration = Duration::from_secs(120);

/// Runs `gpucache ARGS` (no input); returns its exit code (-1 when killed by a signal), stdout
/// and stderr.
pub(crate) fn gpucache(args: &[&str]) -> (i32, String, String) {
    codes(&gpucache_with_input(args, None))
}

/// Runs `gpucache-bench ARGS` (no input), as [`gpucache`] runs `gpucache`.
pub(crate) fn gpucache_bench(args: &[&str]) -> (i32, String, String) {
    codes(&run_with_input(env!("CARGO_BIN_EXE_gpucache-bench"), args, None))
}

fn codes(out: &Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `gpucache ARGS` with `stdin` (or nothing) on its standard input.
pub(crate) fn gpucache_with_input(args: &[&str], stdin: Option<&[u8]>) -> Output {
    run_with_input(env!("CARGO_BIN_EXE_gpucache"), args, stdin)
}

/// Runs the binary `exe` with ARGS and `stdin` (or nothing) on its standard input, within
/// [`COMMAND_PATIENCE`].
fn run_with_input(exe: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {exe}: {e}"));
    if let Some(input) = stdin {
        // A command that refuses before reading its input closes the pipe: not this helper's
        // failure (the caller checks the exit status and messages).
        match child.stdin.take().expect("stdin").write_all(input) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("write stdin: {e}"),
            _ => {}
        }
    }
    drop(child.stdin.take());
    output_within(child, COMMAND_PATIENCE)
}

/// One HTTP/1.1 GET on a fresh connection (the metrics listener); the whole reply.
pub(crate) fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect metrics");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

/// The value of `name` (`name` includes its `=`) among a line's space-separated fields.
pub(crate) fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name))
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

use gpucache_dataplane::testing::process::{kill_process, output_within};

/// Most log lines a starting server may write before its start line.
const START_LINES_MAX: usize = 200;

/// Reads a starting server's log until its start line (the one with `listening`), within
/// [`START_PATIENCE`] and [`START_LINES_MAX`] lines: answers the start line (None when the
/// server ended, or the limits ran out, first) and every line read so far. A thread keeps
/// draining the log afterwards so the server never blocks writing to it.
pub(crate) fn start_line(stderr: impl Read + Send + 'static) -> (Option<String>, Vec<String>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(START_LINES_MAX);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            // The receiver stops listening after the start line: the rest is drained.
            let _ = tx.try_send(line);
        }
    });
    let deadline = std::time::Instant::now() + START_PATIENCE;
    let mut log = Vec::new();
    while log.len() < START_LINES_MAX {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("listening native=") => {
                log.push(line.clone());
                return (Some(line), log);
            }
            Ok(line) => log.push(line),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                log.push(format!("(no start line within {START_PATIENCE:?})"));
                break;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    (None, log)
}

/// A running `gpucache serve` and the start line it printed.
#[derive(Debug)]
pub(crate) struct Serve {
    child: Child,
    /// Its start line: where it listens, its epoch, its store and I/O engine, its limits.
    pub(crate) line: String,
    done: bool,
}

impl Serve {
    /// Starts `gpucache serve --config CONFIG` and waits for its start line; fails the test
    /// when the first line is not one (it then says why the server could not start).
    pub(crate) fn start(config: &Path) -> Self {
        Self::start_in(Path::new("."), config)
    }

    /// [`Serve::start`] with `cwd` as the server's working directory.
    pub(crate) fn start_in(cwd: &Path, config: &Path) -> Self {
        Self::start_with(cwd, config, &[])
    }

    /// [`Serve::start_in`] with `env` added to the server's environment.
    pub(crate) fn start_with(cwd: &Path, config: &Path, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpucache"));
        command.args(["serve", "--config"]).arg(config).current_dir(cwd).envs(env.iter().copied());
        Self::spawn(command)
    }

    /// [`Serve::start`] as the user and group `id` (the caller runs as root).
    pub(crate) fn start_as(config: &Path, id: u32) -> Self {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpucache"));
        command.args(["serve", "--config"]).arg(config).uid(id).gid(id);
        Self::spawn(command)
    }

    fn spawn(mut command: Command) -> Self {
        let mut child = command.stderr(Stdio::piped()).spawn().expect("spawn gpucache serve");
        let stderr = child.stderr.take().expect("stderr");
        let (line, log) = start_line(stderr);
        let mut serve = Self { child, line: String::new(), done: false };
        serve.line = match line {
            Some(line) => line,
            None => panic!("serve did not start:\n{}", log.join("\n")),
        };
        serve
    }

    pub(crate) fn field(&self, name: &str) -> &str {
        field(&self.line, name)
    }

    pub(crate) fn native(&self) -> SocketAddr {
        self.field("native=").parse().expect("native addr")
    }

    pub(crate) fn metrics(&self) -> SocketAddr {
        self.field("metrics=").parse().expect("metrics addr")
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.field("epoch=").parse().expect("epoch")
    }

    pub(crate) fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    /// Marks the process as gone (a test killed and reaped it itself), so drop leaves it be.
    pub(crate) fn forget(mut self) {
        self.done = true;
    }

    /// SIGKILL, reaped: the server ran no more code after this returns.
    pub(crate) fn kill_9(self) {
        kill_process(self.pid());
        self.forget();
    }

    /// SIGTERM, then waits for a clean exit within [`STOP_PATIENCE`]: a thread blocks in
    /// waitpid and reports the exit status.
    pub(crate) fn stop(mut self) {
        let pid = self.pid();
        let (exited, status) = std::sync::mpsc::sync_channel(1);
        std::thread::spawn(move || {
            let mut status = 0;
            // SAFETY: waits for our own child; the status pointer is a live local.
            let reaped = unsafe { libc::waitpid(pid, &mut status, 0) };
            let _ = exited.send((reaped, status));
        });
        // SAFETY: sends SIGTERM to our own child process.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let (reaped, status) = status
            .recv_timeout(STOP_PATIENCE)
            .unwrap_or_else(|_| panic!("serve did not stop within {STOP_PATIENCE:?} of SIGTERM"));
        self.done = true;
        assert_eq!(reaped, pid, "waitpid");
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "serve exited with wait status {status:#x}"
        );
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if !self.done {
            // A test that failed before stopping its server: take the server down with it.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
