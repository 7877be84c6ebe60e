//! The logical prefix key (GPCL) and the physical byte key (GPCK): versioned, length-delimited
//! binary encodings of a [`CacheIdentity`], and their strict decoders.
//!
//! Layout of both: `magic[4] | version u8 | field_count u8 | field*`, where each field is
//! `tag u8 | len u32-le | value[len]`. Tags appear exactly once, in ascending order, and the set
//! of tags is fixed per key kind. The encoding is canonical: `encode(decode(b)) == b` for every
//! accepted `b`. The physical key carries every identity field; the logical key leaves out the
//! layout, shard and every other byte-affecting field, so one logical prefix may have several
//! physical forms. Owns no storage state.

use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::identity::{
    Adapter, BLOCK_TOKENS_MAX, CHAIN_HASHES_MAX, CacheIdentity, ChainHash, Digest32,
    IDENTITY_VERSION, IdentityError, KvDtype, LayoutAbi, Multimodal, NAME_BYTES_MAX, Name,
    PositionEncoding, QuantFormat, RopeParams, RopeScaling, Shard, TenantId,
};

/// Magic of the logical prefix key.
pub const LOGICAL_MAGIC: [u8; 4] = *b"GPCL";
/// Magic of the physical byte key.
pub const PHYSICAL_MAGIC: [u8; 4] = *b"GPCK";
const HEADER_BYTES: usize = 6;
const FIELD_HEADER_BYTES: usize = 5;
/// Largest encoded key accepted by the decoders: a full chain plus generous room for the rest.
pub const KEY_BYTES_MAX: usize = CHAIN_HASHES_MAX * 32 + 4096;

mod tag {
    pub(super) const TENANT: u8 = 1;
    pub(super) const TRUST_DOMAIN: u8 = 2;
    pub(super) const MODEL_REVISION: u8 = 3;
    pub(super) const MODEL_CONFIG: u8 = 4;
    pub(super) const TOKENIZER: u8 = 5;
    pub(super) const ADAPTER: u8 = 6;
    pub(super) const KV_DTYPE: u8 = 7;
    pub(super) const QUANT: u8 = 8;
    pub(super) const LAYOUT: u8 = 9;
    pub(super) const SHARD: u8 = 10;
    pub(super) const POSITION: u8 = 11;
    pub(super) const ROPE: u8 = 12;
    pub(super) const CHAIN: u8 = 13;
    pub(super) const BLOCK_TOKENS: u8 = 14;
    pub(super) const VALID_TOKENS: u8 = 15;
    pub(super) const MULTIMODAL: u8 = 16;
}

const LOGICAL_FIELDS: u8 = 8;
const PHYSICAL_FIELDS: u8 = 16;

/// Why a byte string is not a valid key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyDecodeError {
    #[error("key is {len} bytes, the limit is {max}")]
    TooLong { len: usize, max: usize },
    #[error("key ends after {available} bytes where {needed} are needed ({context})")]
    Truncated { context: &'static str, needed: usize, available: usize },
    #[error("key magic is {found:02x?}, expected {expected:02x?}")]
    BadMagic { found: [u8; 4], expected: [u8; 4] },
    #[error("key version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion { found: u8, supported: u8 },
    #[error("key declares {found} fields, this kind has {expected}")]
    FieldCount { found: u8, expected: u8 },
    #[error("field tag {found} where tag {expected} must come next")]
    UnexpectedTag { found: u8, expected: u8 },
    #[error("field {field} has length {len}, which this field cannot have")]
    FieldLength { field: &'static str, len: usize },
    #[error("field {field} holds unknown code {code}")]
    UnknownCode { field: &'static str, code: u32 },
    #[error("field {field} is not UTF-8")]
    NotUtf8 { field: &'static str },
    #[error("{count} bytes follow the last field")]
    TrailingBytes { count: usize },
    #[error("key fields are individually well formed but invalid together: {0}")]
    Identity(#[from] IdentityError),
}

/// A 32-byte BLAKE3 digest of a key's canonical encoding, used to index and to bind identities.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyDigest(pub [u8; 32]);

impl KeyDigest {
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }
}

impl fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyDigest(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("..)")
    }
}

/// The physical byte key: the full identity. Equal keys mean byte-identical interpretations.
///
/// A key is one shared allocation: clones (every index a store keeps names the key again) copy a
/// pointer, and the digests derived on first use are computed once for all of them.
#[derive(Clone)]
pub struct PhysicalKey(Arc<KeyInner>);

struct KeyInner {
    identity: CacheIdentity,
    encoded: Box<[u8]>,
    digest: KeyDigest,
    /// Derived digests, computed on first use: stores index by them on every put, lookup and
    /// eviction.
    logical: OnceLock<KeyDigest>,
    shape: OnceLock<KeyDigest>,
}

impl PhysicalKey {
    pub fn new(identity: CacheIdentity) -> Self {
        let encoded = encode_physical(&identity).into_boxed_slice();
        let digest = KeyDigest::of(&encoded);
        Self::from_parts(identity, encoded, digest)
    }

    fn from_parts(identity: CacheIdentity, encoded: Box<[u8]>, digest: KeyDigest) -> Self {
        Self(Arc::new(KeyInner {
            identity,
            encoded,
            digest,
            logical: OnceLock::new(),
            shape: OnceLock::new(),
        }))
    }

    /// Strictly decodes a GPCK key.
    pub fn decode(bytes: &[u8]) -> Result<Self, KeyDecodeError> {
        let identity = decode_physical(bytes)?;
        Ok(Self::from_parts(identity, Box::from(bytes), KeyDigest::of(bytes)))
    }

    pub fn identity(&self) -> &CacheIdentity {
        &self.0.identity
    }
    pub fn encoded(&self) -> &[u8] {
        &self.0.encoded
    }
    pub fn digest(&self) -> KeyDigest {
        self.0.digest
    }
    pub fn tenant(&self) -> &TenantId {
        self.0.identity.tenant()
    }
    /// Digest of every field except the chain and the valid length: blocks that may serve each
    /// other as prefixes share it.
    pub fn shape_digest(&self) -> KeyDigest {
        *self.0.shape.get_or_init(|| KeyDigest::of(&encode_physical_fields(&self.0.identity, true)))
    }
    /// Digest of [`Self::logical`]'s encoding.
    pub fn logical_digest(&self) -> KeyDigest {
        *self.0.logical.get_or_init(|| self.logical().digest())
    }
    /// The logical prefix key this physical key belongs to.
    pub fn logical(&self) -> LogicalKey {
        LogicalKey::from_identity(&self.0.identity)
    }
}

/// A key's digest and its logical digest, as a store that kept them beside the key's bytes
/// (under a checksum of its own) hands them back to [`KeyDecoder::decode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownDigests {
    pub digest: KeyDigest,
    pub logical: KeyDigest,
}

impl KnownDigests {
    pub fn of(key: &PhysicalKey) -> Self {
        Self { digest: key.digest(), logical: key.logical_digest() }
    }
}

/// Decodes many GPCK keys in a row, as strictly as [`PhysicalKey::decode`], for keys that mostly
/// share their shape (every field but the chain and the valid length), as the blocks of one
/// model do: when a key's fields up to its chain are byte for byte those of the key decoded
/// before it, they are not parsed again (their names are shared, not copied), and when its
/// shape is that key's, so is its shape digest.
#[derive(Debug, Default)]
pub struct KeyDecoder {
    /// The last key fully decoded, and where its chain field starts.
    template: Option<(PhysicalKey, usize)>,
}

impl KeyDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes `bytes`; with `known`, its digests are taken as given instead of computed (the
    /// caller vouches that they are the digests of these bytes).
    pub fn decode(
        &mut self,
        bytes: &[u8],
        known: Option<KnownDigests>,
    ) -> Result<PhysicalKey, KeyDecodeError> {
        // A key whose fields before the chain are malformed gets the strict decoder's error.
        let chain_at = chain_field_at(bytes);
        let reused = match (&self.template, chain_at) {
            (Some((t, t_chain_at)), Some(at)) if bytes[..at] == t.encoded()[..*t_chain_at] => {
                Some(decode_chain_on(t, &bytes[at..])?)
            }
            _ => None,
        };
        let digest = known.map_or_else(|| KeyDigest::of(bytes), |k| k.digest);
        let key = match reused {
            Some((identity, same_shape)) => {
                let key = Self::keyed(identity, bytes, digest);
                let template = self.template.as_ref().map(|(t, _)| t);
                if same_shape && let Some(shape) = template.and_then(|t| t.0.shape.get()) {
                    let _ = key.0.shape.set(*shape);
                }
                key
            }
            None => {
                let key = Self::keyed(decode_physical(bytes)?, bytes, digest);
                if let Some(at) = chain_at {
                    // Computed once here, shared by every key of its shape that follows.
                    key.shape_digest();
                    self.template = Some((key.clone(), at));
                }
                key
            }
        };
        if let Some(k) = known {
            let _ = key.0.logical.set(k.logical);
        }
        Ok(key)
    }

    fn keyed(identity: CacheIdentity, bytes: &[u8], digest: KeyDigest) -> PhysicalKey {
        PhysicalKey::from_parts(identity, Box::from(bytes), digest)
    }
}

/// Where the chain field of a GPCK key starts, when its header and every field before it are
/// framed well (their values are not checked here).
fn chain_field_at(bytes: &[u8]) -> Option<usize> {
    let mut r = Reader::header(bytes, PHYSICAL_MAGIC, PHYSICAL_FIELDS).ok()?;
    for (t, name) in [
        (tag::TENANT, "tenant"),
        (tag::TRUST_DOMAIN, "trust_domain"),
        (tag::MODEL_REVISION, "model_revision"),
        (tag::MODEL_CONFIG, "model_config"),
        (tag::TOKENIZER, "tokenizer"),
        (tag::ADAPTER, "adapter"),
        (tag::KV_DTYPE, "kv_dtype"),
        (tag::QUANT, "quant"),
        (tag::LAYOUT, "layout"),
        (tag::SHARD, "shard"),
        (tag::POSITION, "position"),
        (tag::ROPE, "rope"),
    ] {
        r.field(t, name).ok()?;
    }
    Some(bytes.len() - r.rest.len())
}

/// The identity of `template` with the chain, block length, valid length and multimodal
/// fields of `rest` (a key's bytes from its chain field on), checked as [`decode_physical`]
/// checks them; and whether its shape is the template's.
fn decode_chain_on(
    template: &PhysicalKey,
    rest: &[u8],
) -> Result<(CacheIdentity, bool), KeyDecodeError> {
    let Tail { chain, block_tokens, valid_tokens, multimodal } = decode_tail(Reader { rest })?;
    if !(1..=BLOCK_TOKENS_MAX).contains(&block_tokens) {
        let e = IdentityError::BlockTokens { tokens: block_tokens, max: BLOCK_TOKENS_MAX };
        return Err(e.into());
    }
    if !(1..=block_tokens).contains(&valid_tokens) {
        let e = IdentityError::ValidTokens { valid: valid_tokens, capacity: block_tokens };
        return Err(e.into());
    }
    let t = template.identity();
    let same_shape = block_tokens == t.block_tokens && multimodal == t.multimodal;
    let identity = CacheIdentity { chain, block_tokens, valid_tokens, multimodal, ..t.clone() };
    Ok((identity, same_shape))
}

impl PartialEq for PhysicalKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.digest == other.0.digest && self.0.encoded == other.0.encoded
    }
}
impl Eq for PhysicalKey {}
impl std::hash::Hash for PhysicalKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.digest.hash(state)
    }
}
impl fmt::Debug for PhysicalKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PhysicalKey({} {:?} chain={} valid={})",
            self.0.identity.tenant(),
            self.0.digest,
            self.0.identity.chain().len(),
            self.0.identity.valid_tokens()
        )
    }
}

/// The fields of a logical prefix key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LogicalParts {
    pub tenant: TenantId,
    pub trust_domain: Name,
    pub model_revision: Name,
    pub model_config: Digest32,
    pub tokenizer_revision: Name,
    pub adapter: Option<Adapter>,
    pub chain: Arc<[ChainHash]>,
    pub multimodal: Option<Multimodal>,
}

/// The logical prefix key: which tokens under which model, with no layout and no shard.
#[derive(Clone)]
pub struct LogicalKey {
    parts: LogicalParts,
    encoded: Arc<[u8]>,
    digest: KeyDigest,
}

impl LogicalKey {
    pub fn from_identity(id: &CacheIdentity) -> Self {
        let parts = LogicalParts {
            tenant: id.tenant.clone(),
            trust_domain: id.trust_domain.clone(),
            model_revision: id.model_revision.clone(),
            model_config: id.model_config,
            tokenizer_revision: id.tokenizer_revision.clone(),
            adapter: id.adapter.clone(),
            chain: id.chain.clone(),
            multimodal: id.multimodal,
        };
        let encoded: Arc<[u8]> = encode_logical(&parts).into();
        let digest = KeyDigest::of(&encoded);
        Self { parts, encoded, digest }
    }

    /// Strictly decodes a GPCL key.
    pub fn decode(bytes: &[u8]) -> Result<Self, KeyDecodeError> {
        let parts = decode_logical(bytes)?;
        Ok(Self { parts, encoded: Arc::from(bytes), digest: KeyDigest::of(bytes) })
    }

    pub fn parts(&self) -> &LogicalParts {
        &self.parts
    }
    pub fn encoded(&self) -> &[u8] {
        &self.encoded
    }
    pub fn digest(&self) -> KeyDigest {
        self.digest
    }
}

impl PartialEq for LogicalKey {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest && self.encoded == other.encoded
    }
}
impl Eq for LogicalKey {}
impl std::hash::Hash for LogicalKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.digest.hash(state)
    }
}
impl fmt::Debug for LogicalKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LogicalKey({} {:?})", self.parts.tenant, self.digest)
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding

struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn new(magic: [u8; 4], fields: u8, capacity: usize) -> Self {
        let mut buf = Vec::with_capacity(capacity);
        buf.extend_from_slice(&magic);
        buf.push(IDENTITY_VERSION);
        buf.push(fields);
        Self { buf }
    }

    fn field(&mut self, tag: u8, parts: &[&[u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.buf.push(tag);
        // Every field is bounded far below u32::MAX by the identity limits.
        self.buf.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
        for p in parts {
            self.buf.extend_from_slice(p);
        }
    }
}

fn adapter_parts(adapter: &Option<Adapter>) -> Vec<u8> {
    match adapter {
        None => Vec::new(),
        Some(a) => {
            let mut v = Vec::with_capacity(32 + a.name.as_str().len());
            v.extend_from_slice(&a.weights.0);
            v.extend_from_slice(a.name.as_str().as_bytes());
            v
        }
    }
}

fn multimodal_parts(mm: &Option<Multimodal>) -> Vec<u8> {
    match mm {
        None => Vec::new(),
        Some(m) => [m.processor.0, m.inputs.0].concat(),
    }
}

fn chain_bytes(chain: &[ChainHash]) -> Vec<u8> {
    chain.iter().flat_map(|h| h.0).collect()
}

fn encode_logical(p: &LogicalParts) -> Vec<u8> {
    let chain = chain_bytes(&p.chain);
    let mut w = Writer::new(LOGICAL_MAGIC, LOGICAL_FIELDS, 512 + chain.len());
    w.field(tag::TENANT, &[p.tenant.as_str().as_bytes()]);
    w.field(tag::TRUST_DOMAIN, &[p.trust_domain.as_str().as_bytes()]);
    w.field(tag::MODEL_REVISION, &[p.model_revision.as_str().as_bytes()]);
    w.field(tag::MODEL_CONFIG, &[&p.model_config.0]);
    w.field(tag::TOKENIZER, &[p.tokenizer_revision.as_str().as_bytes()]);
    w.field(tag::ADAPTER, &[&adapter_parts(&p.adapter)]);
    w.field(tag::CHAIN, &[&chain]);
    w.field(tag::MULTIMODAL, &[&multimodal_parts(&p.multimodal)]);
    w.buf
}

/// Magic of the shape encoding: a physical key with an empty chain and a zero valid length.
const SHAPE_MAGIC: [u8; 4] = *b"GPCS";

fn encode_physical(id: &CacheIdentity) -> Vec<u8> {
    encode_physical_fields(id, false)
}

/// Encodes `id`; with `shape_only` the chain and the valid length are left out, so two
/// identities encode equal exactly when [`CacheIdentity::same_shape`] holds.
fn encode_physical_fields(id: &CacheIdentity, shape_only: bool) -> Vec<u8> {
    let chain = if shape_only { Vec::new() } else { chain_bytes(&id.chain) };
    let magic = if shape_only { SHAPE_MAGIC } else { PHYSICAL_MAGIC };
    let mut w = Writer::new(magic, PHYSICAL_FIELDS, 640 + chain.len());
    w.field(tag::TENANT, &[id.tenant.as_str().as_bytes()]);
    w.field(tag::TRUST_DOMAIN, &[id.trust_domain.as_str().as_bytes()]);
    w.field(tag::MODEL_REVISION, &[id.model_revision.as_str().as_bytes()]);
    w.field(tag::MODEL_CONFIG, &[&id.model_config.0]);
    w.field(tag::TOKENIZER, &[id.tokenizer_revision.as_str().as_bytes()]);
    w.field(tag::ADAPTER, &[&adapter_parts(&id.adapter)]);
    w.field(tag::KV_DTYPE, &[&[id.kv_dtype.code()]]);
    w.field(tag::QUANT, &[&[id.quant.code()], &id.quant.group_size().to_le_bytes()]);
    w.field(tag::LAYOUT, &[&id.layout.version.to_le_bytes(), id.layout.name.as_str().as_bytes()]);
    let s = id.shard;
    w.field(
        tag::SHARD,
        &[
            &s.tp_rank.to_le_bytes(),
            &s.tp_size.to_le_bytes(),
            &s.pp_rank.to_le_bytes(),
            &s.pp_size.to_le_bytes(),
        ],
    );
    w.field(tag::POSITION, &[&[id.position as u8]]);
    match id.rope {
        None => w.field(tag::ROPE, &[]),
        Some(r) => w.field(
            tag::ROPE,
            &[
                &r.theta_bits.to_le_bytes(),
                &[r.scaling as u8],
                &r.factor_bits.to_le_bytes(),
                &r.original_max_positions.to_le_bytes(),
            ],
        ),
    }
    w.field(tag::CHAIN, &[&chain]);
    w.field(tag::BLOCK_TOKENS, &[&id.block_tokens.to_le_bytes()]);
    let valid_tokens = if shape_only { 0 } else { id.valid_tokens };
    w.field(tag::VALID_TOKENS, &[&valid_tokens.to_le_bytes()]);
    w.field(tag::MULTIMODAL, &[&multimodal_parts(&id.multimodal)]);
    w.buf
}

// ---------------------------------------------------------------------------------------------
// Decoding

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn header(bytes: &'a [u8], magic: [u8; 4], fields: u8) -> Result<Self, KeyDecodeError> {
        if bytes.len() > KEY_BYTES_MAX {
            return Err(KeyDecodeError::TooLong { len: bytes.len(), max: KEY_BYTES_MAX });
        }
        if bytes.len() < HEADER_BYTES {
            return Err(KeyDecodeError::Truncated {
                context: "header",
                needed: HEADER_BYTES,
                available: bytes.len(),
            });
        }
        let found: [u8; 4] = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if found != magic {
            return Err(KeyDecodeError::BadMagic { found, expected: magic });
        }
        if bytes[4] != IDENTITY_VERSION {
            return Err(KeyDecodeError::UnsupportedVersion {
                found: bytes[4],
                supported: IDENTITY_VERSION,
            });
        }
        if bytes[5] != fields {
            return Err(KeyDecodeError::FieldCount { found: bytes[5], expected: fields });
        }
        Ok(Self { rest: &bytes[HEADER_BYTES..] })
    }

    fn field(&mut self, expected: u8, name: &'static str) -> Result<&'a [u8], KeyDecodeError> {
        if self.rest.len() < FIELD_HEADER_BYTES {
            return Err(KeyDecodeError::Truncated {
                context: name,
                needed: FIELD_HEADER_BYTES,
                available: self.rest.len(),
            });
        }
        if self.rest[0] != expected {
            return Err(KeyDecodeError::UnexpectedTag { found: self.rest[0], expected });
        }
        let len = u32::from_le_bytes([self.rest[1], self.rest[2], self.rest[3], self.rest[4]]);
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let body = &self.rest[FIELD_HEADER_BYTES..];
        if body.len() < len {
            return Err(KeyDecodeError::Truncated {
                context: name,
                needed: len,
                available: body.len(),
            });
        }
        let (value, rest) = body.split_at(len);
        self.rest = rest;
        Ok(value)
    }

    fn finish(self) -> Result<(), KeyDecodeError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(KeyDecodeError::TrailingBytes { count: self.rest.len() })
        }
    }
}

fn name(field: &'static str, v: &[u8]) -> Result<Name, KeyDecodeError> {
    if v.len() > NAME_BYTES_MAX {
        return Err(KeyDecodeError::FieldLength { field, len: v.len() });
    }
    let s = std::str::from_utf8(v).map_err(|_| KeyDecodeError::NotUtf8 { field })?;
    Ok(Name::parse(field, s)?)
}

fn exact<const N: usize>(field: &'static str, v: &[u8]) -> Result<[u8; N], KeyDecodeError> {
    v.try_into().map_err(|_| KeyDecodeError::FieldLength { field, len: v.len() })
}

fn u16_at(v: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([v[at], v[at + 1]])
}
fn u32_at(v: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([v[at], v[at + 1], v[at + 2], v[at + 3]])
}
fn u64_at(v: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&v[at..at + 8]);
    u64::from_le_bytes(b)
}

fn adapter(v: &[u8]) -> Result<Option<Adapter>, KeyDecodeError> {
    if v.is_empty() {
        return Ok(None);
    }
    if v.len() <= 32 {
        return Err(KeyDecodeError::FieldLength { field: "adapter", len: v.len() });
    }
    let weights = Digest32(exact::<32>("adapter", &v[..32])?);
    Ok(Some(Adapter { name: name("adapter", &v[32..])?, weights }))
}

fn multimodal(v: &[u8]) -> Result<Option<Multimodal>, KeyDecodeError> {
    match v.len() {
        0 => Ok(None),
        64 => Ok(Some(Multimodal {
            processor: Digest32(exact::<32>("multimodal", &v[..32])?),
            inputs: Digest32(exact::<32>("multimodal", &v[32..])?),
        })),
        len => Err(KeyDecodeError::FieldLength { field: "multimodal", len }),
    }
}

fn chain(v: &[u8]) -> Result<Arc<[ChainHash]>, KeyDecodeError> {
    if v.is_empty() || !v.len().is_multiple_of(32) || v.len() / 32 > CHAIN_HASHES_MAX {
        return Err(KeyDecodeError::FieldLength { field: "chain", len: v.len() });
    }
    Ok(v.chunks_exact(32).map(|c| Digest32(c.try_into().unwrap_or([0; 32]))).collect())
}

fn decode_logical(bytes: &[u8]) -> Result<LogicalParts, KeyDecodeError> {
    let mut r = Reader::header(bytes, LOGICAL_MAGIC, LOGICAL_FIELDS)?;
    let tenant = TenantId::parse(
        std::str::from_utf8(r.field(tag::TENANT, "tenant")?)
            .map_err(|_| KeyDecodeError::NotUtf8 { field: "tenant" })?,
    )?;
    let trust_domain = name("trust_domain", r.field(tag::TRUST_DOMAIN, "trust_domain")?)?;
    let model_revision = name("model_revision", r.field(tag::MODEL_REVISION, "model_revision")?)?;
    let model_config =
        Digest32(exact("model_config", r.field(tag::MODEL_CONFIG, "model_config")?)?);
    let tokenizer_revision = name("tokenizer_revision", r.field(tag::TOKENIZER, "tokenizer")?)?;
    let adapter = adapter(r.field(tag::ADAPTER, "adapter")?)?;
    let chain = chain(r.field(tag::CHAIN, "chain")?)?;
    let multimodal = multimodal(r.field(tag::MULTIMODAL, "multimodal")?)?;
    r.finish()?;
    Ok(LogicalParts {
        tenant,
        trust_domain,
        model_revision,
        model_config,
        tokenizer_revision,
        adapter,
        chain,
        multimodal,
    })
}

/// The fields of a GPCK key from its chain on; nothing may follow them.
struct Tail {
    chain: Arc<[ChainHash]>,
    block_tokens: u32,
    valid_tokens: u32,
    multimodal: Option<Multimodal>,
}

fn decode_tail(mut r: Reader<'_>) -> Result<Tail, KeyDecodeError> {
    let chain = chain(r.field(tag::CHAIN, "chain")?)?;
    let block_tokens =
        u32::from_le_bytes(exact("block_tokens", r.field(tag::BLOCK_TOKENS, "block_tokens")?)?);
    let valid_tokens =
        u32::from_le_bytes(exact("valid_tokens", r.field(tag::VALID_TOKENS, "valid_tokens")?)?);
    let multimodal = multimodal(r.field(tag::MULTIMODAL, "multimodal")?)?;
    r.finish()?;
    Ok(Tail { chain, block_tokens, valid_tokens, multimodal })
}

fn decode_physical(bytes: &[u8]) -> Result<CacheIdentity, KeyDecodeError> {
    let mut r = Reader::header(bytes, PHYSICAL_MAGIC, PHYSICAL_FIELDS)?;
    let tenant = std::str::from_utf8(r.field(tag::TENANT, "tenant")?)
        .map_err(|_| KeyDecodeError::NotUtf8 { field: "tenant" })?
        .to_owned();
    let trust_domain = name("trust_domain", r.field(tag::TRUST_DOMAIN, "trust_domain")?)?;
    let model_revision = name("model_revision", r.field(tag::MODEL_REVISION, "model_revision")?)?;
    let model_config =
        Digest32(exact("model_config", r.field(tag::MODEL_CONFIG, "model_config")?)?);
    let tokenizer_revision = name("tokenizer_revision", r.field(tag::TOKENIZER, "tokenizer")?)?;
    let adapter = adapter(r.field(tag::ADAPTER, "adapter")?)?;

    let [dtype] = exact::<1>("kv_dtype", r.field(tag::KV_DTYPE, "kv_dtype")?)?;
    let kv_dtype = KvDtype::from_code(dtype)
        .ok_or(KeyDecodeError::UnknownCode { field: "kv_dtype", code: dtype.into() })?;

    let q = exact::<5>("quant", r.field(tag::QUANT, "quant")?)?;
    let quant = QuantFormat::from_parts(q[0], u32_at(&q, 1))
        .ok_or(KeyDecodeError::UnknownCode { field: "quant", code: q[0].into() })?;

    let l = r.field(tag::LAYOUT, "layout")?;
    if l.len() < 5 {
        return Err(KeyDecodeError::FieldLength { field: "layout", len: l.len() });
    }
    let layout = LayoutAbi { version: u32_at(l, 0), name: name("layout", &l[4..])? };

    let s = exact::<8>("shard", r.field(tag::SHARD, "shard")?)?;
    let shard = Shard {
        tp_rank: u16_at(&s, 0),
        tp_size: u16_at(&s, 2),
        pp_rank: u16_at(&s, 4),
        pp_size: u16_at(&s, 6),
    };

    let [pos] = exact::<1>("position", r.field(tag::POSITION, "position")?)?;
    let position = PositionEncoding::from_code(pos)
        .ok_or(KeyDecodeError::UnknownCode { field: "position", code: pos.into() })?;

    let rv = r.field(tag::ROPE, "rope")?;
    let rope = match rv.len() {
        0 => None,
        21 => Some(RopeParams {
            theta_bits: u64_at(rv, 0),
            scaling: RopeScaling::from_code(rv[8])
                .ok_or(KeyDecodeError::UnknownCode { field: "rope.scaling", code: rv[8].into() })?,
            factor_bits: u64_at(rv, 9),
            original_max_positions: u32_at(rv, 17),
        }),
        len => return Err(KeyDecodeError::FieldLength { field: "rope", len }),
    };
    let Tail { chain, block_tokens, valid_tokens, multimodal } = decode_tail(r)?;

    let mut b = CacheIdentity::builder()
        .tenant(&tenant)
        .trust_domain(trust_domain.as_str())
        .model_revision(model_revision.as_str())
        .model_config(model_config)
        .tokenizer_revision(tokenizer_revision.as_str())
        .kv_dtype(kv_dtype)
        .quant(quant)
        .layout(layout.name.as_str(), layout.version)
        .shard(shard)
        .position(position)
        .rope(rope)
        .chain(chain.to_vec())
        .block_tokens(block_tokens)
        .valid_tokens(valid_tokens)
        .multimodal(multimodal);
    if let Some(a) = adapter {
        b = b.adapter(a.name.as_str(), a.weights);
    }
    Ok(b.build()?)
}
