//! Fuzzes the strict GPCK (physical byte key) decoder, which is also the identity decoder: a
//! CacheIdentity's canonical encoding is its physical key.
//!
//! Any input may be refused, but none may panic, and every accepted input must be canonical:
//! encoding the decoded identity again reproduces the input exactly. The logical key derived
//! from it must survive its own decoder, and the shape digest must be computable.

use gpucache_dataplane::key::{LogicalKey, PhysicalKey};

use crate::Outcome;

/// Decodes `data` as a physical key and checks what an accepted key must satisfy.
pub fn run(data: &[u8]) -> Outcome {
    let Ok(decoded) = PhysicalKey::decode(data) else { return Outcome::Refused };
    let identity = decoded.identity();

    // Canonical: a key built from the decoded identity encodes to exactly the input.
    let rebuilt = PhysicalKey::new(identity.clone());
    assert_eq!(rebuilt.encoded(), data, "physical key encoding is not canonical");
    assert_eq!(rebuilt, decoded, "rebuilt physical key is not equal to the decoded one");
    assert_eq!(rebuilt.digest(), decoded.digest(), "digests of equal encodings differ");

    // The identity survives a trip through its own builder unchanged.
    match identity.to_builder().build() {
        Ok(copy) => assert_eq!(&copy, identity, "identity changed through to_builder().build()"),
        Err(e) => panic!("a decoded identity does not rebuild: {e}"),
    }

    // The derived logical key encodes and decodes back equal.
    let logical = decoded.logical();
    let back = match LogicalKey::decode(logical.encoded()) {
        Ok(k) => k,
        Err(e) => panic!("the logical key of an accepted physical key does not decode: {e}"),
    };
    assert_eq!(back, logical, "logical key changed through its decoder");
    assert_eq!(back.parts(), logical.parts(), "logical parts changed through the decoder");

    // Shape digest: computable, and the same for the rebuilt key.
    assert_eq!(decoded.shape_digest(), rebuilt.shape_digest(), "shape digests differ");
    Outcome::Accepted
}
