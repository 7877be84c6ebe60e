//! Mooncake Store as a GPUCache store.
//!
//! Owns the mapping of Mooncake result codes to our outcomes ([`results`]). It must not decide
//! policy: it reports what a code proves (a miss, a success, a retired or unretired failure)
//! and the executor decides what to do with it.

pub mod results;
pub mod wire;
