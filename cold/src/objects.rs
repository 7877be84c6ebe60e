//! [`ColdObjects`]: what the cold tier asks of an object store.

use std::ops::Range;
use std::time::Duration;

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

/// Most objects one [`ColdObjects::list`] call returns.
pub const LIST_OBJECTS_MAX: usize = 1 << 20;

/// An object store as the cold tier uses it. Object names are created once and never
/// overwritten; every call is bounded by the implementation's deadline, and a read by the
/// caller's too.
pub trait ColdObjects: Send + Sync {
    /// Stores `bytes` under `key` unless the name is taken ([`ColdError::AlreadyExists`]).
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError>;
    /// The object's size, or none when there is no such object.
    fn head(&self, key: &str) -> Result<Option<u64>, ColdError>;
    /// The bytes of `range` of the object, given up (transient) after `within`. A store may
    /// hand back fewer bytes than asked (a torn read): callers check what they got.
    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        within: Duration,
    ) -> Result<Vec<u8>, ColdError>;
    /// Deletes the object (deleting an absent one succeeds).
    fn delete(&self, key: &str) -> Result<(), ColdError>;
    /// The names and sizes of the objects whose names start with `prefix` (at most
    /// [`LIST_OBJECTS_MAX`]; more is a permanent error).
    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError>;
}

impl<T: ColdObjects + ?Sized> ColdObjects for std::sync::Arc<T> {
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError> {
        (**self).put_new(key, bytes)
    }
    fn head(&self, key: &str) -> Result<Option<u64>, ColdError> {
        (**self).head(key)
    }
    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        within: Duration,
    ) -> Result<Vec<u8>, ColdError> {
        (**self).get_range(key, range, within)
    }
    fn delete(&self, key: &str) -> Result<(), ColdError> {
        (**self).delete(key)
    }
    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError> {
        (**self).list(prefix)
    }
}
