//! `AUTH` and `HELLO`: authenticating a connection with one of the tenant's keys, and switching
//! its reply protocol while saying who the server is.

use gpucache_wire::resp::{Reply, RespVersion, parse_int};
use subtle::ConstantTimeEq;

use crate::auth::TenantKeys;
use crate::auth::keys::unhex;

use super::client::checked_name;
use super::reply::{arity, shown};
use super::session::RespSession;

/// The Redis version INFO and HELLO report; clients check it to pick a dialect.
pub const REDIS_VERSION: &str = "7.0.0";

/// The server name HELLO reports.
pub const SERVER_NAME: &str = "gpucache";

pub(super) const NOAUTH_TEXT: &str = "NOAUTH Authentication required.";

pub(super) const HELLO_NOAUTH_TEXT: &str = "NOAUTH Authentication required: authenticate first with AUTH, or \
                                 in the same command with HELLO <protover> AUTH <key-id> <hex secret>";

const NOPROTO_TEXT: &str = "NOPROTO unsupported protocol version; this server speaks 2 and 3";

pub(super) const WRONGPASS_TEXT: &str =
    "WRONGPASS invalid username-password pair or user is disabled.";

impl RespSession<'_> {
    /// `AUTH <key-id> <hex secret>` or `AUTH <key-id>:<hex secret>` against the tenant's keys
    /// in force (re-read when the key file changed; an expired key is refused).
    pub(super) fn auth(&self, rest: &[Vec<u8>]) -> Reply {
        let Some(keys) = &self.shared.config.auth else {
            return Reply::err(
                "AUTH <password> called without any password configured for the default user",
            );
        };
        let (id, hex) = match rest {
            [user, pass] => (&user[..], &pass[..]),
            [joined] => match joined.iter().position(|b| *b == b':') {
                Some(at) => (&joined[..at], &joined[at + 1..]),
                None => return Reply::Error(WRONGPASS_TEXT.into()),
            },
            _ => return arity("auth"),
        };
        self.check_key(keys, id, hex)
    }

    /// Authenticates the connection when `id` names a key of the tenant in force whose secret
    /// is the hex `hex`: `+OK`, else `-WRONGPASS` and nothing changes.
    fn check_key(&self, keys: &TenantKeys, id: &[u8], hex: &[u8]) -> Reply {
        let id = String::from_utf8_lossy(id);
        let offered = std::str::from_utf8(hex).ok().and_then(unhex);
        let now_ms = self.shared.config.clock.now_ms();
        let good = match (keys.find(&id), offered) {
            (Some(key), Some(offered)) => {
                !key.expired(now_ms) && bool::from(key.secret.bytes().ct_eq(&offered[..]))
            }
            _ => false,
        };
        if good {
            self.authenticated.set(true);
            Reply::ok()
        } else {
            Reply::Error(WRONGPASS_TEXT.into())
        }
    }

    /// `HELLO [protover [AUTH key-id hex-secret] [SETNAME name]]`: checks everything first, so
    /// that a refused HELLO changes nothing; then authenticates, switches the reply protocol and
    /// names the connection, and answers who the server is (a map in RESP3, a flat array of
    /// field-value pairs in RESP2).
    pub(super) fn hello(&self, rest: &[Vec<u8>]) -> Reply {
        let mut version = self.version.get();
        let mut credentials: Option<(&[u8], &[u8])> = None;
        let mut setname: Option<&[u8]> = None;
        if let Some((protover, mut options)) = rest.split_first() {
            let Some(number) = parse_int(protover) else {
                return Reply::err("protocol version is not an integer or out of range");
            };
            let Some(asked) = RespVersion::from_number(number) else {
                return Reply::Error(NOPROTO_TEXT.into());
            };
            version = asked;
            while let Some((option, after)) = options.split_first() {
                let syntax =
                    || Reply::err(format!("syntax error in HELLO option '{}'", shown(option)));
                if option.eq_ignore_ascii_case(b"AUTH") {
                    let [user, pass, more @ ..] = after else { return syntax() };
                    credentials = Some((user, pass));
                    options = more;
                } else if option.eq_ignore_ascii_case(b"SETNAME") {
                    let [name, more @ ..] = after else { return syntax() };
                    if let Err(r) = checked_name("client name", name) {
                        return r;
                    }
                    setname = Some(name);
                    options = more;
                } else {
                    return syntax();
                }
            }
        }
        match (credentials, &self.shared.config.auth) {
            (Some((user, pass)), Some(keys)) => {
                let answer = self.check_key(keys, user, pass);
                if answer != Reply::ok() {
                    return answer;
                }
            }
            (Some(_), None) => return self.auth(&[]),
            (None, _) if !self.authenticated.get() => {
                return Reply::Error(HELLO_NOAUTH_TEXT.into());
            }
            (None, _) => {}
        }
        self.version.set(version);
        if let Some(name) = setname {
            *self.name.borrow_mut() = (!name.is_empty()).then(|| name.to_vec());
        }
        let text = |t: &str| Reply::Bulk(t.as_bytes().to_vec());
        Reply::Map(vec![
            (text("server"), text(SERVER_NAME)),
            (text("version"), text(REDIS_VERSION)),
            (text("proto"), Reply::Integer(version.number())),
            (text("id"), Reply::Integer(i64::try_from(self.id).unwrap_or(i64::MAX))),
            (text("mode"), text("standalone")),
            (text("role"), text("master")),
            (text("modules"), Reply::Array(Vec::new())),
        ])
    }
}
