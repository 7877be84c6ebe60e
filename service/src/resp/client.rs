//! `CLIENT`: the connection's id, its name, and what the client says about its library.

use gpucache_wire::resp::Reply;

use super::reply::{arity, shown};
use super::session::{CLIENT_NAME_BYTES_MAX, RespSession};

/// A connection or library name as Redis takes one: at most [`CLIENT_NAME_BYTES_MAX`] bytes of
/// printable ASCII without spaces (empty: no name).
pub(super) fn checked_name(what: &str, name: &[u8]) -> Result<(), Reply> {
    if name.len() > CLIENT_NAME_BYTES_MAX {
        return Err(Reply::err(format!(
            "a {what} of {} bytes is over the limit of {CLIENT_NAME_BYTES_MAX}",
            name.len()
        )));
    }
    if !name.iter().all(|b| (0x21..0x7f).contains(b)) {
        return Err(Reply::err(format!(
            "a {what} may hold only printable ASCII, without spaces or newlines"
        )));
    }
    Ok(())
}

impl RespSession<'_> {
    /// `CLIENT ID | GETNAME | SETNAME name | SETINFO LIB-NAME|LIB-VER value`; any other
    /// subcommand is an error that names the ones answered.
    pub(super) fn client(&self, rest: &[Vec<u8>]) -> Reply {
        let Some((sub, args)) = rest.split_first() else { return arity("client") };
        let upper = sub.to_ascii_uppercase();
        match (upper.as_slice(), args) {
            (b"ID", []) => Reply::Integer(i64::try_from(self.id).unwrap_or(i64::MAX)),
            (b"GETNAME", []) => self.name.borrow().clone().map_or(Reply::Nil, Reply::Bulk),
            (b"SETNAME", [name]) => match checked_name("client name", name) {
                Ok(()) => {
                    *self.name.borrow_mut() = (!name.is_empty()).then(|| name.clone());
                    Reply::ok()
                }
                Err(r) => r,
            },
            (b"SETINFO", [attribute, value]) => {
                let mut library = self.library.borrow_mut();
                let (slot, what) = if attribute.eq_ignore_ascii_case(b"LIB-NAME") {
                    (&mut library.name, "library name")
                } else if attribute.eq_ignore_ascii_case(b"LIB-VER") {
                    (&mut library.version, "library version")
                } else {
                    return Reply::err(format!(
                        "CLIENT SETINFO attribute '{}' is not known; use LIB-NAME or LIB-VER",
                        shown(attribute)
                    ));
                };
                match checked_name(what, value) {
                    Ok(()) => {
                        *slot = (!value.is_empty()).then(|| value.clone());
                        Reply::ok()
                    }
                    Err(r) => r,
                }
            }
            (b"ID" | b"GETNAME" | b"SETNAME" | b"SETINFO", _) => {
                arity(&format!("client|{}", String::from_utf8_lossy(&sub.to_ascii_lowercase())))
            }
            _ => Reply::err(format!(
                "unknown subcommand CLIENT {}; this server answers CLIENT ID, GETNAME, SETNAME \
                 and SETINFO",
                shown(sub)
            )),
        }
    }
}
