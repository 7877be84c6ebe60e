//! Fuzzes the strict GPCL (logical prefix key) decoder.
//!
//! Any input may be refused, but none may panic, and every accepted input must be the one
//! canonical encoding of what it decodes to: rebuilding the key from its decoded parts (through
//! an identity that carries them) has to give back exactly the input bytes.

use gpucache_dataplane::identity::{CacheIdentity, KvDtype, PositionEncoding, QuantFormat, Shard};
use gpucache_dataplane::key::{LogicalKey, LogicalParts};

use crate::Outcome;

/// An identity holding exactly `parts`, with fixed placeholder values for every field the
/// logical key leaves out (dtype, layout, shard and the rest).
fn identity_with(parts: &LogicalParts) -> CacheIdentity {
    let mut b = CacheIdentity::builder()
        .tenant(parts.tenant.as_str())
        .trust_domain(parts.trust_domain.as_str())
        .model_revision(parts.model_revision.as_str())
        .model_config(parts.model_config)
        .tokenizer_revision(parts.tokenizer_revision.as_str())
        .kv_dtype(KvDtype::F16)
        .quant(QuantFormat::None)
        .layout("fuzz-layout", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::None)
        .rope(None)
        .chain(parts.chain.to_vec())
        .block_tokens(1)
        .valid_tokens(1)
        .multimodal(parts.multimodal);
    if let Some(a) = &parts.adapter {
        b = b.adapter(a.name.as_str(), a.weights);
    }
    match b.build() {
        Ok(id) => id,
        Err(e) => panic!("decoded logical parts do not form an identity: {e}"),
    }
}

/// Decodes `data` as a logical key and checks what an accepted key must satisfy.
pub fn run(data: &[u8]) -> Outcome {
    let Ok(decoded) = LogicalKey::decode(data) else { return Outcome::Refused };

    // The key keeps the bytes it was decoded from.
    assert_eq!(decoded.encoded(), data, "decoded key does not hold its input bytes");

    // Decoding is repeatable and stable under equality.
    let again = match LogicalKey::decode(decoded.encoded()) {
        Ok(k) => k,
        Err(e) => panic!("re-decoding an accepted logical key failed: {e}"),
    };
    assert_eq!(again, decoded, "re-decoded logical key differs");
    assert_eq!(again.parts(), decoded.parts(), "re-decoded logical parts differ");

    // Canonical: encoding the decoded parts afresh reproduces the input exactly.
    let rebuilt = LogicalKey::from_identity(&identity_with(decoded.parts()));
    assert_eq!(rebuilt.encoded(), data, "logical key encoding is not canonical");
    assert_eq!(rebuilt, decoded, "rebuilt logical key is not equal to the decoded one");
    assert_eq!(rebuilt.parts(), decoded.parts(), "rebuilt logical parts differ");
    Outcome::Accepted
}
