//! Mooncake Store as a GPUCache store.
//!
//! Owns the mapping of Mooncake result codes to our outcomes ([`results`]), the adapter
//! ([`MooncakeStore`]) and the Python sidecar it drives ([`sidecar`]). It must not decide
//! executor policy: it reports what a code proves (a miss, a success, a retired or unretired
//! failure) and the executor decides what to do with it. ADR 0017 gives the reasons.
//!
//! # Why a sidecar
//! Mooncake Store 0.3.13 ships as a Python wheel (`mooncake-transfer-engine-non-cuda`) with no
//! C headers; its client is `mooncake.store.MooncakeDistributedStore`. The adapter runs that
//! client in a child process (`sidecar.py`, embedded here and run with the venv's Python), so
//! the workspace builds without Python or Mooncake and a crash in the SDK stays out of our
//! process. The sidecar registers one buffer of `buffer_bytes`; payloads are copied through it.
//!
//! # Protocol (one Unix socket, one connection, one request in flight)
//! Every frame is a little-endian `u32` body length, then the body.
//!
//! Request body: `op: u8`, `key_len: u16`, `argument: u64`, `key` (`key_len` ASCII bytes), then
//! the payload (PUT only: the rest of the frame).
//!
//! | op | SDK call | argument |
//! | --- | --- | --- |
//! | 1 PUT | `put_from(key, buffer, len(payload))` | 0 |
//! | 2 GET | `get_into(key, buffer, argument)` | bytes to read |
//! | 3 SIZE | `get_size(key)` | 0 |
//! | 4 EXISTS | `is_exist(key)` | 0 |
//! | 5 REMOVE | `remove(key)` | 0 |
//!
//! Reply body: `status: u8` (0: `code` is the SDK's return value; 1: the SDK raised after the
//! call was entered; 2: refused before any SDK call), `code: i64`, then for a GET whose code is
//! positive, the first `min(code, argument)` bytes of the buffer. A reply whose payload length
//! differs from that is malformed.
//!
//! Every exchange has the call deadline (`call_ms`); startup has `startup_ms`. A missed deadline
//! or a malformed reply puts the socket out of step: the adapter never uses it again and
//! reports the interrupted call as if the SDK had raised.
//!
//! # Objects
//! The Mooncake key of a [`gpucache_dataplane::PhysicalKey`] is `gpc1-<tenant hex>-<digest hex>`,
//! or `gpc1-<namespace>-<tenant hex>-<digest hex>` for a store configured with a namespace.
//! The object is a 24-byte header (`GPCMOON1`, payload length `u64`, payload checksum `u64`)
//! followed by the payload, so a GET checks the bytes it hands back.

mod error;
pub mod results;
pub mod sidecar;
mod store;
pub mod wire;

pub use error::MooncakeError;
pub use results::Raw;
pub use sidecar::{MooncakeVenv, SidecarConfig};
pub use store::{MooncakeConfig, MooncakeStore};
pub use wire::{Op, object_key, object_key_in};
