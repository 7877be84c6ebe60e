//! The connection pools, one per tenant and rights: taking a connection, returning it, and the
//! single-request calls made on one (a read retried once when a pooled connection was dead).

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::store::StoreError;
use gpucache_wire::{Frame, Request, Response};

use super::conn::Conn;
use super::errors::transport;
use super::tcp_store::{PoolKey, TcpStore, pool_key};

/// Idle connections kept per (tenant, rights).
const POOL_CONNECTIONS_MAX: usize = 8;

impl TcpStore {
    /// A pooled connection as `caller`, or a new one; says which.
    pub(super) fn take_conn(
        &self,
        caller: &Caller,
        operation: &'static str,
    ) -> Result<(Conn, bool), StoreError> {
        let pooled = self
            .pools
            .lock()
            .ok()
            .and_then(|mut p| p.get_mut(&pool_key(caller)).and_then(Vec::pop));
        match pooled {
            Some(mut c) => {
                self.declare(&mut c, operation)?;
                Ok((c, true))
            }
            None => Ok((self.connect(caller, operation)?, false)),
        }
    }

    /// One request as `caller`, answered by `decode`: a pooled connection, or a new one. A
    /// request that only reads (or whose repetition is harmless) is retried once on a fresh
    /// connection when a pooled one turns out dead; writes are never retried here (their
    /// request ids make a caller's own retry safe).
    fn call_with<T>(
        &self,
        caller: &Caller,
        request: &Request,
        operation: &'static str,
        decode: impl FnOnce(&Frame) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let (mut conn, was_pooled) = self.take_conn(caller, operation)?;
        let frame = match self.exchange_with(&mut conn, request, operation, None) {
            Ok(f) => f,
            Err(e) if was_pooled && retryable(request) => {
                conn = self.connect(caller, operation)?;
                self.exchange_with(&mut conn, request, operation, None).map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        let answer = decode(&frame);
        conn.decoder.recycle(frame.body);
        self.keep(pool_key(caller), conn);
        answer
    }

    /// Returns an idle connection to its pool (unless the pool is full).
    pub(super) fn keep(&self, key: PoolKey, conn: Conn) {
        if conn.decoder.is_idle()
            && conn.pending.is_empty()
            && let Ok(mut pools) = self.pools.lock()
        {
            let pool = pools.entry(key).or_default();
            if pool.len() < POOL_CONNECTIONS_MAX {
                pool.push(conn);
            }
        }
    }

    pub(super) fn call(
        &self,
        caller: &Caller,
        request: Request,
        operation: &'static str,
    ) -> Result<Response, StoreError> {
        self.call_with(caller, &request, operation, |frame| {
            Response::from_frame(frame).map_err(|e| transport(operation, e))
        })
    }

    pub(super) fn control(
        &self,
        request: Request,
        operation: &'static str,
    ) -> Result<Response, StoreError> {
        let control = self.config.control.clone();
        self.call(&control, request, operation)
    }
}

/// Requests whose repetition cannot change what the store holds.
fn retryable(request: &Request) -> bool {
    matches!(
        request,
        Request::Info
            | Request::Epoch
            | Request::Stats
            | Request::Lookup { .. }
            | Request::Locate { .. }
            | Request::Get { .. }
            | Request::GetShared { .. }
            | Request::NixlAttach { .. }
            | Request::StageStats
            | Request::Limits
            | Request::Condition
            | Request::Cluster { .. }
            | Request::FillWait { .. }
    )
}
