//! Cross-crate integration tests for GPUCache. The tests live in `tests/tests/`, one file per
//! area; this library holds nothing but this description.
