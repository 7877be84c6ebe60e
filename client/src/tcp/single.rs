//! The one-item fast paths of an unsealed session: a GET whose payload is read from the socket
//! straight into the caller's buffer, and a PUT sent from the caller's buffer with no copy.

use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::checksum::{Checksum, ChecksumBuilder};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{BatchPut, Get, MissReason, Put, StoreError};
use gpucache_wire::{
    FrameDecoder, GetItem, HEADER_BYTES, Request, Response, put_request_parts, sole_hit,
    write_all_vectored,
};

use super::conn::Conn;
use super::errors::{checked, not_encodable, transport, unexpected};
use super::land::land_framed;
use super::tcp_store::{TcpStore, pool_key};

/// The caller's buffer for the payload of a one-hit GET answer
/// ([`gpucache_wire::FLAG_SOLE_HIT`]): when the
/// payload fits, it is read into the buffer straight from the socket (the part that arrived
/// with the header is copied from the decoder), instead of into the decoder and copied out
/// after; the decoder still takes the header and the trailer.
pub(super) struct Sink<'a> {
    pub(super) dst: &'a mut [u8],
    /// Payload bytes in `dst`, once the answer started coming this way.
    at: Option<usize>,
    payload: usize,
    /// The checksum of the bytes in `dst` so far: each piece is hashed as soon as it has
    /// landed, while it is in the cache and while the rest is still on its way.
    hashed: ChecksumBuilder,
}

impl<'a> Sink<'a> {
    fn new(dst: &'a mut [u8]) -> Self {
        Self { dst, at: None, payload: 0, hashed: ChecksumBuilder::default() }
    }

    /// Where in `dst` the next read goes, while the frame `decoder` is taking is a one-hit
    /// answer that fits and whose payload has not all arrived.
    pub(super) fn next(&mut self, decoder: &FrameDecoder) -> Option<Range<usize>> {
        let (payload, so_far) = decoder.sole_hit_payload()?;
        if payload > self.dst.len() {
            return None;
        }
        let at = match self.at {
            Some(at) => at,
            None => {
                let first = self.dst.get_mut(..so_far.len())?;
                first.copy_from_slice(so_far);
                self.hashed.update(first);
                self.payload = payload;
                so_far.len()
            }
        };
        self.at = Some(at);
        (at < payload).then_some(at..payload)
    }

    pub(super) fn took(&mut self, n: usize) {
        if let Some(at) = self.at {
            self.hashed.update(self.dst.get(at..at + n).unwrap_or_default());
            self.at = Some(at + n);
        }
    }

    /// The payload's length and the checksum of what landed, when all of it is in `dst`.
    fn landed(&self) -> Option<(usize, Checksum)> {
        self.at.filter(|&at| at == self.payload).map(|at| (at, self.hashed.finish()))
    }

    /// Zeroes what an answer that failed wrote into `dst`.
    fn undo(&mut self) {
        if let Some(at) = self.at.take() {
            self.dst[..at].fill(0);
        }
    }
}

impl TcpStore {
    /// One GET over frames: the answer's payload lands straight in `dst` when the session is
    /// unsealed (a seal covers the payload, so it must be in the frame to be checked) and the
    /// answer is one hit. A pooled connection whose exchange fails is replaced once, as for any
    /// read.
    pub(super) fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let request =
            Request::Get { items: vec![GetItem { key: key.clone(), capacity: dst.len() as u64 }] };
        let (mut conn, was_pooled) = self.take_conn(caller, "get")?;
        let got = match self.get_on(&mut conn, &request, dst) {
            Err(_) if was_pooled => {
                conn = self.connect(caller, "get")?;
                self.get_on(&mut conn, &request, dst)?
            }
            other => other?,
        };
        self.keep(pool_key(caller), conn);
        got
    }

    /// [`Self::get_one`] on `conn`: the outer error is the exchange's (nothing of it is left
    /// in `dst`), the inner result the store's answer.
    fn get_on(
        &self,
        conn: &mut Conn,
        request: &Request,
        dst: &mut [u8],
    ) -> Result<Result<Get, StoreError>, StoreError> {
        let seal = conn.seal.clone();
        let deadline = self.config.deadline;
        let mut sink = Sink::new(dst);
        let into = if seal.is_none() { Some(&mut sink) } else { None };
        let frame = match self.exchange_within(conn, request, seal.as_ref(), None, deadline, into) {
            Ok(frame) => checked(frame, seal.as_ref(), "get").map_err(|(e, _)| e),
            Err(f) => Err(f.into_store_error("get")),
        };
        let frame = frame.inspect_err(|_| sink.undo())?;
        let got = match (sink.landed(), sole_hit(&frame.body)) {
            (Some((n, landed)), Some((checksum, len))) if n == len => {
                if landed == checksum {
                    Ok(Ok(Get::Hit { len: n as u64, checksum }))
                } else {
                    sink.dst[..n].fill(0);
                    Ok(Ok(Get::Miss(MissReason::Corrupt)))
                }
            }
            (Some(_), _) => {
                sink.undo();
                Err(transport("get", "a one-hit answer did not hold what its header said"))
            }
            (None, _) => land_framed(&frame, &mut [&mut *sink.dst]).map(|mut answers| {
                answers.pop().unwrap_or_else(|| Err(transport("get", "the answer is empty")))
            }),
        };
        conn.decoder.recycle(frame.body);
        got
    }

    /// One PUT over frames on an unsealed session, its bytes sent from the caller's buffer
    /// between the frame's header and trailer (one vectored write, no copy into a frame) and
    /// hashed in place unless the caller gave their checksum. None when the session is sealed
    /// (a seal covers the bytes, so they go through the frame): the caller sends it as a batch.
    /// Never sent twice: a write the server may have stored is not repeated here.
    pub(super) fn put_one(
        &self,
        caller: &Caller,
        item: &BatchPut<'_>,
        expected: Option<Checksum>,
    ) -> Option<Result<Put, StoreError>> {
        let (mut conn, _) = match self.take_conn(caller, "put") {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        if conn.seal.is_some() {
            self.keep(pool_key(caller), conn);
            return None;
        }
        let sum = expected.unwrap_or_else(|| Checksum::of(item.src));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let item = BatchPut { key: item.key, src: item.src, request: item.request };
        if let Err(e) = put_request_parts(id, std::slice::from_ref(&item), &[sum], &mut conn.out) {
            return Some(Err(not_encodable("put", e)));
        }
        let deadline = self.config.deadline;
        let until = Instant::now() + deadline;
        let sent = conn.stream.set_write_timeout(Some(deadline)).and_then(|()| {
            let (head, tail) = conn.out.split_at(HEADER_BYTES.min(conn.out.len()));
            let mut parts =
                [io::IoSlice::new(head), io::IoSlice::new(item.src), io::IoSlice::new(tail)];
            write_all_vectored(&mut conn.stream, &mut parts)
        });
        let answer = self
            .answer_after_send(&mut conn, sent, id, until, deadline, None)
            .map_err(|f| f.into_store_error("put"))
            .and_then(|frame| checked(frame, None, "put").map_err(|(e, _)| e))
            .map(|frame| {
                let answer = match Response::from_frame(&frame) {
                    Ok(Response::Put(mut answers)) if answers.len() == 1 => {
                        answers.pop().unwrap_or_else(|| Err(transport("put", "no answer")))
                    }
                    Ok(other) => Err(unexpected("put", &other)),
                    Err(e) => Err(transport("put", e)),
                };
                conn.decoder.recycle(frame.body);
                answer
            });
        Some(match answer {
            Ok(answer) => {
                self.keep(pool_key(caller), conn);
                answer
            }
            Err(e) => Err(e),
        })
    }
}
