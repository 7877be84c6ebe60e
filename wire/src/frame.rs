//! Frames: the fixed header, frame encoding, and the incremental decoder.

use std::io::{self, IoSlice, Write};

use gpucache_dataplane::checksum::Checksum;

use super::codec::{Reader, Writer, wide};
use super::seal::SealKey;
use super::{
    BODY_BYTES_MAX, FLAG_SEALED, FLAG_SOLE_HIT, FLAG_TRAILER, FLAGS_ACCEPTED, HEADER_BYTES, Kind,
    MAGIC, Op, SEAL_BYTES, SOLE_HIT_TAIL_BYTES, VERSION, WireError, offset, text,
};

/// Header bytes a seal covers: everything before the header checksum, with the seal slot
/// zeroed. The body follows them in the MAC input.
pub const SEALED_HEADER_BYTES: usize = offset::HEADER_CHECKSUM;

/// The header checksum: the low 32 bits of XXH3-64 of `bytes` (the header up to its checksum
/// field).
pub fn header_checksum(bytes: &[u8]) -> u32 {
    let [a, b, c, d, ..] = Checksum::of(bytes).0.to_le_bytes();
    u32::from_le_bytes([a, b, c, d])
}

fn field<const N: usize>(bytes: &[u8; HEADER_BYTES], at: usize) -> [u8; N] {
    let mut out = [0; N];
    if let Some(src) = bytes.get(at..at + N) {
        out.copy_from_slice(src);
    }
    out
}

fn set(bytes: &mut [u8; HEADER_BYTES], at: usize, value: &[u8]) {
    if let Some(dst) = bytes.get_mut(at..at + value.len()) {
        dst.copy_from_slice(value);
    }
}

/// Every header field as raw numbers, unvalidated. [`FrameHeader::to_bytes`] computes the
/// header checksum; everything else is written as given, so tests can build any header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub magic: [u8; 4],
    pub version: u8,
    pub kind: u8,
    pub op: u8,
    pub flags: u8,
    pub request_id: u64,
    pub body_len: u32,
    pub body_checksum: u64,
    pub seal: [u8; SEAL_BYTES],
}

impl FrameHeader {
    /// A valid version-1 header for `body` (which must fit a `u32` length; longer bodies get
    /// `u32::MAX`, which no decoder accepts).
    pub fn new(kind: Kind, op: Op, request_id: u64, body: &[u8]) -> Self {
        let (flags, body_checksum) = body_checksum(kind, op, body);
        Self::with_checksum(kind, op, request_id, body.len(), flags, body_checksum)
    }

    pub(super) fn with_checksum(
        kind: Kind,
        op: Op,
        request_id: u64,
        body_len: usize,
        flags: u8,
        body_checksum: u64,
    ) -> Self {
        Self {
            magic: MAGIC,
            version: VERSION,
            kind: kind.code(),
            op: op.code(),
            flags,
            request_id,
            body_len: u32::try_from(body_len).unwrap_or(u32::MAX),
            body_checksum,
            seal: [0; SEAL_BYTES],
        }
    }

    /// What a seal covers of this header: bytes `0..60` with the seal slot zeroed.
    pub fn seal_input(&self) -> [u8; SEALED_HEADER_BYTES] {
        let unsealed = Self { seal: [0; SEAL_BYTES], ..*self }.to_bytes();
        let mut out = [0; SEALED_HEADER_BYTES];
        out.copy_from_slice(&unsealed[..SEALED_HEADER_BYTES]);
        out
    }

    /// Marks the header sealed and fills its seal slot with `key`'s MAC of the header and
    /// `body`.
    pub fn seal_with(&mut self, key: &SealKey, body: &[u8]) {
        self.flags |= FLAG_SEALED;
        self.seal = key.mac(&[&self.seal_input(), body]);
    }

    /// The header bytes, ending with the header checksum.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        set(&mut b, offset::MAGIC, &self.magic);
        set(&mut b, offset::VERSION, &[self.version]);
        set(&mut b, offset::KIND, &[self.kind]);
        set(&mut b, offset::OP, &[self.op]);
        set(&mut b, offset::FLAGS, &[self.flags]);
        set(&mut b, offset::REQUEST_ID, &self.request_id.to_le_bytes());
        set(&mut b, offset::BODY_LEN, &self.body_len.to_le_bytes());
        set(&mut b, offset::BODY_CHECKSUM, &self.body_checksum.to_le_bytes());
        set(&mut b, offset::SEAL, &self.seal);
        let sum = header_checksum(b.get(..offset::HEADER_CHECKSUM).unwrap_or_default());
        set(&mut b, offset::HEADER_CHECKSUM, &sum.to_le_bytes());
        b
    }

    /// Reads every field (but not the header checksum) without checking anything.
    pub fn from_bytes(b: &[u8; HEADER_BYTES]) -> Self {
        Self {
            magic: field(b, offset::MAGIC),
            version: field::<1>(b, offset::VERSION)[0],
            kind: field::<1>(b, offset::KIND)[0],
            op: field::<1>(b, offset::OP)[0],
            flags: field::<1>(b, offset::FLAGS)[0],
            request_id: u64::from_le_bytes(field(b, offset::REQUEST_ID)),
            body_len: u32::from_le_bytes(field(b, offset::BODY_LEN)),
            body_checksum: u64::from_le_bytes(field(b, offset::BODY_CHECKSUM)),
            seal: field(b, offset::SEAL),
        }
    }
}

/// Whether a frame of `kind` and `op` carries its payloads before a trailer
/// ([`FLAG_TRAILER`]): GET answers and PUT requests. Their frame checksum covers the trailer
/// only; each payload has its own checksum in the trailer, which the receiver checks in the
/// pass that copies it out (the client as it lands a GET, the store as it stores a PUT).
pub(super) fn uses_trailer(kind: Kind, op: Op) -> bool {
    matches!((kind, op), (Kind::Response, Op::Get) | (Kind::Request, Op::Put))
}

/// Where the part of `body` its checksum covers starts, for a frame with [`FLAG_TRAILER`]:
/// the trailer and its 4-byte length at the end. `None` when the length does not fit.
pub(super) fn trailer_start(body: &[u8]) -> Option<usize> {
    let at = body.len().checked_sub(4)?;
    let t = usize::try_from(u32::from_le_bytes(body.get(at..)?.try_into().ok()?)).ok()?;
    at.checked_sub(t)
}

/// The flags and body checksum a frame of `kind` and `op` is sent with: the trailer's
/// checksum for a GET answer or PUT laid out with one (and [`FLAG_SOLE_HIT`] for a GET answer
/// that is one hit), the whole body's otherwise.
fn body_checksum(kind: Kind, op: Op, body: &[u8]) -> (u8, u64) {
    match trailer_start(body).filter(|_| uses_trailer(kind, op)) {
        Some(start) => {
            let sole = kind == Kind::Response && op == Op::Get && sole_hit(body).is_some();
            let flags = if sole { FLAG_TRAILER | FLAG_SOLE_HIT } else { FLAG_TRAILER };
            (flags, Checksum::of(body.get(start..).unwrap_or_default()).0)
        }
        None => (0, Checksum::of(body).0),
    }
}

/// The checksum and length of the one hit a GET answer body holds when it is exactly that:
/// its payload, then a trailer that describes one hit of the payload's length.
pub fn sole_hit(body: &[u8]) -> Option<(Checksum, usize)> {
    let n = body.len().checked_sub(SOLE_HIT_TAIL_BYTES)?;
    let mut r = Reader::new(body.get(n..)?);
    let tags = (r.count().ok()?, r.u8("").ok()?, r.u8("").ok()?);
    let checksum = Checksum(r.u64("").ok()?);
    let len = usize::try_from(r.u32("").ok()?).ok()?;
    let trailer = usize::try_from(r.u32("").ok()?).ok()?;
    (tags == (1, 0, 0) && len == n && trailer == SOLE_HIT_TAIL_BYTES - 4).then_some((checksum, n))
}

/// A whole frame whose header and body checksums verified, with a known kind and op. A sealed
/// frame's seal has not been checked yet: that needs the session's key
/// ([`Frame::verify_seal`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub op: Op,
    pub request_id: u64,
    pub body: Vec<u8>,
    /// The seal slot of a frame with [`FLAG_SEALED`]; `None` for an unsealed frame.
    pub seal: Option<[u8; SEAL_BYTES]>,
}

impl Frame {
    /// The frame's header as it was (or will be) sent.
    pub fn header(&self) -> FrameHeader {
        let mut header = FrameHeader::new(self.kind, self.op, self.request_id, &self.body);
        if let Some(seal) = self.seal {
            header.flags |= FLAG_SEALED;
            header.seal = seal;
        }
        header
    }

    /// Checks the seal under `key`: [`WireError::Unsealed`] for an unsealed frame,
    /// [`WireError::SealMismatch`] for a seal that does not verify.
    pub fn verify_seal(&self, key: &SealKey) -> Result<(), WireError> {
        let Some(seal) = self.seal else { return Err(WireError::Unsealed) };
        key.verify(&[&self.header().seal_input(), &self.body], &seal)
    }

    /// Appends the frame's bytes (with its seal, when it has one). Refuses a body over
    /// [`BODY_BYTES_MAX`].
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        if self.body.len() > BODY_BYTES_MAX {
            return Err(too_large(self.body.len()));
        }
        out.extend_from_slice(&self.header().to_bytes());
        out.extend_from_slice(&self.body);
        Ok(())
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::with_capacity(HEADER_BYTES + self.body.len());
        self.encode_into(&mut out)?;
        Ok(out)
    }
}

fn too_large(len: usize) -> WireError {
    WireError::TooLarge { len: wide(len), max: wide(BODY_BYTES_MAX) }
}

/// Appends a frame whose body `body` writes straight into `out` after room for the header, so
/// a payload is copied once; with `seal`, the MAC of the finished header and body goes into
/// the header last. On error `out` is left as it was.
pub(super) fn write_frame(
    kind: Kind,
    op: Op,
    request_id: u64,
    seal: Option<&SealKey>,
    out: &mut Vec<u8>,
    body: impl FnOnce(&mut Writer<'_>),
) -> Result<(), WireError> {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_BYTES]);
    finish_frame(kind, op, request_id, seal, out, start, body)
}

/// Completes the frame that starts at `start` of `out`: its first [`HEADER_BYTES`] are room
/// for the header (whatever they hold is overwritten), the bytes after them are the start of
/// its body, and `body` appends the rest. On error `out` is cut back to `start`.
pub(super) fn finish_frame(
    kind: Kind,
    op: Op,
    request_id: u64,
    seal: Option<&SealKey>,
    out: &mut Vec<u8>,
    start: usize,
    body: impl FnOnce(&mut Writer<'_>),
) -> Result<(), WireError> {
    let mut w = Writer::new(out);
    body(&mut w);
    let result = w.finish().and_then(|()| {
        let len = out.len().saturating_sub(start + HEADER_BYTES);
        if len > BODY_BYTES_MAX { Err(too_large(len)) } else { Ok(()) }
    });
    if let Err(e) = result {
        out.truncate(start);
        return Err(e);
    }
    let (_, rest) = out.split_at_mut(start);
    let (head, body) = rest.split_at_mut(HEADER_BYTES);
    let mut header = FrameHeader::new(kind, op, request_id, body);
    if let Some(key) = seal {
        header.seal_with(key, body);
    }
    head.copy_from_slice(&header.to_bytes());
    Ok(())
}

/// A frame the decoder could not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct FrameError {
    pub error: WireError,
    /// The request id of the offending frame when its header checksum verified (answer with
    /// it); `None` when the header could not be trusted (answer with 0).
    pub request_id: Option<u64>,
}

impl FrameError {
    /// Whether the stream has lost frame sync: bad magic, bad header checksum, an oversize body
    /// length or an unknown version. The decoder stays failed; the connection must be closed
    /// (after a best-effort [`super::Response::Error`]). Otherwise the bad frame was consumed
    /// whole and decoding continues with the next one.
    pub fn resync_impossible(&self) -> bool {
        self.error.closes_connection()
    }
}

/// The first body allocation; later growth doubles, never past the announced length.
const BODY_CHUNK_BYTES: usize = 64 << 10;

#[derive(Debug)]
enum State {
    /// Filling the header array.
    Header,
    /// Filling the body of a frame whose header verified.
    Body {
        kind: Kind,
        op: Op,
        request_id: u64,
        checksum: u64,
        /// The checksum covers only the body's trailer ([`FLAG_TRAILER`]).
        trailer: bool,
        /// The body is one GET hit ([`FLAG_SOLE_HIT`]).
        sole_hit: bool,
        seal: Option<[u8; SEAL_BYTES]>,
        len: usize,
        /// Body bytes received so far.
        filled: usize,
        /// The body buffer: `body.len()` bytes are initialised (`filled <= body.len() <= len`);
        /// bytes past `filled` are scratch, never read.
        body: Vec<u8>,
    },
    /// Discarding the body of a frame refused for a per-frame reason.
    Skip { request_id: u64, remaining: usize, error: WireError },
    /// A frame (or a per-frame error) waits for [`FrameDecoder::next_frame`].
    Ready(Result<Frame, FrameError>),
    /// The stream lost sync; every later call reports this error.
    Failed(FrameError),
}

/// Incremental frame decoder: [`Self::push`] bytes as they arrive, then take frames with
/// [`Self::next_frame`] (or do both with [`Self::feed`]).
///
/// It holds at most one frame: `push` stops at the end of each frame until it is taken. The
/// body buffer grows with the bytes actually received (doubling from 64 KiB) and never beyond
/// the body length the verified header announced, which is refused over [`BODY_BYTES_MAX`]
/// before anything is allocated. The header sits in a fixed array.
#[derive(Debug)]
pub struct FrameDecoder {
    header: [u8; HEADER_BYTES],
    filled: usize,
    state: State,
    /// A body buffer handed back by [`Self::recycle`], reused for the next body so that
    /// steady traffic neither allocates nor faults in fresh pages.
    spare: Vec<u8>,
}

/// Largest body buffer [`FrameDecoder::recycle`] keeps for reuse; a bigger one is freed.
pub const RECYCLE_BYTES_MAX: usize = 8 << 20;

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self { header: [0; HEADER_BYTES], filled: 0, state: State::Header, spare: Vec::new() }
    }

    /// Consumes bytes from the front of `input` up to the end of the frame in progress and
    /// returns how many it took: fewer than `input.len()` when a frame (or an error) is ready,
    /// 0 while one waits to be taken or after the stream failed. Feed the rest after
    /// [`Self::next_frame`].
    #[must_use = "the bytes after the returned count were not consumed"]
    pub fn push(&mut self, input: &[u8]) -> usize {
        let mut used = 0;
        while let Some(rest) = input.get(used..).filter(|r| !r.is_empty()) {
            let taken = match &mut self.state {
                State::Header => self.fill_header(rest),
                State::Body { len, filled, body, .. } => {
                    let n = len.saturating_sub(*filled).min(rest.len());
                    grow(body, *filled + n, *len);
                    if let (Some(dst), Some(src)) =
                        (body.get_mut(*filled..*filled + n), rest.get(..n))
                    {
                        dst.copy_from_slice(src);
                    }
                    *filled += n;
                    if *filled == *len {
                        self.finish_body();
                    }
                    n
                }
                State::Skip { request_id, remaining, error } => {
                    let n = (*remaining).min(rest.len());
                    *remaining -= n;
                    if *remaining == 0 {
                        let e = FrameError { error: error.clone(), request_id: Some(*request_id) };
                        self.state = State::Ready(Err(e));
                    }
                    n
                }
                State::Ready(_) | State::Failed(_) => break,
            };
            used += taken;
        }
        used
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed, or the error of the next
    /// frame. After an error with [`FrameError::resync_impossible`] every call returns it
    /// again.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        match std::mem::replace(&mut self.state, State::Header) {
            State::Ready(result) => result.map(Some),
            State::Failed(e) => {
                self.state = State::Failed(e.clone());
                Err(e)
            }
            other => {
                self.state = other;
                Ok(None)
            }
        }
    }

    /// Pushes from `input` (advancing it past what was consumed) until a frame or an error is
    /// ready; `Ok(None)` means `input` is used up and more bytes are needed.
    pub fn feed(&mut self, input: &mut &[u8]) -> Result<Option<Frame>, FrameError> {
        loop {
            if let Some(frame) = self.next_frame()? {
                return Ok(Some(frame));
            }
            if input.is_empty() {
                return Ok(None);
            }
            let n = self.push(input);
            *input = input.get(n..).unwrap_or_default();
            if n == 0 {
                // Nothing ready and nothing taken cannot happen; refuse to spin if it does.
                return self.next_frame();
            }
        }
    }

    /// Where the rest of the body in progress can be read straight from the socket, skipping
    /// the copy [`Self::push`] makes: a window of at most the bytes still missing, grown by the
    /// same doubling rule (never past the announced length). `None` between bodies. Report
    /// what was read into it with [`Self::commit_body`].
    pub fn body_window(&mut self) -> Option<&mut [u8]> {
        let State::Body { len, filled, body, .. } = &mut self.state else { return None };
        if *filled >= *len {
            return None;
        }
        grow(body, *filled + 1, *len);
        body.get_mut(*filled..)
    }

    /// For a body in progress that is one GET hit ([`FLAG_SOLE_HIT`]) and has not been
    /// received past its payload: the payload's length and the part of it already in the
    /// decoder. A receiver may take the rest of the payload itself ([`Self::skip_body`]).
    pub fn sole_hit_payload(&self) -> Option<(usize, &[u8])> {
        let State::Body { len, filled, body, sole_hit: true, .. } = &self.state else {
            return None;
        };
        let payload = len.checked_sub(SOLE_HIT_TAIL_BYTES)?;
        (*filled <= payload).then(|| (payload, body.get(..*filled).unwrap_or_default()))
    }

    /// Records that the receiver took the next `n` body bytes (at most up to the end of a
    /// sole hit's payload) into its own buffer: they count as received but are never in the
    /// decoder's buffer, so the frame's payload part is not the payload (only its trailer is
    /// meaningful, and [`sole_hit`] reads it).
    pub fn skip_body(&mut self, n: usize) {
        let payload = self.sole_hit_payload().map(|(p, _)| p);
        let State::Body { len, filled, body, .. } = &mut self.state else { return };
        let Some(payload) = payload else { return };
        let n = n.min(payload - *filled);
        grow(body, *filled + n, *len);
        *filled += n;
        if *filled == *len {
            self.finish_body();
        }
    }

    /// Records `n` bytes read into [`Self::body_window`]. More than the window held is a
    /// caller bug; it is clamped.
    pub fn commit_body(&mut self, n: usize) {
        let State::Body { len, filled, body, .. } = &mut self.state else { return };
        *filled = (*filled + n).min(body.len()).min(*len);
        if *filled == *len {
            self.finish_body();
        }
    }

    /// Hands back a frame's body buffer for the next frame to reuse (kept when it is larger
    /// than the one kept already and at most [`RECYCLE_BYTES_MAX`]).
    pub fn recycle(&mut self, body: Vec<u8>) {
        if body.capacity() > self.spare.capacity() && body.capacity() <= RECYCLE_BYTES_MAX {
            self.spare = body;
        }
    }

    /// Whether the stream lost sync (the connection must close).
    pub fn is_failed(&self) -> bool {
        matches!(self.state, State::Failed(_))
    }

    /// Whether the decoder is between frames (no partial frame buffered).
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Header) && self.filled == 0
    }

    /// The request id and announced body length of the frame whose verified header has arrived
    /// and whose body is being received; `None` otherwise. A server charges the length against
    /// its budgets here, before any body byte is buffered (see [`Self::header_missing`]).
    pub fn body_in_progress(&self) -> Option<(u64, usize)> {
        match &self.state {
            State::Body { request_id, len, .. } => Some((*request_id, *len)),
            _ => None,
        }
    }

    /// How many bytes of the next header are still missing while one is being received
    /// ([`HEADER_BYTES`] between frames); `None` otherwise. Pushing no more than this stops
    /// the decoder at the header's end, before it allocates anything for the body.
    pub fn header_missing(&self) -> Option<usize> {
        matches!(self.state, State::Header).then(|| HEADER_BYTES - self.filled)
    }

    /// Heap bytes the decoder holds for the frame in progress or waiting (the header array
    /// is not counted).
    pub fn buffer_capacity(&self) -> usize {
        match &self.state {
            State::Body { body, .. } => body.capacity(),
            State::Ready(Ok(frame)) => frame.body.capacity(),
            _ => 0,
        }
    }

    fn fill_header(&mut self, rest: &[u8]) -> usize {
        let start = self.filled;
        let n = (HEADER_BYTES - start).min(rest.len());
        if let (Some(dst), Some(src)) = (self.header.get_mut(start..start + n), rest.get(..n)) {
            dst.copy_from_slice(src);
        }
        self.filled += n;
        if let Some(error) = self.check_prefix(start) {
            self.state = State::Failed(FrameError { error, request_id: None });
        } else if self.filled == HEADER_BYTES {
            self.filled = 0;
            self.state = self.on_header();
        }
        n
    }

    /// Checks the magic and the version as soon as their bytes arrive, so garbage and foreign
    /// versions are refused without waiting for a whole header. `start` is how much had been
    /// checked before.
    fn check_prefix(&self, start: usize) -> Option<WireError> {
        let magic_seen = self.filled.min(MAGIC.len());
        if start < MAGIC.len() && self.header.get(..magic_seen) != MAGIC.get(..magic_seen) {
            let mut found = [0; 4];
            if let (Some(dst), Some(src)) =
                (found.get_mut(..magic_seen), self.header.get(..magic_seen))
            {
                dst.copy_from_slice(src);
            }
            return Some(WireError::BadMagic { found });
        }
        if start <= offset::VERSION && self.filled > offset::VERSION {
            let version = self.header[offset::VERSION];
            if version != VERSION {
                return Some(WireError::UnsupportedVersion { found: version, supported: VERSION });
            }
        }
        None
    }

    /// Validates a complete header and picks what follows it.
    fn on_header(&mut self) -> State {
        let h = FrameHeader::from_bytes(&self.header);
        let found = u32::from_le_bytes(field(&self.header, offset::HEADER_CHECKSUM));
        let computed = header_checksum(self.header.get(..offset::HEADER_CHECKSUM).unwrap_or(&[]));
        if found != computed {
            let error = WireError::HeaderChecksum { found, computed };
            return State::Failed(FrameError { error, request_id: None });
        }
        let request_id = h.request_id;
        let len = usize::try_from(h.body_len).unwrap_or(usize::MAX);
        if len > BODY_BYTES_MAX {
            let error =
                WireError::TooLarge { len: u64::from(h.body_len), max: wide(BODY_BYTES_MAX) };
            return State::Failed(FrameError { error, request_id: Some(request_id) });
        }
        let accepted = Kind::from_code(h.kind)
            .ok_or(WireError::UnknownKind { kind: h.kind })
            .and_then(|kind| {
                if h.flags & !FLAGS_ACCEPTED != 0 {
                    return Err(WireError::UnsupportedFlags { flags: h.flags });
                }
                let trailer_ok = Op::from_code(h.op).is_some_and(|op| uses_trailer(kind, op));
                if h.flags & FLAG_TRAILER != 0 && !trailer_ok {
                    return Err(WireError::UnsupportedFlags { flags: h.flags });
                }
                let sole_ok =
                    h.flags & FLAG_TRAILER != 0 && kind == Kind::Response && h.op == Op::Get.code();
                if h.flags & FLAG_SOLE_HIT != 0 && !sole_ok {
                    return Err(WireError::UnsupportedFlags { flags: h.flags });
                }
                if h.flags & FLAG_SEALED == 0 && h.seal != [0; SEAL_BYTES] {
                    return Err(WireError::Malformed { what: text::SEAL });
                }
                Op::from_code(h.op)
                    .filter(|op| op.valid_for(kind))
                    .map(|op| (kind, op))
                    .ok_or(WireError::UnknownOp { op: h.op })
            });
        match accepted {
            Err(error) if len == 0 => {
                State::Ready(Err(FrameError { error, request_id: Some(request_id) }))
            }
            Err(error) => State::Skip { request_id, remaining: len, error },
            Ok((kind, op)) => {
                // A recycled buffer keeps its initialised bytes (scratch until overwritten).
                let mut body = std::mem::take(&mut self.spare);
                body.truncate(len);
                let seal = (h.flags & FLAG_SEALED != 0).then_some(h.seal);
                let checksum = h.body_checksum;
                let trailer = h.flags & FLAG_TRAILER != 0;
                let sole_hit = h.flags & FLAG_SOLE_HIT != 0;
                let mut state = State::Body {
                    kind,
                    op,
                    request_id,
                    checksum,
                    trailer,
                    sole_hit,
                    seal,
                    len,
                    filled: 0,
                    body,
                };
                if len == 0 {
                    state = verify(state);
                }
                state
            }
        }
    }

    fn finish_body(&mut self) {
        let state = std::mem::replace(&mut self.state, State::Header);
        self.state = verify(state);
    }
}

/// Turns a complete [`State::Body`] into a ready frame or a body checksum error.
fn verify(state: State) -> State {
    let State::Body {
        kind,
        op,
        request_id,
        checksum,
        trailer,
        sole_hit: sole,
        seal,
        mut body,
        filled,
        ..
    } = state
    else {
        return state;
    };
    body.truncate(filled);
    if sole && sole_hit(&body).is_none() {
        let error = WireError::Malformed { what: text::TRAILER };
        return State::Ready(Err(FrameError { error, request_id: Some(request_id) }));
    }
    let covered = if trailer {
        match trailer_start(&body) {
            Some(start) => body.get(start..).unwrap_or_default(),
            None => {
                let error = WireError::Malformed { what: text::TRAILER };
                return State::Ready(Err(FrameError { error, request_id: Some(request_id) }));
            }
        }
    } else {
        &body
    };
    let computed = Checksum::of(covered).0;
    if computed == checksum {
        State::Ready(Ok(Frame { kind, op, request_id, body, seal }))
    } else {
        let error = WireError::BodyChecksum { found: checksum, computed };
        State::Ready(Err(FrameError { error, request_id: Some(request_id) }))
    }
}

/// Makes at least `needed` bytes of a body of announced length `len` initialised: the first
/// step is [`BODY_CHUNK_BYTES`], later ones at least double (so growth is amortised and memory
/// follows the bytes that actually arrive), never past `len`.
fn grow(body: &mut Vec<u8>, needed: usize, len: usize) {
    if needed > body.len() {
        let target = needed.max(body.len().saturating_mul(2)).max(BODY_CHUNK_BYTES).min(len);
        body.resize(target, 0);
    }
}

/// Writes every byte of `parts`, in order, with as few calls as the socket allows: how a
/// frame goes out whose payload is sent from where it lies (between a header and a trailer).
pub fn write_all_vectored<W: Write>(
    stream: &mut W,
    mut parts: &mut [IoSlice<'_>],
) -> io::Result<()> {
    while !parts.is_empty() {
        match stream.write_vectored(parts) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
