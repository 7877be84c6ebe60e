//! Why a configuration file was refused, with the key path each refusal is about.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::auth::KeyFileError;
use gpucache_dataplane::identity::IdentityError;
use gpucache_dataplane::limits::LimitsError;

/// Why a configuration was refused. Display starts with the key path it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: larger than {bytes_max} bytes; not a configuration file")]
    TooLarge { path: PathBuf, bytes_max: u64 },
    /// The TOML is malformed, a key is unknown, or a value has the wrong type or spelling.
    #[error("{}", parse_display(.key, .message, *.line, *.column))]
    Parse { key: String, message: String, line: usize, column: usize },
    #[error("{key}: {source}")]
    Limits { key: String, source: LimitsError },
    #[error("{key}: {value} is outside {min}..={max}")]
    OutOfRange { key: &'static str, value: u64, min: u64, max: u64 },
    #[error(
        "{key}: {addr} is not a loopback address; set listen.allow_remote = true to accept \
         connections from other hosts"
    )]
    NotLoopback { key: &'static str, addr: SocketAddr },
    #[error("{key}: {addr} is already used by {other}")]
    AddressReused { key: &'static str, other: &'static str, addr: SocketAddr },
    #[error(
        "store.eviction: \"refuse\" is for kind = \"memory\"; a {kind} store always evicts \
         (choose a policy, or leave the key out for \"fifo\")"
    )]
    FileStoreRefuses { kind: &'static str },
    #[error(
        "store.direct_io: O_DIRECT needs layout = \"files\" (the block log's records are not \
         aligned for it)"
    )]
    DirectLog,
    #[error("store.tiers: {why}")]
    Tiers { why: String },
    #[error("{key}: {why}")]
    Cluster { key: &'static str, why: String },
    #[error("tenants: at least one tenant is required")]
    NoTenants,
    #[error("tenants: {configured} tenants configured, limits.tenants_max is {max}")]
    TooManyTenants { configured: usize, max: u32 },
    #[error("{key}: {source}")]
    TenantName { key: String, source: IdentityError },
    #[error("{key}: tenant {name} is already defined by tenants[{first}]")]
    DuplicateTenant { key: String, name: String, first: usize },
    #[error("{key}: a tenant needs at least one right (read, write or admin)")]
    NoRights { key: String },
    #[error("{key}: a cold tier's retention, and this store has no s3 tier")]
    ColdRetentionWithoutTier { key: String },
    #[error("listen.resp_tenant: {name} is not one of the configured tenants ({known})")]
    UnknownRespTenant { name: String, known: String },
    /// A tenant's key file is missing, open to others, or has a bad line (the error names the
    /// file and the line).
    #[error("{key}: {source}")]
    KeyFile { key: String, source: KeyFileError },
    #[error(
        "{key}: tenant {name} has no secret_file and listen.native {addr} is not loopback; \
         give it a secret_file, or set listen.allow_open_tenants = true to trust every peer \
         to name its own tenant"
    )]
    OpenTenant { key: String, name: String, addr: SocketAddr },
    #[error("{key}: {name:?} is not a seal algorithm (\"blake3\" or \"hmac-sha256\")")]
    SealAlgorithm { key: String, name: String },
    /// `listen.local` names a socket that cannot be bound: too long for `sun_path`, or in a
    /// directory that does not exist.
    #[error("listen.local: {path}: {why}")]
    LocalSocket { path: PathBuf, why: String },
    /// `nixl.agent` is empty, too long, or has characters other than letters, digits, `-`,
    /// `_` and `.`.
    #[error("nixl.agent: {name:?} {why}")]
    NixlAgentName { name: String, why: String },
    /// A `[dpu]` key (or a `[[dpu.reactors]]` entry) that cannot describe an agent.
    #[error("{key}: {why}")]
    Dpu { key: String, why: String },
    /// `nixl.pool_bytes` is not a whole number of `nixl.slot_bytes` slots.
    #[error(
        "nixl.pool_bytes: {pool_bytes} is not a multiple of nixl.slot_bytes ({slot_bytes}); \
         the pool is carved into whole slots"
    )]
    NixlPoolNotWhole { pool_bytes: u64, slot_bytes: u64 },
}

fn parse_display(key: &str, message: &str, line: usize, column: usize) -> String {
    if key.is_empty() {
        format!("line {line}, column {column}: {message}")
    } else {
        format!("{key}: {message} (line {line}, column {column})")
    }
}

impl ConfigError {
    /// The key path the error is about (`listen.native`, `tenants[1].name`), when it is about
    /// one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Read { .. } | Self::TooLarge { .. } => None,
            Self::Parse { key, .. } => Some(key).filter(|k| !k.is_empty()).map(String::as_str),
            Self::Limits { key, .. }
            | Self::TenantName { key, .. }
            | Self::DuplicateTenant { key, .. }
            | Self::NoRights { key }
            | Self::ColdRetentionWithoutTier { key }
            | Self::KeyFile { key, .. }
            | Self::OpenTenant { key, .. }
            | Self::SealAlgorithm { key, .. }
            | Self::Dpu { key, .. } => Some(key),
            Self::OutOfRange { key, .. }
            | Self::NotLoopback { key, .. }
            | Self::AddressReused { key, .. }
            | Self::Cluster { key, .. } => Some(key),
            Self::NoTenants | Self::TooManyTenants { .. } => Some("tenants"),
            Self::UnknownRespTenant { .. } => Some("listen.resp_tenant"),
            Self::LocalSocket { .. } => Some("listen.local"),
            Self::FileStoreRefuses { .. } => Some("store.eviction"),
            Self::DirectLog => Some("store.direct_io"),
            Self::Tiers { .. } => Some("store.tiers"),
            Self::NixlAgentName { .. } => Some("nixl.agent"),
            Self::NixlPoolNotWhole { .. } => Some("nixl.pool_bytes"),
        }
    }
}

/// `section.leaf`, or whichever of the two is not empty.
pub(super) fn join(section: &str, leaf: &str) -> String {
    match (section.is_empty(), leaf.is_empty()) {
        (true, _) => leaf.to_owned(),
        (_, true) => section.to_owned(),
        _ => format!("{section}.{leaf}"),
    }
}
