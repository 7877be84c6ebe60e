//! [`ColdObjects`]: what the cold tier asks of an object store.

use std::ops::Range;

/// Why an object store call failed. Nothing else: a caller decides from the kind alone
/// whether to try again ([`ColdError::is_transient`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ColdError {
    #[error("object {key} does not exist")]
    NotFound { key: String },
    /// A create-only PUT found the name taken; the object there is unchanged.
    #[error("object {key} exists already")]
    AlreadyExists { key: String },
    /// The store did not answer in time, answered a server error, or the connection failed:
    /// the call may or may not have taken effect, and may be tried again.
    #[error("{operation} {key}: {detail} (worth another try)")]
    Transient { operation: &'static str, key: String, detail: String },
    /// Refused for good (credentials, a missing bucket, a bad request).
    #[error("{operation} {key}: {detail}")]
    Permanent { operation: &'static str, key: String, detail: String },
    #[error("object store configuration: {0}")]
    Config(String),
}

impl ColdError {
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient { .. })
    }
}

/// An object store as the cold tier uses it. Object names are created once and never
/// overwritten; every call is bounded by the implementation's deadline.
pub trait ColdObjects: Send + Sync {
    /// Stores `bytes` under `key` unless the name is taken ([`ColdError::AlreadyExists`]).
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError>;
    /// The object's size, or none when there is no such object.
    fn head(&self, key: &str) -> Result<Option<u64>, ColdError>;
    /// The bytes of `range` of the object. A store may hand back fewer bytes than asked
    /// (a torn read): callers check what they got.
    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>, ColdError>;
    /// Deletes the object (deleting an absent one succeeds).
    fn delete(&self, key: &str) -> Result<(), ColdError>;
}
