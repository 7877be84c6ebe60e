//! Packs and their manifests (version 3).
//!
//! A pack is one object holding the payloads of several blocks of one tenant, back to back.
//! Its manifest is a second, small object that says where each block lies in the pack and
//! binds each range to the tenant and to the digest of the block's physical key (the canonical
//! encoding of its validated [`CacheIdentity`](gpucache_dataplane::identity::CacheIdentity)).
//! Both objects are named by the BLAKE3 digest of their own bytes, so a name is never written
//! twice with different contents and a reader proves what it fetched matches its name.
//!
//! Manifest layout, little-endian:
//!
//! ```text
//! magic "GPCM" | version u8 (3) | 0u8 | tenant_len u16 | tenant | pack digest [32] | pack_len u64
//! | created_ms u64 | expires_ms u64 | entries u32 | entry*
//! entry: key digest [32] | key_len u32 | GPCK key | offset u64 | len u64 | checksum u64
//! ```
//!
//! Decoding is strict: every key is decoded and validated, its digest recomputed and compared,
//! its tenant compared with the manifest's; ranges lie inside the pack, in order, without
//! overlap; nothing follows the last entry. A manifest of version 1 or 2 is reported as
//! legacy, and its entries are never read.

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::{KEY_BYTES_MAX, KeyDigest, PhysicalKey};

/// Magic of a manifest object.
pub const MANIFEST_MAGIC: [u8; 4] = *b"GPCM";
/// The manifest version this build writes and reads.
pub const MANIFEST_VERSION: u8 = 3;
/// Most blocks in one pack.
pub const PACK_BLOCKS_MAX: usize = 4096;
/// Largest pack object.
pub const PACK_BYTES_MAX: u64 = 1 << 30;
/// Largest manifest object (a full pack of the longest keys fits).
pub const MANIFEST_BYTES_MAX: usize = 64 + 255 + PACK_BLOCKS_MAX * (KEY_BYTES_MAX / 4 + 64);

/// One block of a pack, as its manifest describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackEntry {
    pub key: PhysicalKey,
    pub offset: u64,
    pub len: u64,
    pub checksum: Checksum,
}

/// A decoded, validated manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub tenant: TenantId,
    pub pack_digest: [u8; 32],
    pub pack_len: u64,
    pub created_ms: u64,
    pub expires_ms: u64,
    pub entries: Vec<PackEntry>,
}

/// Why manifest bytes were not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Written by an older build: its ranges are not bound to identities, so never read.
    #[error("manifest version {version} is legacy (this build reads version {MANIFEST_VERSION})")]
    Legacy { version: u8 },
    #[error("manifest version {version} is not supported (this build reads {MANIFEST_VERSION})")]
    Unsupported { version: u8 },
    #[error("manifest bytes do not match the digest in its name")]
    NameMismatch,
    #[error("manifest is malformed: {0}")]
    Malformed(String),
}

fn malformed(what: impl Into<String>) -> ManifestError {
    ManifestError::Malformed(what.into())
}

/// The lowercase hexadecimal form of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The BLAKE3 digest of `bytes`, which names the object holding them.
pub fn content_digest(bytes: &[u8]) -> [u8; 32] {
    KeyDigest::of(bytes).0
}

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let tenant = self.tenant.as_str().as_bytes();
        let mut out = Vec::with_capacity(
            64 + tenant.len()
                + self.entries.iter().map(|e| 60 + e.key.encoded().len()).sum::<usize>(),
        );
        out.extend_from_slice(&MANIFEST_MAGIC);
        out.push(MANIFEST_VERSION);
        out.push(0);
        let tenant_len = u16::try_from(tenant.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&tenant_len.to_le_bytes());
        out.extend_from_slice(&tenant[..usize::from(tenant_len)]);
        out.extend_from_slice(&self.pack_digest);
        out.extend_from_slice(&self.pack_len.to_le_bytes());
        out.extend_from_slice(&self.created_ms.to_le_bytes());
        out.extend_from_slice(&self.expires_ms.to_le_bytes());
        let count = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&count.to_le_bytes());
        for e in &self.entries {
            let key = e.key.encoded();
            out.extend_from_slice(&e.key.digest().0);
            out.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_le_bytes());
            out.extend_from_slice(key);
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
            out.extend_from_slice(&e.checksum.0.to_le_bytes());
        }
        out
    }

    /// Decodes `bytes` fetched from the object named by `name_digest` (see the module
    /// documentation for every check).
    pub fn decode(bytes: &[u8], name_digest: &[u8; 32]) -> Result<Self, ManifestError> {
        if bytes.len() > MANIFEST_BYTES_MAX {
            return Err(malformed(format!(
                "{} bytes, the limit is {MANIFEST_BYTES_MAX}",
                bytes.len()
            )));
        }
        if &content_digest(bytes) != name_digest {
            return Err(ManifestError::NameMismatch);
        }
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != MANIFEST_MAGIC {
            return Err(malformed("bad magic"));
        }
        match r.u8()? {
            MANIFEST_VERSION => {}
            version @ (1 | 2) => return Err(ManifestError::Legacy { version }),
            version => return Err(ManifestError::Unsupported { version }),
        }
        if r.u8()? != 0 {
            return Err(malformed("reserved byte is not zero"));
        }
        let tenant_len = usize::from(r.u16()?);
        let tenant = std::str::from_utf8(r.take(tenant_len)?)
            .map_err(|_| malformed("tenant is not UTF-8"))?;
        let tenant = TenantId::parse(tenant).map_err(|e| malformed(format!("tenant: {e}")))?;
        let pack_digest: [u8; 32] = r.take(32)?.try_into().map_err(|_| malformed("digest"))?;
        let pack_len = r.u64()?;
        if pack_len > PACK_BYTES_MAX {
            return Err(malformed(format!("pack of {pack_len} bytes")));
        }
        let created_ms = r.u64()?;
        let expires_ms = r.u64()?;
        let count = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
        if count == 0 || count > PACK_BLOCKS_MAX {
            return Err(malformed(format!("{count} entries (1 to {PACK_BLOCKS_MAX})")));
        }
        let mut entries = Vec::with_capacity(count);
        let mut end = 0u64;
        for _ in 0..count {
            let digest: [u8; 32] = r.take(32)?.try_into().map_err(|_| malformed("digest"))?;
            let key_len = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
            if key_len > KEY_BYTES_MAX {
                return Err(malformed(format!("a key of {key_len} bytes")));
            }
            let key = PhysicalKey::decode(r.take(key_len)?)
                .map_err(|e| malformed(format!("key: {e}")))?;
            if key.digest().0 != digest {
                return Err(malformed("a key does not match its digest"));
            }
            if key.tenant() != &tenant {
                return Err(malformed("a key of another tenant"));
            }
            let (offset, len) = (r.u64()?, r.u64()?);
            let checksum = Checksum(r.u64()?);
            let stop = offset.checked_add(len).ok_or_else(|| malformed("range overflows"))?;
            if offset < end || stop > pack_len {
                return Err(malformed("ranges overlap, are out of order or leave the pack"));
            }
            end = stop;
            entries.push(PackEntry { key, offset, len, checksum });
        }
        if r.at != bytes.len() {
            return Err(malformed(format!("{} bytes after the last entry", bytes.len() - r.at)));
        }
        Ok(Self { tenant, pack_digest, pack_len, created_ms, expires_ms, entries })
    }

    /// The entry for `key`, bound to it by digest and full key.
    pub fn entry(&self, key: &PhysicalKey) -> Option<&PackEntry> {
        self.entries
            .iter()
            .find(|e| e.key.digest() == key.digest() && e.key.encoded() == key.encoded())
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ManifestError> {
        let stop = self.at.checked_add(n).filter(|&s| s <= self.bytes.len());
        let stop = stop.ok_or_else(|| malformed(format!("ends before byte {}", self.at + n)))?;
        let out = &self.bytes[self.at..stop];
        self.at = stop;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, ManifestError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ManifestError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().map_err(|_| malformed("u16"))?))
    }
    fn u32(&mut self) -> Result<u32, ManifestError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| malformed("u32"))?))
    }
    fn u64(&mut self) -> Result<u64, ManifestError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| malformed("u64"))?))
    }
}

/// A pack being filled: its payload bytes and the entries so far, all of one tenant.
#[derive(Debug)]
pub struct PackBuilder {
    tenant: TenantId,
    bytes: Vec<u8>,
    entries: Vec<PackEntry>,
}

/// A sealed pack: the two objects to store and what they hold.
#[derive(Debug, Clone)]
pub struct SealedPack {
    pub pack_name: String,
    pub pack: std::sync::Arc<[u8]>,
    pub manifest_name: String,
    pub manifest_bytes: std::sync::Arc<[u8]>,
    pub manifest: Manifest,
}

impl PackBuilder {
    pub fn new(tenant: TenantId) -> Self {
        Self { tenant, bytes: Vec::new(), entries: Vec::new() }
    }

    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn bytes(&self) -> u64 {
        self.bytes.len() as u64
    }
    /// Whether the pack already holds this very block.
    pub fn holds(&self, key: &PhysicalKey) -> bool {
        self.entries.iter().any(|e| e.key.digest() == key.digest())
    }

    /// Takes `key`'s block out of the pack; the bytes it held, if it was there.
    pub fn remove(&mut self, key: &PhysicalKey) -> Option<u64> {
        let i = self.entries.iter().position(|e| e.key.digest() == key.digest())?;
        let e = self.entries.remove(i);
        let from = usize::try_from(e.offset).ok()?;
        let to = usize::try_from(e.offset + e.len).ok()?;
        self.bytes.drain(from..to);
        for later in &mut self.entries[i..] {
            later.offset -= e.len;
        }
        Some(e.len)
    }

    /// Appends a block of this pack's tenant. The caller keeps the pack within
    /// [`PACK_BLOCKS_MAX`] and [`PACK_BYTES_MAX`].
    pub fn push(&mut self, key: PhysicalKey, payload: &[u8], checksum: Checksum) {
        debug_assert_eq!(key.tenant(), &self.tenant);
        let offset = self.bytes.len() as u64;
        self.bytes.extend_from_slice(payload);
        self.entries.push(PackEntry { key, offset, len: payload.len() as u64, checksum });
    }

    /// The pack object and its manifest, named under `prefix`, and validated as a reader will
    /// validate them: the manifest decodes, and every range's bytes match their checksum.
    pub fn seal(
        self,
        prefix: &str,
        created_ms: u64,
        expires_ms: u64,
    ) -> Result<SealedPack, ManifestError> {
        let pack_digest = content_digest(&self.bytes);
        let manifest = Manifest {
            tenant: self.tenant,
            pack_digest,
            pack_len: self.bytes.len() as u64,
            created_ms,
            expires_ms,
            entries: self.entries,
        };
        let manifest_bytes = manifest.encode();
        let manifest_digest = content_digest(&manifest_bytes);
        let checked = Manifest::decode(&manifest_bytes, &manifest_digest)?;
        for e in &checked.entries {
            let range = usize::try_from(e.offset).unwrap_or(usize::MAX)
                ..usize::try_from(e.offset + e.len).unwrap_or(usize::MAX);
            if self.bytes.get(range).map(Checksum::of) != Some(e.checksum) {
                return Err(malformed("a block does not match its checksum"));
            }
        }
        Ok(SealedPack {
            pack_name: pack_name(prefix, &pack_digest),
            pack: self.bytes.into(),
            manifest_name: manifest_name(prefix, &checked.tenant, &manifest_digest),
            manifest_bytes: manifest_bytes.into(),
            manifest: checked,
        })
    }
}

/// Where the pack with this digest lives.
pub fn pack_name(prefix: &str, digest: &[u8; 32]) -> String {
    format!("{prefix}/packs/{}", hex(digest))
}

/// The folder of a tenant's manifests (the tenant hex-encoded, so any tenant name is a safe
/// path segment).
pub fn manifest_folder(prefix: &str, tenant: &TenantId) -> String {
    format!("{prefix}/manifests/{}", hex(tenant.as_str().as_bytes()))
}

pub fn manifest_name(prefix: &str, tenant: &TenantId, digest: &[u8; 32]) -> String {
    format!("{}/{}", manifest_folder(prefix, tenant), hex(digest))
}

/// The marker object that records a retired tenant.
pub fn retired_name(prefix: &str, tenant: &TenantId) -> String {
    format!("{prefix}/retired/{}", hex(tenant.as_str().as_bytes()))
}

/// The digest a content-addressed object name ends in.
pub fn name_digest(name: &str) -> Option<[u8; 32]> {
    let tail = name.rsplit('/').next()?;
    if tail.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(tail.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The tenant whose hex-encoded name is `segment`.
pub fn tenant_of_segment(segment: &str) -> Option<TenantId> {
    if !segment.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..segment.len() / 2)
        .map(|i| u8::from_str_radix(segment.get(2 * i..2 * i + 2)?, 16).ok())
        .collect();
    TenantId::parse(std::str::from_utf8(&bytes?).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::testing::fixture;

    fn key(tenant: usize, link: u8) -> PhysicalKey {
        fixture::key(tenant, &[link], KvDtype::F16, 16)
    }

    fn sealed() -> SealedPack {
        let mut b = PackBuilder::new(fixture::tenant(0));
        for i in 0..3u8 {
            let payload = vec![i; 100 + usize::from(i)];
            b.push(key(0, i), &payload, Checksum::of(&payload));
        }
        b.seal("gc", 10, 20).expect("seal")
    }

    #[test]
    fn a_sealed_manifest_decodes_to_itself_and_names_match_contents() {
        let s = sealed();
        let digest = name_digest(&s.manifest_name).expect("digest");
        let back = Manifest::decode(&s.manifest_bytes, &digest).expect("decode");
        assert_eq!(back, s.manifest);
        assert_eq!(name_digest(&s.pack_name), Some(content_digest(&s.pack)));
        assert_eq!(back.entries.iter().map(|e| e.offset).collect::<Vec<_>>(), [0, 100, 201]);
        assert!(s.manifest_name.starts_with(&manifest_folder("gc", &back.tenant)));
    }

    #[test]
    fn any_flipped_byte_or_legacy_version_is_refused() {
        let s = sealed();
        let bytes = s.manifest_bytes.to_vec();
        for at in [0, 4, 8, 40, bytes.len() / 2, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 1;
            // Renamed to match, so only the structural checks can catch it.
            let r = Manifest::decode(&bad, &content_digest(&bad));
            let renamed_ok = matches!(&r, Ok(m) if *m == s.manifest);
            assert!(!renamed_ok, "byte {at} flipped still gave the same manifest");
            assert_eq!(
                Manifest::decode(&bad, &name_digest(&s.manifest_name).expect("digest")),
                Err(ManifestError::NameMismatch)
            );
        }
        for version in [1u8, 2] {
            let mut legacy = bytes.clone();
            legacy[4] = version;
            assert_eq!(
                Manifest::decode(&legacy, &content_digest(&legacy)),
                Err(ManifestError::Legacy { version })
            );
        }
    }

    #[test]
    fn a_key_of_another_tenant_cannot_enter_a_manifest() {
        let mut m = sealed().manifest;
        m.entries[1].key = key(1, 1);
        let bytes = m.encode();
        assert!(matches!(
            Manifest::decode(&bytes, &content_digest(&bytes)),
            Err(ManifestError::Malformed(_))
        ));
    }

    #[test]
    fn tenant_segments_round_trip() {
        let t = fixture::tenant(2);
        let folder = manifest_folder("p", &t);
        let seg = folder.rsplit('/').next().expect("segment");
        assert_eq!(tenant_of_segment(seg), Some(t));
    }
}
