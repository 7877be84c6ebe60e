//! Striping one large PUT over several pooled connections at once: the protocol's multi-part
//! PUT (RESERVE, then one WRITE per part, each on its own connection and in flight together,
//! then COMMIT).
//!
//! Every part travels in its own WRITE frame, whose body checksum (XXH3-64 over the reservation,
//! the offset and the part's bytes) the server checks before it writes anything of it; the
//! parts are contiguous, disjoint and cover the value exactly ([`split`](super::split)), and the store commits
//! only a reservation written in full. The whole value is then checked end to end: COMMIT
//! answers the checksum the store computed over the block it holds, and it must be the
//! writer's (the caller's `expected`, or the one computed here while the parts are on their
//! way). A part that fails fails the PUT: the reservation is aborted and nothing is stored. A
//! committed block whose checksum is not the writer's is invalidated and the PUT fails.
//!
//! Bounds: at most [`STRIPE_PARTS_MAX`](super::STRIPE_PARTS_MAX) parts (so as many connections and threads, scoped to
//! the call), each part at least [`STRIPE_PART_BYTES_MIN`](super::STRIPE_PART_BYTES_MIN)
//! bytes, and every exchange within the
//! configuration's `deadline`, so the call waits at most that long per step.

use std::io::IoSlice;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::store::{Put, Reservation, Retirement, Store, StoreError};
use gpucache_wire::{Response, write_all_vectored, write_request_parts};

use super::errors::{checked, not_encodable, transport, unexpected};
use super::parts::covers;
use super::tcp_store::{TcpStore, pool_key};

impl TcpStore {
    /// The striped PUT of `src` under `key` in the parts `parts` ([`split`](super::split)), on an unsealed
    /// session. See the module's documentation for what is checked and what a failure leaves.
    pub(super) fn put_striped(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
        expected: Option<Checksum>,
        parts: &[Range<usize>],
    ) -> Result<Put, StoreError> {
        if !covers(parts, src.len()) {
            return Err(transport("put", "the stripe's parts do not cover the value"));
        }
        let reserved = self.reserve(caller, key, src.len() as u64, request)?;
        let reservation = match reserved.into_reservation() {
            Ok(r) => r,
            Err(answer) => return Ok(answer),
        };
        let (sum, written) = std::thread::scope(|s| {
            let r = &reservation;
            let others: Vec<_> = parts
                .iter()
                .skip(1)
                .map(|p| s.spawn(move || self.write_part(caller, r, p.start, &src[p.clone()])))
                .collect();
            let mut written = vec![
                parts
                    .first()
                    .map_or(Ok(()), |p| self.write_part(caller, r, p.start, &src[p.clone()])),
            ];
            // The whole value's checksum, while the other parts are still on their way.
            let sum = expected.unwrap_or_else(|| Checksum::of(src));
            written.extend(others.into_iter().map(|h| {
                h.join().unwrap_or_else(|_| Err(transport("put", "a part's sender panicked")))
            }));
            (sum, written)
        });
        if let Some(e) = written.into_iter().find_map(Result::err) {
            // The server only read what it was sent: nothing of the caller's is held. The
            // reservation may already be gone; the part's error is the one the caller needs.
            let _ = self.abort(caller, reservation, Retirement::Retired);
            return Err(e);
        }
        let committed = match self.commit(caller, &reservation) {
            Ok(c) => c,
            Err(e) => {
                let _ = self.abort(caller, reservation, e.retirement());
                return Err(e);
            }
        };
        if committed.checksum != sum {
            // What the store holds is not what was written: it must not be read.
            let removed = self.invalidate(caller, key);
            return Err(StoreError::Backend {
                operation: "put",
                detail: format!(
                    "the striped block committed as {:016x} but the writer's bytes hash to \
                     {:016x}; it was invalidated ({removed:?})",
                    committed.checksum.0, sum.0
                ),
                retirement: Retirement::Retired,
            });
        }
        Ok(Put::Committed(sum))
    }

    /// One part: a WRITE of `data` at `offset` of `reservation`, sent from the caller's buffer
    /// (one vectored write, no copy into a frame) on a connection of its own, within the
    /// deadline. Never retried: the caller's PUT fails instead.
    fn write_part(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: usize,
        data: &[u8],
    ) -> Result<(), StoreError> {
        let (mut conn, _) = self.take_conn(caller, "put")?;
        if conn.seal.is_some() {
            return Err(transport("put", "a striped PUT on a sealed session"));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        write_request_parts(id, reservation, offset as u64, data, &mut conn.out)
            .map_err(|e| not_encodable("put", e))?;
        let deadline = self.config.deadline;
        let until = Instant::now() + deadline;
        let sent = conn.stream.set_write_timeout(Some(deadline)).and_then(|()| {
            let mut parts = [IoSlice::new(&conn.out), IoSlice::new(data)];
            write_all_vectored(&mut conn.stream, &mut parts)
        });
        let frame = self
            .answer_after_send(&mut conn, sent, id, until, deadline, None)
            .map_err(|f| f.into_store_error("put"))
            .and_then(|frame| checked(frame, None, "put").map_err(|(e, _)| e))?;
        let answer = match Response::from_frame(&frame) {
            Ok(Response::Write(answer)) => answer,
            Ok(other) => Err(unexpected("put", &other)),
            Err(e) => Err(transport("put", e)),
        };
        conn.decoder.recycle(frame.body);
        self.keep(pool_key(caller), conn);
        answer
    }
}
