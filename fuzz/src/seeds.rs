//! The seed inputs of every target, built through the crates' own encoders from values made
//! with their public APIs, so that each seed is a valid, canonical encoding. The `seeds` example
//! writes them under `seeds/<target>/<name>`; the tests check that the files there are exactly
//! these bytes and that every target accepts its seeds.

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::{
    CacheIdentity, CacheIdentityBuilder, Digest32, KvDtype, Multimodal, PositionEncoding,
    QuantFormat, RopeParams, RopeScaling, Shard,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::store::{Invalidate, Lookup, MissReason};
use gpucache_mooncake::Raw;
use gpucache_mooncake::wire::{object_header, reply_body};
use gpucache_nic::nixl::{BlockMem, RemoteBlock};
use gpucache_storage::file::layout::{encode_header, header_len_for};
use gpucache_wire::resp::encode_request;
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

/// `control` followed by `bytes`.
fn with_control(control: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![control];
    out.extend_from_slice(bytes);
    out
}

fn resp_seeds(out: &mut Vec<Seed>) {
    let mut pipeline = Vec::new();
    encode_request(&[&b"SET"[..], b"user:1", b"binary\r\n\x00value"], &mut pipeline);
    encode_request(&[&b"GET"[..], b"user:1"], &mut pipeline);
    encode_request(&[&b"MSET"[..], b"a", b"1", b"b", b"2"], &mut pipeline);
    encode_request(&[&b"DEL"[..], b"a", b"b"], &mut pipeline);
    // Control 4: default limits, pieces seeded with 2.
    out.push(Seed { target: "resp_request", name: "pipeline", bytes: with_control(4, &pipeline) });
    // Inline commands as redis-cli and telnet users type them, with an empty line and an
    // empty array between them (both skipped). The encoder writes arrays only.
    let inline = b"PING\r\n\r\n*0\r\nGET user:1\r\n  SET\tkey  value \nQUIT\r\n";
    out.push(Seed { target: "resp_request", name: "inline", bytes: with_control(6, inline) });
    // Control 1: the tiny limits (64-byte bulk strings, 100 bytes a request), filled.
    let mut small = Vec::new();
    encode_request(&[&b"SET"[..], b"k", &[b'v'; 64][..]], &mut small);
    out.push(Seed { target: "resp_request", name: "small_limits", bytes: with_control(1, &small) });
}

fn nixl_seeds(out: &mut Vec<Seed>) {
    let dram = RemoteBlock {
        agent: "gpucache-a".into(),
        mem: BlockMem::Dram,
        addr: 0x7f00_0000_1000,
        len_bytes: 1 << 20,
        dev_id: 0,
    };
    let vram = RemoteBlock {
        agent: format!("node-7/gpu-{}", "x".repeat(200)),
        mem: BlockMem::Vram,
        addr: 0x0000_7000_0000_0000,
        len_bytes: 2 << 20,
        dev_id: 3,
    };
    for (name, control, block) in [("dram", 0, dram), ("vram_checked", 1, vram)] {
        let bytes = block.encode().unwrap_or_else(|e| panic!("seed descriptor {name}: {e}"));
        out.push(Seed { target: "nixl_descriptor", name, bytes: with_control(control, &bytes) });
    }
}

/// One block header seed: which of [`keys`] it names and what else the header says.
struct HeaderCase {
    name: &'static str,
    control: u8,
    key: usize,
    payload_len: u64,
    seq: u64,
    epoch: u64,
    /// Bytes after the header (the start of a payload).
    after: &'static [u8],
}

fn header_seeds(out: &mut Vec<Seed>) {
    let keys = keys();
    let cases = [
        // A header alone, parsed as it is.
        HeaderCase {
            name: "minimal",
            control: 0,
            key: 0,
            payload_len: 4096,
            seq: 1,
            epoch: 1,
            after: b"",
        },
        // With control bit 0 set (the checksum rewritten, here to what it already is) and the
        // start of the payload after the header.
        HeaderCase {
            name: "full_checked",
            control: 1,
            key: 1,
            payload_len: 300,
            seq: 77,
            epoch: 2,
            after: b"payload bytes after the header",
        },
        // An empty payload.
        HeaderCase {
            name: "alibi_empty",
            control: 0,
            key: 2,
            payload_len: 0,
            seq: 1 << 40,
            epoch: 5,
            after: b"",
        },
    ];
    for case in cases {
        let key = &keys[case.key].1;
        let mut header = vec![0u8; header_len_for(key.encoded().len())];
        let checksum = Checksum::of(&[b'p'; 7][..]);
        encode_header(&mut header, key, case.payload_len, checksum, case.seq, case.epoch);
        header.extend_from_slice(case.after);
        let bytes = with_control(case.control, &header);
        out.push(Seed { target: "block_header", name: case.name, bytes });
    }
}

fn mooncake_seeds(out: &mut Vec<Seed>) {
    // Control values modulo 5 pick the operation: 0 PUT, 1 GET, 4 REMOVE.
    let replies: [(&'static str, u8, u64, Raw, &[u8]); 4] = [
        ("get_hit", 1, 8, Raw::Code(3), b"abc"),
        ("get_missing", 1, 8, Raw::Code(-704), b""),
        ("put_done", 0, 0, Raw::Code(0), b""),
        ("remove_raised", 4, 0, Raw::Raised, b""),
    ];
    for (name, control, argument, raw, payload) in replies {
        let mut bytes = vec![control];
        bytes.extend_from_slice(&argument.to_le_bytes());
        bytes.extend_from_slice(&reply_body(raw, payload));
        out.push(Seed { target: "mooncake_wire", name, bytes });
    }
    let payload = b"kv page bytes";
    let mut object = object_header(payload).to_vec();
    object.extend_from_slice(payload);
    out.push(Seed { target: "mooncake_wire", name: "object", bytes: with_control(0x80, &object) });
}

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut out = Vec::new();
    frame_seeds(&mut out);
    key_seeds(&mut out);
    resp_seeds(&mut out);
    nixl_seeds(&mut out);
    header_seeds(&mut out);
    mooncake_seeds(&mut out);
    out
}
