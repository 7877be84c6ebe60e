//! Reactors: threads pinned to one core each, polling their queues run-to-completion.
//!
//! A reactor never blocks inside its loop: it takes one submission per queue per pass, runs it
//! to its end, posts the completion, and when a pass found nothing to do it parks with a bounded
//! deadline, so that new work (submitters unpark it) and shutdown are both noticed.
//!
//! Pinning is reported as it really happened: after `sched_setaffinity` the reactor reads its
//! mask back and reports [`Pinning::Pinned`] only when the mask is exactly its core.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use gpucache_dataplane::registry::Epoch;

use crate::queue::{Done, Fault, Op, Posted, Queue, QueueState};
use crate::slab::RawSlab;

pub use crate::ids::ReactorId;

/// What to do when a core cannot be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinPolicy {
    /// Refuse to start ([`crate::DpuError::PinRefused`]).
    Required,
    /// Run unpinned and report [`Pinning::Refused`].
    BestEffort,
}

/// What pinning a reactor really achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pinning {
    /// The thread's affinity mask is exactly `core` (read back after setting it).
    Pinned { core: usize },
    /// Pinning was asked for and refused; the reactor runs wherever the scheduler puts it.
    Refused { core: usize, detail: String },
    /// No core was configured.
    NotRequested,
}

/// One reactor as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReactorReport {
    pub id: ReactorId,
    pub pinning: Pinning,
    pub queues: Vec<crate::queue::QueueId>,
}

/// Pins the calling thread to `core` and reads the mask back.
pub(crate) fn pin_current(core: usize) -> Pinning {
    let refused = |detail: String| Pinning::Refused { core, detail };
    if core >= libc::CPU_SETSIZE as usize {
        return refused(format!("core {core} is beyond CPU_SETSIZE"));
    }
    // SAFETY: an all-zero cpu_set_t is the empty set, a valid value.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: core < CPU_SETSIZE, checked above; `set` is a valid, writable cpu_set_t.
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return refused(format!("sched_setaffinity: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: as above, the empty set.
    let mut got: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `got` is writable and of the size passed.
    let rc = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut got) };
    if rc != 0 {
        return refused(format!("sched_getaffinity: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `got` is a valid cpu_set_t filled by the kernel.
    let count = unsafe { libc::CPU_COUNT(&got) };
    // SAFETY: core < CPU_SETSIZE; `got` is a valid cpu_set_t.
    if count == 1 && unsafe { libc::CPU_ISSET(core, &got) } {
        Pinning::Pinned { core }
    } else {
        refused(format!("the mask read back holds {count} cores"))
    }
}

/// Cores the calling thread may run on now (its affinity mask), ascending.
pub fn allowed_cores() -> Vec<usize> {
    // SAFETY: the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is writable and of the size passed.
    if unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: c < CPU_SETSIZE; `set` is a valid cpu_set_t.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// What a reactor thread shares with the agent.
pub(crate) struct ReactorShared {
    pub(crate) queues: Vec<Arc<Queue>>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) slab_epoch: Arc<AtomicU64>,
    pub(crate) slab: RawSlab,
    pub(crate) idle_park: Duration,
}

/// Posts a completion, unless its submitter is gone (abandoned after a deadline: a late
/// completion) or it already has one (a duplicate). Returns what the caller must discard.
pub(crate) fn post(st: &mut QueueState, seq: u64, result: Posted) -> Option<Posted> {
    if st.outstanding.contains_key(&seq) && !st.completed.contains_key(&seq) {
        st.completed.insert(seq, result);
        None
    } else {
        Some(result)
    }
}

fn discard(queue: &Queue, leftover: Option<Posted>) {
    if let Some(Ok(Done::Staged(staged))) = leftover {
        queue.backend().discard(staged);
    }
}

/// The reactor loop. Returns when `stop` is set.
pub(crate) fn run(shared: ReactorShared) {
    while !shared.stop.load(Ordering::Acquire) {
        let mut worked = false;
        for q in &shared.queues {
            worked |= poll(q, &shared);
        }
        if !worked {
            std::thread::park_timeout(shared.idle_park);
        }
    }
}

/// One pass over one queue: release due late completions, then run at most one submission.
/// Returns whether there was anything to do.
fn poll(q: &Queue, shared: &ReactorShared) -> bool {
    let mut st = q.lock();
    let mut worked = false;
    if !st.delayed.is_empty() {
        worked = true;
        let mut due = Vec::new();
        st.delayed.retain_mut(|(left, seq, _)| {
            *left = left.saturating_sub(1);
            if *left == 0 {
                due.push(*seq);
            }
            *left > 0
        });
        // Re-take the due entries (retain_mut cannot move them out).
        for seq in due {
            if let Some(i) = st.delayed.iter().position(|(l, s, _)| *l == 0 && *s == seq) {
                let (_, seq, result) = st.delayed.remove(i);
                if !st.outstanding.contains_key(&seq) {
                    st.stats.late += 1;
                }
                let leftover = post(&mut st, seq, result);
                discard(q, leftover);
            }
        }
        q.changed.notify_all();
    }
    if st.stall_polls_left > 0 {
        st.stall_polls_left -= 1;
        st.stats.stalled_polls += 1;
        return true;
    }
    let Some(sub) = st.pending.pop_front() else {
        return worked;
    };
    if !st.outstanding.contains_key(&sub.seq) {
        // Abandoned by its submitter before it ran: it never touches the slot.
        st.stats.fenced += 1;
        return true;
    }
    if sub.lease.epoch != Epoch(shared.slab_epoch.load(Ordering::Acquire)) {
        st.stats.fenced += 1;
        let leftover = post(&mut st, sub.seq, Ok(Done::Miss(crate::queue::MissCause::Fenced)));
        discard(q, leftover);
        q.changed.notify_all();
        return true;
    }
    let fault = q.backend().next_fault();
    match fault {
        Fault::Stall { polls } => {
            st.stall_polls_left = polls;
            st.pending.push_front(sub);
            return true;
        }
        Fault::Error => {
            st.stats.errors += 1;
            let leftover = post(&mut st, sub.seq, Err("injected error completion".into()));
            discard(q, leftover);
            q.changed.notify_all();
            return true;
        }
        _ => {}
    }
    st.executing = Some(sub.lease.epoch);
    drop(st);
    // SAFETY: the submission holds the slot's lease, which stays checked out until its
    // submitter settles it after this completion or the fence reclaims it, and the fence
    // waits for `executing` to clear first; the agent joins reactors before dropping the slab.
    let slot = unsafe { shared.slab.slot_mut(sub.lease.slot) };
    let result: Posted = {
        let mut backend = q.backend();
        match sub.op {
            Op::Write { block, len } => {
                backend.write(block, &slot[..len], sub.seq).map(Done::Staged)
            }
            Op::Read { block } => backend.read(block, slot),
            Op::Store(job) => {
                // A store call runs against the store, not the queue's backend: release it.
                drop(backend);
                Ok(Done::Store(job.run(slot)))
            }
        }
    };
    let mut st = q.lock();
    st.executing = None;
    match fault {
        Fault::Lost => {
            st.stats.lost += 1;
            discard(q, Some(result));
        }
        Fault::Late { polls } => st.delayed.push((polls.max(1), sub.seq, result)),
        Fault::Duplicated => {
            let leftover = post(&mut st, sub.seq, result);
            discard(q, leftover);
            // The copy finds the first already posted and is dropped, as a reaper would.
            st.stats.duplicated += 1;
        }
        _ => {
            let leftover = post(&mut st, sub.seq, result);
            discard(q, leftover);
        }
    }
    q.changed.notify_all();
    true
}
