//! Fuzzes the GPCW frame decoder and the message codecs behind it.
//!
//! Input layout: a control byte, then the rest.
//! - Control bit 7 clear ("raw"): the rest is a byte stream fed to one `FrameDecoder` in chunks
//!   whose sizes come from a generator seeded by the control byte.
//! - Control bit 7 set ("wrapped"): the rest is `kind u8 | op u8 | body`, wrapped in a header
//!   with correct checksums before it is fed the same way, so the fuzzer reaches the body
//!   decoders instead of spending itself on the header checksum.
//!
//! Nothing may panic. The decoder must never buffer more than `BODY_BYTES_MAX`, must stay
//! failed after a resync-impossible error, and every frame it yields must re-encode to the
//! same bytes. Every request it accepts must re-encode byte for byte; every response it accepts
//! must re-encode to a frame that decodes to an equal response (static names it does not know
//! are normalised to "remote", so only the second encoding is byte-stable).

use gpucache_dataplane::checksum::Checksum;
use gpucache_wire::{
    BODY_BYTES_MAX, Frame, FrameDecoder, FrameHeader, Kind, MAGIC, Request, Response, SEAL_BYTES,
    VERSION,
};

use crate::Outcome;

/// Feeds `data` to a frame decoder as the control byte says and checks every frame it yields;
/// accepted when at least one frame came out.
pub fn run(data: &[u8]) -> Outcome {
    let Some((&control, rest)) = data.split_first() else { return Outcome::Refused };
    let frames = if control & 0x80 == 0 {
        decode_stream(control, rest)
    } else if let [kind, op, body @ ..] = rest {
        let header = FrameHeader {
            magic: MAGIC,
            version: VERSION,
            kind: *kind,
            op: *op,
            flags: 0,
            request_id: u64::from(control),
            body_len: u32::try_from(body.len()).unwrap_or(u32::MAX),
            body_checksum: Checksum::of(body).0,
            seal: [0; SEAL_BYTES],
        };
        let mut stream = header.to_bytes().to_vec();
        stream.extend_from_slice(body);
        decode_stream(control, &stream)
    } else {
        0
    };
    if frames > 0 { Outcome::Accepted } else { Outcome::Refused }
}

/// Feeds `stream` in pseudo-random chunks and checks every outcome; answers how many frames
/// were decoded and checked.
fn decode_stream(seed: u8, stream: &[u8]) -> usize {
    let mut frames = 0;
    let mut dec = FrameDecoder::new();
    for chunk in crate::Chunks::new(seed, stream) {
        let mut input = chunk;
        loop {
            assert!(dec.buffer_capacity() <= BODY_BYTES_MAX, "decoder buffer over the limit");
            match dec.feed(&mut input) {
                Ok(Some(frame)) => {
                    check_frame(&frame);
                    frames += 1;
                }
                Ok(None) => break,
                Err(e) if e.resync_impossible() => {
                    assert!(dec.is_failed(), "a resync-impossible error left the decoder open");
                    assert_eq!(dec.push(b"GPCW"), 0, "a failed decoder took bytes");
                    assert_eq!(dec.next_frame(), Err(e), "a failed decoder changed its error");
                    return frames;
                }
                Err(e) => assert!(e.request_id.is_some(), "per-frame error without an id: {e}"),
            }
        }
    }
    frames
}

/// Decodes exactly one frame from `bytes`.
fn single_frame(bytes: &[u8]) -> Frame {
    let mut dec = FrameDecoder::new();
    let mut input = bytes;
    let frame = match dec.feed(&mut input) {
        Ok(Some(frame)) => frame,
        other => panic!("a re-encoded frame does not decode: {other:?}"),
    };
    assert!(input.is_empty(), "a re-encoded frame has trailing bytes");
    frame
}

fn check_frame(frame: &Frame) {
    let bytes = frame.to_bytes().unwrap_or_else(|e| panic!("a decoded frame does not encode: {e}"));
    assert_eq!(&single_frame(&bytes), frame, "frame changed through encode and decode");
    match frame.kind {
        Kind::Request => {
            let Ok(request) = Request::from_frame(frame) else { return };
            let again = request
                .to_frame_bytes(frame.request_id)
                .unwrap_or_else(|e| panic!("a decoded request does not encode: {e}"));
            assert_eq!(again, bytes, "request encoding is not canonical");
            let back = Request::from_frame(&single_frame(&again));
            assert_eq!(back.as_ref(), Ok(&request), "request changed through the codec");
        }
        Kind::Response => {
            let Ok(response) = Response::from_frame(frame) else { return };
            let again = response
                .to_frame_bytes(frame.request_id)
                .unwrap_or_else(|e| panic!("a decoded response does not encode: {e}"));
            let back = Response::from_frame(&single_frame(&again))
                .unwrap_or_else(|e| panic!("a re-encoded response does not decode: {e}"));
            assert_eq!(back, response, "response changed through the codec");
            let third = back
                .to_frame_bytes(frame.request_id)
                .unwrap_or_else(|e| panic!("a re-decoded response does not encode: {e}"));
            assert_eq!(third, again, "response encoding is not stable");
        }
    }
}
