//! Writes the seed corpora under `fuzz/seeds/` from identities built through the public API,
//! so every seed is a valid, canonical key. Run from `fuzz/`: `cargo run --example seeds`.
//! Each seed is checked against its decoder before it is written.

use std::fs;
use std::path::Path;

use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, Multimodal, PositionEncoding, QuantFormat, RopeParams,
    RopeScaling, Shard,
};
use gpucache_dataplane::key::{LogicalKey, PhysicalKey};

/// A digest whose bytes are `seed, seed+1, ...` (wrapping): distinct and easy to spot in hex.
fn digest(seed: u8) -> Digest32 {
    let mut d = [0u8; 32];
    let mut v = seed;
    for b in &mut d {
        *b = v;
        v = v.wrapping_add(1);
    }
    Digest32(d)
}

fn chain(len: u8) -> Vec<Digest32> {
    (0..len).map(|i| digest(0x80 + i)).collect()
}

fn base() -> gpucache_dataplane::identity::CacheIdentityBuilder {
    CacheIdentity::builder()
        .tenant("acme")
        .trust_domain("prod")
        .model_revision("llama-3.1-8b@rev2")
        .model_config(digest(0x10))
        .tokenizer_revision("tok:v3")
}

fn identities() -> Vec<(&'static str, CacheIdentity)> {
    let minimal = base()
        .kv_dtype(KvDtype::F16)
        .quant(QuantFormat::None)
        .layout("paged-nhd", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::None)
        .chain(chain(1))
        .block_tokens(16)
        .valid_tokens(16)
        .build();
    let rope = RopeParams::new(500_000.0, RopeScaling::Yarn, 8.0, 8192)
        .unwrap_or_else(|e| panic!("seed RoPE parameters: {e}"));
    let full = base()
        .adapter("lora/support-bot", digest(0x40))
        .kv_dtype(KvDtype::F8E4m3)
        .quant(QuantFormat::Grouped { group_size: 128 })
        .layout("paged-hnd", 3)
        .shard(Shard { tp_rank: 1, tp_size: 4, pp_rank: 0, pp_size: 2 })
        .position(PositionEncoding::Rope)
        .rope(Some(rope))
        .chain(chain(3))
        .block_tokens(512)
        .valid_tokens(300)
        .multimodal(Some(Multimodal { processor: digest(0x60), inputs: digest(0x70) }))
        .build();
    let alibi = base()
        .kv_dtype(KvDtype::I8)
        .quant(QuantFormat::PerChannel)
        .layout("flat", 7)
        .shard(Shard::SOLO)
        .position(PositionEncoding::Alibi)
        .chain(chain(2))
        .block_tokens(64)
        .valid_tokens(1)
        .build();
    [("minimal", minimal), ("full", full), ("alibi", alibi)]
        .into_iter()
        .map(|(name, id)| (name, id.unwrap_or_else(|e| panic!("seed identity {name}: {e}"))))
        .collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    println!("{} ({} bytes)", path.display(), bytes.len());
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    for (name, id) in identities() {
        let physical = PhysicalKey::new(id);
        let logical = physical.logical();
        let p = PhysicalKey::decode(physical.encoded())
            .unwrap_or_else(|e| panic!("seed {name} physical key does not decode: {e}"));
        assert_eq!(p, physical, "seed {name} physical key changed through its decoder");
        let l = LogicalKey::decode(logical.encoded())
            .unwrap_or_else(|e| panic!("seed {name} logical key does not decode: {e}"));
        assert_eq!(l, logical, "seed {name} logical key changed through its decoder");
        write(&root.join("physical_key"), name, physical.encoded());
        write(&root.join("logical_key"), name, logical.encoded());
    }
}
