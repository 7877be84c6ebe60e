//! Fuzzes the Mooncake adapter's decoders (`gpucache_mooncake::wire`): the sidecar's reply
//! bodies (`reply`) and the stored object format (`parse_object`).
//!
//! Input layout: a control byte, then the rest.
//! - Control bit 7 clear: a reply. The control byte's value modulo 5 picks the operation that
//!   was asked for (PUT, GET, SIZE, EXISTS, REMOVE); the next 8 bytes are the request's
//!   argument (little-endian; a GET's buffer size), the rest is the reply body.
//! - Control bit 7 set: the rest is a whole stored object.
//!
//! Nothing may panic. An accepted reply's payload is exactly the bytes after the reply head,
//! as long as the operation allows (a GET's positive code, capped at its argument; nothing
//! otherwise), its status and code are the ones in the head, and the sidecar's encoding of it
//! (`reply_body`) decodes to the same reply: to the same bytes for a code. A refusal is the
//! documented one for what the bytes hold. An object is accepted exactly when it has the magic
//! and a length that matches its payload; its header then re-encodes to the input's whenever
//! the stored checksum is the payload's.

use gpucache_dataplane::checksum::Checksum;
use gpucache_mooncake::Raw;
use gpucache_mooncake::wire::{
    OBJECT_HEADER_BYTES, OBJECT_MAGIC, Op, REPLY_HEAD_BYTES, ReplyError, object_header,
    parse_object, reply, reply_body,
};

use crate::Outcome;

const OPS: [Op; 5] = [Op::Put, Op::Get, Op::Size, Op::Exists, Op::Remove];

/// Decodes the rest of `data` as the control byte says and checks the answer.
pub fn run(data: &[u8]) -> Outcome {
    let Some((&control, rest)) = data.split_first() else { return Outcome::Refused };
    if control & 0x80 == 0 {
        let op = OPS[usize::from(control) % OPS.len()];
        let Some((argument, body)) = rest.split_first_chunk::<8>() else {
            return Outcome::Refused;
        };
        check_reply(op, u64::from_le_bytes(*argument), body)
    } else {
        check_object(rest)
    }
}

fn check_reply(op: Op, argument: u64, body: &[u8]) -> Outcome {
    let decoded = reply(body, op, argument);
    let Some((head, after)) = body.split_first_chunk::<REPLY_HEAD_BYTES>() else {
        assert_eq!(decoded, Err(ReplyError::Short { len: body.len() }), "a short reply");
        return Outcome::Refused;
    };
    let code = i64::from_le_bytes(head[1..].try_into().expect("8 code bytes"));
    let raw = match head[0] {
        0 => Raw::Code(code),
        1 => Raw::Raised,
        2 => Raw::Refused,
        status => {
            assert_eq!(decoded, Err(ReplyError::Status { status }), "an unknown status");
            return Outcome::Refused;
        }
    };
    // What the payload must hold: a GET's positive code, at most what was asked for.
    let expected = match (raw, op) {
        (Raw::Code(c), Op::Get) if c > 0 => c.unsigned_abs().min(argument),
        _ => 0,
    };
    if expected != after.len() as u64 {
        assert_eq!(
            decoded,
            Err(ReplyError::Payload { code, len: after.len() }),
            "a payload of the wrong length"
        );
        return Outcome::Refused;
    }
    let (got, payload) = decoded.unwrap_or_else(|e| panic!("a well-formed reply refused: {e:?}"));
    assert_eq!(got, raw, "the reply's status or code");
    assert!(std::ptr::eq(payload, after), "the payload is not the bytes after the head");
    let again = reply_body(raw, payload);
    assert_eq!(reply(&again, op, argument), Ok((raw, payload)), "a re-encoded reply");
    if let Raw::Code(_) = raw {
        assert_eq!(again, body, "reply encoding is not canonical");
    }
    Outcome::Accepted
}

fn check_object(object: &[u8]) -> Outcome {
    let parsed = parse_object(object);
    let Some((head, payload)) = object.split_first_chunk::<OBJECT_HEADER_BYTES>() else {
        assert_eq!(parsed, None, "an object shorter than its header");
        return Outcome::Refused;
    };
    let len = u64::from_le_bytes(head[8..16].try_into().expect("8 length bytes"));
    if head[..8] != OBJECT_MAGIC || len != payload.len() as u64 {
        assert_eq!(parsed, None, "a foreign object or one of another length was accepted");
        return Outcome::Refused;
    }
    let (found, got) = parsed.unwrap_or_else(|| panic!("a well-formed object refused"));
    assert!(std::ptr::eq(got, payload), "the payload is not the bytes after the header");
    assert_eq!(found.len, len, "object length");
    let stored = Checksum(u64::from_le_bytes(head[16..24].try_into().expect("8 checksum bytes")));
    assert_eq!(found.checksum, stored, "object checksum");
    if stored == Checksum::of(payload) {
        assert_eq!(&object_header(payload), head, "object header encoding is not canonical");
    }
    Outcome::Accepted
}
