//! The frames between [`super::MooncakeStore`] and its Python sidecar, and the object format.
//!
//! Pure encoding and decoding; the socket and the process live in [`super::sidecar`]. The
//! layout is described once, in the header of [`super`].

use gpucache_dataplane::{Checksum, PhysicalKey};

use super::results::Raw;

/// Bytes of the length prefix in front of every frame.
pub const PREFIX_BYTES: usize = 4;
/// Bytes of a request body before the key: op (1), key length (2), argument (8).
pub const REQUEST_HEAD_BYTES: usize = 11;
/// Bytes of a reply body before any payload: status (1), code (8).
pub const REPLY_HEAD_BYTES: usize = 9;
/// Longest Mooncake key the adapter makes (and the sidecar accepts).
pub const KEY_BYTES_MAX: usize = 512;
/// Bytes of the header the adapter puts in front of every stored payload.
pub const OBJECT_HEADER_BYTES: usize = 24;
/// First bytes of every object the adapter stores, and the format version.
pub const OBJECT_MAGIC: [u8; 8] = *b"GPCMOON1";

/// What the sidecar is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// `put_from(key, buffer, len(payload))`.
    Put = 1,
    /// `get_into(key, buffer, argument)`; the reply carries the bytes read.
    Get = 2,
    /// `get_size(key)`.
    Size = 3,
    /// `is_exist(key)`.
    Exists = 4,
    /// `remove(key)`.
    Remove = 5,
}

/// Status byte of a reply.
const STATUS_CODE: u8 = 0;
const STATUS_RAISED: u8 = 1;
const STATUS_REFUSED: u8 = 2;

/// Longest namespace ([`object_key_in`]) a store's object keys may carry.
pub const NAMESPACE_BYTES_MAX: usize = 32;

/// The Mooncake key of `key`: tenant and digest in hex, so that two tenants can never share
/// a key string, whatever characters their names hold.
pub fn object_key(key: &PhysicalKey) -> String {
    object_key_in("", key)
}

/// Whether `namespace` may prefix object keys: at most [`NAMESPACE_BYTES_MAX`] ASCII letters
/// and digits (no dash, so a namespaced key has one field more than a plain one and the two
/// can never be the same string).
pub fn valid_namespace(namespace: &str) -> bool {
    namespace.len() <= NAMESPACE_BYTES_MAX && namespace.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// [`object_key`] within `namespace` (empty: none): `gpc1-<namespace>-<tenant>-<digest>`, so
/// that stores with different namespaces share one cluster without meeting.
pub fn object_key_in(namespace: &str, key: &PhysicalKey) -> String {
    debug_assert!(valid_namespace(namespace));
    let tenant = key.tenant().as_str().as_bytes();
    let digest = key.digest().0;
    let mut out =
        String::with_capacity(5 + namespace.len() + 1 + 2 * tenant.len() + 1 + 2 * digest.len());
    out.push_str("gpc1-");
    if !namespace.is_empty() {
        out.push_str(namespace);
        out.push('-');
    }
    push_hex(&mut out, tenant);
    out.push('-');
    push_hex(&mut out, &digest);
    out
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

/// One request frame, length prefix included.
pub fn request(op: Op, key: &str, argument: u64, payload: &[u8]) -> Vec<u8> {
    debug_assert!(key.len() <= KEY_BYTES_MAX);
    let body = REQUEST_HEAD_BYTES + key.len() + payload.len();
    let mut out = Vec::with_capacity(PREFIX_BYTES + body);
    out.extend_from_slice(&u32::try_from(body).unwrap_or(u32::MAX).to_le_bytes());
    out.push(op as u8);
    out.extend_from_slice(&u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes());
    out.extend_from_slice(&argument.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(payload);
    out
}

/// Why a reply could not be read as one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyError {
    Short {
        len: usize,
    },
    Status {
        status: u8,
    },
    /// A payload that does not match the code (only a GET's nonnegative code has one).
    Payload {
        code: i64,
        len: usize,
    },
}

/// A decoded reply body (without its prefix): the raw result and any payload. A GET's
/// payload holds `min(code, argument)` bytes: a code above what was asked for still arrives
/// as a well-formed frame, so that [`super::results`] can judge it.
pub fn reply(body: &[u8], op: Op, argument: u64) -> Result<(Raw, &[u8]), ReplyError> {
    if body.len() < REPLY_HEAD_BYTES {
        return Err(ReplyError::Short { len: body.len() });
    }
    let mut code = [0_u8; 8];
    code.copy_from_slice(&body[1..9]);
    let code = i64::from_le_bytes(code);
    let payload = &body[REPLY_HEAD_BYTES..];
    let raw = match body[0] {
        STATUS_CODE => Raw::Code(code),
        STATUS_RAISED => Raw::Raised,
        STATUS_REFUSED => Raw::Refused,
        status => return Err(ReplyError::Status { status }),
    };
    let expected = match (raw, op) {
        (Raw::Code(c), Op::Get) if c > 0 => usize::try_from(c.unsigned_abs().min(argument)).ok(),
        _ => Some(0),
    };
    if expected != Some(payload.len()) {
        return Err(ReplyError::Payload { code, len: payload.len() });
    }
    Ok((raw, payload))
}

/// A reply body (without its prefix) as the sidecar writes it: status, code (zero for an
/// exception or a refusal) and the payload; the inverse of [`reply`] for a payload that fits
/// the request.
pub fn reply_body(raw: Raw, payload: &[u8]) -> Vec<u8> {
    let (status, code) = match raw {
        Raw::Code(code) => (STATUS_CODE, code),
        Raw::Raised => (STATUS_RAISED, 0),
        Raw::Refused => (STATUS_REFUSED, 0),
    };
    let mut out = Vec::with_capacity(REPLY_HEAD_BYTES + payload.len());
    out.push(status);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The header stored in front of a payload: magic, payload length, checksum (little endian).
pub fn object_header(payload: &[u8]) -> [u8; OBJECT_HEADER_BYTES] {
    let mut out = [0_u8; OBJECT_HEADER_BYTES];
    out[..8].copy_from_slice(&OBJECT_MAGIC);
    out[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out[16..].copy_from_slice(&Checksum::of(payload).0.to_le_bytes());
    out
}

/// What a stored object's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectHeader {
    pub len: u64,
    pub checksum: Checksum,
}

/// Reads the header of a whole stored object; `None` when it is not one the adapter wrote
/// (wrong magic, or a length that disagrees with the object's size).
pub fn parse_object(object: &[u8]) -> Option<(ObjectHeader, &[u8])> {
    if object.len() < OBJECT_HEADER_BYTES || object[..8] != OBJECT_MAGIC {
        return None;
    }
    let mut len = [0_u8; 8];
    len.copy_from_slice(&object[8..16]);
    let len = u64::from_le_bytes(len);
    let mut sum = [0_u8; 8];
    sum.copy_from_slice(&object[16..24]);
    let payload = &object[OBJECT_HEADER_BYTES..];
    if len != payload.len() as u64 {
        return None;
    }
    Some((ObjectHeader { len, checksum: Checksum(u64::from_le_bytes(sum)) }, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_prefix_op_keylen_argument_key_payload() {
        let f = request(Op::Get, "ab", 0x0102, b"xyz");
        assert_eq!(&f[..4], &(11_u32 + 2 + 3).to_le_bytes());
        assert_eq!(f[4], 2);
        assert_eq!(&f[5..7], &2_u16.to_le_bytes());
        assert_eq!(&f[7..15], &0x0102_u64.to_le_bytes());
        assert_eq!(&f[15..17], b"ab");
        assert_eq!(&f[17..], b"xyz");
    }

    fn body(status: u8, code: i64, payload: &[u8]) -> Vec<u8> {
        let mut b = vec![status];
        b.extend_from_slice(&code.to_le_bytes());
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn replies_decode_codes_exceptions_and_refusals() {
        assert_eq!(reply(&body(0, -704, b""), Op::Get, 8), Ok((Raw::Code(-704), &b""[..])));
        assert_eq!(reply(&body(0, 3, b"abc"), Op::Get, 8), Ok((Raw::Code(3), &b"abc"[..])));
        assert_eq!(reply(&body(1, 0, b""), Op::Put, 0), Ok((Raw::Raised, &b""[..])));
        assert_eq!(reply(&body(2, 0, b""), Op::Put, 0), Ok((Raw::Refused, &b""[..])));
    }

    #[test]
    fn reply_bodies_decode_to_what_they_were_made_of() {
        assert_eq!(reply_body(Raw::Code(3), b"abc"), body(0, 3, b"abc"));
        assert_eq!(reply_body(Raw::Raised, b""), body(1, 0, b""));
        assert_eq!(reply_body(Raw::Refused, b""), body(2, 0, b""));
        for (raw, payload, op, argument) in [
            (Raw::Code(3), &b"abc"[..], Op::Get, 8),
            (Raw::Code(5), b"abcd", Op::Get, 4),
            (Raw::Code(-704), b"", Op::Get, 8),
            (Raw::Code(0), b"", Op::Put, 0),
            (Raw::Raised, b"", Op::Remove, 0),
            (Raw::Refused, b"", Op::Size, 0),
        ] {
            assert_eq!(reply(&reply_body(raw, payload), op, argument), Ok((raw, payload)));
        }
    }

    #[test]
    fn malformed_replies_are_errors() {
        assert_eq!(reply(&[0; 8], Op::Put, 0), Err(ReplyError::Short { len: 8 }));
        assert_eq!(reply(&body(3, 0, b""), Op::Put, 0), Err(ReplyError::Status { status: 3 }));
        // A GET payload must be exactly as long as the code says; nothing else has one.
        assert_eq!(
            reply(&body(0, 4, b"abc"), Op::Get, 8),
            Err(ReplyError::Payload { code: 4, len: 3 })
        );
        assert_eq!(
            reply(&body(0, 0, b"a"), Op::Put, 0),
            Err(ReplyError::Payload { code: 0, len: 1 })
        );
    }

    #[test]
    fn objects_round_trip_and_reject_foreign_bytes() {
        let payload = b"page bytes";
        let mut object = object_header(payload).to_vec();
        object.extend_from_slice(payload);
        let (h, p) = parse_object(&object).expect("ours");
        assert_eq!(h, ObjectHeader { len: 10, checksum: Checksum::of(payload) });
        assert_eq!(p, payload);
        assert_eq!(parse_object(&object[..object.len() - 1]), None);
        assert_eq!(parse_object(&object[..OBJECT_HEADER_BYTES - 1]), None);
        object[0] ^= 1;
        assert_eq!(parse_object(&object), None);
    }

    #[test]
    fn object_keys_are_deterministic_and_tenant_scoped() {
        use gpucache_dataplane::identity::KvDtype;
        use gpucache_dataplane::testing::fixture::key;
        let a = key(0, &[1, 2], KvDtype::Bf16, 16);
        let b = key(1, &[1, 2], KvDtype::Bf16, 16);
        assert_eq!(object_key(&a), object_key(&a.clone()));
        assert_ne!(object_key(&a), object_key(&b));
        assert!(object_key(&a).starts_with("gpc1-74656e616e742d61-"), "{}", object_key(&a));
        assert_eq!(object_key(&a).len(), 5 + 16 + 1 + 64);
        assert!(object_key(&a).len() <= KEY_BYTES_MAX);
    }

    #[test]
    fn namespaces_separate_keys_and_are_checked() {
        use gpucache_dataplane::identity::KvDtype;
        use gpucache_dataplane::testing::fixture::key;
        let a = key(0, &[1, 2], KvDtype::Bf16, 16);
        assert_eq!(object_key_in("", &a), object_key(&a));
        let spaced = object_key_in("run7", &a);
        assert_eq!(spaced, format!("gpc1-run7-{}", &object_key(&a)[5..]));
        assert_ne!(object_key_in("run8", &a), spaced);
        assert!(valid_namespace("") && valid_namespace("Ab09") && valid_namespace(&"x".repeat(32)));
        assert!(
            !valid_namespace("a-b") && !valid_namespace("a b") && !valid_namespace(&"x".repeat(33))
        );
    }
}
