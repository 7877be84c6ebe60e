//! [`Coordinator`]: the cluster's one shared record, kept in etcd.
//!
//! etcd holds two things per cluster, under `/gpucache/<cluster>/`: `view`, the
//! [`ClusterView`] every client and node routes by, and `members/<node>`, each node's liveness
//! record, written under the node's lease (etcd deletes it when the lease lapses). It never
//! holds anything per block. A change of the view is a transaction that compares the view's
//! revision with the one the change was computed from, so concurrent changes never both
//! apply: the loser reads the new view and computes its change again.
//!
//! The calls block the calling thread on a small runtime of their own; each has a deadline
//! and is retried while etcd answers that it is unavailable (a member died, a leader is being
//! elected).

use std::future::Future;
use std::time::{Duration, Instant};

use gpucache_dataplane::shard::{ClusterView, ControlError, NodeId, ViewMember};

use crate::changes::{self, Change};
use crate::etcd::{Etcd, transient};
use crate::record::{decode_member, decode_view, encode_member, encode_view};

/// A call to etcd gives up after this long unless configured otherwise.
pub const REQUEST_TIMEOUT_MS_DEFAULT: u64 = 2_000;
/// A node's registration lapses this long after its last renewal unless configured otherwise.
pub const LEASE_TTL_S_DEFAULT: u64 = 5;
/// Times a view change is computed again after losing a race with another change.
pub const CHANGE_ATTEMPTS_MAX: usize = 32;
/// Members a view may list.
pub const MEMBERS_MAX: usize = 4_096;
/// The pause before a call is tried again after a transient failure; it doubles each time,
/// up to [`RETRY_PAUSE_MS_MAX`], within the call's deadline.
pub const RETRY_PAUSE_MS_FIRST: u64 = 20;
pub const RETRY_PAUSE_MS_MAX: u64 = 200;

/// Where the cluster's record lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// etcd client URLs (`http://127.0.0.1:2379`), every member of the etcd cluster.
    pub endpoints: Vec<String>,
    /// The cluster's name: its records sit under `/gpucache/<cluster>/`.
    pub cluster: String,
    pub request_timeout_ms: u64,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>, cluster: impl Into<String>) -> Self {
        Self { endpoints, cluster: cluster.into(), request_timeout_ms: REQUEST_TIMEOUT_MS_DEFAULT }
    }

    fn prefix(&self) -> String {
        format!("/gpucache/{}/", self.cluster)
    }

    pub(crate) fn view_key(&self) -> String {
        format!("{}view", self.prefix())
    }

    pub(crate) fn members_prefix(&self) -> String {
        format!("{}members/", self.prefix())
    }

    pub(crate) fn member_key(&self, node: NodeId) -> String {
        format!("{}{:020}", self.members_prefix(), node.0)
    }

    pub(crate) fn applied_prefix(&self) -> String {
        format!("{}applied/", self.prefix())
    }

    pub(crate) fn applied_key(&self, node: NodeId) -> String {
        format!("{}{:020}", self.applied_prefix(), node.0)
    }
}

/// What went wrong talking to the cluster's record.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("etcd at {endpoints:?}: {detail}")]
    Etcd { endpoints: Vec<String>, detail: String },
    #[error("etcd did not answer {what} within {waited:?}")]
    Deadline { what: &'static str, waited: Duration },
    #[error("the cluster record {key} is not readable: {detail}")]
    Record { key: String, detail: String },
    #[error(transparent)]
    Refused(#[from] ControlError),
    #[error("the view would list {members} members; the limit is {max}")]
    TooManyMembers { members: usize, max: usize },
    #[error("the view changed under {attempts} attempts in a row; try again")]
    Contended { attempts: usize },
    #[error("cannot start the etcd client runtime: {0}")]
    Runtime(std::io::Error),
}

/// The cluster's record in etcd (see the module documentation).
pub struct Coordinator {
    runtime: tokio::runtime::Runtime,
    client: Etcd,
    config: EtcdConfig,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Connects to etcd (lazily: the first call finds out whether it answers).
    pub fn connect(config: EtcdConfig) -> Result<Self, ClusterError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gpucache-etcd")
            .enable_all()
            .build()
            .map_err(ClusterError::Runtime)?;
        let timeout = Duration::from_millis(config.request_timeout_ms);
        let client = {
            let _in_runtime = runtime.enter();
            Etcd::connect(&config.endpoints, timeout).map_err(|detail| ClusterError::Etcd {
                endpoints: config.endpoints.clone(),
                detail,
            })?
        };
        Ok(Self { runtime, client, config })
    }

    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    pub(crate) fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }

    /// Runs one etcd call to completion, again while it fails transiently, until the request
    /// deadline.
    pub(crate) fn call<T, F, Fut>(&self, what: &'static str, f: F) -> Result<T, ClusterError>
    where
        F: FnMut(Etcd) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        self.runtime.block_on(self.call_async(what, f))
    }

    pub(crate) async fn call_async<T, F, Fut>(
        &self,
        what: &'static str,
        mut f: F,
    ) -> Result<T, ClusterError>
    where
        F: FnMut(Etcd) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let budget = Duration::from_millis(self.config.request_timeout_ms);
        let start = Instant::now();
        let mut pause = Duration::from_millis(RETRY_PAUSE_MS_FIRST);
        loop {
            let left = budget.saturating_sub(start.elapsed());
            let error = match tokio::time::timeout(left, f(self.client.clone())).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => e,
                Err(_) => return Err(ClusterError::Deadline { what, waited: budget }),
            };
            if !transient(&error) || start.elapsed() + pause >= budget {
                return Err(ClusterError::Etcd {
                    endpoints: self.config.endpoints.clone(),
                    detail: format!("{what}: {error}"),
                });
            }
            // Another endpoint may answer: the client spreads calls over them.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(RETRY_PAUSE_MS_MAX));
        }
    }

    /// The view and its revision (0 and an empty view at epoch 0 when none was written yet).
    pub fn view(&self) -> Result<(ClusterView, i64), ClusterError> {
        self.runtime.block_on(self.view_async())
    }

    pub(crate) async fn view_async(&self) -> Result<(ClusterView, i64), ClusterError> {
        let key = self.config.view_key();
        let got = self
            .call_async("get view", |mut c| {
                let key = key.clone();
                async move { c.get(&key).await }
            })
            .await?;
        match got {
            None => Ok((ClusterView::default(), 0)),
            Some(kv) => decode_view(&kv.value)
                .map(|v| (v, kv.mod_revision))
                .map_err(|detail| ClusterError::Record { key, detail }),
        }
    }

    /// The members holding a live registration now.
    pub fn live_members(&self) -> Result<Vec<ViewMember>, ClusterError> {
        self.runtime.block_on(self.live_members_async())
    }

    pub(crate) async fn live_members_async(&self) -> Result<Vec<ViewMember>, ClusterError> {
        let prefix = self.config.members_prefix();
        let got = self
            .call_async("get members", |mut c| {
                let prefix = prefix.clone();
                async move { c.get_prefix(&prefix).await }
            })
            .await?;
        got.iter()
            .map(|kv| {
                decode_member(&kv.value).map_err(|detail| ClusterError::Record {
                    key: String::from_utf8_lossy(&kv.key).into_owned(),
                    detail,
                })
            })
            .collect()
    }

    /// Applies `change` to the current view with a compare-and-swap on its revision; computes
    /// it again from the new view when another change won the race. Returns the view that
    /// stands afterwards (the current one when the change changed nothing).
    pub fn change(
        &self,
        change: impl FnMut(&ClusterView) -> Change,
    ) -> Result<ClusterView, ClusterError> {
        self.runtime.block_on(self.change_async(change))
    }

    pub(crate) async fn change_async(
        &self,
        mut change: impl FnMut(&ClusterView) -> Change,
    ) -> Result<ClusterView, ClusterError> {
        let key = self.config.view_key();
        for _ in 0..CHANGE_ATTEMPTS_MAX {
            let (view, revision) = self.view_async().await?;
            let Some(next) = change(&view)? else { return Ok(view) };
            if next.members.len() > MEMBERS_MAX {
                return Err(ClusterError::TooManyMembers {
                    members: next.members.len(),
                    max: MEMBERS_MAX,
                });
            }
            let bytes = encode_view(&next);
            // Written only if the view is still at the revision read (absent when 0).
            let swapped = self
                .call_async("change view", |mut c| {
                    let (key, bytes) = (key.clone(), bytes.clone());
                    async move { c.put_if_revision(&key, bytes, revision).await }
                })
                .await?;
            if swapped {
                tracing::info!(
                    epoch = next.epoch,
                    members = next.members.len(),
                    "cluster view changed"
                );
                return Ok(next);
            }
        }
        Err(ClusterError::Contended { attempts: CHANGE_ATTEMPTS_MAX })
    }

    /// The epoch every member of `live` (the members holding a live registration) has
    /// applied, from the applied records in etcd, by [`changes::settled`].
    pub(crate) async fn settled_async(&self, live: &[ViewMember]) -> Result<u64, ClusterError> {
        let prefix = self.config.applied_prefix();
        let got = self
            .call_async("get applied", |mut c| {
                let prefix = prefix.clone();
                async move { c.get_prefix(&prefix).await }
            })
            .await?;
        let applied: Vec<(u64, u64, u64)> = got
            .iter()
            .filter_map(|kv| {
                let node = std::str::from_utf8(&kv.key).ok()?.rsplit('/').next()?.parse().ok()?;
                let text = std::str::from_utf8(&kv.value).ok()?;
                let (life, epoch) = text.split_once(' ')?;
                Some((node, life.parse().ok()?, epoch.parse().ok()?))
            })
            .collect();
        let lives = live.iter().map(|m| (m.node, m.node_epoch));
        Ok(changes::settled(lives, |node, node_epoch| {
            applied
                .iter()
                .find(|(n, life, _)| *n == node.0 && *life == node_epoch)
                .map(|(_, _, epoch)| *epoch)
        }))
    }

    /// Says, under `lease`, that this life (`node_epoch`) of `node` applied `epoch`.
    pub(crate) async fn put_applied_async(
        &self,
        node: NodeId,
        node_epoch: u64,
        epoch: u64,
        lease: i64,
    ) -> Result<(), ClusterError> {
        let key = self.config.applied_key(node);
        let value = format!("{node_epoch} {epoch}");
        self.call_async("put applied", |mut c| {
            let (key, value) = (key.clone(), value.clone());
            async move { c.put(&key, value.into_bytes(), lease).await }
        })
        .await
        .map(drop)
    }

    /// Writes `member`'s liveness record under `lease`; returns the revision of the write
    /// (the node epoch of this registration).
    pub(crate) async fn put_member_async(
        &self,
        member: &ViewMember,
        lease: i64,
    ) -> Result<i64, ClusterError> {
        let key = self.config.member_key(member.node);
        let bytes = encode_member(member);
        self.call_async("put member", |mut c| {
            let (key, bytes) = (key.clone(), bytes.clone());
            async move { c.put(&key, bytes, lease).await }
        })
        .await
    }
}
