//! RESP, the Redis protocol, as the RESP front speaks it: a strict, bounded, incremental
//! request decoder ([`RequestDecoder`]), the replies ([`Reply`]) in either protocol version a
//! connection chose ([`RespVersion`]: RESP2, or RESP3 after `HELLO 3`) and a request encoder
//! ([`encode_request`]) for clients and tests. Pure: bytes in, values out, no I/O; the listener
//! that runs commands over a store is `gpucache_service::resp`.
//!
//! Requests are RESP2 arrays of bulk strings (RESP3 did not change requests), or inline
//! commands (one line of words separated by spaces or tabs; quotes are not interpreted). Every
//! length is checked against the constants here and [`RespLimits`] before its bytes are waited
//! for, and after any [`ProtocolError`] the stream cannot be resynchronised.

use gpucache_dataplane::limits::ResourceLimits;

// ---------------------------------------------------------------------------------------------
// Limits

/// Most arguments (command name included) in one request.
pub const ARGS_MAX: usize = 1024;
/// Longest inline command line, without its line end.
pub const INLINE_BYTES_MAX: usize = 64 << 10;
/// Longest `*<count>` or `$<length>` line, CRLF included.
pub const LENGTH_LINE_BYTES_MAX: usize = 32;
/// How far a bulk string may exceed the value limit: a value slightly over `object_bytes_max`
/// still decodes, so the store refuses it with its own reason and the connection stays open.
pub const BULK_SLACK_BYTES: usize = 64 << 10;
/// The value limit the decoder uses at most, whatever `object_bytes_max` is (the same as Redis'
/// default `proto-max-bulk-len`).
pub const VALUE_BYTES_CEILING: usize = 512 << 20;
/// How much one request's arguments together may exceed the bulk limit (room for the command
/// name and keys next to one large value).
pub const REQUEST_SLACK_BYTES: usize = 1 << 20;
/// A decoder buffer grown past this by one large request is given back once it is drained.
const DECODER_KEEP_BYTES: usize = 4 << 20;

/// Size limits of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RespLimits {
    /// Longest bulk string.
    pub bulk_bytes_max: usize,
    /// Most bytes of all bulk strings of one request together.
    pub request_bytes_max: usize,
}

impl RespLimits {
    /// The limits for a store whose largest value is `object_bytes_max`: a bulk string may be
    /// that long (capped at [`VALUE_BYTES_CEILING`]) plus [`BULK_SLACK_BYTES`], and a whole
    /// request [`REQUEST_SLACK_BYTES`] more.
    pub fn for_object_bytes_max(object_bytes_max: u64) -> Self {
        let object = usize::try_from(object_bytes_max).unwrap_or(usize::MAX);
        let bulk = object.min(VALUE_BYTES_CEILING) + BULK_SLACK_BYTES;
        Self { bulk_bytes_max: bulk, request_bytes_max: bulk + REQUEST_SLACK_BYTES }
    }
}

impl Default for RespLimits {
    /// The limits for the default `object_bytes_max`.
    fn default() -> Self {
        Self::for_object_bytes_max(ResourceLimits::default().object_bytes_max)
    }
}

// ---------------------------------------------------------------------------------------------
// Request decoding

/// Why a request could not be decoded. The stream cannot be resynchronised after any of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("invalid multibulk length")]
    ArrayLength,
    #[error("{count} arguments exceed the limit of {max}")]
    TooManyArgs { count: u64, max: usize },
    #[error("expected '$', got {found:?}")]
    ExpectedBulk { found: char },
    #[error("invalid bulk length")]
    BulkLength,
    #[error("bulk string of {len} bytes exceeds the limit of {max}")]
    BulkTooLarge { len: u64, max: usize },
    #[error("request arguments of {len} bytes exceed the limit of {max}")]
    RequestTooLarge { len: u64, max: usize },
    #[error("bulk string not followed by CRLF")]
    BulkTerminator,
    #[error("length line not ended by CRLF within {max} bytes")]
    LengthLine { max: usize },
    #[error("inline request longer than {max} bytes")]
    InlineTooLong { max: usize },
}

/// One step of decoding the front of the buffer.
enum Parsed {
    /// More bytes are needed; nothing is worth retrying before the buffer holds `need` bytes.
    Incomplete {
        need: usize,
    },
    /// A request with no words (an empty line, `*0`): skipped.
    Empty {
        used: usize,
    },
    Request {
        args: Vec<Vec<u8>>,
        used: usize,
    },
}

/// An incremental, bounded RESP2 request decoder.
///
/// Feed it bytes as they arrive and take complete requests out with
/// [`RequestDecoder::next_request`] until it answers `None` before feeding more. Used that way it
/// holds at most one incomplete request, whose size the limits bound before its bytes arrive,
/// plus what was fed last. After an error it must not be used again.
#[derive(Debug)]
pub struct RequestDecoder {
    buf: Vec<u8>,
    /// Where the undecoded bytes start in `buf`.
    start: usize,
    /// Undecoded bytes needed before decoding is worth trying again.
    need: usize,
    limits: RespLimits,
}

impl RequestDecoder {
    pub fn new(limits: RespLimits) -> Self {
        Self { buf: Vec::new(), start: 0, need: 0, limits }
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.start > 0 && (self.start == self.buf.len() || self.start >= self.buf.len() / 2) {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        if self.buf.is_empty() && self.buf.capacity() > DECODER_KEEP_BYTES {
            self.buf = Vec::new();
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Whether no undecoded byte is buffered.
    pub fn is_idle(&self) -> bool {
        self.start == self.buf.len()
    }

    /// Undecoded bytes buffered.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next complete request (its words, the command name first), `None` when more bytes
    /// are needed.
    pub fn next_request(&mut self) -> Result<Option<Vec<Vec<u8>>>, ProtocolError> {
        loop {
            let data = &self.buf[self.start..];
            if data.is_empty() || data.len() < self.need {
                return Ok(None);
            }
            let parsed =
                if data[0] == b'*' { parse_array(data, self.limits)? } else { parse_inline(data)? };
            match parsed {
                Parsed::Incomplete { need } => {
                    self.need = need;
                    return Ok(None);
                }
                Parsed::Empty { used } => {
                    self.start += used;
                    self.need = 0;
                }
                Parsed::Request { args, used } => {
                    self.start += used;
                    self.need = 0;
                    return Ok(Some(args));
                }
            }
        }
    }
}

/// The `*<n>` or `$<n>` line starting at `at`: its text without the CRLF, and where the next
/// line starts. `None` when the line has not fully arrived.
fn length_line(data: &[u8], at: usize) -> Result<Option<(&[u8], usize)>, ProtocolError> {
    let window = &data[at..data.len().min(at + LENGTH_LINE_BYTES_MAX)];
    match window.iter().position(|&b| b == b'\n') {
        Some(nl) if nl > 0 && window[nl - 1] == b'\r' => Ok(Some((&window[..nl - 1], at + nl + 1))),
        Some(_) => Err(ProtocolError::LengthLine { max: LENGTH_LINE_BYTES_MAX }),
        None if window.len() == LENGTH_LINE_BYTES_MAX => {
            Err(ProtocolError::LengthLine { max: LENGTH_LINE_BYTES_MAX })
        }
        None => Ok(None),
    }
}

/// A decimal integer as RESP writes one: an optional `-` and 1 to 18 digits, nothing else.
pub fn parse_int(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let magnitude = digits.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
    Some(if negative { -magnitude } else { magnitude })
}

fn parse_array(data: &[u8], limits: RespLimits) -> Result<Parsed, ProtocolError> {
    let incomplete = Parsed::Incomplete { need: data.len() + 1 };
    let Some((line, mut at)) = length_line(data, 0)? else { return Ok(incomplete) };
    let count = parse_int(&line[1..]).ok_or(ProtocolError::ArrayLength)?;
    // Like Redis, a count of zero or less is an empty request.
    let Ok(count) = u64::try_from(count) else { return Ok(Parsed::Empty { used: at }) };
    if count == 0 {
        return Ok(Parsed::Empty { used: at });
    }
    let count = usize::try_from(count)
        .ok()
        .filter(|&c| c <= ARGS_MAX)
        .ok_or(ProtocolError::TooManyArgs { count, max: ARGS_MAX })?;
    // Validate every length and find every argument before copying any, so that a request that
    // arrives in many pieces is copied once.
    let mut ranges = Vec::with_capacity(count);
    let mut total: u64 = 0;
    for _ in 0..count {
        let Some((line, next)) = length_line(data, at)? else { return Ok(incomplete) };
        match line.first() {
            Some(b'$') => {}
            Some(&other) => return Err(ProtocolError::ExpectedBulk { found: char::from(other) }),
            None => return Err(ProtocolError::ExpectedBulk { found: '\r' }),
        }
        let len = parse_int(&line[1..])
            .and_then(|n| u64::try_from(n).ok())
            .ok_or(ProtocolError::BulkLength)?;
        let bulk_max = limits.bulk_bytes_max;
        let len_bytes = usize::try_from(len)
            .ok()
            .filter(|&l| l <= bulk_max)
            .ok_or(ProtocolError::BulkTooLarge { len, max: bulk_max })?;
        total += len;
        if total > limits.request_bytes_max as u64 {
            return Err(ProtocolError::RequestTooLarge {
                len: total,
                max: limits.request_bytes_max,
            });
        }
        let end = next + len_bytes;
        if data.len() < end + 2 {
            return Ok(Parsed::Incomplete { need: end + 2 });
        }
        if &data[end..end + 2] != b"\r\n" {
            return Err(ProtocolError::BulkTerminator);
        }
        ranges.push((next, end));
        at = end + 2;
    }
    let args = ranges.into_iter().map(|(s, e)| data[s..e].to_vec()).collect();
    Ok(Parsed::Request { args, used: at })
}

fn parse_inline(data: &[u8]) -> Result<Parsed, ProtocolError> {
    let too_long = ProtocolError::InlineTooLong { max: INLINE_BYTES_MAX };
    let window = &data[..data.len().min(INLINE_BYTES_MAX + 2)];
    let Some(nl) = window.iter().position(|&b| b == b'\n') else {
        // One byte more may be the CR of a line of exactly the limit.
        return if window.len() > INLINE_BYTES_MAX + 1 {
            Err(too_long)
        } else {
            Ok(Parsed::Incomplete { need: data.len() + 1 })
        };
    };
    let line = &data[..nl];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.len() > INLINE_BYTES_MAX {
        return Err(too_long);
    }
    let args: Vec<Vec<u8>> = line
        .split(|&b| b == b' ' || b == b'\t')
        .filter(|w| !w.is_empty())
        .map(<[u8]>::to_vec)
        .collect();
    if args.len() > ARGS_MAX {
        return Err(ProtocolError::TooManyArgs { count: args.len() as u64, max: ARGS_MAX });
    }
    if args.is_empty() {
        return Ok(Parsed::Empty { used: nl + 1 });
    }
    Ok(Parsed::Request { args, used: nl + 1 })
}

/// Appends `args` as one RESP2 request, an array of bulk strings, to `out`: the form every Redis
/// client sends, and the one [`RequestDecoder`] reads back as exactly `args`.
pub fn encode_request<A: AsRef<[u8]>>(args: &[A], out: &mut Vec<u8>) {
    out.push(b'*');
    out.extend_from_slice(args.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for arg in args {
        let arg = arg.as_ref();
        out.push(b'$');
        out.extend_from_slice(arg.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

// ---------------------------------------------------------------------------------------------
// Replies

/// The reply protocol of a connection: RESP2 until a `HELLO 3` switches it to RESP3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RespVersion {
    #[default]
    Resp2,
    Resp3,
}

impl RespVersion {
    /// The version number `HELLO` names and answers: 2 or 3.
    pub fn number(self) -> i64 {
        match self {
            Self::Resp2 => 2,
            Self::Resp3 => 3,
        }
    }

    /// The version `HELLO <number>` asks for, `None` for any number but 2 and 3.
    pub fn from_number(number: i64) -> Option<Self> {
        match number {
            2 => Some(Self::Resp2),
            3 => Some(Self::Resp3),
            _ => None,
        }
    }
}

/// A reply, encoded for either protocol version. The two versions differ only where RESP3 has
/// its own type: [`Reply::Nil`], [`Reply::Map`] and [`Reply::Verbatim`]; everything else is the
/// same bytes in both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+text`; CR and LF in the text are sent as spaces.
    Simple(String),
    /// `-text`, where the text starts with an error code such as `ERR`; CR and LF are sent as
    /// spaces.
    Error(String),
    Integer(i64),
    Bulk(Vec<u8>),
    /// No value: the null bulk string `$-1` in RESP2, the null `_` in RESP3.
    Nil,
    Array(Vec<Reply>),
    /// Field-value pairs: a flat array of twice as many items in RESP2 (field, value, field,
    /// value, ...), a `%` map in RESP3.
    Map(Vec<(Reply, Reply)>),
    /// Text meant for people (INFO): a bulk string in RESP2, a `=` verbatim string of format
    /// `txt` in RESP3.
    Verbatim(String),
}

impl Reply {
    pub fn ok() -> Self {
        Self::Simple("OK".to_owned())
    }

    /// An `ERR` error with `message`.
    pub fn err(message: impl std::fmt::Display) -> Self {
        Self::Error(format!("ERR {message}"))
    }

    /// Appends the RESP2 wire form of the reply to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_as(RespVersion::Resp2, out);
    }

    /// Appends the wire form of the reply in `version` to `out`.
    pub fn encode_as(&self, version: RespVersion, out: &mut Vec<u8>) {
        let resp3 = version == RespVersion::Resp3;
        match self {
            Self::Simple(text) => line(out, b'+', text),
            Self::Error(text) => line(out, b'-', text),
            Self::Integer(n) => length(out, b':', *n),
            Self::Bulk(bytes) => bulk(out, b'$', bytes),
            Self::Nil if resp3 => out.extend_from_slice(b"_\r\n"),
            Self::Nil => out.extend_from_slice(b"$-1\r\n"),
            Self::Array(items) => {
                length(out, b'*', items.len());
                for item in items {
                    item.encode_as(version, out);
                }
            }
            Self::Map(pairs) => {
                if resp3 {
                    length(out, b'%', pairs.len());
                } else {
                    length(out, b'*', pairs.len() * 2);
                }
                for (field, value) in pairs {
                    field.encode_as(version, out);
                    value.encode_as(version, out);
                }
            }
            Self::Verbatim(text) if resp3 => {
                let mut framed = Vec::with_capacity(text.len() + 4);
                framed.extend_from_slice(b"txt:");
                framed.extend_from_slice(text.as_bytes());
                bulk(out, b'=', &framed);
            }
            Self::Verbatim(text) => bulk(out, b'$', text.as_bytes()),
        }
    }
}

/// `<kind><n>\r\n`.
fn length(out: &mut Vec<u8>, kind: u8, n: impl std::fmt::Display) {
    out.push(kind);
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// `<kind><len>\r\n<bytes>\r\n`.
fn bulk(out: &mut Vec<u8>, kind: u8, bytes: &[u8]) {
    length(out, kind, bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

fn line(out: &mut Vec<u8>, kind: u8, text: &str) {
    out.push(kind);
    out.extend(text.bytes().map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }));
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(bytes: &[u8], chunk: usize) -> Result<Vec<Vec<Vec<u8>>>, ProtocolError> {
        let mut d = RequestDecoder::new(RespLimits::default());
        let mut out = Vec::new();
        for piece in bytes.chunks(chunk.max(1)) {
            d.feed(piece);
            while let Some(r) = d.next_request()? {
                out.push(r);
            }
        }
        Ok(out)
    }

    fn words(ws: &[&[u8]]) -> Vec<Vec<u8>> {
        ws.iter().map(|w| w.to_vec()).collect()
    }

    #[test]
    fn arrays_and_inline_decode_under_any_chunking() {
        let input =
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n\r\nPING\r\n\r\n*0\r\n  get   k \n";
        let want =
            vec![words(&[b"SET", b"k", b"a\r\nb"]), words(&[b"PING"]), words(&[b"get", b"k"])];
        for chunk in 1..input.len() + 1 {
            assert_eq!(decode_all(input, chunk), Ok(want.clone()), "chunk {chunk}");
        }
    }

    #[test]
    fn malformed_requests_are_refused() {
        let cases: &[(&[u8], ProtocolError)] = &[
            (b"*x\r\n", ProtocolError::ArrayLength),
            (b"*2000\r\n", ProtocolError::TooManyArgs { count: 2000, max: ARGS_MAX }),
            (b"*1\r\n:1\r\n", ProtocolError::ExpectedBulk { found: ':' }),
            (b"*1\r\n$-1\r\n", ProtocolError::BulkLength),
            (b"*1\r\n$1x\r\n", ProtocolError::BulkLength),
            (b"*1\r\n$2\r\nabcd", ProtocolError::BulkTerminator),
            (b"*1\n", ProtocolError::LengthLine { max: LENGTH_LINE_BYTES_MAX }),
            (b"*1\r\n$99999999999\r\n", {
                let max = RespLimits::default().bulk_bytes_max;
                ProtocolError::BulkTooLarge { len: 99_999_999_999, max }
            }),
        ];
        for (input, want) in cases {
            assert_eq!(decode_all(input, 1).as_ref(), Err(want), "{input:?}");
        }
        let long = vec![b'a'; INLINE_BYTES_MAX + 2];
        assert_eq!(decode_all(&long, 4096), Err(ProtocolError::InlineTooLong { max: 65536 }));
        let endless = vec![b'1'; 100];
        let mut header = b"*".to_vec();
        header.extend_from_slice(&endless);
        assert!(matches!(decode_all(&header, 7), Err(ProtocolError::LengthLine { .. })));
    }

    #[test]
    fn the_request_total_is_bounded() {
        let limits = RespLimits { bulk_bytes_max: 10, request_bytes_max: 15 };
        let mut d = RequestDecoder::new(limits);
        d.feed(b"*2\r\n$10\r\n0123456789\r\n$6\r\n");
        assert_eq!(d.next_request(), Err(ProtocolError::RequestTooLarge { len: 16, max: 15 }));
    }

    #[test]
    fn replies_encode_exactly() {
        let mut out = Vec::new();
        Reply::Array(vec![
            Reply::ok(),
            Reply::err("bad\r\nthing"),
            Reply::Integer(-3),
            Reply::Bulk(b"a\r\n".to_vec()),
            Reply::Nil,
        ])
        .encode(&mut out);
        assert_eq!(out, b"*5\r\n+OK\r\n-ERR bad  thing\r\n:-3\r\n$3\r\na\r\n\r\n$-1\r\n");
    }

    #[test]
    fn replies_differ_between_versions_only_where_resp3_has_a_type() {
        let reply = Reply::Array(vec![
            Reply::Nil,
            Reply::Map(vec![
                (Reply::Bulk(b"proto".to_vec()), Reply::Integer(3)),
                (Reply::Bulk(b"modules".to_vec()), Reply::Array(vec![])),
            ]),
            Reply::Verbatim("# Server\r\n".to_owned()),
            Reply::Simple("OK".to_owned()),
        ]);
        let mut two = Vec::new();
        reply.encode_as(RespVersion::Resp2, &mut two);
        assert_eq!(
            two,
            &b"*4\r\n$-1\r\n*4\r\n$5\r\nproto\r\n:3\r\n$7\r\nmodules\r\n*0\r\n\
               $10\r\n# Server\r\n\r\n+OK\r\n"[..]
        );
        let mut plain = Vec::new();
        reply.encode(&mut plain);
        assert_eq!(plain, two, "encode is RESP2");
        let mut three = Vec::new();
        reply.encode_as(RespVersion::Resp3, &mut three);
        assert_eq!(
            three,
            &b"*4\r\n_\r\n%2\r\n$5\r\nproto\r\n:3\r\n$7\r\nmodules\r\n*0\r\n\
               =14\r\ntxt:# Server\r\n\r\n+OK\r\n"[..]
        );
        assert_eq!(RespVersion::from_number(2), Some(RespVersion::Resp2));
        assert_eq!(RespVersion::from_number(3).map(RespVersion::number), Some(3));
        assert_eq!(RespVersion::from_number(4), None);
        assert_eq!(RespVersion::default(), RespVersion::Resp2);
    }

    #[test]
    fn encoded_requests_decode_to_their_words() {
        let cases: Vec<Vec<Vec<u8>>> = vec![
            words(&[b"PING"]),
            words(&[b"SET", b"k", b"a\r\nb"]),
            words(&[b"GET", b""]),
            vec![vec![0u8, 0xff, b'\n'], vec![b'*'; 300]],
        ];
        let mut stream = Vec::new();
        for args in &cases {
            let mut one = Vec::new();
            encode_request(args, &mut one);
            assert_eq!(decode_all(&one, one.len()), Ok(vec![args.clone()]), "{args:?}");
            stream.extend_from_slice(&one);
        }
        for chunk in [1, 3, stream.len()] {
            assert_eq!(decode_all(&stream, chunk), Ok(cases.clone()), "chunk {chunk}");
        }
        let mut out = Vec::new();
        encode_request(&[&b"GET"[..], b"k"], &mut out);
        assert_eq!(out, b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
    }
}
