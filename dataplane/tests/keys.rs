//! Identity validation and the GPCL/GPCK encodings: round trips, canonical form, and a typed
//! error for every malformed input.

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small, bounded values

use gpucache_dataplane::identity::{
    BLOCK_TOKENS_MAX, CHAIN_HASHES_MAX, CacheIdentity, CacheIdentityBuilder, Digest32,
    IdentityError, KvDtype, NAME_BYTES_MAX, PositionEncoding, QuantFormat, RopeParams, RopeScaling,
    Shard,
};
use gpucache_dataplane::key::{
    KEY_BYTES_MAX, KeyDecodeError, KeyDecoder, KnownDigests, LogicalKey, PhysicalKey,
};
use proptest::prelude::*;

fn base() -> CacheIdentityBuilder {
    CacheIdentity::builder()
        .tenant("acme")
        .trust_domain("prod")
        .model_revision("qwen2.5-7b@r3")
        .model_config(Digest32([1; 32]))
        .tokenizer_revision("tok-1")
        .kv_dtype(KvDtype::Bf16)
        .quant(QuantFormat::None)
        .layout("paged-hnd", 2)
        .shard(Shard { tp_rank: 1, tp_size: 4, pp_rank: 0, pp_size: 1 })
        .position(PositionEncoding::Rope)
        .rope(Some(RopeParams::new(10_000.0, RopeScaling::None, 1.0, 4096).unwrap()))
        .chain(vec![Digest32([2; 32]), Digest32([3; 32])])
        .block_tokens(512)
        .valid_tokens(512)
}

#[test]
fn every_invalid_field_is_a_typed_error() {
    let cases: Vec<(CacheIdentityBuilder, IdentityError)> = vec![
        (base().tenant(""), IdentityError::EmptyName { field: "tenant" }),
        (
            base().tenant(&"x".repeat(NAME_BYTES_MAX + 1)),
            IdentityError::NameTooLong {
                field: "tenant",
                len: NAME_BYTES_MAX + 1,
                max: NAME_BYTES_MAX,
            },
        ),
        (
            base().model_revision("a b"),
            IdentityError::NameCharacter { field: "model_revision", index: 1, byte: b' ' },
        ),
        (
            base().trust_domain("é"),
            IdentityError::NameCharacter { field: "trust_domain", index: 0, byte: 0xC3 },
        ),
        (
            base().adapter("lo\0ra", Digest32([0; 32])),
            IdentityError::NameCharacter { field: "adapter", index: 2, byte: 0 },
        ),
        (base().layout("", 1), IdentityError::EmptyName { field: "layout" }),
        (CacheIdentity::builder(), IdentityError::Missing { field: "tenant" }),
        (base().chain(vec![]), IdentityError::EmptyChain),
        (
            base().chain(vec![Digest32([0; 32]); CHAIN_HASHES_MAX + 1]),
            IdentityError::ChainTooLong { len: CHAIN_HASHES_MAX + 1, max: CHAIN_HASHES_MAX },
        ),
        (base().block_tokens(0), IdentityError::BlockTokens { tokens: 0, max: BLOCK_TOKENS_MAX }),
        (
            base().block_tokens(BLOCK_TOKENS_MAX + 1),
            IdentityError::BlockTokens { tokens: BLOCK_TOKENS_MAX + 1, max: BLOCK_TOKENS_MAX },
        ),
        (base().valid_tokens(0), IdentityError::ValidTokens { valid: 0, capacity: 512 }),
        (base().valid_tokens(513), IdentityError::ValidTokens { valid: 513, capacity: 512 }),
        (
            base().shard(Shard { tp_rank: 4, tp_size: 4, pp_rank: 0, pp_size: 1 }),
            IdentityError::ShardRank { axis: "tp", rank: 4, size: 4 },
        ),
        (
            base().shard(Shard { tp_rank: 0, tp_size: 1, pp_rank: 0, pp_size: 0 }),
            IdentityError::ShardSize { axis: "pp" },
        ),
        (
            base().rope(None),
            IdentityError::RopeMismatch {
                encoding: PositionEncoding::Rope,
                problem: "needs RoPE parameters",
            },
        ),
        (
            base().position(PositionEncoding::Alibi),
            IdentityError::RopeMismatch {
                encoding: PositionEncoding::Alibi,
                problem: "takes no RoPE parameters",
            },
        ),
        (base().quant(QuantFormat::Grouped { group_size: 0 }), IdentityError::QuantGroup),
    ];
    for (builder, want) in cases {
        assert_eq!(builder.build().unwrap_err(), want);
    }
    for bad in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
        assert!(matches!(
            RopeParams::new(bad, RopeScaling::Yarn, 1.0, 1),
            Err(IdentityError::RopeValue { param: "theta", .. })
        ));
        assert!(matches!(
            RopeParams::new(1.0, RopeScaling::Yarn, bad, 1),
            Err(IdentityError::RopeValue { param: "factor", .. })
        ));
    }
    assert!(base().build().is_ok());
}

#[test]
fn error_messages_name_the_problem() {
    let samples: Vec<(Box<dyn std::fmt::Display>, &str)> = vec![
        (Box::new(IdentityError::EmptyName { field: "tenant" }), "tenant is empty"),
        (Box::new(IdentityError::NameTooLong { field: "layout", len: 200, max: 128 }), "200 bytes"),
        (Box::new(IdentityError::NameCharacter { field: "adapter", index: 3, byte: 0x20 }), "0x20"),
        (Box::new(IdentityError::Missing { field: "chain" }), "chain was not set"),
        (Box::new(IdentityError::EmptyChain), "chain is empty"),
        (Box::new(IdentityError::ChainTooLong { len: 9000, max: 8192 }), "9000"),
        (Box::new(IdentityError::BlockTokens { tokens: 0, max: 5 }), "1..=5"),
        (Box::new(IdentityError::ValidTokens { valid: 9, capacity: 8 }), "1..=8"),
        (Box::new(IdentityError::ShardRank { axis: "tp", rank: 2, size: 2 }), "tp rank 2"),
        (Box::new(IdentityError::ShardSize { axis: "pp" }), "pp size is zero"),
        (
            Box::new(IdentityError::RopeMismatch {
                encoding: PositionEncoding::Rope,
                problem: "needs RoPE parameters",
            }),
            "needs RoPE",
        ),
        (Box::new(IdentityError::RopeValue { param: "theta", bits: 0 }), "theta"),
        (Box::new(IdentityError::QuantGroup), "group size is zero"),
        (Box::new(KeyDecodeError::TooLong { len: 9, max: 8 }), "limit is 8"),
        (
            Box::new(KeyDecodeError::Truncated { context: "chain", needed: 5, available: 2 }),
            "chain",
        ),
        (Box::new(KeyDecodeError::BadMagic { found: *b"XXXX", expected: *b"GPCK" }), "magic"),
        (Box::new(KeyDecodeError::UnsupportedVersion { found: 9, supported: 1 }), "version 9"),
        (Box::new(KeyDecodeError::FieldCount { found: 3, expected: 16 }), "3 fields"),
        (Box::new(KeyDecodeError::UnexpectedTag { found: 7, expected: 6 }), "tag 7"),
        (Box::new(KeyDecodeError::FieldLength { field: "shard", len: 3 }), "shard"),
        (Box::new(KeyDecodeError::UnknownCode { field: "kv_dtype", code: 99 }), "99"),
        (Box::new(KeyDecodeError::NotUtf8 { field: "tenant" }), "UTF-8"),
        (Box::new(KeyDecodeError::TrailingBytes { count: 4 }), "4 bytes"),
        (Box::new(KeyDecodeError::Identity(IdentityError::EmptyChain)), "chain is empty"),
    ];
    for (e, needle) in samples {
        let text = e.to_string();
        assert!(text.contains(needle), "{text:?} lacks {needle:?}");
    }
}

#[test]
fn physical_key_round_trips_and_is_canonical() {
    let id = base().adapter("lora-7", Digest32([9; 32])).build().unwrap();
    let k = PhysicalKey::new(id.clone());
    assert_eq!(&k.encoded()[..4], b"GPCK");
    let back = PhysicalKey::decode(k.encoded()).unwrap();
    assert_eq!(back, k);
    assert_eq!(back.identity(), &id);
    let l = k.logical();
    assert_eq!(&l.encoded()[..4], b"GPCL");
    assert_eq!(LogicalKey::decode(l.encoded()).unwrap(), l);
}

#[test]
fn logical_key_ignores_byte_layout_fields() {
    let a = PhysicalKey::new(base().build().unwrap());
    let b = PhysicalKey::new(
        base()
            .kv_dtype(KvDtype::F8E4m3)
            .layout("paged-nhd", 9)
            .shard(Shard::SOLO)
            .valid_tokens(3)
            .build()
            .unwrap(),
    );
    assert_ne!(a, b);
    assert_eq!(a.logical(), b.logical());
    let c = PhysicalKey::new(base().tokenizer_revision("tok-2").build().unwrap());
    assert_ne!(a.logical(), c.logical());
    // Shape ignores only the chain and the valid length.
    let d =
        PhysicalKey::new(base().chain(vec![Digest32([5; 32])]).valid_tokens(1).build().unwrap());
    assert_eq!(a.shape_digest(), d.shape_digest());
    assert_ne!(a.shape_digest(), b.shape_digest());
}

#[test]
fn structural_corruptions_get_their_own_error() {
    let k = PhysicalKey::new(base().build().unwrap());
    let good = k.encoded().to_vec();
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(PhysicalKey::decode(&bad), Err(KeyDecodeError::BadMagic { .. })));
    assert!(matches!(LogicalKey::decode(&good), Err(KeyDecodeError::BadMagic { .. })));
    let mut bad = good.clone();
    bad[4] = 2;
    assert_eq!(
        PhysicalKey::decode(&bad).unwrap_err(),
        KeyDecodeError::UnsupportedVersion { found: 2, supported: 1 }
    );
    let mut bad = good.clone();
    bad[5] = 15;
    assert_eq!(
        PhysicalKey::decode(&bad).unwrap_err(),
        KeyDecodeError::FieldCount { found: 15, expected: 16 }
    );
    let mut bad = good.clone();
    bad[6] = 2;
    assert_eq!(
        PhysicalKey::decode(&bad).unwrap_err(),
        KeyDecodeError::UnexpectedTag { found: 2, expected: 1 }
    );
    let mut bad = good.clone();
    bad.push(0);
    assert_eq!(PhysicalKey::decode(&bad).unwrap_err(), KeyDecodeError::TrailingBytes { count: 1 });
    assert!(matches!(
        PhysicalKey::decode(&good[..3]),
        Err(KeyDecodeError::Truncated { context: "header", .. })
    ));
    let huge = vec![0u8; KEY_BYTES_MAX + 1];
    assert_eq!(
        PhysicalKey::decode(&huge).unwrap_err(),
        KeyDecodeError::TooLong { len: KEY_BYTES_MAX + 1, max: KEY_BYTES_MAX }
    );
    // A tenant field declared longer than the input.
    let mut bad = good.clone();
    bad[7..11].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        PhysicalKey::decode(&bad),
        Err(KeyDecodeError::Truncated { context: "tenant", .. })
    ));
}

#[test]
fn every_truncation_is_rejected() {
    let k = PhysicalKey::new(base().build().unwrap());
    for n in 0..k.encoded().len() {
        assert!(PhysicalKey::decode(&k.encoded()[..n]).is_err(), "prefix of {n} bytes decoded");
    }
    let l = k.logical();
    for n in 0..l.encoded().len() {
        assert!(
            LogicalKey::decode(&l.encoded()[..n]).is_err(),
            "logical prefix of {n} bytes decoded"
        );
    }
}

fn digest() -> impl Strategy<Value = Digest32> {
    any::<[u8; 32]>().prop_map(Digest32)
}

fn name() -> impl Strategy<Value = String> {
    "[A-Za-z0-9._:/@+-]{1,40}"
}

prop_compose! {
    fn identity()(
        tenant in name(), trust in name(), model in name(), config in digest(), tok in name(),
        adapter in proptest::option::of((name(), digest())),
        dtype in proptest::sample::select(KvDtype::ALL.to_vec()),
        quant in prop_oneof![Just(QuantFormat::None), Just(QuantFormat::PerToken), (1u32..1024).prop_map(|group_size| QuantFormat::Grouped { group_size })],
        layout in (name(), any::<u32>()),
        tp in (1u16..16).prop_flat_map(|size| (0..size, Just(size))),
        rope in proptest::option::of((1.0f64..1e7, 0.5f64..64.0, any::<u32>())),
        chain in proptest::collection::vec(digest(), 1..20),
        cap in 1u32..4096,
        valid_frac in 0.0f64..1.0,
        mm in proptest::option::of((digest(), digest())),
    ) -> CacheIdentity {
        let valid = ((f64::from(cap) * valid_frac) as u32).clamp(1, cap);
        let mut b = CacheIdentity::builder()
            .tenant(&tenant).trust_domain(&trust).model_revision(&model).model_config(config)
            .tokenizer_revision(&tok).kv_dtype(dtype).quant(quant).layout(&layout.0, layout.1)
            .shard(Shard { tp_rank: tp.0, tp_size: tp.1, pp_rank: 0, pp_size: 1 })
            .chain(chain).block_tokens(cap).valid_tokens(valid)
            .multimodal(mm.map(|(processor, inputs)| gpucache_dataplane::identity::Multimodal { processor, inputs }));
        b = match rope {
            Some((theta, factor, orig)) => b.position(PositionEncoding::Rope)
                .rope(Some(RopeParams::new(theta, RopeScaling::Ntk, factor, orig).unwrap())),
            None => b.position(PositionEncoding::Learned),
        };
        if let Some((n, d)) = adapter { b = b.adapter(&n, d); }
        b.build().unwrap()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn valid_identities_round_trip(id in identity()) {
        let k = PhysicalKey::new(id.clone());
        let back = PhysicalKey::decode(k.encoded()).unwrap();
        prop_assert_eq!(back.identity(), &id);
        prop_assert_eq!(back.digest(), k.digest());
        let l = LogicalKey::from_identity(&id);
        prop_assert_eq!(LogicalKey::decode(l.encoded()).unwrap(), l);
    }

    #[test]
    fn mutated_keys_are_rejected_or_canonical(id in identity(), at in any::<usize>(), byte in any::<u8>()) {
        let k = PhysicalKey::new(id);
        let mut bytes = k.encoded().to_vec();
        let i = at % bytes.len();
        bytes[i] = byte;
        if let Ok(decoded) = PhysicalKey::decode(&bytes) {
            // Whatever decodes must re-encode to exactly the input: no two encodings alias.
            let again = PhysicalKey::new(decoded.identity().clone());
            prop_assert_eq!(again.encoded(), &bytes[..]);
        }
        let l = k.logical();
        let mut bytes = l.encoded().to_vec();
        let i = at % bytes.len();
        bytes[i] = byte;
        if let Ok(decoded) = LogicalKey::decode(&bytes) {
            prop_assert_eq!(decoded.encoded(), &bytes[..]);
            let again = LogicalKey::decode(decoded.encoded()).unwrap();
            prop_assert_eq!(again.parts(), decoded.parts());
        }
    }

    /// A decoder that saw another key first (whose fields it may reuse) decodes a key, damaged
    /// or not, exactly as the strict decoder does: the same identity and digests, or the same
    /// error.
    #[test]
    fn a_key_decoder_decodes_as_strictly_as_decode(
        id in identity(), at in any::<usize>(), byte in any::<u8>(), tail in any::<bool>(),
    ) {
        let k = PhysicalKey::new(id);
        let mut bytes = k.encoded().to_vec();
        // Most mutations of the tail land in the fields the decoder parses on its own.
        let from = if tail { bytes.len().saturating_sub(120) } else { 0 };
        let i = from + at % (bytes.len() - from);
        bytes[i] = byte;
        let mut decoder = KeyDecoder::new();
        let first = decoder.decode(k.encoded(), None).unwrap();
        prop_assert_eq!(first.shape_digest(), k.shape_digest());
        let strict = PhysicalKey::decode(&bytes);
        match (decoder.decode(&bytes, None), strict) {
            (Ok(ours), Ok(strict)) => {
                prop_assert_eq!(ours.identity(), strict.identity());
                prop_assert_eq!(&ours, &strict);
                prop_assert_eq!(ours.shape_digest(), strict.shape_digest());
                prop_assert_eq!(ours.logical_digest(), strict.logical_digest());
                let known = decoder.decode(&bytes, Some(KnownDigests::of(&strict))).unwrap();
                prop_assert_eq!(KnownDigests::of(&known), KnownDigests::of(&strict));
            }
            (Err(ours), Err(strict)) => prop_assert_eq!(ours, strict),
            (ours, strict) => prop_assert!(false, "decoder {ours:?}, decode {strict:?}"),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = PhysicalKey::decode(&bytes);
        let _ = LogicalKey::decode(&bytes);
        let mut framed = b"GPCK\x01\x10".to_vec();
        framed.extend_from_slice(&bytes);
        if let Ok(k) = PhysicalKey::decode(&framed) {
            prop_assert_eq!(k.encoded(), &framed[..]);
        }
    }
}
