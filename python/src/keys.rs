//! Physical keys for Python: [`Key`] (a `PhysicalKey`), [`Identity`] (a `CacheIdentity` v1
//! without its chain, which builds the keys of a prefix), and the plain-name namespace
//! ([`plain_key`], the RESP front's mapping).
//!
//! The identity has no field for a model's name, so the name is hashed together with the
//! model's configuration into the identity's `model_config` digest: two models, or one model
//! with two configurations, never share a key. Block hashes and token ids are turned into chain
//! links by BLAKE3 in derive-key mode with a context of this package, so a link never equals a
//! link some other caller computed for other input.

use std::hash::{Hash, Hasher};

use gpucache_dataplane::identity::{
    CHAIN_HASHES_MAX, CacheIdentity, CacheIdentityBuilder, ChainHash, Digest32, KvDtype,
    Multimodal, PositionEncoding, QuantFormat, RopeParams, RopeScaling, Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_wire::namespace::IdentityTemplate;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyString};

use crate::client::BATCH_KEYS_MAX;

const MODEL_CONTEXT: &str = "gpucache python 2026-12 model config v1";
const ADAPTER_CONTEXT: &str = "gpucache python 2026-12 adapter v1";
const BLOCK_HASH_CONTEXT: &str = "gpucache python 2026-12 block hash v1";
const TOKEN_CHAIN_CONTEXT: &str = "gpucache python 2026-12 token chain v1";
const MULTIMODAL_CONTEXT: &str = "gpucache python 2026-12 multimodal v1";

/// Bytes of a digest that `Key.hex()` shows.
const SHORT_DIGEST_BYTES: usize = 16;

fn bad(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A physical key: what one block is stored under.
#[pyclass(module = "gpucache._native", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub(crate) key: PhysicalKey,
}

#[pymethods]
impl Key {
    /// The key decoded from its canonical encoding (`bytes(key)`); bad bytes raise ValueError.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        PhysicalKey::decode(data).map(|key| Self { key }).map_err(bad)
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.key.encoded())
    }

    /// The first 16 bytes of the key's BLAKE3 digest, as hex.
    fn hex(&self) -> String {
        let d = self.key.digest();
        d.0[..SHORT_DIGEST_BYTES].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn __hash__(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.key.digest().0.hash(&mut h);
        h.finish()
    }

    /// The tenant that owns the key.
    #[getter]
    fn tenant(&self) -> String {
        self.key.tenant().as_str().to_owned()
    }

    /// How many blocks of the prefix the key names.
    #[getter]
    fn blocks(&self) -> usize {
        self.key.identity().chain().len()
    }

    fn __repr__(&self) -> String {
        format!("Key(tenant={:?}, blocks={}, {})", self.tenant(), self.blocks(), self.hex())
    }
}

/// Bytes from a `bytes` or `str` argument (str as UTF-8).
fn bytes_or_str(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_cow()?.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(format!("{what} must be bytes or str")))
}

/// BLAKE3 in derive-key mode over length-prefixed parts.
fn derive(context: &str, parts: &[&[u8]]) -> Digest32 {
    let mut h = blake3::Hasher::new_derive_key(context);
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    Digest32(*h.finalize().as_bytes())
}

fn dtype(name: &str) -> PyResult<KvDtype> {
    Ok(match name {
        "f32" | "float32" | "fp32" => KvDtype::F32,
        "f16" | "float16" | "fp16" | "half" => KvDtype::F16,
        "bf16" | "bfloat16" => KvDtype::Bf16,
        "fp8_e4m3" | "float8_e4m3fn" | "f8e4m3" => KvDtype::F8E4m3,
        "fp8_e5m2" | "float8_e5m2" | "f8e5m2" => KvDtype::F8E5m2,
        "i8" | "int8" => KvDtype::I8,
        "u8" | "uint8" => KvDtype::U8,
        "i4" | "int4" => KvDtype::I4,
        other => {
            return Err(PyValueError::new_err(format!(
                "kv_dtype {other:?}: expected f32 f16 bf16 fp8_e4m3 fp8_e5m2 i8 u8 i4"
            )));
        }
    })
}

fn quant(name: Option<&str>, group: Option<u32>) -> PyResult<QuantFormat> {
    Ok(match (name, group) {
        (None | Some("none"), None) => QuantFormat::None,
        (Some("per_tensor"), None) => QuantFormat::PerTensor,
        (Some("per_channel"), None) => QuantFormat::PerChannel,
        (Some("per_token"), None) => QuantFormat::PerToken,
        (Some("grouped"), Some(group_size)) if group_size > 0 => {
            QuantFormat::Grouped { group_size }
        }
        (q, g) => {
            return Err(PyValueError::new_err(format!(
                "quant={q:?} quant_group={g:?}: expected none, per_tensor, per_channel, \
                 per_token, or grouped with quant_group > 0"
            )));
        }
    })
}

fn rope(d: &Bound<'_, PyDict>) -> PyResult<RopeParams> {
    let get = |k: &str| d.get_item(k);
    let theta: f64 = get("theta")?.ok_or_else(|| bad("rope needs theta"))?.extract()?;
    let scaling = match get("scaling")? {
        None => RopeScaling::None,
        Some(s) => match s.extract::<Option<String>>()?.as_deref() {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear,
            Some("ntk") | Some("dynamic") => RopeScaling::Ntk,
            Some("yarn") => RopeScaling::Yarn,
            Some("llama3") => RopeScaling::Llama3,
            Some(o) => return Err(bad(format!("rope scaling {o:?} is not known"))),
        },
    };
    let factor: f64 = get("factor")?.map_or(Ok(1.0), |f| f.extract())?;
    let orig: u32 = get("original_max_positions")?.map_or(Ok(0), |f| f.extract())?;
    RopeParams::new(theta, scaling, factor, orig).map_err(bad)
}

/// What a model's cached KV depends on, short of the prefix itself. `chain_keys` and
/// `token_keys` build the keys of a prefix's blocks; two identities that differ in any field
/// never share a key.
#[pyclass(module = "gpucache._native", frozen)]
#[derive(Debug, Clone)]
pub struct Identity {
    base: CacheIdentityBuilder,
    block_tokens: u32,
    tenant: String,
}

#[pymethods]
impl Identity {
    #[new]
    #[pyo3(signature = (
        tenant, model, model_revision = "main", model_config = None, tokenizer_revision = "main",
        adapter = None, adapter_revision = None, kv_dtype = "f16", layout = "gpucache-raw",
        layout_version = 1, tp_rank = 0, tp_size = 1, pp_rank = 0, pp_size = 1,
        block_tokens = 16, rope = None, multimodal = None, position = None, quant = None,
        quant_group = None, trust_domain = "default"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tenant: &str,
        model: &str,
        model_revision: &str,
        model_config: Option<&Bound<'_, PyAny>>,
        tokenizer_revision: &str,
        adapter: Option<&str>,
        adapter_revision: Option<&str>,
        kv_dtype: &str,
        layout: &str,
        layout_version: u32,
        tp_rank: u16,
        tp_size: u16,
        pp_rank: u16,
        pp_size: u16,
        block_tokens: u32,
        rope: Option<&Bound<'_, PyDict>>,
        multimodal: Option<&Bound<'_, PyDict>>,
        position: Option<&str>,
        quant: Option<&str>,
        quant_group: Option<u32>,
        trust_domain: &str,
    ) -> PyResult<Self> {
        if model.is_empty() {
            return Err(bad("model must not be empty"));
        }
        let config = match model_config {
            None => Vec::new(),
            Some(c) => bytes_or_str(c, "model_config")?,
        };
        let mut b = CacheIdentity::builder()
            .tenant(tenant)
            .trust_domain(trust_domain)
            .model_revision(model_revision)
            .model_config(derive(MODEL_CONTEXT, &[model.as_bytes(), &config]))
            .tokenizer_revision(tokenizer_revision)
            .kv_dtype(dtype(kv_dtype)?)
            .quant(self::quant(quant, quant_group)?)
            .layout(layout, layout_version)
            .shard(Shard { tp_rank, tp_size, pp_rank, pp_size });
        b = match (adapter, adapter_revision) {
            (Some(name), revision) => b.adapter(
                name,
                derive(ADAPTER_CONTEXT, &[name.as_bytes(), revision.unwrap_or("").as_bytes()]),
            ),
            (None, None) => b.no_adapter(),
            (None, Some(_)) => return Err(bad("adapter_revision without adapter")),
        };
        let rope = rope.map(self::rope).transpose()?;
        let position = match (position, rope.is_some()) {
            (None, true) | (Some("rope"), _) => PositionEncoding::Rope,
            (None | Some("none"), false) => PositionEncoding::None,
            (Some("alibi"), _) => PositionEncoding::Alibi,
            (Some("learned"), _) => PositionEncoding::Learned,
            (Some(o), _) => return Err(bad(format!("position {o:?}: rope alibi learned none"))),
        };
        b = b.position(position).rope(rope);
        let mm = match multimodal {
            None => None,
            Some(d) => {
                let part = |k: &str| -> PyResult<Vec<u8>> {
                    match d.get_item(k)? {
                        Some(v) => bytes_or_str(&v, k),
                        None => Err(bad(format!("multimodal needs {k}"))),
                    }
                };
                Some(Multimodal {
                    processor: derive(MULTIMODAL_CONTEXT, &[b"processor", &part("processor")?]),
                    inputs: derive(MULTIMODAL_CONTEXT, &[b"inputs", &part("inputs")?]),
                })
            }
        };
        b = b.multimodal(mm);
        // Validates every field now, so that a bad identity fails here, not at the first key.
        b.clone()
            .chain(vec![Digest32([0; 32])])
            .block_tokens(block_tokens)
            .valid_tokens(block_tokens)
            .build()
            .map_err(bad)?;
        Ok(Self { base: b, block_tokens, tenant: tenant.to_owned() })
    }

    /// Tokens per block.
    #[getter]
    fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    #[getter]
    fn tenant(&self) -> &str {
        &self.tenant
    }

    /// One key per block: key `i` names the prefix `block_hashes[0..=i]`. Each hash is bytes,
    /// str or int (an engine's own block hash); at most 8192 blocks.
    fn chain_keys(&self, block_hashes: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<Key>> {
        let links = block_hashes.iter().map(link_of).collect::<PyResult<Vec<_>>>()?;
        self.keys_of(&links)
    }

    /// One key per engine block hash, each naming that block alone: for engines whose block
    /// hash already covers the whole prefix before it (vLLM's, SGLang's). The same key as
    /// `chain_keys([h])[0]`, derived for all the hashes in one call, outside the GIL; at most
    /// `BATCH_KEYS_MAX` hashes.
    fn block_keys(
        &self,
        py: Python<'_>,
        block_hashes: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Key>> {
        if block_hashes.len() > BATCH_KEYS_MAX {
            return Err(bad(format!(
                "{} block hashes: one call derives at most {BATCH_KEYS_MAX}",
                block_hashes.len()
            )));
        }
        let links = block_hashes.iter().map(link_of).collect::<PyResult<Vec<_>>>()?;
        py.detach(|| links.into_iter().map(|l| self.key_of_chain(vec![l])).collect())
    }

    /// One key per full block of `token_ids` (a trailing partial block gets none), over this
    /// package's own chain: link `i` hashes link `i - 1` and the ids of block `i`.
    fn token_keys(&self, token_ids: Vec<i64>) -> PyResult<Vec<Key>> {
        let per = usize::try_from(self.block_tokens).unwrap_or(usize::MAX).max(1);
        let mut links = Vec::with_capacity(token_ids.len() / per);
        let mut prev = [0u8; 32];
        for block in token_ids.chunks_exact(per) {
            let mut h = blake3::Hasher::new_derive_key(TOKEN_CHAIN_CONTEXT);
            h.update(&prev);
            for t in block {
                h.update(&t.to_le_bytes());
            }
            prev = *h.finalize().as_bytes();
            links.push(Digest32(prev));
        }
        self.keys_of(&links)
    }

    fn __repr__(&self) -> String {
        format!("Identity(tenant={:?}, block_tokens={})", self.tenant, self.block_tokens)
    }
}

impl Identity {
    fn keys_of(&self, links: &[ChainHash]) -> PyResult<Vec<Key>> {
        if links.len() > CHAIN_HASHES_MAX {
            return Err(bad(format!(
                "{} blocks: a prefix has at most {CHAIN_HASHES_MAX}",
                links.len()
            )));
        }
        (1..=links.len()).map(|n| self.key_of_chain(links[..n].to_vec())).collect()
    }

    /// The key of the block that ends the chain `links`.
    fn key_of_chain(&self, links: Vec<ChainHash>) -> PyResult<Key> {
        let id = self
            .base
            .clone()
            .chain(links)
            .block_tokens(self.block_tokens)
            .valid_tokens(self.block_tokens)
            .build()
            .map_err(bad)?;
        Ok(Key { key: PhysicalKey::new(id) })
    }
}

/// A chain link from one engine block hash.
fn link_of(h: &Bound<'_, PyAny>) -> PyResult<ChainHash> {
    if h.is_instance_of::<PyInt>() {
        let n: i128 = h.extract().map_err(|_| bad("an int block hash must fit 128 bits"))?;
        return Ok(derive(BLOCK_HASH_CONTEXT, &[b"int", &n.to_le_bytes()]));
    }
    if let Ok(b) = h.cast::<PyBytes>() {
        return Ok(derive(BLOCK_HASH_CONTEXT, &[b"bytes", b.as_bytes()]));
    }
    if let Ok(s) = h.cast::<PyString>() {
        return Ok(derive(BLOCK_HASH_CONTEXT, &[b"str", s.to_cow()?.as_bytes()]));
    }
    Err(PyTypeError::new_err("a block hash must be bytes, str or int"))
}

/// The key of the plain name `name` (bytes or str) in `tenant`'s namespace: the key the RESP
/// front reads for `GET name` and `gpucache get name` prints.
#[pyfunction]
pub(crate) fn plain_key(tenant: &str, name: &Bound<'_, PyAny>) -> PyResult<Key> {
    let tenant = TenantId::parse(tenant).map_err(bad)?;
    let ns = IdentityTemplate::for_tenant(&tenant).map_err(bad)?;
    let name = bytes_or_str(name, "a plain name")?;
    ns.key_for(&name).map(|key| Key { key }).map_err(bad)
}
