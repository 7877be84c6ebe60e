//! Group commit: concurrent commits share one flush: a `syncfs` of the store's filesystem
//! (`Durability::GroupCommit`), or an `fdatasync` of the block log's segments (`Layout::Log`).
//!
//! The first committer to arrive while no flush is running leads: it flushes, then wakes every
//! committer that arrived before its flush began. A committer that arrived during a flush waits
//! for the next one. Every wait has a deadline; a commit whose flush did not finish in time is
//! abandoned (never acknowledged).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How many finished flushes are remembered for late waiters.
const FLUSH_RESULTS_MAX: usize = 256;

#[derive(Debug, Default)]
struct State {
    /// Commits registered so far (each gets the next number).
    requested: u64,
    /// Every commit numbered up to this one is covered by a finished flush.
    completed: u64,
    leading: bool,
    /// Recent flushes: (first covered, last covered, error).
    results: VecDeque<(u64, u64, Option<String>)>,
}

/// What a group's leader runs to make every commit registered so far durable.
pub(crate) type Flush = Box<dyn Fn() -> io::Result<()> + Send + Sync>;

pub(crate) struct GroupSync {
    flush: Flush,
    deadline: Duration,
    state: Mutex<State>,
    flushed: Condvar,
}

impl std::fmt::Debug for GroupSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupSync").field("deadline", &self.deadline).finish_non_exhaustive()
    }
}

/// Flushes directory `path`, so that the names created or removed in it are durable.
pub(crate) fn sync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}

/// Flushes the whole file system that holds `dir` (its dirty data and metadata).
pub(crate) fn syncfs(dir: &File) -> io::Result<()> {
    // SAFETY: syncfs takes an fd we own and touches no memory of ours.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl GroupSync {
    /// Groups that share a `syncfs` of the file system holding `root`.
    pub(crate) fn filesystem(root: &Path, deadline: Duration) -> io::Result<Self> {
        let dir = File::open(root)?;
        Ok(Self::new(Box::new(move || syncfs(&dir)), deadline))
    }

    /// Groups that share `flush`.
    pub(crate) fn new(flush: Flush, deadline: Duration) -> Self {
        Self { flush, deadline, state: Mutex::default(), flushed: Condvar::new() }
    }

    /// Returns once everything this thread wrote before the call is durable.
    pub(crate) fn barrier(&self) -> io::Result<()> {
        let poisoned = || io::Error::other("group commit state poisoned");
        let until = Instant::now() + self.deadline;
        let mut st = self.state.lock().map_err(|_| poisoned())?;
        st.requested += 1;
        let mine = st.requested;
        loop {
            if st.completed >= mine {
                return match st.results.iter().find(|(from, to, _)| (*from..=*to).contains(&mine)) {
                    Some((_, _, None)) => Ok(()),
                    Some((_, _, Some(e))) => {
                        Err(io::Error::other(format!("group flush failed: {e}")))
                    }
                    None => Err(io::Error::other("group flush result forgotten; commit abandoned")),
                };
            }
            if !st.leading {
                st.leading = true;
                let (from, to) = (st.completed + 1, st.requested);
                drop(st);
                let result = (self.flush)();
                st = self.state.lock().map_err(|_| poisoned())?;
                st.leading = false;
                st.completed = to;
                st.results.push_back((from, to, result.err().map(|e| e.to_string())));
                while st.results.len() > FLUSH_RESULTS_MAX {
                    st.results.pop_front();
                }
                self.flushed.notify_all();
                continue;
            }
            let now = Instant::now();
            if now >= until {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "group flush did not finish in time",
                ));
            }
            st = self.flushed.wait_timeout(st, until - now).map_err(|_| poisoned())?.0;
        }
    }
}
