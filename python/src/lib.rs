//! The native module `gpucache._native` of the Python package `gpucache`: [`Client`](client)
//! over the Rust client (`gpucache_client::TcpStore`), physical keys built by an
//! [`Identity`](keys), and the typed exceptions. Every call that waits on the server releases the
//! GIL. The pure-Python package (`python/gpucache/`) re-exports these names with their stubs.
//!
//! Built with the stable ABI (abi3, Python 3.9 and later) by maturin. Every build sets
//! `PYO3_BUILD_EXTENSION_MODULE` (maturin, and `.cargo/config.toml` for plain cargo), so the
//! module never links libpython: the importing interpreter provides its symbols.

use pyo3::prelude::*;

mod buffers;
mod client;
mod errors;
mod executor;
mod keys;

/// The package version (the workspace's), which `gpucache.__version__` reports.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", VERSION)?;
    m.add("Error", py.get_type::<errors::Error>())?;
    m.add("RefusedError", py.get_type::<errors::RefusedError>())?;
    m.add("BufferTooSmallError", py.get_type::<errors::BufferTooSmallError>())?;
    m.add("UnavailableError", py.get_type::<errors::UnavailableError>())?;
    m.add_class::<keys::Key>()?;
    m.add_class::<keys::Identity>()?;
    m.add_class::<client::Client>()?;
    m.add_class::<client::SharedBuffer>()?;
    m.add_class::<executor::Executor>()?;
    m.add_function(wrap_pyfunction!(keys::plain_key, m)?)?;
    m.add("PAYLOAD_BYTES_MAX", gpucache_wire::PAYLOAD_BYTES_MAX)?;
    m.add("BATCH_ITEMS_MAX", gpucache_wire::BATCH_ITEMS_MAX)?;
    m.add("BATCH_KEYS_MAX", client::BATCH_KEYS_MAX)?;
    m.add("REGISTERED_BUFFERS_MAX", client::REGISTERED_BUFFERS_MAX)?;
    Ok(())
}
