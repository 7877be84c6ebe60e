//! [`MemoryObjects`]: an object store in this process's memory, for tests and for measuring
//! the tier without a server. A simulation: nothing survives the process, and it says so in
//! its `Debug`. It keeps the rules a real store keeps for the tier (create-only names, ranges
//! clipped to the object, absent objects as `NotFound`), within a byte limit.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::objects::{ColdError, ColdObjects, LIST_OBJECTS_MAX};

/// The objects a [`MemoryObjects`] holds, by name.
type Objects = BTreeMap<String, Arc<[u8]>>;

/// An in-memory object store (see the module documentation).
pub struct MemoryObjects {
    objects: Mutex<Objects>,
    bytes_max: u64,
}

impl std::fmt::Debug for MemoryObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryObjects (simulated, in memory)")
            .field("bytes_max", &self.bytes_max)
            .finish_non_exhaustive()
    }
}

impl MemoryObjects {
    /// A store that holds at most `bytes_max` bytes of objects.
    pub fn new(bytes_max: u64) -> Self {
        Self { objects: Mutex::default(), bytes_max }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Objects> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ColdObjects for MemoryObjects {
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError> {
        let mut objects = self.lock();
        if objects.contains_key(key) {
            return Err(ColdError::AlreadyExists { key: key.to_owned() });
        }
        let held: u64 = objects.values().map(|b| b.len() as u64).sum();
        if held + bytes.len() as u64 > self.bytes_max {
            return Err(ColdError::Permanent {
                operation: "put",
                key: key.to_owned(),
                detail: format!("the in-memory store is full ({held} of {} bytes)", self.bytes_max),
            });
        }
        objects.insert(key.to_owned(), bytes.into());
        Ok(())
    }

    fn head(&self, key: &str) -> Result<Option<u64>, ColdError> {
        Ok(self.lock().get(key).map(|b| b.len() as u64))
    }

    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        _within: Duration,
    ) -> Result<Vec<u8>, ColdError> {
        let objects = self.lock();
        let bytes = objects.get(key).ok_or_else(|| ColdError::NotFound { key: key.to_owned() })?;
        let len = bytes.len() as u64;
        let (from, to) = (range.start.min(len), range.end.min(len));
        Ok(bytes[usize::try_from(from).unwrap_or(0)..usize::try_from(to).unwrap_or(0)].to_vec())
    }

    fn delete(&self, key: &str) -> Result<(), ColdError> {
        self.lock().remove(key);
        Ok(())
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError> {
        let found: Vec<(String, u64)> = self
            .lock()
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, b)| (k.clone(), b.len() as u64))
            .take(LIST_OBJECTS_MAX + 1)
            .collect();
        if found.len() > LIST_OBJECTS_MAX {
            return Err(ColdError::Permanent {
                operation: "list",
                key: prefix.to_owned(),
                detail: format!("more than {LIST_OBJECTS_MAX} objects"),
            });
        }
        Ok(found)
    }
}
