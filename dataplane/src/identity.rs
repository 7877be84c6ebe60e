//! CacheIdentity version 1: every fact that decides whether stored KV bytes may be reused.
//!
//! Owns the validated identity record and its field types. Raw prompts, token ids and media bytes
//! are never fields: callers hash them outside the store and pass the digests (the token-prefix
//! hash chain and the optional multimodal digest). Encoding lives in [`crate::key`].

use std::fmt;
use std::sync::Arc;

/// The identity layout version this crate writes and accepts.
pub const IDENTITY_VERSION: u8 = 1;
/// Longest name (tenant, trust domain, revisions, adapter, layout) in bytes.
pub const NAME_BYTES_MAX: usize = 128;
/// Most hashes one token-prefix chain may carry (8192 blocks of 512 tokens is 4 Mi tokens).
pub const CHAIN_HASHES_MAX: usize = 8192;
/// Largest block token capacity accepted.
pub const BLOCK_TOKENS_MAX: u32 = 1 << 20;

/// Why an identity or one of its fields was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    #[error("{field} is empty")]
    EmptyName { field: &'static str },
    #[error("{field} is {len} bytes, the limit is {max}")]
    NameTooLong { field: &'static str, len: usize, max: usize },
    #[error(
        "{field} holds byte 0x{byte:02x} at {index}; names use ASCII letters, digits and ._:/@+-"
    )]
    NameCharacter { field: &'static str, index: usize, byte: u8 },
    #[error("{field} was not set")]
    Missing { field: &'static str },
    #[error("the token-prefix chain is empty")]
    EmptyChain,
    #[error("the token-prefix chain has {len} hashes, the limit is {max}")]
    ChainTooLong { len: usize, max: usize },
    #[error("block token capacity {tokens} is outside 1..={max}")]
    BlockTokens { tokens: u32, max: u32 },
    #[error("valid length {valid} is outside 1..={capacity} (the block token capacity)")]
    ValidTokens { valid: u32, capacity: u32 },
    #[error("shard {axis} rank {rank} is not below its size {size}")]
    ShardRank { axis: &'static str, rank: u16, size: u16 },
    #[error("shard {axis} size is zero")]
    ShardSize { axis: &'static str },
    #[error("position encoding {encoding:?} {problem}")]
    RopeMismatch { encoding: PositionEncoding, problem: &'static str },
    #[error("RoPE {param} has bits 0x{bits:016x}, which is not a finite positive number")]
    RopeValue { param: &'static str, bits: u64 },
    #[error("quantization group size is zero")]
    QuantGroup,
}

/// A validated name: 1..=[`NAME_BYTES_MAX`] bytes of ASCII letters, digits and `._:/@+-`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Name(Arc<str>);

impl Name {
    /// Validates `value` as the field `field` (the field name goes into the error).
    pub fn parse(field: &'static str, value: &str) -> Result<Self, IdentityError> {
        if value.is_empty() {
            return Err(IdentityError::EmptyName { field });
        }
        if value.len() > NAME_BYTES_MAX {
            return Err(IdentityError::NameTooLong {
                field,
                len: value.len(),
                max: NAME_BYTES_MAX,
            });
        }
        if let Some((index, &byte)) = value
            .as_bytes()
            .iter()
            .enumerate()
            .find(|(_, b)| !(b.is_ascii_alphanumeric() || b"._:/@+-".contains(b)))
        {
            return Err(IdentityError::NameCharacter { field, index, byte });
        }
        Ok(Self(Arc::from(value)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The tenant that owns a block; every read, write and attestation is checked against it.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(Name);

impl TenantId {
    pub fn parse(value: &str) -> Result<Self, IdentityError> {
        Name::parse("tenant", value).map(Self)
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A 32-byte digest computed by the caller (model config, adapter weights, multimodal inputs).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest32(pub [u8; 32]);

impl fmt::Debug for Digest32 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("..")
    }
}

/// One link of the token-prefix hash chain: link `i` digests the tokens of blocks `0..=i`
/// (cumulatively, computed by the caller). Two chains that agree on link `i` agree on the prefix.
pub type ChainHash = Digest32;

/// A LoRA or other adapter applied on top of the base model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Adapter {
    pub name: Name,
    pub weights: Digest32,
}

/// Element type of the stored K and V tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KvDtype {
    F32 = 1,
    F16 = 2,
    Bf16 = 3,
    F8E4m3 = 4,
    F8E5m2 = 5,
    I8 = 6,
    U8 = 7,
    I4 = 8,
}

impl KvDtype {
    pub const ALL: [KvDtype; 8] = [
        Self::F32,
        Self::F16,
        Self::Bf16,
        Self::F8E4m3,
        Self::F8E5m2,
        Self::I8,
        Self::U8,
        Self::I4,
    ];

    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.code() == code)
    }
}

/// How the stored values are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    None,
    PerTensor,
    PerChannel,
    PerToken,
    /// One scale per `group_size` consecutive elements.
    Grouped {
        group_size: u32,
    },
}

impl QuantFormat {
    pub fn code(self) -> u8 {
        match self {
            Self::None => 0,
            Self::PerTensor => 1,
            Self::PerChannel => 2,
            Self::PerToken => 3,
            Self::Grouped { .. } => 4,
        }
    }

    /// The group size, zero for every format without groups.
    pub fn group_size(self) -> u32 {
        match self {
            Self::Grouped { group_size } => group_size,
            _ => 0,
        }
    }

    /// Rebuilds a format from its code and group size; `None` when the pair is not canonical.
    pub fn from_parts(code: u8, group_size: u32) -> Option<Self> {
        let format = match code {
            0 => Self::None,
            1 => Self::PerTensor,
            2 => Self::PerChannel,
            3 => Self::PerToken,
            4 if group_size > 0 => return Some(Self::Grouped { group_size }),
            _ => return None,
        };
        (group_size == 0).then_some(format)
    }
}

/// The byte layout contract of a block (e.g. `paged-nhd`, version 3).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LayoutAbi {
    pub name: Name,
    pub version: u32,
}

/// Tensor- and pipeline-parallel shard that produced the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shard {
    pub tp_rank: u16,
    pub tp_size: u16,
    pub pp_rank: u16,
    pub pp_size: u16,
}

impl Shard {
    /// The single-GPU shard.
    pub const SOLO: Shard = Shard { tp_rank: 0, tp_size: 1, pp_rank: 0, pp_size: 1 };

    pub fn validate(self) -> Result<Self, IdentityError> {
        for (axis, rank, size) in
            [("tp", self.tp_rank, self.tp_size), ("pp", self.pp_rank, self.pp_size)]
        {
            if size == 0 {
                return Err(IdentityError::ShardSize { axis });
            }
            if rank >= size {
                return Err(IdentityError::ShardRank { axis, rank, size });
            }
        }
        Ok(self)
    }
}

/// How positions enter attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PositionEncoding {
    None = 0,
    Rope = 1,
    Alibi = 2,
    Learned = 3,
}

impl PositionEncoding {
    pub fn from_code(code: u8) -> Option<Self> {
        [Self::None, Self::Rope, Self::Alibi, Self::Learned].into_iter().find(|p| *p as u8 == code)
    }
}

/// RoPE scaling variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RopeScaling {
    None = 0,
    Linear = 1,
    Ntk = 2,
    Yarn = 3,
    Llama3 = 4,
}

impl RopeScaling {
    pub fn from_code(code: u8) -> Option<Self> {
        [Self::None, Self::Linear, Self::Ntk, Self::Yarn, Self::Llama3]
            .into_iter()
            .find(|s| *s as u8 == code)
    }
}

/// RoPE parameters kept as IEEE-754 bit patterns, so equality is exact and hashing is stable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RopeParams {
    pub theta_bits: u64,
    pub scaling: RopeScaling,
    pub factor_bits: u64,
    pub original_max_positions: u32,
}

impl RopeParams {
    /// Builds parameters from floats; both must be finite and positive.
    pub fn new(
        theta: f64,
        scaling: RopeScaling,
        factor: f64,
        original_max_positions: u32,
    ) -> Result<Self, IdentityError> {
        Self {
            theta_bits: theta.to_bits(),
            scaling,
            factor_bits: factor.to_bits(),
            original_max_positions,
        }
        .validate()
    }

    pub fn validate(self) -> Result<Self, IdentityError> {
        for (param, bits) in [("theta", self.theta_bits), ("factor", self.factor_bits)] {
            let v = f64::from_bits(bits);
            if !(v.is_finite() && v > 0.0) {
                return Err(IdentityError::RopeValue { param, bits });
            }
        }
        Ok(self)
    }
}

/// Digests of the multimodal processor and of the media inputs that shaped this block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Multimodal {
    pub processor: Digest32,
    pub inputs: Digest32,
}

/// CacheIdentity version 1. Immutable once built; construct with [`CacheIdentity::builder`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheIdentity {
    pub(crate) tenant: TenantId,
    pub(crate) trust_domain: Name,
    pub(crate) model_revision: Name,
    pub(crate) model_config: Digest32,
    pub(crate) tokenizer_revision: Name,
    pub(crate) adapter: Option<Adapter>,
    pub(crate) kv_dtype: KvDtype,
    pub(crate) quant: QuantFormat,
    pub(crate) layout: LayoutAbi,
    pub(crate) shard: Shard,
    pub(crate) position: PositionEncoding,
    pub(crate) rope: Option<RopeParams>,
    pub(crate) chain: Arc<[ChainHash]>,
    pub(crate) block_tokens: u32,
    pub(crate) valid_tokens: u32,
    pub(crate) multimodal: Option<Multimodal>,
}

impl CacheIdentity {
    pub fn builder() -> CacheIdentityBuilder {
        CacheIdentityBuilder::default()
    }

    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }
    pub fn trust_domain(&self) -> &Name {
        &self.trust_domain
    }
    pub fn model_revision(&self) -> &Name {
        &self.model_revision
    }
    pub fn model_config(&self) -> Digest32 {
        self.model_config
    }
    pub fn tokenizer_revision(&self) -> &Name {
        &self.tokenizer_revision
    }
    pub fn adapter(&self) -> Option<&Adapter> {
        self.adapter.as_ref()
    }
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }
    pub fn quant(&self) -> QuantFormat {
        self.quant
    }
    pub fn layout(&self) -> &LayoutAbi {
        &self.layout
    }
    pub fn shard(&self) -> Shard {
        self.shard
    }
    pub fn position(&self) -> PositionEncoding {
        self.position
    }
    pub fn rope(&self) -> Option<RopeParams> {
        self.rope
    }
    /// The token-prefix hash chain, first block first; the last link names this block.
    pub fn chain(&self) -> &[ChainHash] {
        &self.chain
    }
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    pub fn valid_tokens(&self) -> u32 {
        self.valid_tokens
    }
    pub fn multimodal(&self) -> Option<Multimodal> {
        self.multimodal
    }

    /// Whether `self` and `other` agree on every field except the chain and the valid length:
    /// the condition under which a shorter stored chain may serve a longer request.
    pub fn same_shape(&self, other: &CacheIdentity) -> bool {
        self.tenant == other.tenant
            && self.trust_domain == other.trust_domain
            && self.model_revision == other.model_revision
            && self.model_config == other.model_config
            && self.tokenizer_revision == other.tokenizer_revision
            && self.adapter == other.adapter
            && self.kv_dtype == other.kv_dtype
            && self.quant == other.quant
            && self.layout == other.layout
            && self.shard == other.shard
            && self.position == other.position
            && self.rope == other.rope
            && self.block_tokens == other.block_tokens
            && self.multimodal == other.multimodal
    }

    /// Whether this identity's chain is a strict prefix of `longer`'s chain.
    pub fn chain_is_strict_prefix_of(&self, longer: &CacheIdentity) -> bool {
        self.chain.len() < longer.chain.len() && longer.chain[..self.chain.len()] == self.chain[..]
    }

    /// A copy whose chain is cut to its first `links` hashes, with the given valid length.
    pub fn truncated(&self, links: usize, valid_tokens: u32) -> Result<Self, IdentityError> {
        let mut b = self.to_builder();
        b.chain = Some(self.chain[..links.min(self.chain.len())].to_vec());
        b.valid_tokens = Some(valid_tokens);
        b.build()
    }

    /// A builder preloaded with every field of this identity.
    pub fn to_builder(&self) -> CacheIdentityBuilder {
        CacheIdentityBuilder {
            tenant: Some(self.tenant.as_str().to_owned()),
            trust_domain: Some(self.trust_domain.as_str().to_owned()),
            model_revision: Some(self.model_revision.as_str().to_owned()),
            model_config: Some(self.model_config),
            tokenizer_revision: Some(self.tokenizer_revision.as_str().to_owned()),
            adapter: self.adapter.as_ref().map(|a| (a.name.as_str().to_owned(), a.weights)),
            kv_dtype: Some(self.kv_dtype),
            quant: Some(self.quant),
            layout: Some((self.layout.name.as_str().to_owned(), self.layout.version)),
            shard: Some(self.shard),
            position: Some(self.position),
            rope: self.rope,
            chain: Some(self.chain.to_vec()),
            block_tokens: Some(self.block_tokens),
            valid_tokens: Some(self.valid_tokens),
            multimodal: self.multimodal,
        }
    }
}

/// Collects the fields of a [`CacheIdentity`]; `build` validates all of them at once.
#[derive(Clone, Debug, Default)]
pub struct CacheIdentityBuilder {
    tenant: Option<String>,
    trust_domain: Option<String>,
    model_revision: Option<String>,
    model_config: Option<Digest32>,
    tokenizer_revision: Option<String>,
    adapter: Option<(String, Digest32)>,
    kv_dtype: Option<KvDtype>,
    quant: Option<QuantFormat>,
    layout: Option<(String, u32)>,
    shard: Option<Shard>,
    position: Option<PositionEncoding>,
    rope: Option<RopeParams>,
    chain: Option<Vec<ChainHash>>,
    block_tokens: Option<u32>,
    valid_tokens: Option<u32>,
    multimodal: Option<Multimodal>,
}

impl CacheIdentityBuilder {
    pub fn tenant(mut self, v: &str) -> Self {
        self.tenant = Some(v.to_owned());
        self
    }
    pub fn trust_domain(mut self, v: &str) -> Self {
        self.trust_domain = Some(v.to_owned());
        self
    }
    pub fn model_revision(mut self, v: &str) -> Self {
        self.model_revision = Some(v.to_owned());
        self
    }
    pub fn model_config(mut self, v: Digest32) -> Self {
        self.model_config = Some(v);
        self
    }
    pub fn tokenizer_revision(mut self, v: &str) -> Self {
        self.tokenizer_revision = Some(v.to_owned());
        self
    }
    pub fn adapter(mut self, name: &str, weights: Digest32) -> Self {
        self.adapter = Some((name.to_owned(), weights));
        self
    }
    pub fn no_adapter(mut self) -> Self {
        self.adapter = None;
        self
    }
    pub fn kv_dtype(mut self, v: KvDtype) -> Self {
        self.kv_dtype = Some(v);
        self
    }
    pub fn quant(mut self, v: QuantFormat) -> Self {
        self.quant = Some(v);
        self
    }
    pub fn layout(mut self, name: &str, version: u32) -> Self {
        self.layout = Some((name.to_owned(), version));
        self
    }
    pub fn shard(mut self, v: Shard) -> Self {
        self.shard = Some(v);
        self
    }
    pub fn position(mut self, v: PositionEncoding) -> Self {
        self.position = Some(v);
        self
    }
    pub fn rope(mut self, v: Option<RopeParams>) -> Self {
        self.rope = v;
        self
    }
    pub fn chain(mut self, v: Vec<ChainHash>) -> Self {
        self.chain = Some(v);
        self
    }
    pub fn block_tokens(mut self, v: u32) -> Self {
        self.block_tokens = Some(v);
        self
    }
    pub fn valid_tokens(mut self, v: u32) -> Self {
        self.valid_tokens = Some(v);
        self
    }
    pub fn multimodal(mut self, v: Option<Multimodal>) -> Self {
        self.multimodal = v;
        self
    }

    /// Validates every field and returns the identity, or the first problem found.
    pub fn build(self) -> Result<CacheIdentity, IdentityError> {
        fn need<T>(v: Option<T>, field: &'static str) -> Result<T, IdentityError> {
            v.ok_or(IdentityError::Missing { field })
        }
        let tenant = TenantId::parse(&need(self.tenant, "tenant")?)?;
        let trust_domain = Name::parse("trust_domain", &need(self.trust_domain, "trust_domain")?)?;
        let model_revision =
            Name::parse("model_revision", &need(self.model_revision, "model_revision")?)?;
        let model_config = need(self.model_config, "model_config")?;
        let tokenizer_revision = Name::parse(
            "tokenizer_revision",
            &need(self.tokenizer_revision, "tokenizer_revision")?,
        )?;
        let adapter = match self.adapter {
            Some((name, weights)) => {
                Some(Adapter { name: Name::parse("adapter", &name)?, weights })
            }
            None => None,
        };
        let kv_dtype = need(self.kv_dtype, "kv_dtype")?;
        let quant = need(self.quant, "quant")?;
        if quant == (QuantFormat::Grouped { group_size: 0 }) {
            return Err(IdentityError::QuantGroup);
        }
        let (layout_name, layout_version) = need(self.layout, "layout")?;
        let layout =
            LayoutAbi { name: Name::parse("layout", &layout_name)?, version: layout_version };
        let shard = need(self.shard, "shard")?.validate()?;
        let position = need(self.position, "position")?;
        let rope = match (position, self.rope) {
            (PositionEncoding::Rope, Some(r)) => Some(r.validate()?),
            (PositionEncoding::Rope, None) => {
                return Err(IdentityError::RopeMismatch {
                    encoding: position,
                    problem: "needs RoPE parameters",
                });
            }
            (_, Some(_)) => {
                return Err(IdentityError::RopeMismatch {
                    encoding: position,
                    problem: "takes no RoPE parameters",
                });
            }
            (_, None) => None,
        };
        let chain = need(self.chain, "chain")?;
        if chain.is_empty() {
            return Err(IdentityError::EmptyChain);
        }
        if chain.len() > CHAIN_HASHES_MAX {
            return Err(IdentityError::ChainTooLong { len: chain.len(), max: CHAIN_HASHES_MAX });
        }
        let block_tokens = need(self.block_tokens, "block_tokens")?;
        if !(1..=BLOCK_TOKENS_MAX).contains(&block_tokens) {
            return Err(IdentityError::BlockTokens { tokens: block_tokens, max: BLOCK_TOKENS_MAX });
        }
        let valid_tokens = need(self.valid_tokens, "valid_tokens")?;
        if !(1..=block_tokens).contains(&valid_tokens) {
            return Err(IdentityError::ValidTokens { valid: valid_tokens, capacity: block_tokens });
        }
        Ok(CacheIdentity {
            tenant,
            trust_domain,
            model_revision,
            model_config,
            tokenizer_revision,
            adapter,
            kv_dtype,
            quant,
            layout,
            shard,
            position,
            rope,
            chain: Arc::from(chain),
            block_tokens,
            valid_tokens,
            multimodal: self.multimodal,
        })
    }
}
