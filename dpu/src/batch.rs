//! Batches of store jobs: the items of one batch call split by the queue that owns each key,
//! every queue given its items before any completion is waited on, and the answers handed back
//! by item index, so that the caller can keep its own order.
//!
//! Each item is its own job with its own slab slot, so one item's lost or failed completion
//! settles (and quarantines) only that item's slot and answers only that item. Items of one
//! queue are submitted in item order, and a queue runs its submissions in order, so two items
//! under one key behave as two calls in item order.
//!
//! At most [`BATCH_IN_FLIGHT_MAX`] items (and never more than the slab has slots, nor more than
//! a queue's depth on that queue) are in flight at once; the rest wait in their queue's lane and
//! go as the batch's own items settle. A submission refused for room (a full queue, an
//! exhausted slab: other callers' work) is held back until one of the batch's own items
//! settles; with none of them in flight there is nothing to wait for, and the refusal is that
//! item's answer, as it would be for a single call. Every wait has its item's deadline (the
//! store's op deadline from its submission), so a batch always ends.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::store::Store;

use crate::agent::Agent;
use crate::error::DpuError;
use crate::job::{Answer, Job, JobOp};
use crate::queue::{QueueId, Ticket};
use crate::reactor::ReactorId;

/// Most items of one batch call in flight at once; each holds one slab slot while it is.
pub const BATCH_IN_FLIGHT_MAX: usize = 256;

/// One item of a batch, ready to submit.
pub(crate) struct Item<'p> {
    /// The item's place in the caller's batch, handed back with its answer.
    pub(crate) index: usize,
    /// The stable hash that picks the item's queue.
    pub(crate) hash: u64,
    /// Bytes copied into the item's slot when it is submitted (at most a slot).
    pub(crate) payload: &'p [u8],
    pub(crate) op: JobOp,
}

/// The items of one queue not yet submitted, in item order.
struct Lane<'p> {
    reactor: ReactorId,
    queue: QueueId,
    /// The queue's depth: the most of this batch's items it is given at once.
    depth: usize,
    todo: VecDeque<Item<'p>>,
    in_flight: usize,
    /// The queue refused a submission for room since the batch last settled an item.
    held: bool,
}

/// One submitted item.
struct InFlight {
    index: usize,
    lane: usize,
    ticket: Ticket,
    deadline: Instant,
}

/// Runs one batch.
pub(crate) struct Batch<'a> {
    pub(crate) agent: &'a Agent,
    pub(crate) store: &'a Arc<dyn Store>,
    pub(crate) caller: &'a Caller,
    pub(crate) op_deadline: Duration,
}

impl Batch<'_> {
    /// Runs every item and hands each item's outcome to `take` exactly once, with the item's
    /// index: the job's answer and its slot (read while the slot's lease still holds it), or
    /// why the job was not submitted or did not complete.
    pub(crate) fn run<'p>(
        &self,
        items: impl IntoIterator<Item = Item<'p>>,
        mut take: impl FnMut(usize, Result<(Answer, &[u8]), DpuError>),
    ) {
        let mut lanes: Vec<Lane<'p>> = Vec::new();
        let mut lane_of: BTreeMap<QueueId, usize> = BTreeMap::new();
        for item in items {
            let (reactor, queue) = self.agent.route(item.hash);
            let lane = *lane_of.entry(queue).or_insert_with(|| {
                lanes.push(Lane {
                    reactor,
                    queue,
                    depth: self.agent.depth_max(queue).max(1),
                    todo: VecDeque::new(),
                    in_flight: 0,
                    held: false,
                });
                lanes.len() - 1
            });
            lanes[lane].todo.push_back(item);
        }
        let window = BATCH_IN_FLIGHT_MAX.min(self.agent.slab_slots()).max(1);
        let mut in_flight: VecDeque<InFlight> = VecDeque::with_capacity(window);
        loop {
            self.submit_round(&mut lanes, &mut in_flight, window, &mut take);
            // The oldest submission first: the window is spread over every queue, so the others
            // keep working meanwhile, and each item settled makes room for the next one.
            let Some(f) = in_flight.pop_front() else { break };
            lanes[f.lane].in_flight -= 1;
            let index = f.index;
            let reaped = self.agent.wait_job(f.ticket, f.deadline, |answer, slot| {
                take(index, Ok((answer, slot)));
            });
            if let Err(e) = reaped {
                take(index, Err(e));
            }
        }
        debug_assert!(lanes.iter().all(|l| l.todo.is_empty()), "a batch ended with items left");
    }

    /// Submits items lane by lane (one item per lane per pass, so that every queue gets work
    /// early) until the window is full or every lane is empty, at its depth or held back.
    fn submit_round<'p>(
        &self,
        lanes: &mut [Lane<'p>],
        in_flight: &mut VecDeque<InFlight>,
        window: usize,
        take: &mut impl FnMut(usize, Result<(Answer, &[u8]), DpuError>),
    ) {
        for lane in lanes.iter_mut() {
            lane.held = false;
        }
        loop {
            let mut progressed = false;
            for (at, lane) in lanes.iter_mut().enumerate() {
                if in_flight.len() >= window {
                    return;
                }
                if lane.held || lane.in_flight >= lane.depth {
                    continue;
                }
                let Some(item) = lane.todo.pop_front() else { continue };
                progressed = true;
                let Item { index, hash, payload, op } = item;
                let job = Job { store: Arc::clone(self.store), caller: self.caller.clone(), op };
                let fill = |slot: &mut [u8]| slot[..payload.len()].copy_from_slice(payload);
                match self.agent.submit_job(lane.reactor, lane.queue, fill, job) {
                    Ok(ticket) => {
                        lane.in_flight += 1;
                        let deadline = Instant::now() + self.op_deadline;
                        in_flight.push_back(InFlight { index, lane: at, ticket, deadline });
                    }
                    Err((error, job)) => {
                        // A refusal for room waits for room while the batch has items of
                        // its own in flight to free some; otherwise it is the item's answer.
                        let for_room = matches!(
                            error,
                            DpuError::QueueFull { .. } | DpuError::SlabExhausted { .. }
                        );
                        let room_will_free = for_room && !in_flight.is_empty();
                        if !room_will_free {
                            take(index, Err(error));
                            continue;
                        }
                        // Held back until one of this batch's items settles and frees room.
                        lane.todo.push_front(Item { index, hash, payload, op: job.op });
                        lane.held = true;
                        if matches!(error, DpuError::SlabExhausted { .. }) {
                            // No queue can lease a slot now.
                            return;
                        }
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }
}
