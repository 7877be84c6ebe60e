//! Transactions: `MULTI` opens one, the commands that follow are queued within bounds, and
//! `EXEC` runs them with no other RESP command in between, or `DISCARD` drops them.

use std::sync::PoisonError;

use gpucache_wire::resp::Reply;

use super::reply::{arity, shown};
use super::session::{RespSession, Then, Transaction};

/// Most commands one transaction queues; one more makes its `EXEC` abort.
pub const TRANSACTION_COMMANDS_MAX: usize = 4096;

/// Most bytes of arguments one transaction queues; more makes its `EXEC` abort.
pub const TRANSACTION_BYTES_MAX: usize = 256 << 20;

/// The commands the front knows, by their upper-case names: what `MULTI` agrees to queue.
const COMMANDS: &[&[u8]] = &[
    b"AUTH", b"HELLO", b"CLIENT", b"PING", b"GET", b"SET", b"TTL", b"PTTL", b"EXISTS", b"DEL",
    b"MGET", b"MSET", b"INFO", b"COMMAND", b"CONFIG", b"SELECT", b"QUIT",
];

/// Queues `args` (a command named `upper` in upper case) in an open transaction: `+QUEUED`, or
/// an error that makes the transaction's `EXEC` abort.
pub(super) fn queue(transaction: &mut Transaction, upper: &[u8], args: &[Vec<u8>]) -> Reply {
    if !COMMANDS.contains(&upper) {
        transaction.aborted = true;
        return Reply::err(format!("unknown command '{}'", shown(&args[0])));
    }
    let bytes: usize = args.iter().map(Vec::len).sum();
    if transaction.commands.len() >= TRANSACTION_COMMANDS_MAX
        || transaction.bytes + bytes > TRANSACTION_BYTES_MAX
    {
        transaction.aborted = true;
        return Reply::err(format!(
            "transaction too large: at most {TRANSACTION_COMMANDS_MAX} commands and \
             {TRANSACTION_BYTES_MAX} bytes of arguments"
        ));
    }
    transaction.bytes += bytes;
    transaction.commands.push(args.to_vec());
    Reply::Simple("QUEUED".to_owned())
}

impl RespSession<'_> {
    /// `MULTI`: opens a transaction.
    pub(super) fn multi(&self, rest: &[Vec<u8>]) -> Reply {
        if !rest.is_empty() {
            return arity("multi");
        }
        let mut open = self.transaction.borrow_mut();
        if open.is_some() {
            return Reply::err("MULTI calls can not be nested");
        }
        *open = Some(Transaction::default());
        Reply::ok()
    }

    /// `DISCARD`: drops the open transaction's commands.
    pub(super) fn discard(&self, rest: &[Vec<u8>]) -> Reply {
        if !rest.is_empty() {
            return arity("discard");
        }
        match self.transaction.borrow_mut().take() {
            Some(_) => Reply::ok(),
            None => Reply::err("DISCARD without MULTI"),
        }
    }

    /// `EXEC`: runs the open transaction's commands in order, with no other RESP command in
    /// between, and answers their replies.
    pub(super) fn exec(&self, rest: &[Vec<u8>]) -> (Reply, Then) {
        if !rest.is_empty() {
            return (arity("exec"), Then::Continue);
        }
        let Some(transaction) = self.transaction.borrow_mut().take() else {
            return (Reply::err("EXEC without MULTI"), Then::Continue);
        };
        if transaction.aborted {
            let text = "EXECABORT Transaction discarded because of previous errors.";
            return (Reply::Error(text.into()), Then::Continue);
        }
        let _alone = self.shared.transactions.write().unwrap_or_else(PoisonError::into_inner);
        // QUIT is never queued, so no queued command closes the connection.
        let replies = transaction
            .commands
            .iter()
            .filter_map(|args| args.split_first())
            .map(|(name, rest)| self.run(name, &name.to_ascii_uppercase(), rest).0)
            .collect();
        (Reply::Array(replies), Then::Continue)
    }
}
