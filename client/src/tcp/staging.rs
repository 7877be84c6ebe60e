//! The stage calls of one-sided transfers (NIXL_ATTACH, STAGE_GET, RESERVE_PUT, COMMIT_PUT,
//! RELEASE, STAGE_STATS).

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::store::{Put, StoreError};
use gpucache_wire::staging::{StageCallError, StageId, StagedGet, StagedSlot, StagingStats};
use gpucache_wire::{GetItem, Request, Response, WireError};

use super::errors::{check_right, unexpected};
use super::tcp_store::TcpStore;

/// The stage ops (block staging for one-sided transfers, ADR 0018). The transfers themselves
/// are the caller's (`gpucache-nic`'s NIXL client): these only open, settle and count stages.
impl TcpStore {
    fn stage_call(
        &self,
        caller: &Caller,
        request: Request,
        operation: &'static str,
    ) -> Result<Response, StageCallError> {
        match self.call(caller, request, operation)? {
            Response::Error(WireError::Staging { reason, detail }) => {
                Err(StageCallError::Refused { reason, detail })
            }
            other => Ok(other),
        }
    }

    /// NIXL_ATTACH: hands the server this side's agent metadata, answers the server's.
    pub fn nixl_attach(&self, caller: &Caller, metadata: &[u8]) -> Result<Vec<u8>, StageCallError> {
        match self.stage_call(
            caller,
            Request::NixlAttach { metadata: metadata.to_vec() },
            "nixl_attach",
        )? {
            Response::NixlAttach(theirs) => Ok(theirs),
            other => Err(unexpected("nixl_attach", &other).into()),
        }
    }

    /// STAGE_GET: stages each item's block (at most [`BATCH_ITEMS_MAX`] items); `capacity` is
    /// the caller's destination size.
    ///
    /// [`BATCH_ITEMS_MAX`]: gpucache_wire::BATCH_ITEMS_MAX
    pub fn stage_get(
        &self,
        caller: &Caller,
        items: &[GetItem],
    ) -> Result<Vec<Result<StagedGet, StoreError>>, StageCallError> {
        check_right(caller, Right::Read)?;
        let n = items.len();
        match self.stage_call(caller, Request::StageGet { items: items.to_vec() }, "stage_get")? {
            Response::StageGet(answers) if answers.len() == n => Ok(answers),
            other => Err(unexpected("stage_get", &other).into()),
        }
    }

    /// RESERVE_PUT: leases an empty slot for a block of `len` bytes hashing to `checksum`.
    pub fn reserve_put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        checksum: Checksum,
        request: Option<RequestId>,
    ) -> Result<StagedSlot, StageCallError> {
        check_right(caller, Right::Write)?;
        let request = Request::ReservePut { key: Box::new(key.clone()), len, checksum, request };
        match self.stage_call(caller, request, "reserve_put")? {
            Response::ReservePut(r) => Ok(r?),
            other => Err(unexpected("reserve_put", &other).into()),
        }
    }

    /// COMMIT_PUT: the server checks and stores the stage's bytes, and returns its slot.
    pub fn commit_put(&self, caller: &Caller, stage: StageId) -> Result<Put, StageCallError> {
        check_right(caller, Right::Write)?;
        match self.stage_call(caller, Request::CommitPut { stage }, "commit_put")? {
            Response::CommitPut(r) => Ok(r?),
            other => Err(unexpected("commit_put", &other).into()),
        }
    }

    /// RELEASE: per stage, whether it was open.
    pub fn release_stages(
        &self,
        caller: &Caller,
        stages: &[StageId],
    ) -> Result<Vec<bool>, StageCallError> {
        match self.stage_call(caller, Request::Release { stages: stages.to_vec() }, "release")? {
            Response::Release(open) if open.len() == stages.len() => Ok(open),
            other => Err(unexpected("release", &other).into()),
        }
    }

    /// STAGE_STATS, as the control identity.
    pub fn stage_stats(&self) -> Result<StagingStats, StageCallError> {
        let control = self.config.control.clone();
        match self.stage_call(&control, Request::StageStats, "stage_stats")? {
            Response::StageStats(s) => Ok(s),
            other => Err(unexpected("stage_stats", &other).into()),
        }
    }
}
