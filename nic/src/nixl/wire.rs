//! The compact, versioned encoding of a [`RemoteBlock`]: what a peer needs, besides its loaded
//! agent metadata, to read or write one block of another agent's registered memory. These bytes
//! travel over GPUCache's own TCP control channel, so decoding checks everything and answers
//! with a typed [`WireError`].
//!
//! Layout (version 1, integers little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `GPNX` |
//! | 1 | version (1) |
//! | 1 | memory type: 0 DRAM, 1 VRAM |
//! | 2 | agent name length `n` (1..=[`AGENT_NAME_BYTES_MAX`]) |
//! | `n` | agent name, UTF-8 |
//! | 8 | address |
//! | 8 | length in bytes (not zero) |
//! | 8 | device id (0 for DRAM, the GPU index for VRAM) |
//! | 4 | FNV-1a 32 of every byte before it |

/// Longest agent name a descriptor may carry.
pub const AGENT_NAME_BYTES_MAX: usize = 255;
/// The encoding version this build writes and the only one it reads.
pub const WIRE_VERSION: u8 = 1;
/// Fixed part of an encoded descriptor (everything but the name).
pub const WIRE_FIXED_BYTES: usize = 4 + 1 + 1 + 2 + 8 + 8 + 8 + 4;
/// Largest encoded descriptor.
pub const WIRE_BYTES_MAX: usize = WIRE_FIXED_BYTES + AGENT_NAME_BYTES_MAX;

const MAGIC: [u8; 4] = *b"GPNX";
const _: () = assert!(AGENT_NAME_BYTES_MAX <= u16::MAX as usize);

/// Where a block's bytes live on its agent. VRAM is reserved for hosts with a GPU: nothing in
/// this crate registers VRAM yet, but a peer that does can describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockMem {
    Dram,
    Vram,
}

impl BlockMem {
    fn code(self) -> u8 {
        match self {
            Self::Dram => 0,
            Self::Vram => 1,
        }
    }
    fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::Dram),
            1 => Some(Self::Vram),
            _ => None,
        }
    }
}

/// One block of registered memory on a (possibly remote) NIXL agent.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteBlock {
    /// The NIXL agent that registered it (as its loaded metadata names it).
    pub agent: String,
    pub mem: BlockMem,
    pub addr: u64,
    pub len_bytes: u64,
    /// 0 for DRAM; the GPU index for VRAM.
    pub dev_id: u64,
}

/// Why descriptor bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("descriptor of {have} bytes is truncated, {need} needed")]
    Truncated { need: usize, have: usize },
    #[error("descriptor has {extra} trailing bytes")]
    Trailing { extra: usize },
    #[error("descriptor magic {got:02x?} is not GPNX")]
    BadMagic { got: [u8; 4] },
    #[error("descriptor version {got} is not supported (this build reads {WIRE_VERSION})")]
    Version { got: u8 },
    #[error("descriptor memory type {got} is unknown")]
    MemType { got: u8 },
    #[error("agent name of {len} bytes refused (1..={max})")]
    NameLength { len: usize, max: usize },
    #[error("agent name is not UTF-8")]
    NameNotUtf8,
    #[error("descriptor describes an empty block")]
    Empty,
    #[error("descriptor checksum {stored:#010x} does not match {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
}

/// The descriptor's check: the low 32 bits of the data plane's checksum (as GPCW headers take
/// theirs).
fn check32(bytes: &[u8]) -> u32 {
    let [a, b, c, d, ..] = gpucache_dataplane::checksum::Checksum::of(bytes).0.to_le_bytes();
    u32::from_le_bytes([a, b, c, d])
}

impl RemoteBlock {
    /// Encodes the descriptor; refuses a name outside 1..=[`AGENT_NAME_BYTES_MAX`] bytes or an
    /// empty block, which no decoder would accept.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let name = self.agent.as_bytes();
        let name_len = u16::try_from(name.len())
            .ok()
            .filter(|n| (1..=AGENT_NAME_BYTES_MAX).contains(&usize::from(*n)))
            .ok_or(WireError::NameLength { len: name.len(), max: AGENT_NAME_BYTES_MAX })?;
        if self.len_bytes == 0 {
            return Err(WireError::Empty);
        }
        let mut out = Vec::with_capacity(WIRE_FIXED_BYTES + name.len());
        out.extend_from_slice(&MAGIC);
        out.push(WIRE_VERSION);
        out.push(self.mem.code());
        out.extend_from_slice(&name_len.to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.len_bytes.to_le_bytes());
        out.extend_from_slice(&self.dev_id.to_le_bytes());
        let check = check32(&out);
        out.extend_from_slice(&check.to_le_bytes());
        Ok(out)
    }

    /// Decodes exactly one descriptor; every field is checked before anything is returned.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let need = |n: usize| {
            if bytes.len() < n {
                Err(WireError::Truncated { need: n, have: bytes.len() })
            } else {
                Ok(())
            }
        };
        need(8)?;
        let got: [u8; 4] = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if got != MAGIC {
            return Err(WireError::BadMagic { got });
        }
        if bytes[4] != WIRE_VERSION {
            return Err(WireError::Version { got: bytes[4] });
        }
        let mem = BlockMem::from_code(bytes[5]).ok_or(WireError::MemType { got: bytes[5] })?;
        let name_len = usize::from(u16::from_le_bytes([bytes[6], bytes[7]]));
        if !(1..=AGENT_NAME_BYTES_MAX).contains(&name_len) {
            return Err(WireError::NameLength { len: name_len, max: AGENT_NAME_BYTES_MAX });
        }
        let total = WIRE_FIXED_BYTES + name_len;
        need(total)?;
        if bytes.len() > total {
            return Err(WireError::Trailing { extra: bytes.len() - total });
        }
        let body = total - 4;
        let stored = u32::from_le_bytes(bytes[body..total].try_into().expect("4 bytes"));
        let computed = check32(&bytes[..body]);
        if stored != computed {
            return Err(WireError::Checksum { stored, computed });
        }
        let name_end = 8 + name_len;
        let agent = std::str::from_utf8(&bytes[8..name_end])
            .map_err(|_| WireError::NameNotUtf8)?
            .to_owned();
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let block = Self {
            agent,
            mem,
            addr: word(name_end),
            len_bytes: word(name_end + 8),
            dev_id: word(name_end + 16),
        };
        if block.len_bytes == 0 {
            return Err(WireError::Empty);
        }
        Ok(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> RemoteBlock {
        RemoteBlock {
            agent: "gpucache-a".into(),
            mem: BlockMem::Dram,
            addr: 0x7f00_0000_1000,
            len_bytes: 1 << 20,
            dev_id: 0,
        }
    }

    #[test]
    fn round_trips_and_has_the_documented_size() {
        let b = sample();
        let bytes = b.encode().unwrap();
        assert_eq!(bytes.len(), WIRE_FIXED_BYTES + b.agent.len());
        assert_eq!(RemoteBlock::decode(&bytes).unwrap(), b);
    }

    #[test]
    fn every_refusal_is_typed() {
        let good = sample().encode().unwrap();
        assert_eq!(RemoteBlock::decode(&good[..3]), Err(WireError::Truncated { need: 8, have: 3 }));
        let n = good.len();
        assert_eq!(
            RemoteBlock::decode(&good[..n - 1]),
            Err(WireError::Truncated { need: n, have: n - 1 })
        );
        let mut long = good.clone();
        long.push(0);
        assert_eq!(RemoteBlock::decode(&long), Err(WireError::Trailing { extra: 1 }));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(RemoteBlock::decode(&bad), Err(WireError::BadMagic { .. })));
        let mut bad = good.clone();
        bad[4] = 2;
        assert_eq!(RemoteBlock::decode(&bad), Err(WireError::Version { got: 2 }));
        let mut bad = good.clone();
        bad[5] = 9;
        assert_eq!(RemoteBlock::decode(&bad), Err(WireError::MemType { got: 9 }));
        let mut bad = good.clone();
        bad[6..8].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(
            RemoteBlock::decode(&bad),
            Err(WireError::NameLength { len: 0, max: AGENT_NAME_BYTES_MAX })
        );
        let mut bad = good.clone();
        bad[9] ^= 0x01;
        assert!(matches!(RemoteBlock::decode(&bad), Err(WireError::Checksum { .. })));
        let empty = RemoteBlock { len_bytes: 0, ..sample() };
        assert_eq!(empty.encode(), Err(WireError::Empty));
        let unnamed = RemoteBlock { agent: String::new(), ..sample() };
        assert_eq!(
            unnamed.encode(),
            Err(WireError::NameLength { len: 0, max: AGENT_NAME_BYTES_MAX })
        );
    }

    #[test]
    fn errors_display_their_numbers() {
        assert_eq!(
            WireError::Truncated { need: 8, have: 3 }.to_string(),
            "descriptor of 3 bytes is truncated, 8 needed"
        );
        assert_eq!(
            WireError::Version { got: 2 }.to_string(),
            "descriptor version 2 is not supported (this build reads 1)"
        );
        assert_eq!(
            WireError::Checksum { stored: 1, computed: 2 }.to_string(),
            "descriptor checksum 0x00000001 does not match 0x00000002"
        );
    }

    proptest! {
        #[test]
        fn any_descriptor_round_trips(
            agent in "[a-z0-9-]{1,64}", vram in any::<bool>(), addr in any::<u64>(),
            len in 1u64.., dev in any::<u64>(),
        ) {
            let b = RemoteBlock {
                agent, mem: if vram { BlockMem::Vram } else { BlockMem::Dram },
                addr, len_bytes: len, dev_id: dev,
            };
            prop_assert_eq!(RemoteBlock::decode(&b.encode().unwrap()).unwrap(), b);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..WIRE_BYTES_MAX + 8)) {
            let _ = RemoteBlock::decode(&bytes);
        }

        #[test]
        fn one_flipped_bit_is_refused(bit in 0usize..(WIRE_FIXED_BYTES + 10) * 8) {
            let mut bytes = sample().encode().unwrap();
            bytes[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(RemoteBlock::decode(&bytes).is_err());
        }
    }
}
