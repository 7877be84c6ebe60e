//! [`Etcd`]: the few etcd v3 calls the coordinator makes, over gRPC.
//!
//! The gRPC stubs in `etcdserverpb.rs` are generated from `cluster/proto/etcd.proto` and
//! checked in (the `etcd_stubs` test regenerates them and fails on any difference), so building
//! this crate runs no protobuf compiler. Calls are spread over every endpoint given; one that
//! fails comes back as a [`tonic::Status`], which [`transient`] sorts into worth another try or
//! not.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::{Channel, Endpoint};

/// The generated messages and clients (see the module documentation).
#[allow(
    missing_debug_implementations,
    unreachable_pub,
    clippy::all,
    clippy::cast_possible_truncation,
    rust_2018_idioms
)]
pub(crate) mod pb {
    include!("etcdserverpb.rs");
}

use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::kv_client::KvClient;
use pb::lease_client::LeaseClient;
use pb::{
    Compare, KeyValue, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseRevokeRequest, PutRequest, PutResponse, RangeRequest, RequestOp, TxnRequest, TxnResponse,
    request_op,
};

/// Renewals a lease's keep-alive stream holds before the caller's next one waits: renewals are
/// sent one at a time, each waiting for its answer, so one slot is enough.
const KEEP_ALIVE_QUEUE_MAX: usize = 1;

/// gRPC status codes worth another try: UNKNOWN (a connection reset mid-call), CANCELLED (the
/// channel's own per-call timeout ran out), DEADLINE_EXCEEDED, UNAVAILABLE (no endpoint
/// answered, or the member lost its leader).
const TRANSIENT_CODES: [tonic::Code; 4] = [
    tonic::Code::Unknown,
    tonic::Code::Cancelled,
    tonic::Code::DeadlineExceeded,
    tonic::Code::Unavailable,
];

/// Whether a failed call may succeed when tried again (perhaps on another endpoint).
pub(crate) fn transient(status: &tonic::Status) -> bool {
    TRANSIENT_CODES.contains(&status.code())
}

/// A client of one etcd cluster: cheap to clone, every clone shares the connections.
#[derive(Debug, Clone)]
pub(crate) struct Etcd {
    kv: KvClient<Channel>,
    lease: LeaseClient<Channel>,
}

/// The renewing side of a lease's keep-alive stream and its answers.
#[derive(Debug)]
pub(crate) struct LeaseKeeper {
    id: i64,
    requests: mpsc::Sender<LeaseKeepAliveRequest>,
    answers: Streaming<LeaseKeepAliveResponse>,
}

impl LeaseKeeper {
    /// Renews the lease once; returns the seconds it has left (0 or less: etcd no longer knows
    /// it), or `None` when the stream ended.
    pub(crate) async fn renew(&mut self) -> Result<Option<i64>, tonic::Status> {
        self.requests
            .send(LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|_| tonic::Status::unavailable("the lease keep-alive stream closed"))?;
        Ok(self.answers.message().await?.map(|a| a.ttl))
    }
}

/// The end of the range of every key that starts with `prefix` (etcd's "range_end"): the prefix
/// with its last byte below 0xff incremented and what follows it dropped; `[0]` (every key)
/// when there is no such byte.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&b| b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

impl Etcd {
    /// A client spreading its calls over `endpoints` (etcd client URLs). Connections are made
    /// lazily, each within `timeout`; each call's answer is awaited for at most `timeout`, and
    /// an idle connection is probed every `timeout` and dropped when a probe goes unanswered
    /// as long. Must be called inside a tokio runtime.
    pub(crate) fn connect(endpoints: &[String], timeout: Duration) -> Result<Self, String> {
        if endpoints.is_empty() {
            return Err("no endpoints".to_owned());
        }
        let endpoints = endpoints
            .iter()
            .map(|url| {
                Endpoint::from_shared(url.clone())
                    .map(|e| {
                        e.connect_timeout(timeout)
                            .timeout(timeout)
                            .http2_keep_alive_interval(timeout)
                            .keep_alive_timeout(timeout)
                    })
                    .map_err(|e| format!("{url}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let channel = Channel::balance_list(endpoints.into_iter());
        Ok(Self { kv: KvClient::new(channel.clone()), lease: LeaseClient::new(channel) })
    }

    /// The value and revisions of `key`, when it exists.
    pub(crate) async fn get(&mut self, key: &str) -> Result<Option<KeyValue>, tonic::Status> {
        let request = RangeRequest { key: key.as_bytes().to_vec(), ..Default::default() };
        Ok(self.kv.range(request).await?.into_inner().kvs.into_iter().next())
    }

    /// Every key that starts with `prefix`, in key order.
    pub(crate) async fn get_prefix(
        &mut self,
        prefix: &str,
    ) -> Result<Vec<KeyValue>, tonic::Status> {
        let request = RangeRequest {
            key: prefix.as_bytes().to_vec(),
            range_end: prefix_end(prefix.as_bytes()),
            limit: 0,
        };
        Ok(self.kv.range(request).await?.into_inner().kvs)
    }

    /// Writes `key` under `lease` (0: none); returns etcd's revision after the write.
    pub(crate) async fn put(
        &mut self,
        key: &str,
        value: Vec<u8>,
        lease: i64,
    ) -> Result<i64, tonic::Status> {
        let request = PutRequest { key: key.as_bytes().to_vec(), value, lease };
        let answer: PutResponse = self.kv.put(request).await?.into_inner();
        Ok(answer.header.map_or(0, |h| h.revision))
    }

    /// Writes `key` (no lease) only if it is still at `mod_revision` (0: only if it does not
    /// exist); returns whether it was written.
    pub(crate) async fn put_if_revision(
        &mut self,
        key: &str,
        value: Vec<u8>,
        mod_revision: i64,
    ) -> Result<bool, tonic::Status> {
        // An absent key has version 0; a present one has a modification revision.
        let (target, target_union) = if mod_revision == 0 {
            (CompareTarget::Version, TargetUnion::Version(0))
        } else {
            (CompareTarget::Mod, TargetUnion::ModRevision(mod_revision))
        };
        let request = TxnRequest {
            compare: vec![Compare {
                result: CompareResult::Equal as i32,
                target: target as i32,
                key: key.as_bytes().to_vec(),
                target_union: Some(target_union),
            }],
            success: vec![RequestOp {
                request: Some(request_op::Request::RequestPut(PutRequest {
                    key: key.as_bytes().to_vec(),
                    value,
                    lease: 0,
                })),
            }],
            failure: Vec::new(),
        };
        let answer: TxnResponse = self.kv.txn(request).await?.into_inner();
        Ok(answer.succeeded)
    }

    /// A new lease living `ttl_s` seconds without renewal; returns its ID.
    pub(crate) async fn lease_grant(&mut self, ttl_s: i64) -> Result<i64, tonic::Status> {
        let answer = self.lease.lease_grant(LeaseGrantRequest { ttl: ttl_s, id: 0 }).await?;
        let answer = answer.into_inner();
        if !answer.error.is_empty() {
            return Err(tonic::Status::failed_precondition(answer.error));
        }
        Ok(answer.id)
    }

    /// Ends lease `id` now, deleting every key written under it.
    pub(crate) async fn lease_revoke(&mut self, id: i64) -> Result<(), tonic::Status> {
        self.lease.lease_revoke(LeaseRevokeRequest { id }).await.map(drop)
    }

    /// Opens a keep-alive stream for lease `id` and renews the lease once through it; returns
    /// the stream and what that renewal answered (see [`LeaseKeeper::renew`]).
    ///
    /// The first renewal is queued before the call is made: etcd sends the stream's response
    /// headers only with its first answer, so a stream opened empty would wait for them forever.
    pub(crate) async fn lease_keep_alive(
        &mut self,
        id: i64,
    ) -> Result<(LeaseKeeper, Option<i64>), tonic::Status> {
        let (requests, queue) = mpsc::channel(KEEP_ALIVE_QUEUE_MAX);
        requests.try_send(LeaseKeepAliveRequest { id }).map_err(|_| {
            tonic::Status::internal("a new keep-alive queue refused its first renewal")
        })?;
        let mut answers =
            self.lease.lease_keep_alive(ReceiverStream::new(queue)).await?.into_inner();
        let first = answers.message().await?.map(|a| a.ttl);
        Ok((LeaseKeeper { id, requests, answers }, first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_bounds_exactly_the_keys_with_the_prefix() {
        assert_eq!(prefix_end(b"/gpucache/a/members/"), b"/gpucache/a/members0".to_vec());
        assert_eq!(prefix_end(b"a\xff\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
        // Every key with the prefix sorts below the end, and the next key without it does not.
        let prefix = b"/p/".to_vec();
        let end = prefix_end(&prefix);
        for key in [b"/p/".to_vec(), b"/p/\xff\xff".to_vec(), b"/p/zzz".to_vec()] {
            assert!(key >= prefix && key < end, "{key:?}");
        }
        assert!(b"/p0".to_vec() >= end);
    }

    #[test]
    fn only_unavailable_deadline_cancelled_and_unknown_are_tried_again() {
        assert!(transient(&tonic::Status::unavailable("x")));
        assert!(transient(&tonic::Status::cancelled("x")));
        assert!(transient(&tonic::Status::deadline_exceeded("x")));
        assert!(transient(&tonic::Status::unknown("x")));
        assert!(!transient(&tonic::Status::invalid_argument("x")));
        assert!(!transient(&tonic::Status::permission_denied("x")));
        assert!(!transient(&tonic::Status::failed_precondition("x")));
    }

    /// One etcd member on loopback in a temporary directory, stopped by its PID on drop; None
    /// (the test skips) when etcd is not installed, unless GPUCACHE_REQUIRE_ETCD=1.
    struct OneEtcd {
        child: std::process::Child,
        url: String,
        _dir: tempfile::TempDir,
    }

    impl Drop for OneEtcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn etcd() -> Option<OneEtcd> {
        if std::process::Command::new("etcd").arg("--version").output().is_err() {
            assert!(
                std::env::var("GPUCACHE_REQUIRE_ETCD").as_deref() != Ok("1"),
                "etcd is required (GPUCACHE_REQUIRE_ETCD=1): scripts/setup.sh etcd"
            );
            eprintln!("skipped: no etcd here (scripts/setup.sh etcd installs it)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let url = format!("http://127.0.0.1:{}", free_port());
        let peer = format!("http://127.0.0.1:{}", free_port());
        let child = std::process::Command::new("etcd")
            .args(["--name", "e0", "--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("e0={peer}")])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn etcd");
        Some(OneEtcd { child, url, _dir: dir })
    }

    /// Liveness bound for a call to a local etcd that has started.
    const ANSWER: Duration = Duration::from_secs(30);

    #[test]
    fn a_lease_is_renewed_through_its_keep_alive_stream_until_revoked() {
        let Some(server) = etcd() else { return };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let mut c =
                Etcd::connect(std::slice::from_ref(&server.url), Duration::from_secs(2)).unwrap();
            // etcd takes a moment to answer after it starts.
            let start = std::time::Instant::now();
            let lease = loop {
                match c.lease_grant(30).await {
                    Ok(id) => break id,
                    Err(e) => {
                        assert!(start.elapsed() < ANSWER, "etcd never answered: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            };
            // Opening the stream renews once (etcd answers a stream only after its first
            // request), and each later renewal is answered on it.
            let (mut keeper, first) = tokio::time::timeout(ANSWER, c.lease_keep_alive(lease))
                .await
                .expect("the keep-alive stream opens")
                .expect("etcd renews the lease");
            assert!(first.is_some_and(|ttl| ttl > 0), "{first:?}");
            for _ in 0..3 {
                let ttl = tokio::time::timeout(ANSWER, keeper.renew()).await.unwrap().unwrap();
                assert!(ttl.is_some_and(|t| t > 0), "{ttl:?}");
            }
            // Keys under the lease, and a compare-and-put on one.
            let revision = c.put("/t/k", b"v1".to_vec(), lease).await.unwrap();
            assert!(revision > 0);
            let kv = c.get("/t/k").await.unwrap().expect("written");
            assert_eq!((kv.value.as_slice(), kv.lease), (&b"v1"[..], lease));
            assert!(!c.put_if_revision("/t/k", b"v2".to_vec(), 0).await.unwrap());
            assert!(c.put_if_revision("/t/k", b"v2".to_vec(), kv.mod_revision).await.unwrap());
            assert!(c.put_if_revision("/t/new", b"n".to_vec(), 0).await.unwrap());
            c.put("/t/leased", b"l".to_vec(), lease).await.unwrap();
            c.put("/u/other", b"o".to_vec(), 0).await.unwrap();
            let keys: Vec<Vec<u8>> =
                c.get_prefix("/t/").await.unwrap().into_iter().map(|kv| kv.key).collect();
            assert_eq!(keys, vec![b"/t/k".to_vec(), b"/t/leased".to_vec(), b"/t/new".to_vec()]);
            // Revoked: the keys under it go (a compare-and-put wrote "/t/k" again without
            // one), and a renewal says it has no time left.
            c.lease_revoke(lease).await.unwrap();
            assert!(c.get("/t/leased").await.unwrap().is_none());
            assert!(c.get("/t/k").await.unwrap().is_some());
            let ttl = tokio::time::timeout(ANSWER, keeper.renew()).await.unwrap().unwrap();
            assert!(ttl.is_some_and(|t| t <= 0), "{ttl:?}");
        });
    }

    #[test]
    fn bad_endpoints_are_refused_at_connect() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _in = runtime.enter();
        assert!(Etcd::connect(&[], Duration::from_secs(1)).is_err());
        let e = Etcd::connect(&["not a url".to_owned()], Duration::from_secs(1)).unwrap_err();
        assert!(e.contains("not a url"), "{e}");
    }
}
