//! The seal: a MAC over a frame, and the key derivations a session uses (ADR 0012).
//!
//! Owns the bytes every MAC covers and the derivations from a tenant secret (fingerprint,
//! HELLO key, session key). It knows nothing of key files, clocks or connections: those are
//! `tcp::auth`'s.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::{SEAL_BYTES, WireError};

/// Bytes of a HELLO's client nonce and of its answer's server nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of a tenant fingerprint.
pub const FINGERPRINT_BYTES: usize = 16;
/// Bytes of a session key (either algorithm is keyed with 32 bytes).
pub const SESSION_KEY_BYTES: usize = 32;
/// Shortest tenant secret accepted.
pub const SECRET_BYTES_MIN: usize = 32;

const FINGERPRINT_LABEL: &[u8] = b"gpcw fingerprint v1";
const SESSION_LABEL: &[u8] = b"gpcw session v1";

type HmacSha256 = Hmac<Sha256>;

/// The MAC a session seals its frames with. HELLO itself is always sealed with HMAC-SHA-256
/// keyed by the tenant secret; this is what the frames after it use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SealAlgorithm {
    /// HMAC-SHA-256 keyed by the session key.
    HmacSha256,
    /// BLAKE3 in keyed mode, keyed by the session key.
    Blake3,
}

impl SealAlgorithm {
    /// Both, in code order.
    pub const ALL: [Self; 2] = [Self::HmacSha256, Self::Blake3];

    pub fn code(self) -> u8 {
        match self {
            Self::HmacSha256 => 0,
            Self::Blake3 => 1,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.code() == code)
    }

    /// The name used in configuration files and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::HmacSha256 => "hmac-sha256",
            Self::Blake3 => "blake3",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }
}

impl fmt::Display for SealAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn hmac(key: &[u8]) -> HmacSha256 {
    // HMAC takes a key of any length; the error case does not exist for it.
    HmacSha256::new_from_slice(key).unwrap_or_else(|_| HmacSha256::new(&Default::default()))
}

fn finish(mac: HmacSha256) -> [u8; 32] {
    mac.finalize().into_bytes().into()
}

/// The tenant fingerprint: the first [`FINGERPRINT_BYTES`] of
/// HMAC-SHA-256(secret, "gpcw fingerprint v1" || tenant).
pub fn fingerprint(secret: &[u8], tenant: &str) -> [u8; FINGERPRINT_BYTES] {
    let mut mac = hmac(secret);
    mac.update(FINGERPRINT_LABEL);
    mac.update(tenant.as_bytes());
    let full = finish(mac);
    let mut out = [0; FINGERPRINT_BYTES];
    out.copy_from_slice(&full[..FINGERPRINT_BYTES]);
    out
}

/// The session key: HMAC-SHA-256(secret, "gpcw session v1" || client nonce || server nonce ||
/// tenant). Both nonces make it fresh per connection, so a frame sealed on one connection does
/// not verify on another.
pub fn session_key(
    secret: &[u8],
    client_nonce: &[u8; NONCE_BYTES],
    server_nonce: &[u8; NONCE_BYTES],
    tenant: &str,
) -> [u8; SESSION_KEY_BYTES] {
    let mut mac = hmac(secret);
    mac.update(SESSION_LABEL);
    mac.update(client_nonce);
    mac.update(server_nonce);
    mac.update(tenant.as_bytes());
    finish(mac)
}

#[derive(Clone)]
enum Keyed {
    Hmac(Box<HmacSha256>),
    Blake3(Box<blake3::Hasher>),
}

/// A keyed MAC, ready to seal: the keyed state is built once (per session) and cloned per
/// frame, so sealing a frame costs one pass over its bytes. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct SealKey {
    algorithm: SealAlgorithm,
    keyed: Keyed,
}

impl fmt::Debug for SealKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealKey").field("algorithm", &self.algorithm).finish_non_exhaustive()
    }
}

impl SealKey {
    /// A session's key for `algorithm`.
    pub fn new(algorithm: SealAlgorithm, key: &[u8; SESSION_KEY_BYTES]) -> Self {
        let keyed = match algorithm {
            SealAlgorithm::HmacSha256 => Keyed::Hmac(Box::new(hmac(key))),
            SealAlgorithm::Blake3 => Keyed::Blake3(Box::new(blake3::Hasher::new_keyed(key))),
        };
        Self { algorithm, keyed }
    }

    /// The key that seals a HELLO: HMAC-SHA-256 keyed by the tenant secret itself.
    pub fn hello(secret: &[u8]) -> Self {
        Self { algorithm: SealAlgorithm::HmacSha256, keyed: Keyed::Hmac(Box::new(hmac(secret))) }
    }

    pub fn algorithm(&self) -> SealAlgorithm {
        self.algorithm
    }

    /// The MAC of `parts`, concatenated.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; SEAL_BYTES] {
        match &self.keyed {
            Keyed::Hmac(m) => finish(hmac_over(m, parts)),
            Keyed::Blake3(h) => {
                let mut h = (**h).clone();
                for p in parts {
                    // One thread: the service parallelises across connections, not within.
                    h.update(p);
                }
                *h.finalize().as_bytes()
            }
        }
    }

    /// Checks `seal` against the MAC of `parts`; [`WireError::SealMismatch`] when it differs.
    /// Both comparisons take time independent of where the seal differs: HMAC's own
    /// `verify_slice`, and `subtle`'s constant-time equality for BLAKE3.
    pub fn verify(&self, parts: &[&[u8]], seal: &[u8; SEAL_BYTES]) -> Result<(), WireError> {
        let good = match &self.keyed {
            Keyed::Hmac(m) => hmac_over(m, parts).verify_slice(seal).is_ok(),
            Keyed::Blake3(_) => bool::from(self.mac(parts)[..].ct_eq(&seal[..])),
        };
        if good { Ok(()) } else { Err(WireError::SealMismatch) }
    }
}

/// A copy of the keyed HMAC state, fed `parts` in order.
fn hmac_over(keyed: &HmacSha256, parts: &[&[u8]]) -> HmacSha256 {
    let mut m = keyed.clone();
    for p in parts {
        m.update(p);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let key = SealKey::hello(b"Jefe");
        let mac = key.mac(&[b"what do ya ", b"want for nothing?"]);
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn keyed_blake3_is_the_blake3_keyed_hash() {
        let key = [7u8; 32];
        let sealed = SealKey::new(SealAlgorithm::Blake3, &key).mac(&[b"ab", b"c"]);
        assert_eq!(sealed, *blake3::keyed_hash(&key, b"abc").as_bytes());
    }

    #[test]
    fn derivations_depend_on_every_input() {
        let secret = [1u8; 32];
        let (a, b) = ([2u8; NONCE_BYTES], [3u8; NONCE_BYTES]);
        let base = session_key(&secret, &a, &b, "acme");
        assert_ne!(base, session_key(&secret, &b, &a, "acme"));
        assert_ne!(base, session_key(&secret, &a, &b, "acme2"));
        assert_ne!(base, session_key(&[9u8; 32], &a, &b, "acme"));
        assert_ne!(fingerprint(&secret, "acme"), fingerprint(&secret, "acmf"));
        assert_ne!(fingerprint(&secret, "acme"), fingerprint(&[9u8; 32], "acme"));
    }

    #[test]
    fn verify_refuses_any_flipped_bit() {
        for algorithm in SealAlgorithm::ALL {
            let key = SealKey::new(algorithm, &[5u8; 32]);
            let seal = key.mac(&[b"header", b"body"]);
            assert_eq!(key.verify(&[b"header", b"body"], &seal), Ok(()));
            for i in 0..SEAL_BYTES {
                let mut bad = seal;
                bad[i] ^= 1;
                assert_eq!(key.verify(&[b"header", b"body"], &bad), Err(WireError::SealMismatch));
            }
            assert_eq!(key.verify(&[b"header", b"bodY"], &seal), Err(WireError::SealMismatch));
        }
    }

    #[test]
    fn algorithm_names_and_codes_round_trip() {
        for a in SealAlgorithm::ALL {
            assert_eq!(SealAlgorithm::from_code(a.code()), Some(a));
            assert_eq!(SealAlgorithm::from_name(a.name()), Some(a));
            assert_eq!(a.to_string(), a.name());
        }
        assert_eq!(SealAlgorithm::from_code(2), None);
    }
}
