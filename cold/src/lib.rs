//! GPUCache's cold tier, on any S3-compatible object store.
//!
//! This first layer is the object store itself, as the tier needs it ([`ColdObjects`]):
//! create-only PUT, HEAD, ranged GET and DELETE, with every failure typed as absent, already
//! there, worth another try, or not. [`S3Objects`] is the real one (the `object_store` crate's
//! S3 client); [`FaultyObjects`] wraps any of them with seeded faults for tests (server errors,
//! timeouts, lost acknowledgements, torn ranges), and says it is a simulation.

mod faulty;
mod objects;
mod s3;

pub use faulty::{FaultKind, FaultPlan, FaultyObjects};
pub use objects::{ColdError, ColdObjects};
pub use s3::{S3_REQUEST_TIMEOUT_MS_DEFAULT, S3Config, S3Objects};
