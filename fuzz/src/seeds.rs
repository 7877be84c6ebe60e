//! The seed inputs of every target, built through the crates' own encoders from values made
//! with their public APIs, so that each seed is a valid, canonical encoding. The `seeds` example
//! writes them under `seeds/<target>/<name>`; the tests check that the files there are exactly
//! these bytes and that every target accepts its seeds.

use gpucache_dataplane::identity::{
    CacheIdentity, CacheIdentityBuilder, Digest32, KvDtype, Multimodal, PositionEncoding,
    QuantFormat, RopeParams, RopeScaling, Shard,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::store::{Invalidate, Lookup, MissReason};
use gpucache_wire::{HEADER_BYTES, Request, Response, offset};

/// One seed file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub target: &'static str,
    pub name: &'static str,
    pub bytes: Vec<u8>,
}

/// A digest whose bytes are `seed, seed+1, ...` (wrapping): distinct and easy to spot in hex.
pub fn digest(seed: u8) -> Digest32 {
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

fn base() -> CacheIdentityBuilder {
    CacheIdentity::builder()
        .tenant("acme")
        .trust_domain("prod")
        .model_revision("llama-3.1-8b@rev2")
        .model_config(digest(0x10))
        .tokenizer_revision("tok:v3")
}

/// Three identities that between them use every optional part of a key: `minimal` (nothing
/// optional), `full` (adapter, grouped quantization, sharding, RoPE, multimodal inputs) and
/// `alibi`.
pub fn identities() -> Vec<(&'static str, CacheIdentity)> {
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

/// The physical keys of [`identities`], by name.
pub fn keys() -> Vec<(&'static str, PhysicalKey)> {
    identities().into_iter().map(|(name, id)| (name, PhysicalKey::new(id))).collect()
}

fn key_seeds(out: &mut Vec<Seed>) {
    for (name, physical) in keys() {
        let logical = physical.logical();
        out.push(Seed { target: "physical_key", name, bytes: physical.encoded().to_vec() });
        out.push(Seed { target: "logical_key", name, bytes: logical.encoded().to_vec() });
    }
}

fn request_bytes(request: &Request, id: u64) -> Vec<u8> {
    request.to_frame_bytes(id).unwrap_or_else(|e| panic!("seed request {request:?}: {e}"))
}

fn response_bytes(response: &Response, id: u64) -> Vec<u8> {
    response.to_frame_bytes(id).unwrap_or_else(|e| panic!("seed response {response:?}: {e}"))
}

/// A "wrapped" frame input: control byte (bit 7 set), then the frame's kind, op and body.
fn wrapped(control: u8, frame: &[u8]) -> Vec<u8> {
    let mut out = vec![0x80 | control, frame[offset::KIND], frame[offset::OP]];
    out.extend_from_slice(&frame[HEADER_BYTES..]);
    out
}

fn frame_seeds(out: &mut Vec<Seed>) {
    let keys: Vec<PhysicalKey> = keys().into_iter().map(|(_, k)| k).collect();
    let lookup = Request::Lookup { keys: keys.clone() };
    let lookup_answer = Response::Lookup(vec![
        Ok(Lookup::Hit { len: 4096 }),
        Ok(Lookup::Miss(MissReason::Absent)),
        Ok(Lookup::Miss(MissReason::Corrupt)),
    ]);
    // A raw stream (control byte 5, bit 7 clear): requests and responses back to back.
    let mut stream = vec![0x05];
    stream.extend(request_bytes(&Request::Info, 1));
    stream.extend(request_bytes(&lookup, 2));
    stream.extend(request_bytes(&Request::Invalidate { keys: vec![keys[2].clone()] }, 3));
    stream.extend(response_bytes(&Response::Epoch(Epoch(7)), 1));
    stream.extend(response_bytes(&lookup_answer, 2));
    stream.extend(response_bytes(
        &Response::Invalidate(vec![Ok(Invalidate::Removed), Ok(Invalidate::Busy)]),
        3,
    ));
    out.push(Seed { target: "frame", name: "stream", bytes: stream });
    out.push(Seed {
        target: "frame",
        name: "wrapped_request",
        bytes: wrapped(0x02, &request_bytes(&lookup, 2)),
    });
    out.push(Seed {
        target: "frame",
        name: "wrapped_response",
        bytes: wrapped(0x03, &response_bytes(&lookup_answer, 3)),
    });
}

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut out = Vec::new();
    frame_seeds(&mut out);
    key_seeds(&mut out);
    out
}
