//! The RESP front: a Redis-protocol listener (RESP2, and RESP3 after `HELLO 3`) over a shared
//! [`Store`], so that Redis clients (`redis-cli`, `redis-benchmark`, redis-py and the libraries
//! built on it) can keep opaque values in GPUCache.
//!
//! # Keys
//!
//! Identity decides compatibility, never a string key alone. Every RESP connection acts as one
//! configured tenant ([`RespConfig::tenant`]), and a plain Redis key is an opaque byte string
//! inside one fixed identity namespace of that tenant ([`IdentityTemplate`], in the wire crate
//! so that every client maps names the same way): the physical key is the namespace's
//! `CacheIdentity` with a one-link chain whose only link is the BLAKE3 hash of the key bytes,
//! and block and valid token counts of 1. Plain keys therefore never meet KV
//! blocks of a model (their model revision, tokenizer and layout differ), nor another tenant's
//! keys, and two plain keys are the same key exactly when their bytes are equal.
//!
//! # Values
//!
//! The store is create-only, and so is this front. `SET` of a free key stores the value. `SET`
//! of a key that already holds exactly the same bytes answers `+OK`, because the key then holds
//! what was asked for (this is what lets `redis-benchmark`, which writes one value to random
//! keys, run). `SET` of a key that holds different bytes is an error and changes nothing; with
//! `NX` it answers nil instead, whatever the value, and `XX` never stores (a key it finds either
//! holds the same bytes, or other bytes it cannot replace). A value therefore changes only
//! through `DEL` then `SET`. A value must hold at least one byte and fit the store's
//! `object_bytes_max`. A read that finds nothing usable, including a block whose bytes failed
//! their checksum (which the store drops), answers nil.
//!
//! # Expiry
//!
//! `SET ... EX|PX|EXAT|PXAT` gives a key a deadline, kept by this process in a table of at most
//! [`EXPIRING_KEYS_MAX`] keys shared by every connection. A key whose deadline has passed is
//! removed from the store by the next command that touches it and reads as absent; the store
//! itself has no expiry, so the deadline is lost when the process restarts (the block then stays
//! until `DEL` or eviction).
//!
//! # Protocol
//!
//! Requests are RESP2 arrays of bulk strings, or inline commands (one line of words separated
//! by spaces or tabs; quotes are not interpreted). Replies are RESP2 until the connection sends
//! `HELLO 3`, then RESP3 (null `_`, maps `%`, verbatim text `=`). The decoder ([`gpucache_wire::resp`],
//! re-exported here) is strict and bounded (see the constants and [`RespLimits`]); a request it
//! cannot decode is answered `-ERR Protocol error: ...` and the connection closes, because the
//! stream cannot be resynchronised. Command-level mistakes (unknown command, wrong arity, bad option) are answered
//! `-ERR ...` and the connection goes on. Pipelined requests are answered in order.
//!
//! # Transactions
//!
//! `MULTI` starts a transaction: the commands that follow are answered `+QUEUED` and kept (at
//! most [`TRANSACTION_COMMANDS_MAX`] commands and [`TRANSACTION_BYTES_MAX`] bytes of arguments)
//! until `EXEC` runs them in order and answers an array of their replies, or `DISCARD` drops
//! them. No other RESP connection's command runs while an `EXEC` runs (every command of the
//! front holds a shared lock that `EXEC` holds exclusively); clients of the native protocol are
//! not held back, so the store may change between two commands of a transaction under their
//! writes. As in Redis, a command that fails inside `EXEC` does not undo the others (there is
//! no rollback), and a command refused while queueing (unknown, or past the limits) makes `EXEC`
//! answer `-EXECABORT` and run nothing. `WATCH` is not supported (it is an error), so
//! optimistic locking is not available; redis-py's default `pipeline()`, which wraps its
//! commands in `MULTI` / `EXEC`, works.
//!
//! # Threads
//!
//! As for the native listener (ADR 0011): one accept thread, one thread per connection up to
//! `connections_max`, a read tick that notices shutdown and idleness, and a write timeout.
//!
//! The files: `config` (how to run a listener), `listener` (accepting connections and each
//! connection's read-run-write loop), `session` (one connection's state, and what all of a
//! listener's connections share), `dispatch` (running one request), `auth` (AUTH and HELLO),
//! `client` (CLIENT), `keys` (the single-key commands), `batch` (MGET and MSET), `expiry` (the
//! deadline table), `transaction` (MULTI, EXEC, DISCARD), `info` (INFO and CONFIG) and `reply`
//! (helpers for replies).
//!
//! [`Store`]: gpucache_dataplane::store::Store

mod auth;
mod batch;
mod client;
mod config;
mod dispatch;
mod expiry;
mod info;
mod keys;
mod listener;
mod reply;
mod session;
#[cfg(test)]
mod tests;
mod transaction;

// The RESP codec itself (limits, request decoder, RESP2 and RESP3 replies) is pure and lives in the wire crate;
// it is re-exported here so that the front's users find it next to the listener.
pub use gpucache_wire::resp::{
    ARGS_MAX, BULK_SLACK_BYTES, INLINE_BYTES_MAX, LENGTH_LINE_BYTES_MAX, ProtocolError,
    REQUEST_SLACK_BYTES, Reply, RequestDecoder, RespLimits, RespVersion, VALUE_BYTES_CEILING,
    encode_request, parse_int,
};

// Plain names map into a tenant's namespace in the wire crate, so that every client (the CLI,
// the Python package) maps them exactly as this front does.
pub use gpucache_wire::namespace::{IdentityTemplate, chain_link};

pub use auth::{REDIS_VERSION, SERVER_NAME};
pub use config::RespConfig;
pub use expiry::EXPIRING_KEYS_MAX;
pub use listener::RespServer;
pub use session::CLIENT_NAME_BYTES_MAX;
pub use transaction::{TRANSACTION_BYTES_MAX, TRANSACTION_COMMANDS_MAX};
