//! The calls beside the `Store` trait: the cluster epoch and node status, single-flight fills,
//! PURGE, and the server's limits and description.

use std::sync::atomic::Ordering;
use std::time::Duration;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::shard::{FillLease, FillNotice, FillOutcome, FillStart, FillTicket};
use gpucache_dataplane::store::{PurgeScope, Purged, Retirement, StoreCondition, StoreError};
use gpucache_wire::{
    FillRefused, NodeStatus, RemoteInfo, Request, Response, ServerLimits, WireError,
};

use super::conn::Conn;
use super::errors::{transport, unexpected};
use super::tcp_store::{NOT_CLUSTERED, TcpStore};

/// Most PURGE requests one [`TcpStore::purge`] sends (each removes at most
/// `PURGE_BLOCKS_MAX` blocks): 4 Mi blocks, more than a server's default registrations.
pub const PURGE_ROUNDS_MAX: usize = 64;

impl TcpStore {
    /// Routes this store's requests by cluster epoch `epoch` from now on: each connection says
    /// it (CLUSTER) before its next request, and a node of a cluster refuses requests of any
    /// other epoch with [`StoreError::Fenced`].
    pub fn set_cluster_epoch(&self, epoch: u64) {
        self.cluster_epoch.store(epoch.min(NOT_CLUSTERED - 1), Ordering::Release);
    }

    /// The node's standing in its cluster (CLUSTER, saying this store's epoch); none for a
    /// server that runs alone.
    pub fn node_status(&self) -> Result<Option<NodeStatus>, StoreError> {
        let epoch = match self.cluster_epoch.load(Ordering::Acquire) {
            NOT_CLUSTERED => 0,
            e => e,
        };
        match self.control(Request::Cluster { epoch }, "cluster")? {
            Response::Cluster(status) => Ok(status),
            other => Err(unexpected("cluster", &other)),
        }
    }

    /// Leads or joins the single-flight fill of `key` (FILL_BEGIN; the caller needs the write
    /// right on it). A leader computes the block, PUTs it and calls
    /// [`finish_fill`](Self::finish_fill); a joiner waits with [`wait_fill`](Self::wait_fill).
    pub fn begin_fill(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
    ) -> Result<Result<FillStart, FillRefused>, StoreError> {
        match self.call(caller, Request::FillBegin { key: Box::new(key.clone()) }, "fill")? {
            Response::FillBegin(begun) => Ok(begun),
            other => Err(unexpected("fill", &other)),
        }
    }

    /// The leader's outcome of its fill (FILL_FINISH); answers how the fill stands after it.
    pub fn finish_fill(
        &self,
        caller: &Caller,
        lease: &FillLease,
        outcome: FillOutcome,
    ) -> Result<FillNotice, StoreError> {
        let stored = outcome == FillOutcome::Stored;
        match self.call(caller, Request::FillFinish { lease: *lease, stored }, "fill")? {
            Response::FillFinish(notice) => Ok(notice),
            other => Err(unexpected("fill", &other)),
        }
    }

    /// The fill's outcome, the server waiting up to `wait` while it is pending (FILL_WAIT); the
    /// wait is kept a second short of this store's request deadline.
    pub fn wait_fill(
        &self,
        caller: &Caller,
        ticket: &FillTicket,
        wait: Duration,
    ) -> Result<FillNotice, StoreError> {
        let most = self.config.deadline.saturating_sub(Duration::from_secs(1));
        let wait_ms = u64::try_from(wait.min(most).as_millis()).unwrap_or(u64::MAX);
        match self.call(caller, Request::FillWait { ticket: *ticket, wait_ms }, "fill")? {
            Response::FillWait(notice) => Ok(notice),
            other => Err(unexpected("fill", &other)),
        }
    }

    /// Removes every committed block of `scope` from the server (PURGE; the caller needs the
    /// write right on the scope's tenant): one request per [`PURGE_BLOCKS_MAX`] blocks, while
    /// the server says more may remain and the last request removed some, at most
    /// [`PURGE_ROUNDS_MAX`] requests. Answers the blocks removed and the busy answers (a
    /// reader or writer held the block; summed over the requests), and `more` when the last
    /// request still left some of the scope.
    ///
    /// [`PURGE_BLOCKS_MAX`]: gpucache_dataplane::store::PURGE_BLOCKS_MAX
    pub fn purge(&self, caller: &Caller, scope: &PurgeScope) -> Result<Purged, StoreError> {
        let mut total = Purged::default();
        for _ in 0..PURGE_ROUNDS_MAX {
            let request = Request::Purge { scope: Box::new(scope.clone()) };
            let round = match self.call(caller, request, "purge")? {
                Response::Purge(answer) => answer?,
                other => return Err(unexpected("purge", &other)),
            };
            total.removed += round.removed;
            total.busy += round.busy;
            total.more = round.more;
            if !round.more || round.removed == 0 {
                break;
            }
        }
        Ok(total)
    }

    /// Says the cluster epoch on `conn` when it has not said the current one yet.
    pub(super) fn declare(
        &self,
        conn: &mut Conn,
        operation: &'static str,
    ) -> Result<(), StoreError> {
        let epoch = self.cluster_epoch.load(Ordering::Acquire);
        if epoch == NOT_CLUSTERED || conn.declared == Some(epoch) {
            return Ok(());
        }
        let frame = self.exchange_with(conn, &Request::Cluster { epoch }, operation, None)?;
        match Response::from_frame(&frame).map_err(|e| transport(operation, e))? {
            Response::Cluster(Some(_)) => {
                conn.declared = Some(epoch);
                Ok(())
            }
            Response::Cluster(None) => Err(StoreError::Backend {
                operation,
                detail: "the server runs alone, not as a node of a cluster".into(),
                retirement: Retirement::Retired,
            }),
            other => Err(unexpected(operation, &other)),
        }
    }

    /// The server's limits (LIMITS, as the control identity). A server that predates the op
    /// answers `UnknownOp`: it states none.
    pub fn limits(&self) -> Result<ServerLimits, StoreError> {
        match self.control(Request::Limits, "limits")? {
            Response::Limits(l) => Ok(l),
            Response::Error(WireError::UnknownOp { .. }) => Ok(ServerLimits::default()),
            other => Err(unexpected("limits", &other)),
        }
    }

    /// The server's store's own view of whether it can serve (CONDITION, as the control
    /// identity): its last I/O failure and its free space. A server that predates the op
    /// answers `UnknownOp`: it says nothing ([`StoreCondition::default`]).
    pub fn server_condition(&self) -> Result<StoreCondition, StoreError> {
        match self.control(Request::Condition, "condition")? {
            Response::Condition(c) => Ok(c),
            Response::Error(WireError::UnknownOp { .. }) => Ok(StoreCondition::default()),
            other => Err(unexpected("condition", &other)),
        }
    }

    pub(super) fn remote_info(&self) -> Option<&RemoteInfo> {
        if let Some(i) = self.info.get() {
            return Some(i);
        }
        match self.control(Request::Info, "info") {
            Ok(Response::Info(i)) => Some(self.info.get_or_init(|| i)),
            _ => None,
        }
    }
}
