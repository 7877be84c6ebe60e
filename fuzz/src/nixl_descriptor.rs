//! Fuzzes the NIXL block descriptor decoder (`gpucache_nic::nixl::RemoteBlock::decode`).
//!
//! Input layout: a control byte, then the descriptor bytes. With control bit 0 set, the last 4
//! bytes are overwritten with the correct check of the bytes before them (the low 32 bits of
//! the data plane's checksum, as the encoder writes it) before decoding, so that the fuzzer
//! reaches the checks behind the checksum; with it clear the bytes are decoded as they are.
//!
//! Nothing may panic. An accepted descriptor is canonical: encoding what was decoded gives the
//! input back byte for byte, its size is the fixed part plus the agent name, and every shorter
//! prefix of it is refused as truncated. A refusal says what it found: a truncation names the
//! input's own length and a larger need, trailing bytes are counted exactly.

use gpucache_dataplane::checksum::Checksum;
use gpucache_nic::nixl::wire::{AGENT_NAME_BYTES_MAX, WIRE_BYTES_MAX, WIRE_FIXED_BYTES};
use gpucache_nic::nixl::{RemoteBlock, WireError};

use crate::Outcome;

/// Writes the descriptor check into the last 4 bytes of `bytes` (when it has more than 4).
pub fn fix_check(bytes: &mut [u8]) {
    let Some(body) = bytes.len().checked_sub(4).filter(|&b| b > 0) else { return };
    let sum = Checksum::of(&bytes[..body]).0.to_le_bytes();
    bytes[body..].copy_from_slice(&sum[..4]);
}

/// Decodes the descriptor as the control byte says and checks the answer.
pub fn run(data: &[u8]) -> Outcome {
    let Some((&control, rest)) = data.split_first() else { return Outcome::Refused };
    let mut bytes = rest.to_vec();
    if control & 1 == 1 {
        fix_check(&mut bytes);
    }
    match RemoteBlock::decode(&bytes) {
        Ok(block) => {
            let name = block.agent.len();
            assert!((1..=AGENT_NAME_BYTES_MAX).contains(&name), "agent name of {name} bytes");
            assert_eq!(bytes.len(), WIRE_FIXED_BYTES + name, "descriptor size");
            assert!(bytes.len() <= WIRE_BYTES_MAX, "descriptor over WIRE_BYTES_MAX");
            assert_ne!(block.len_bytes, 0, "an empty block was accepted");
            let again = block.encode().unwrap_or_else(|e| panic!("a decoded block: {e}"));
            assert_eq!(again, bytes, "descriptor encoding is not canonical");
            for len in 0..bytes.len() {
                match RemoteBlock::decode(&bytes[..len]) {
                    Err(WireError::Truncated { .. }) => {}
                    other => panic!("the first {len} bytes of a descriptor: {other:?}"),
                }
            }
            Outcome::Accepted
        }
        Err(WireError::Truncated { need, have }) => {
            assert_eq!(have, bytes.len(), "a truncation names another length");
            assert!(need > have && need <= WIRE_BYTES_MAX, "need {need} of {have}");
            Outcome::Refused
        }
        Err(WireError::Trailing { extra }) => {
            assert!(extra > 0 && extra < bytes.len(), "{extra} trailing of {}", bytes.len());
            assert!(bytes.len() - extra >= WIRE_FIXED_BYTES, "trailing bytes after too little");
            Outcome::Refused
        }
        Err(_) => Outcome::Refused,
    }
}
