//! Small helpers for the replies every command builds: client bytes quoted safely in an error,
//! the wrong-arity error, and a store error as a reply.

use gpucache_dataplane::store::StoreError;
use gpucache_wire::resp::Reply;

/// Most bytes of a command name or key quoted in an error.
const SHOWN_BYTES_MAX: usize = 64;

/// Client bytes (a command name, a key) made safe to quote in an error: printable ASCII, other
/// bytes as `?`, at most [`SHOWN_BYTES_MAX`] of them.
pub(super) fn shown(bytes: &[u8]) -> String {
    let mut s: String = bytes
        .iter()
        .take(SHOWN_BYTES_MAX)
        .map(|&b| if (0x20..0x7f).contains(&b) { char::from(b) } else { '?' })
        .collect();
    if bytes.len() > SHOWN_BYTES_MAX {
        s.push_str("...");
    }
    s
}

pub(super) fn store_error(e: &StoreError) -> Reply {
    Reply::err(e)
}

pub(super) fn arity(name: &str) -> Reply {
    Reply::err(format!("wrong number of arguments for '{name}' command"))
}
