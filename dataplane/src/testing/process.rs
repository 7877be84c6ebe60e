//! Child processes in tests: stopping and killing them for certain (confirmed by waitpid), and
//! waiting for one with a deadline instead of forever.

use std::process::{Child, Output};
use std::sync::mpsc;
use std::time::Duration;

/// SIGSTOP, confirmed by waitpid(WUNTRACED): the process runs no more code after this.
pub fn stop_process(pid: i32) {
    // SAFETY: plain syscalls on the caller's own child; the status pointer is a live local.
    let stopped = unsafe {
        let mut status = 0;
        libc::kill(pid, libc::SIGSTOP) == 0
            && libc::waitpid(pid, &mut status, libc::WUNTRACED) == pid
            && libc::WIFSTOPPED(status)
    };
    assert!(stopped, "process {pid} did not stop");
}

/// SIGKILL, reaped by waitpid: the process is gone when this returns.
pub fn kill_process(pid: i32) {
    // SAFETY: as in `stop_process`.
    let killed = unsafe {
        let mut status = 0;
        libc::kill(pid, libc::SIGKILL) == 0
            && libc::waitpid(pid, &mut status, 0) == pid
            && libc::WIFSIGNALED(status)
    };
    assert!(killed, "process {pid} did not die");
}

/// Waits for `child` to exit and collects its piped output, for at most `within`; past that
/// the child is killed and the test fails. (A thread does the blocking wait.)
pub fn output_within(child: Child, within: Duration) -> Output {
    let pid = i32::try_from(child.id()).expect("pid");
    let (done, output) = mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match output.recv_timeout(within) {
        Ok(out) => out.expect("wait for the child"),
        Err(_) => {
            // SAFETY: signals the caller's own child, still unreaped (the thread is waiting).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("child {pid} did not finish within {within:?}; killed");
        }
    }
}

/// Longest one `promtool` run may take.
const PROMTOOL_PATIENCE: Duration = Duration::from_secs(60);

/// Runs `promtool ARGS` in `cwd` with `stdin` on its standard input: whether it exited 0, and
/// everything it printed (stdout, then stderr). `None` when promtool (Debian's `prometheus`
/// package) is not installed; under `GPUCACHE_REQUIRE_PROMETHEUS=1` that fails the test instead.
pub fn promtool(args: &[&str], cwd: &std::path::Path, stdin: &str) -> Option<(bool, String)> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let spawned = Command::new("promtool")
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            assert!(
                std::env::var("GPUCACHE_REQUIRE_PROMETHEUS").as_deref() != Ok("1"),
                "promtool is required (GPUCACHE_REQUIRE_PROMETHEUS=1) but not installed"
            );
            eprintln!("SKIPPED: promtool is not installed (Debian package prometheus)");
            return None;
        }
        Err(e) => panic!("run promtool: {e}"),
    };
    // promtool may exit before reading stdin (`check rules`): a closed pipe is its answer.
    match child.stdin.take().expect("stdin").write_all(stdin.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => panic!("feed promtool: {e}"),
        _ => {}
    }
    let out = output_within(child, PROMTOOL_PATIENCE);
    let printed =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Some((out.status.success(), printed))
}
