//! How a connection runs one request: the AUTH gate, the transaction commands, and the
//! dispatch of every other command by name.

use std::sync::PoisonError;

use gpucache_wire::resp::{Reply, parse_int};

use super::auth::NOAUTH_TEXT;
use super::info::config;
use super::reply::{arity, shown};
use super::session::{RespSession, Then};
use super::transaction::queue;

impl RespSession<'_> {
    pub(super) fn execute(&self, args: &[Vec<u8>]) -> (Reply, Then) {
        let Some((name, rest)) = args.split_first() else {
            return (Reply::err("empty command"), Then::Continue);
        };
        let upper = name.to_ascii_uppercase();
        if !self.authenticated.get() && !matches!(upper.as_slice(), b"AUTH" | b"HELLO" | b"QUIT") {
            return (Reply::Error(NOAUTH_TEXT.into()), Then::Continue);
        }
        match upper.as_slice() {
            b"MULTI" => return (self.multi(rest), Then::Continue),
            b"EXEC" => return self.exec(rest),
            b"DISCARD" => return (self.discard(rest), Then::Continue),
            b"WATCH" | b"UNWATCH" => {
                return (Reply::err(format!("{} is not supported", shown(name))), Then::Continue);
            }
            _ => {}
        }
        if upper.as_slice() != b"QUIT"
            && let Some(queued) = self.transaction.borrow_mut().as_mut()
        {
            return (queue(queued, &upper, args), Then::Continue);
        }
        let _shared = self.shared.transactions.read().unwrap_or_else(PoisonError::into_inner);
        self.run(name, &upper, rest)
    }

    /// Runs one command (`upper` is its name in upper case) outside any transaction logic.
    pub(super) fn run(&self, name: &[u8], upper: &[u8], rest: &[Vec<u8>]) -> (Reply, Then) {
        let reply = match upper {
            b"AUTH" => self.auth(rest),
            b"HELLO" => self.hello(rest),
            b"CLIENT" => self.client(rest),
            b"PING" => match rest {
                [] => Reply::Simple("PONG".to_owned()),
                [message] => Reply::Bulk(message.clone()),
                _ => arity("ping"),
            },
            b"GET" => match rest {
                [key] => self.get(key).unwrap_or_else(|r| r),
                _ => arity("get"),
            },
            b"SET" => self.set(rest),
            b"TTL" | b"PTTL" => match rest {
                [key] => self.ttl(key, upper == b"PTTL").unwrap_or_else(|r| r),
                _ => arity(&String::from_utf8_lossy(&name.to_ascii_lowercase())),
            },
            b"EXISTS" if !rest.is_empty() => self.count(rest, |s, k| s.exists(k)),
            b"DEL" if !rest.is_empty() => self.count(rest, |s, k| s.del(k)),
            b"MGET" if !rest.is_empty() => self.mget(rest),
            b"MSET" if !rest.is_empty() && rest.len().is_multiple_of(2) => self.mset(rest),
            b"EXISTS" | b"DEL" | b"MGET" | b"MSET" => {
                arity(&String::from_utf8_lossy(&name.to_ascii_lowercase()))
            }
            b"INFO" => self.info(rest),
            b"COMMAND" => match rest.first() {
                Some(sub) if sub.eq_ignore_ascii_case(b"COUNT") => Reply::Integer(0),
                // Command docs are a map (an empty one: there are none).
                Some(sub) if sub.eq_ignore_ascii_case(b"DOCS") => Reply::Map(Vec::new()),
                _ => Reply::Array(Vec::new()),
            },
            b"CONFIG" => config(rest),
            b"SELECT" => match rest {
                [db] => match parse_int(db) {
                    Some(0) => Reply::ok(),
                    Some(_) => Reply::err("DB index is out of range"),
                    None => Reply::err("value is not an integer or out of range"),
                },
                _ => arity("select"),
            },
            b"QUIT" => return (Reply::ok(), Then::Close),
            _ => Reply::err(format!("unknown command '{}'", shown(name))),
        };
        (reply, Then::Continue)
    }
}
