//! Batch exchanges: a batch split into frames within the protocol's limits, the frames pipelined
//! on one connection, and each item given its own answer or the exchange's failure.

use std::io::{self, Write};
use std::net::Shutdown;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Instant;

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{BatchAnswers, StoreError};
use gpucache_storage::host::segment::SharedArena;
use gpucache_wire::seal::SealKey;
use gpucache_wire::{BATCH_ITEMS_MAX, Frame, Request, Response, WireError};

use super::conn::{Conn, OUT_BUFFER_KEEP_BYTES};
use super::errors::{ExchangeFailure, check_right, checked, not_encodable, transport, unexpected};
use super::shm::Place;
use super::tcp_store::{TcpStore, pool_key};

/// Most request frames of one batch exchange that are sent and not yet answered. The server
/// answers a connection's requests one at a time, in order, and reads the next request only
/// after it has written the answer before it; more frames in flight would only wait in the
/// socket buffers. A few keep the server busy while an answer travels back, and the bound keeps
/// a huge batch from running far ahead of its answers.
pub const FRAMES_IN_FLIGHT_MAX: usize = 4;

/// How a batch exchange stopped before every frame was answered.
#[derive(Debug)]
pub(super) struct Interrupted {
    /// Frames answered, in order, before it stopped: their items have their answers.
    answered: usize,
    /// Frames written whole to the socket. The server may have served any of these; a frame
    /// that never left whole cannot be decoded, so the server never served one past these.
    sent: usize,
    /// Why the answers stopped: the failure of every frame from `answered` on.
    error: StoreError,
    /// Why frames from `sent` on were never sent, when the cause is the request itself (a
    /// frame that could not be encoded) rather than the connection.
    unsent: Option<StoreError>,
    /// Whether the connection turned out dead (closed, reset, turned away) before any
    /// answer: a pooled connection that died while idle.
    dead: bool,
}

impl Interrupted {
    fn before_sending(error: StoreError) -> Box<Self> {
        Box::new(Self { answered: 0, sent: 0, error, unsent: None, dead: false })
    }

    /// Whether the server may have served frame `f` without its answer arriving.
    pub(super) fn maybe_served(&self, f: usize) -> bool {
        f >= self.answered && f < self.sent
    }

    /// The failure of frame `f`, which was not answered.
    fn error_of(&self, f: usize) -> StoreError {
        match &self.unsent {
            Some(e) if f >= self.sent => e.clone(),
            _ => self.error.clone(),
        }
    }
}

/// The items of a batch as its frames carry them: frame `f` carries items `frames[f]`.
pub(super) type FrameItems = Vec<Range<usize>>;

/// Every item's answer, in order: what its frame's answer said, or, for the items of frames
/// that were not answered, the exchange's failure; `failed` adjusts that failure per item,
/// given whether the server may have served its frame.
pub(super) fn every_answer<T>(
    mut answers: Vec<Option<Result<T, StoreError>>>,
    frames: &[Range<usize>],
    outcome: &Result<(), Box<Interrupted>>,
    operation: &'static str,
    mut failed: impl FnMut(usize, bool, StoreError) -> StoreError,
) -> BatchAnswers<T> {
    for (f, items) in frames.iter().enumerate() {
        for i in items.clone() {
            let Some(slot) = answers.get_mut(i) else { continue };
            if slot.is_some() {
                continue;
            }
            *slot = Some(Err(match outcome {
                Err(stop) => failed(i, stop.maybe_served(f), stop.error_of(f)),
                Ok(()) => transport(operation, "the answer left this item out"),
            }));
        }
    }
    answers
        .into_iter()
        .map(|a| a.unwrap_or_else(|| Err(transport(operation, "no frame carried this item"))))
        .collect()
}

/// The same failure for each of `n` items.
pub(super) fn every_item<T>(n: usize, e: &StoreError) -> BatchAnswers<T> {
    (0..n).map(|_| Err(e.clone())).collect()
}

/// Stores one frame's answers (or its one failure) in the item slots of its range.
pub(super) fn fill<T>(
    slots: &mut [Option<Result<T, StoreError>>],
    got: Result<BatchAnswers<T>, StoreError>,
    operation: &'static str,
) {
    match got {
        Ok(answers) if answers.len() == slots.len() => {
            for (slot, a) in slots.iter_mut().zip(answers) {
                *slot = Some(a);
            }
        }
        Ok(_) => {
            let e = transport(operation, "answers do not match the batch");
            fill(slots, Err(e), operation);
        }
        Err(e) => {
            for slot in slots {
                *slot = Some(Err(e.clone()));
            }
        }
    }
}

/// One GET or PUT frame of a batch: its items, and where their bytes are in the shared segment
/// when the frame goes through it (GET_SHARED, PUT_SHARED) rather than carrying them.
#[derive(Debug)]
pub(super) struct PlannedFrame {
    pub(super) items: Range<usize>,
    pub(super) offsets: Option<Vec<u64>>,
}

/// Batch exchanges: a batch is split into frames by the protocol's limits, and its frames go out
/// on one connection one after another, without waiting for the answers before them
/// (pipelined); the server answers them in order.
///
/// Deadlock: the server reads one request, serves it, writes its whole answer, and only then
/// reads the next request. A client that wrote frames without reading answers could block
/// writing a request (the server is not reading) while the server blocks writing an answer (the
/// client is not reading): a GET answer of up to 64 MiB fills the socket buffers at once. So a
/// batch of more than one frame is sent by a second thread while this one reads the answers as
/// they come, landing each in the caller's buffers. The reader never waits for the writer, so
/// every answer the server writes is drained and the server always gets back to reading. The
/// writer keeps at most [`FRAMES_IN_FLIGHT_MAX`] frames unanswered, so how far the requests run
/// ahead stays bounded however large the batch, and each side holds one frame in memory at a
/// time. A batch of one frame is written and then read on this thread: the server reads a
/// whole request before it answers, so that cannot deadlock.
impl TcpStore {
    /// Sends `frames` request frames on one connection as `caller` (`encode` writes frame `f`
    /// with a request id and the session's seal) and hands each answer, in order, to `answer`
    /// (which lands it and records per-item failures itself). A request that only reads is sent
    /// again on a fresh connection when a pooled one turns out dead before any answer.
    pub(super) fn batch_exchange<E, A>(
        &self,
        caller: &Caller,
        operation: &'static str,
        frames: usize,
        retryable: bool,
        encode: &E,
        mut answer: A,
    ) -> Result<(), Box<Interrupted>>
    where
        E: Fn(usize, u64, Option<&SealKey>, &mut Vec<u8>) -> Result<(), WireError> + Sync,
        A: FnMut(usize, &Frame),
    {
        if frames == 0 {
            return Ok(());
        }
        let (mut conn, was_pooled) =
            self.take_conn(caller, operation).map_err(Interrupted::before_sending)?;
        let mut outcome = self.pipeline(&mut conn, operation, frames, encode, &mut answer);
        if let Err(stop) = &outcome
            && was_pooled
            && retryable
            && stop.dead
            && stop.answered == 0
        {
            let sent = stop.sent;
            conn = match self.connect(caller, operation) {
                Ok(c) => c,
                Err(e) => {
                    return Err(Box::new(Interrupted { sent, ..*Interrupted::before_sending(e) }));
                }
            };
            outcome = self.pipeline(&mut conn, operation, frames, encode, &mut answer);
        }
        if outcome.is_ok() {
            self.keep(pool_key(caller), conn);
        }
        outcome
    }

    /// One batch exchange on `conn` (see the `impl` comment above for why more than one frame
    /// is written by another thread).
    fn pipeline<E, A>(
        &self,
        conn: &mut Conn,
        operation: &'static str,
        frames: usize,
        encode: &E,
        answer: &mut A,
    ) -> Result<(), Box<Interrupted>>
    where
        E: Fn(usize, u64, Option<&SealKey>, &mut Vec<u8>) -> Result<(), WireError> + Sync,
        A: FnMut(usize, &Frame),
    {
        let deadline = self.config.deadline;
        let first = self.next_id.fetch_add(frames as u64, Ordering::Relaxed);
        let seal = conn.seal.clone();
        let seal = seal.as_ref();
        let stop = |answered, sent, (error, dead)| {
            Box::new(Interrupted {
                answered,
                sent,
                error,
                unsent: None,
                dead: dead && answered == 0,
            })
        };
        let failed = |f: ExchangeFailure| {
            let dead = f.is_dead();
            (f.into_store_error(operation), dead)
        };
        if frames == 1 {
            conn.out.clear();
            encode(0, first, seal, &mut conn.out)
                .map_err(|e| Interrupted::before_sending(not_encodable(operation, e)))?;
            let until = Instant::now() + deadline;
            let written = self.send_out(conn, None, deadline);
            let sent = usize::from(written.is_ok());
            let frame = self
                .answer_after_send(conn, written, first, until, deadline, None)
                .map_err(|f| stop(0, sent, failed(f)))
                .and_then(|frame| checked(frame, seal, operation).map_err(|e| stop(0, sent, e)))?;
            answer(0, &frame);
            conn.decoder.recycle(frame.body);
            return Ok(());
        }

        let mut writer_stream = conn
            .stream
            .try_clone()
            .and_then(|s| s.set_write_timeout(Some(deadline)).map(|()| s))
            .map_err(|e| Interrupted::before_sending(transport(operation, e)))?;
        let mut out = std::mem::take(&mut conn.out);
        // One credit per answer read: the writer sends frame `f` past the first
        // FRAMES_IN_FLIGHT_MAX only once answer `f - FRAMES_IN_FLIGHT_MAX` was read, so at
        // most that many credits are ever unspent and the channel never fills.
        let (credits, credit) = mpsc::sync_channel::<()>(FRAMES_IN_FLIGHT_MAX);
        // The writer waits for the one answer that frees its next frame; the reader waits for
        // that answer at most `deadline`, and ends the exchange (dropping `credits`) when it
        // does not come. This bound is never what ends a sound exchange.
        let credit_wait = deadline.saturating_mul(2);
        let (answered, failure, sent, unsent) = std::thread::scope(|scope| {
            let out = &mut out;
            let writer = scope.spawn(move || {
                for f in 0..frames {
                    if f >= FRAMES_IN_FLIGHT_MAX && credit.recv_timeout(credit_wait).is_err() {
                        // The reader stopped: the answers ended or never came.
                        return (f, None);
                    }
                    out.clear();
                    let id = first + f as u64;
                    let failure = match encode(f, id, seal, out) {
                        Err(e) => ExchangeFailure::Encode(e),
                        Ok(()) => match writer_stream.write_all(out) {
                            Ok(()) => continue,
                            Err(e) => ExchangeFailure::Io(e),
                        },
                    };
                    // The server answers the whole frames it has and then sees the end of
                    // the stream, so the reader gets those answers and then the close.
                    let _ = writer_stream.shutdown(Shutdown::Write);
                    return (f, Some(failure));
                }
                (frames, None)
            });
            let mut answered = 0;
            let mut failure = None;
            while answered < frames {
                let id = first + answered as u64;
                let until = Instant::now() + deadline;
                let frame = self
                    .read_answer(conn, id, until, deadline, None)
                    .map_err(failed)
                    .and_then(|frame| checked(frame, seal, operation));
                match frame {
                    Ok(frame) => {
                        answer(answered, &frame);
                        conn.decoder.recycle(frame.body);
                        answered += 1;
                        let _ = credits.try_send(());
                    }
                    Err(e) => {
                        // A writer blocked on a socket nobody will read fails at once.
                        let _ = conn.stream.shutdown(Shutdown::Both);
                        failure = Some(e);
                        break;
                    }
                }
            }
            drop(credits);
            // A writer that panicked may have sent any of the frames.
            let (sent, unsent) = writer.join().unwrap_or_else(|_| {
                let panicked = io::Error::other("the sending thread panicked");
                (frames, Some(ExchangeFailure::Io(panicked)))
            });
            (answered, failure, sent, unsent)
        });
        if out.capacity() <= OUT_BUFFER_KEEP_BYTES {
            conn.out = out;
        }
        match failure {
            None => Ok(()),
            Some(e) => {
                let unsent = unsent.and_then(|f| match f {
                    ExchangeFailure::Encode(e) => Some(not_encodable(operation, e)),
                    _ => None,
                });
                Err(Box::new(Interrupted { unsent, ..*stop(answered, sent, e) }))
            }
        }
    }

    /// LOOKUP or INVALIDATE for `keys`: frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on
    /// one connection; `request` builds a frame's request, `take` its answers. A batch that needs
    /// only the read right (LOOKUP) only reads, so it may be sent again on a fresh connection.
    pub(super) fn keyed_batch<T>(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
        right: Right,
        operation: &'static str,
        request: fn(Vec<PhysicalKey>) -> Request,
        take: fn(Response) -> Result<BatchAnswers<T>, Box<Response>>,
    ) -> BatchAnswers<T> {
        if let Err(e) = check_right(caller, right) {
            return every_item(keys.len(), &e);
        }
        let frames: FrameItems = (0..keys.len())
            .step_by(BATCH_ITEMS_MAX)
            .map(|start| start..(start + BATCH_ITEMS_MAX).min(keys.len()))
            .collect();
        let encode = |f: usize, id: u64, seal: Option<&SealKey>, out: &mut Vec<u8>| {
            let chunk = keys.get(frames[f].clone()).unwrap_or_default();
            request(chunk.iter().map(|k| (*k).clone()).collect()).encode_sealed_frame(id, seal, out)
        };
        let mut answers: Vec<Option<Result<T, StoreError>>> =
            (0..keys.len()).map(|_| None).collect();
        let retryable = right == Right::Read;
        let outcome =
            self.batch_exchange(caller, operation, frames.len(), retryable, &encode, |f, frame| {
                let got = match Response::from_frame(frame) {
                    Ok(response) => take(response).map_err(|other| unexpected(operation, &other)),
                    Err(e) => Err(transport(operation, e)),
                };
                fill(&mut answers[frames[f].clone()], got, operation);
            });
        every_answer(answers, &frames, &outcome, operation, |_, _, e| e)
    }

    /// How a GET or PUT batch of items of `sizes` bytes travels: over TCP, frames within the
    /// payload limit; on the same-host path, shared frames of at most [`BATCH_ITEMS_MAX`]
    /// items, each placed in the segment by `place` (the caller's shared buffer, or a bounce
    /// buffer), except that a group whose bounce buffers do not fit is sent as ordinary frames.
    /// Returns the frames and, for each shared one, its items' places.
    pub(super) fn plan_frames(
        &self,
        arena: Option<&SharedArena>,
        sizes: &[u64],
        mut place: impl FnMut(&SharedArena, usize) -> Option<Place>,
    ) -> (Vec<PlannedFrame>, Vec<Option<Vec<Place>>>) {
        let (mut frames, mut places) = (Vec::new(), Vec::new());
        let framed = |frames: &mut Vec<PlannedFrame>, places: &mut Vec<_>, at, sizes| {
            for (start, end) in frame_ranges(sizes) {
                frames.push(PlannedFrame { items: at + start..at + end, offsets: None });
                places.push(None);
            }
        };
        let Some(arena) = arena else {
            framed(&mut frames, &mut places, 0, sizes);
            return (frames, places);
        };
        for start in (0..sizes.len()).step_by(BATCH_ITEMS_MAX) {
            let end = (start + BATCH_ITEMS_MAX).min(sizes.len());
            // Stops at the first item that does not fit, freeing the bounce buffers taken.
            let group: Option<Vec<Place>> = (start..end).map(|i| place(arena, i)).collect();
            match group {
                Some(group) => {
                    self.shared.count(&group);
                    let offsets = group.iter().map(Place::offset).collect();
                    frames.push(PlannedFrame { items: start..end, offsets: Some(offsets) });
                    places.push(Some(group));
                }
                None => {
                    self.shared.framed_batches.fetch_add(1, Ordering::Relaxed);
                    framed(&mut frames, &mut places, start, &sizes[start..end]);
                }
            }
        }
        (frames, places)
    }
}

/// Payload bytes after which a batch's frame closes and the next one starts (a single larger
/// item still goes alone, up to [`gpucache_wire::PAYLOAD_BYTES_MAX`]). The server serves a connection's frames
/// one after another, so frames of this size let it read the next frame's blocks while the
/// previous answer is still on the wire and being landed; one frame of the whole batch would
/// read every block before sending any. 2 MiB measured best on loopback (docs/PERFORMANCE.md).
pub const FRAME_PAYLOAD_TARGET: u64 = 2 << 20;

/// Splits items of the given payload sizes into consecutive `[start, end)` ranges that each fit
/// one frame: at most [`BATCH_ITEMS_MAX`] items and [`FRAME_PAYLOAD_TARGET`] payload bytes (a
/// single item is always sent on its own, and the server judges its size).
fn frame_ranges(sizes: &[u64]) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let mut end = start;
        let mut bytes = 0u64;
        while end < sizes.len() && end - start < BATCH_ITEMS_MAX {
            if end > start && bytes + sizes[end] > FRAME_PAYLOAD_TARGET {
                break;
            }
            bytes += sizes[end];
            end += 1;
        }
        ranges.push((start, end));
        start = end;
    }
    ranges
}
