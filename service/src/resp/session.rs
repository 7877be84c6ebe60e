//! The state of one RESP connection ([`RespSession`]) and the state every connection of a
//! listener shares; the commands that act on them live in the sibling files.

use std::cell::{Cell, RefCell};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::store::Store;
use gpucache_wire::namespace::IdentityTemplate;
use gpucache_wire::resp::RespVersion;

use crate::connection::Gate;

use super::config::RespConfig;
use super::expiry::Expiries;
use super::reply::shown;

/// Longest connection name (`CLIENT SETNAME`, `HELLO ... SETNAME`) and library name or version
/// (`CLIENT SETINFO`).
pub const CLIENT_NAME_BYTES_MAX: usize = 256;

/// What every connection of one listener shares.
pub(super) struct Shared {
    pub(super) config: RespConfig,
    pub(super) store: Arc<dyn Store>,
    pub(super) gate: Arc<Gate>,
    pub(super) started: Instant,
    pub(super) port: u16,
    /// The id the next connection gets (`CLIENT ID`, HELLO's `id`), from 1.
    pub(super) next_client_id: AtomicU64,
    pub(super) expiries: Expiries,
    /// Held shared by every command and exclusively by `EXEC`, so that a transaction's commands
    /// run with no other RESP command between them.
    pub(super) transactions: RwLock<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .field("store", &self.store.info())
            .field("open", &self.gate.open)
            .finish()
    }
}

/// What a connection does after answering a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Then {
    Continue,
    Close,
}

/// What one connection acts as and on.
pub(super) struct RespSession<'a> {
    pub(super) store: &'a dyn Store,
    pub(super) caller: &'a Caller,
    pub(super) namespace: &'a IdentityTemplate,
    pub(super) shared: &'a Shared,
    /// Whether the connection may run commands: at once for an open tenant, after a good
    /// `AUTH` (or `HELLO ... AUTH`) for a tenant with keys.
    pub(super) authenticated: Cell<bool>,
    /// The reply protocol, switched by `HELLO`.
    pub(super) version: Cell<RespVersion>,
    /// `CLIENT ID`.
    pub(super) id: u64,
    /// `CLIENT SETNAME`, at most [`CLIENT_NAME_BYTES_MAX`] bytes.
    pub(super) name: RefCell<Option<Vec<u8>>>,
    /// `CLIENT SETINFO LIB-NAME` and `LIB-VER`.
    pub(super) library: RefCell<Library>,
    /// The commands queued since `MULTI`, while a transaction is open.
    pub(super) transaction: RefCell<Option<Transaction>>,
}

/// A transaction being queued.
#[derive(Debug, Default)]
pub(super) struct Transaction {
    pub(super) commands: Vec<Vec<Vec<u8>>>,
    pub(super) bytes: usize,
    /// A command was refused while queueing: `EXEC` runs nothing.
    pub(super) aborted: bool,
}

/// What a client said about its library (`CLIENT SETINFO`), each at most
/// [`CLIENT_NAME_BYTES_MAX`] bytes.
#[derive(Debug, Default)]
pub(super) struct Library {
    pub(super) name: Option<Vec<u8>>,
    pub(super) version: Option<Vec<u8>>,
}

impl Drop for RespSession<'_> {
    fn drop(&mut self) {
        let library = self.library.borrow();
        let text = |v: &Option<Vec<u8>>| v.as_deref().map(shown);
        tracing::debug!(
            id = self.id,
            name = text(&self.name.borrow()),
            lib_name = text(&library.name),
            lib_ver = text(&library.version),
            "RESP connection closed"
        );
    }
}
