//! One request and its answer on a connection: writing the encoded frame within the deadline,
//! then reading and decoding the frame that answers it.

use std::io::{self, Read, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpucache_dataplane::store::StoreError;
use gpucache_storage::host::segment::{Segment, send_with_fd};
use gpucache_wire::seal::SealKey;
use gpucache_wire::{Frame, Op, Request, Response};

use super::conn::{Conn, OUT_BUFFER_KEEP_BYTES, Stream};
use super::errors::{ExchangeFailure, checked};
use super::single::Sink;
use super::tcp_store::TcpStore;

impl TcpStore {
    /// Sends one request (handing over `segment`'s descriptor with it, on a Unix socket) and
    /// returns the frame that answers it, its seal verified on a sealed session. An error answer
    /// that closes the connection is a transport failure.
    pub(super) fn exchange_with(
        &self,
        conn: &mut Conn,
        request: &Request,
        operation: &'static str,
        segment: Option<&Segment>,
    ) -> Result<Frame, StoreError> {
        let seal = conn.seal.clone();
        let frame = self
            .exchange_within(conn, request, seal.as_ref(), segment, self.config.deadline, None)
            .map_err(|f| f.into_store_error(operation))?;
        checked(frame, seal.as_ref(), operation).map_err(|(e, _)| e)
    }

    /// Sends one request (sealed with `seal` when given, with `segment`'s descriptor when
    /// given) and returns the frame that answers it within `deadline`, failing with what went
    /// wrong. The request is encoded into the connection's reused buffer; the rest of a large
    /// answer is read straight into the decoder's body buffer. An ERROR frame with request id
    /// 0 answers the request too: it is how a server turns a connection away (busy, stopping)
    /// or answers a frame whose header it could not trust. With `sink`, the payload of a
    /// one-hit GET answer is read into it instead (see [`Sink`]).
    pub(super) fn exchange_within(
        &self,
        conn: &mut Conn,
        request: &Request,
        seal: Option<&SealKey>,
        segment: Option<&Segment>,
        deadline: Duration,
        sink: Option<&mut Sink<'_>>,
    ) -> Result<Frame, ExchangeFailure> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        conn.out.clear();
        request.encode_sealed_frame(id, seal, &mut conn.out).map_err(ExchangeFailure::Encode)?;
        let until = Instant::now() + deadline;
        let sent = self.send_out(conn, segment, deadline);
        let frame = self.answer_after_send(conn, sent, id, until, deadline, sink)?;
        // One request, one answer: anything after it breaks the connection.
        if !conn.pending.is_empty() {
            return Err(ExchangeFailure::PastTheAnswer);
        }
        Ok(frame)
    }

    /// Writes the connection's encoded request (with `segment`'s descriptor, on a Unix socket)
    /// within `deadline`.
    pub(super) fn send_out(
        &self,
        conn: &mut Conn,
        segment: Option<&Segment>,
        deadline: Duration,
    ) -> io::Result<()> {
        conn.stream.set_write_timeout(Some(deadline))?;
        let sent = match (&conn.stream, segment) {
            (Stream::Local(s), Some(seg)) => send_with_fd(s, &conn.out, seg.fd()),
            (Stream::Tcp(_), Some(_)) => Err(io::Error::other("a descriptor needs a Unix socket")),
            (_, None) => conn.stream.write_all(&conn.out),
        };
        if conn.out.capacity() > OUT_BUFFER_KEEP_BYTES {
            conn.out = Vec::new();
        }
        sent
    }

    /// The answer to request `id` once its frame was written (`sent`). When writing failed, a
    /// server that turned the connection away wrote why before it closed: that is the answer.
    pub(super) fn answer_after_send(
        &self,
        conn: &mut Conn,
        sent: io::Result<()>,
        id: u64,
        until: Instant,
        deadline: Duration,
        sink: Option<&mut Sink<'_>>,
    ) -> Result<Frame, ExchangeFailure> {
        match sent {
            Ok(()) => self.read_answer(conn, id, until, deadline, sink),
            Err(e) => match self.read_answer(conn, id, until, deadline, sink) {
                Ok(frame) if frame.request_id == 0 && frame.op == Op::Error => Ok(frame),
                _ => Err(ExchangeFailure::Io(e)),
            },
        }
    }

    /// Reads the frame that answers request `id`, until `until`. Bytes read past that frame
    /// (the start of the next answer of a pipelined batch) stay in `conn.pending` for the next
    /// call.
    pub(super) fn read_answer(
        &self,
        conn: &mut Conn,
        id: u64,
        until: Instant,
        deadline: Duration,
        mut sink: Option<&mut Sink<'_>>,
    ) -> Result<Frame, ExchangeFailure> {
        loop {
            if conn.pending.is_empty() {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ExchangeFailure::Deadline(deadline));
                }
                conn.stream.set_read_timeout(Some(left)).map_err(ExchangeFailure::Io)?;
                // A one-hit answer's payload goes straight into the caller's buffer.
                let to_sink = sink.as_deref_mut().and_then(|s| s.next(&conn.decoder));
                let direct = conn.decoder.body_window().is_some();
                let read = match (sink.as_deref_mut(), to_sink.clone()) {
                    (Some(sink), Some(range)) => conn.stream.read(&mut sink.dst[range]),
                    _ => match conn.decoder.body_window() {
                        Some(window) => conn.stream.read(window),
                        None => conn.stream.read(&mut conn.buf),
                    },
                };
                let n = match read {
                    Ok(0) => return Err(ExchangeFailure::Closed),
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        return Err(ExchangeFailure::Deadline(deadline));
                    }
                    Err(e) => return Err(ExchangeFailure::Io(e)),
                };
                if let (Some(sink), Some(_)) = (sink.as_deref_mut(), &to_sink) {
                    sink.took(n);
                    conn.decoder.skip_body(n);
                } else if direct {
                    conn.decoder.commit_body(n);
                } else {
                    conn.pending = 0..n;
                }
            }
            let mut input = conn.buf.get(conn.pending.clone()).unwrap_or_default();
            let before = input.len();
            let fed = conn.decoder.feed(&mut input);
            conn.pending.start += before - input.len();
            match fed {
                Ok(None) => continue,
                Err(e) => return Err(ExchangeFailure::Frame(e.error)),
                Ok(Some(frame)) => {
                    let turned_away = frame.request_id == 0 && frame.op == Op::Error;
                    if frame.request_id != id && !turned_away {
                        let what = Response::from_frame(&frame)
                            .map_or_else(|e| e.to_string(), |r| format!("{:?}", r.op()));
                        return Err(ExchangeFailure::OtherAnswer {
                            found: frame.request_id,
                            what,
                            expected: id,
                        });
                    }
                    return Ok(frame);
                }
            }
        }
    }
}
