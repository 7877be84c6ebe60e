//! Fuzzes the RESP2 request decoder of the Redis front (`gpucache_wire::resp::RequestDecoder`).
//!
//! Input layout: a control byte, then a byte stream. Control bit 0 picks the limits: clear, the
//! defaults; set, tiny ones (64-byte bulk strings, 100 bytes a request) so that the limit
//! checks are reached. The other bits seed the sizes of the pieces the stream is fed in.
//!
//! Nothing may panic. The stream decoded from one buffer and fed in pieces must give the same
//! requests and end the same way (the same error, or the same undecoded tail): the decoder's
//! answers may not depend on where reads end. The decoder never claims more bytes than it was
//! given, and where it stops is exact: the bytes it consumed decode to the same requests with
//! nothing left over. Every request has between 1 and `ARGS_MAX` words within the limits, and
//! re-encoded as an array of bulk strings it decodes to exactly the same words.

use gpucache_wire::resp::{
    ARGS_MAX, INLINE_BYTES_MAX, ProtocolError, RequestDecoder, RespLimits, encode_request,
};

use crate::{Chunks, Outcome};

/// How decoding a stream ended.
#[derive(Debug, PartialEq, Eq)]
struct Decoded {
    requests: Vec<Vec<Vec<u8>>>,
    /// The error that stopped it, or how many bytes were left undecoded.
    end: Result<usize, ProtocolError>,
}

/// Feeds `pieces` one after the other, taking out every complete request after each.
fn decode<'a>(limits: RespLimits, pieces: impl IntoIterator<Item = &'a [u8]>) -> Decoded {
    let mut decoder = RequestDecoder::new(limits);
    let mut requests = Vec::new();
    let mut given = 0usize;
    for piece in pieces {
        decoder.feed(piece);
        given += piece.len();
        loop {
            match decoder.next_request() {
                Ok(Some(request)) => requests.push(request),
                Ok(None) => break,
                Err(e) => return Decoded { requests, end: Err(e) },
            }
        }
        assert!(decoder.buffered() <= given, "the decoder holds more bytes than it was given");
    }
    assert_eq!(decoder.is_idle(), decoder.buffered() == 0, "is_idle disagrees with buffered");
    Decoded { requests, end: Ok(decoder.buffered()) }
}

fn limits(control: u8) -> RespLimits {
    if control & 1 == 0 {
        RespLimits::default()
    } else {
        RespLimits { bulk_bytes_max: 64, request_bytes_max: 100 }
    }
}

/// Decodes `data` as the control byte says and checks every request; accepted when at least
/// one request came out.
pub fn run(data: &[u8]) -> Outcome {
    let Some((&control, stream)) = data.split_first() else { return Outcome::Refused };
    let limits = limits(control);
    let whole = decode(limits, [stream]);
    let pieces = decode(limits, Chunks::new(control >> 1, stream));
    assert_eq!(pieces, whole, "decoding depends on how the stream was cut");

    if let Ok(left) = whole.end {
        assert!(left <= stream.len(), "{left} bytes left of {}", stream.len());
        // The consumed prefix holds exactly the requests, with nothing over.
        let consumed = &stream[..stream.len() - left];
        let again = decode(limits, [consumed]);
        assert_eq!(again.requests, whole.requests, "the consumed bytes decode differently");
        assert_eq!(again.end, Ok(0), "the consumed bytes leave an undecoded tail");
    }

    // An inline request is bounded by its line, an array by the limits.
    let word_max = limits.bulk_bytes_max.max(INLINE_BYTES_MAX);
    let total_max = limits.request_bytes_max.max(INLINE_BYTES_MAX);
    for request in &whole.requests {
        assert!(!request.is_empty(), "a request with no words");
        assert!(request.len() <= ARGS_MAX, "{} words exceed ARGS_MAX", request.len());
        assert!(request.iter().all(|w| w.len() <= word_max), "a word over the limits");
        let total: usize = request.iter().map(Vec::len).sum();
        assert!(total <= total_max, "a request of {total} bytes over the limits");

        let mut encoded = Vec::new();
        encode_request(request, &mut encoded);
        let back = decode(RespLimits::default(), [&encoded[..]]);
        assert_eq!(
            back.requests,
            vec![request.clone()],
            "a re-encoded request decodes differently"
        );
        assert_eq!(back.end, Ok(0), "a re-encoded request leaves bytes over");
    }
    if whole.requests.is_empty() { Outcome::Refused } else { Outcome::Accepted }
}
