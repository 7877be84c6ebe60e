//! `gpucache put`, `get` and `stat`: an operator's round trip against a running service over the
//! native protocol. A plain NAME maps into the tenant's identity namespace exactly as the RESP
//! listener maps its keys, so `gpucache put NAME` and `redis-cli GET NAME` see the same block.
//!
//! With `--shm` the commands take the same-host path (docs/adr/0013): the server names its Unix
//! socket in the HELLO answer over TCP, the client shares a memfd segment with it, and payloads
//! move through the segment. `get --shm` reads into a buffer inside the segment (no copy on the
//! client before the bytes are written out). A server that offers no socket is an error, never a
//! silent fallback to TCP.
//!
//! With `--nixl` the block's bytes move over NIXL (PROTOCOL.md section 11): the command creates
//! its own NIXL agent and one registered slot, attaches to the server's agent, and READs a
//! staged block (`get`) or WRITEs a leased slot (`put`); the GPCW connection carries control
//! only. A build without the `nixl` feature, a missing `libnixl_capi.so`, or a server without
//! `[nixl] enabled` is an error naming the reason, never a silent fallback to TCP.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use gpucache_client::{ClientConfig, Credentials, LocalConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Get, Lookup, MissReason, Put, Store, StoreError};
use gpucache_service::config::{NATIVE_ADDR_DEFAULT, NIXL_SLOT_BYTES_DEFAULT, TENANT_DEFAULT};
use gpucache_service::create_only::{DIFFERENT_VALUE_TEXT, Held, compare_held};
use gpucache_service::resp::IdentityTemplate;
use gpucache_storage::host::segment::{Pages, SEGMENT_BYTES_MAX, SEGMENT_BYTES_MIN};
use gpucache_wire::{PAYLOAD_BYTES_MAX, SealAlgorithm};

/// Largest value `gpucache get` will receive.
const GET_BYTES_MAX: usize = 64 << 20;
/// The shared segment `stat --shm` maps (it moves no values).
const STAT_SEGMENT_BYTES: u64 = 64 << 20;
/// How many times `get` looks a name up again when its value was replaced by a longer one
/// between the lookup and the read.
const GET_ATTEMPTS: usize = 3;

/// Where and as whom to connect: what every client command takes.
#[derive(Debug, clap::Args)]
pub(crate) struct Connection {
    /// The native (GPCW) listener of a running `gpucache serve` (listen.native), not its RESP
    /// or metrics port.
    #[arg(long, default_value_t = NATIVE_ADDR_DEFAULT)]
    addr: SocketAddr,
    /// The tenant to act as (one of the server's [[tenants]]).
    #[arg(long, default_value = TENANT_DEFAULT)]
    tenant: String,
    /// Seconds each request may take once connected (connecting and the HELLO exchange have
    /// their own short deadline, so a wrong port fails fast).
    #[arg(long, default_value_t = 30)]
    deadline_s: u64,
    /// The tenant's key file (the same format `gpucache serve` reads); with --key-id, the
    /// session is authenticated and sealed. Without it the tenant must be open.
    #[arg(long, requires = "key_id")]
    secret_file: Option<PathBuf>,
    /// Which key of --secret-file to sign with.
    #[arg(long, requires = "secret_file")]
    key_id: Option<String>,
    /// The seal algorithm to propose: blake3 or hmac-sha256.
    #[arg(long, default_value = "blake3")]
    seal: String,
}

/// The same-host shared-memory path of `put` and `get`.
#[derive(Debug, clap::Args)]
pub(crate) struct SharedMemory {
    /// Take the same-host shared-memory path: the Unix socket the server offers over TCP, with
    /// a memfd segment shared with it. Fails when the server offers none.
    #[arg(long)]
    shm: bool,
    /// Size of the shared segment with --shm (K, M, G are binary); it bounds the value.
    #[arg(long, requires = "shm", default_value = "64M", value_parser = parse_segment)]
    shm_segment: u64,
    /// Back the segment with 2 MiB huge pages (needs vm.nr_hugepages; see docs/OPERATIONS.md).
    #[arg(long, requires = "shm")]
    huge_pages: bool,
}

impl Connection {
    /// How long each request may take once connected (at least a second).
    fn deadline(&self) -> Duration {
        Duration::from_secs(self.deadline_s.max(1))
    }
}

impl SharedMemory {
    fn segment(&self) -> Option<Segment> {
        self.shm.then_some(Segment {
            bytes: self.shm_segment,
            pages: if self.huge_pages { Pages::Huge } else { Pages::Normal },
        })
    }
}

/// The shared segment a command maps with --shm.
#[derive(Debug, Clone, Copy)]
struct Segment {
    bytes: u64,
    pages: Pages,
}

/// `gpucache put`'s connection and data path.
#[derive(Debug, clap::Args)]
pub(crate) struct PutTarget {
    #[command(flatten)]
    connection: Connection,
    #[command(flatten)]
    shm: SharedMemory,
    /// Move the value's bytes over NIXL (the server needs `[nixl] enabled = true`; this build
    /// needs the `nixl` feature and libnixl_capi.so, see docs/OPERATIONS.md).
    #[arg(long, conflicts_with = "shm")]
    nixl: bool,
}

/// `gpucache get`'s connection and data path.
#[derive(Debug, clap::Args)]
pub(crate) struct GetTarget {
    #[command(flatten)]
    connection: Connection,
    #[command(flatten)]
    shm: SharedMemory,
    /// Move the value's bytes over NIXL (the server needs `[nixl] enabled = true`; this build
    /// needs the `nixl` feature and libnixl_capi.so, see docs/OPERATIONS.md).
    #[arg(long, conflicts_with = "shm")]
    nixl: bool,
    /// With --nixl: the largest value received (this side's registered slot; the server's
    /// nixl.slot_bytes bounds it as well); the service's default slot size unless set.
    #[arg(long, requires = "nixl", default_value_t = NIXL_SLOT_BYTES_DEFAULT, value_parser = parse_nixl_slot)]
    nixl_slot_bytes: u64,
}

/// `gpucache stat`'s connection.
#[derive(Debug, clap::Args)]
pub(crate) struct StatTarget {
    #[command(flatten)]
    connection: Connection,
    /// Connect over the same-host path (the server's Unix socket, with a shared segment) and
    /// report the segment's use as well.
    #[arg(long)]
    shm: bool,
}

fn parse_nixl_slot(text: &str) -> Result<u64, String> {
    let bytes = gpucache_service::units::parse_size(text)?;
    if (1..=GET_BYTES_MAX as u64).contains(&bytes) {
        Ok(bytes)
    } else {
        Err(format!("{text:?} is outside 1..={GET_BYTES_MAX} bytes"))
    }
}

// `--nixl`: the bytes move over NIXL in `nixl_real` with the feature; `nixl_unavailable`
// refuses with the typed reason without it. Both offer the same functions.
#[cfg(feature = "nixl")]
use nixl_real as nixl;
#[cfg(not(feature = "nixl"))]
use nixl_unavailable as nixl;

/// `--nixl` with NIXL built in.
#[cfg(feature = "nixl")]
mod nixl_real {
    use std::time::Duration;

    use gpucache_client::TcpStore;
    use gpucache_dataplane::caller::Caller;
    use gpucache_dataplane::key::PhysicalKey;
    use gpucache_dataplane::store::{Get, Put};
    use gpucache_nic::nixl::{NixlClient, NixlClientConfig};
    use gpucache_storage::host::pool::{HugePagePolicy, Lock, Tier};

    /// A NIXL client over `store`, attached to the server's agent, with one slot of
    /// `slot_bytes`.
    fn client(
        deadline: Duration,
        store: TcpStore,
        caller: &Caller,
        slot_bytes: usize,
    ) -> Result<NixlClient, String> {
        let config = NixlClientConfig {
            agent_name: format!("gpucache-cli-{}", std::process::id()),
            slot_bytes: slot_bytes.max(1),
            slots: 1,
            deadline,
            huge_pages: HugePagePolicy::default().prefer(Tier::Huge2M).lock(Lock::Off),
        };
        let client = NixlClient::new(store, config).map_err(|e| format!("--nixl: {e}"))?;
        client
            .attach(caller)
            .map_err(|e| format!("--nixl: attaching to the server's agent: {e}"))?;
        Ok(client)
    }

    /// PUT over NIXL: one slot of the value's size, RESERVE_PUT, WRITE, COMMIT_PUT.
    pub(super) fn put(
        deadline: Duration,
        store: TcpStore,
        caller: &Caller,
        key: &PhysicalKey,
        data: &[u8],
    ) -> Result<Put, String> {
        let client = client(deadline, store, caller, data.len())?;
        client.put(caller, key, data, None).map_err(|e| format!("--nixl: {e}"))
    }

    /// GET over NIXL into `dst`: STAGE_GET, READ into this side's slot, verify, copy, RELEASE.
    pub(super) fn get(
        deadline: Duration,
        store: TcpStore,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, String> {
        let client = client(deadline, store, caller, dst.len())?;
        client.get(caller, key, dst).map_err(|e| format!("--nixl: {e}"))
    }
}

/// `--nixl` in a build without the feature: refused with the typed reason.
#[cfg(not(feature = "nixl"))]
mod nixl_unavailable {
    use std::time::Duration;

    use gpucache_client::TcpStore;
    use gpucache_dataplane::caller::Caller;
    use gpucache_dataplane::key::PhysicalKey;
    use gpucache_dataplane::store::{Get, Put};

    fn not_built() -> String {
        let reason = gpucache_nic::NixlUnavailable::NotBuilt;
        format!("--nixl: {}", gpucache_nic::NicError::NixlUnavailable { reason })
    }

    pub(super) fn put(
        _deadline: Duration,
        _store: TcpStore,
        _caller: &Caller,
        _key: &PhysicalKey,
        _data: &[u8],
    ) -> Result<Put, String> {
        Err(not_built())
    }

    pub(super) fn get(
        _deadline: Duration,
        _store: TcpStore,
        _caller: &Caller,
        _key: &PhysicalKey,
        _dst: &mut [u8],
    ) -> Result<Get, String> {
        Err(not_built())
    }
}

fn parse_segment(text: &str) -> Result<u64, String> {
    let bytes = gpucache_service::units::parse_size(text)?;
    if (SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&bytes) {
        Ok(bytes)
    } else {
        Err(format!("{text:?} is outside {}..={} bytes", SEGMENT_BYTES_MIN, SEGMENT_BYTES_MAX))
    }
}

/// Refuses --nixl before anything else (before connecting) when this process cannot use NIXL:
/// a build without the feature, or no loadable `libnixl_capi.so` or UCX plugin.
fn nixl_available(nixl: bool) -> Result<(), String> {
    if !nixl {
        return Ok(());
    }
    gpucache_nic::nixl::probe()
        .map(drop)
        .map_err(|reason| format!("--nixl: {}", gpucache_nic::NicError::NixlUnavailable { reason }))
}

/// A client of `target` as a new caller with `rights`, its session already open (so an
/// unreachable, busy or wrong server, or an unknown tenant, is reported before anything else
/// happens), and the tenant's namespace of plain names.
fn connect(
    target: &Connection,
    segment: Option<Segment>,
    rights: Rights,
) -> Result<(TcpStore, Caller, IdentityTemplate), String> {
    let tenant = TenantId::parse(&target.tenant).map_err(|e| format!("--tenant: {e}"))?;
    let caller = Caller::new(tenant.clone(), rights);
    let mut config = ClientConfig::new(target.addr, caller.clone());
    config.deadline = target.deadline();
    config.client_name = "gpucache-cli".into();
    if let Some(segment) = segment {
        let mut local = LocalConfig::negotiated();
        local.segment_bytes = segment.bytes;
        local.pages = segment.pages;
        config.local = Some(local);
    }
    if let (Some(path), Some(key_id)) = (&target.secret_file, &target.key_id) {
        let seal = SealAlgorithm::from_name(&target.seal)
            .ok_or_else(|| format!("--seal: {:?} is not blake3 or hmac-sha256", target.seal))?;
        let credentials = gpucache_service::auth::credentials_from_key_file(path, key_id)
            .map_err(|e| format!("--secret-file: {e}"))?;
        config = config.with_credentials(tenant.clone(), Credentials { seal, ..credentials });
    }
    let namespace = IdentityTemplate::for_tenant(&tenant).map_err(|e| e.to_string())?;
    let store = TcpStore::new(config);
    store.handshake(&caller).map_err(|e| e.to_string())?;
    Ok((store, caller, namespace))
}

fn done(result: Result<String, String>, command: &str) -> ExitCode {
    match result {
        Ok(text) => {
            if !text.is_empty() {
                eprintln!("{text}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpucache {command}: {e}");
            ExitCode::from(1)
        }
    }
}

/// The value to store: FILE, refused by its length before it is read when it exceeds `max`,
/// or at most `max + 1` bytes of standard input (one more says that it is too long).
fn read_value(file: Option<&PathBuf>, max: u64, limit: &str) -> Result<Vec<u8>, String> {
    let too_long = |what: String| format!("{what} exceed {limit} of {max} bytes");
    match file {
        Some(p) => {
            let shown = p.display();
            let len = std::fs::metadata(p).map_err(|e| format!("{shown}: {e}"))?.len();
            if len > max {
                return Err(too_long(format!("{shown}: its {len} bytes")));
            }
            let mut data = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
            std::fs::File::open(p)
                .and_then(|f| f.take(max + 1).read_to_end(&mut data))
                .map_err(|e| format!("{shown}: {e}"))?;
            if data.len() as u64 > max {
                // It grew since its length was read.
                return Err(too_long(format!("{shown}: more than {max} bytes")));
            }
            Ok(data)
        }
        None => {
            let mut data = Vec::new();
            std::io::stdin()
                .lock()
                .take(max + 1)
                .read_to_end(&mut data)
                .map_err(|e| format!("stdin: {e}"))?;
            if data.len() as u64 > max {
                return Err(too_long("standard input: more than that many bytes".into()));
            }
            Ok(data)
        }
    }
}

/// Stores FILE (or standard input) under NAME. The store is create-only: a name that already
/// holds exactly these bytes is success ("already stored"), one that holds other bytes is an
/// error, as `SET` over RESP answers.
pub(crate) fn put(target: &PutTarget, name: &str, file: Option<&PathBuf>) -> ExitCode {
    let result = (|| -> Result<String, String> {
        nixl_available(target.nixl)?;
        let connection = &target.connection;
        let (store, caller, ns) = connect(connection, target.shm.segment(), Rights::READ_WRITE)?;
        let (max, limit) = match store.limits().map_err(|e| e.to_string())?.object_bytes_max {
            Some(max) => (max, "the service's object limit (limits.object_bytes_max)"),
            None => (PAYLOAD_BYTES_MAX, "the protocol's payload limit"),
        };
        let data = read_value(file, max, limit)?;
        let key = ns.key_for(name.as_bytes()).map_err(|e| e.to_string())?;
        let shared = if target.shm.shm {
            // The server reads the value straight out of the segment.
            let mut buf = store.shared_buffer(data.len()).ok_or_else(|| {
                format!(
                    "{} bytes do not fit the {}-byte shared segment; raise --shm-segment",
                    data.len(),
                    target.shm.shm_segment
                )
            })?;
            buf.copy_from_slice(&data);
            Some(buf)
        } else {
            None
        };
        let src: &[u8] = shared.as_deref().unwrap_or(&data);
        let (put, store) = if target.nixl {
            if data.is_empty() {
                return Err("--nixl: an empty value cannot be stored".into());
            }
            let put = nixl::put(connection.deadline(), store, &caller, &key, &data)?;
            // The NIXL client took the connection; the comparison below needs one.
            (put, connect(connection, None, Rights::READ_WRITE)?.0)
        } else {
            (store.put(&caller, &key, src, None).map_err(|e| e.to_string())?, store)
        };
        match put {
            Put::Committed(sum) => {
                Ok(format!("stored {} bytes (checksum {:016x})", data.len(), sum.0))
            }
            Put::AlreadyCommitted => {
                match compare_held(&store, &caller, &key, &data).map_err(|e| e.to_string())? {
                    Held::Same => Ok("already stored: the name holds this value".into()),
                    Held::Different => Err(DIFFERENT_VALUE_TEXT.into()),
                    Held::Gone => Err("the name's value was removed while it was compared with \
                                       this one; try again"
                        .into()),
                }
            }
            Put::Busy => Err("another writer holds the key; try again".into()),
            Put::Refused(r) => Err(format!("refused: {r}")),
        }
    })();
    done(result, "put")
}

/// The length of the value under `key`, or the reason there is none.
fn value_len(
    store: &TcpStore,
    caller: &Caller,
    key: &PhysicalKey,
) -> Result<Result<usize, MissReason>, String> {
    match store.lookup(caller, key).map_err(|e| e.to_string())? {
        Lookup::Hit { len } => {
            usize::try_from(len).ok().filter(|n| *n <= GET_BYTES_MAX).map(Ok).ok_or_else(|| {
                format!("the value holds {len} bytes, more than {GET_BYTES_MAX} gpucache get takes")
            })
        }
        // A one-link chain has no strict prefix, so a prefix hit cannot be this name.
        Lookup::PrefixHit { .. } => Ok(Err(MissReason::Absent)),
        Lookup::Miss(reason) => Ok(Err(reason)),
    }
}

/// Writes the value under NAME to standard output; exit code 3 on a miss. The value's length
/// is looked up first and exactly that much is asked for, so neither side prepares a buffer
/// of the largest value for a small one.
pub(crate) fn get(target: &GetTarget, name: &str) -> ExitCode {
    let result = (|| -> Result<Option<String>, String> {
        nixl_available(target.nixl)?;
        let connection = &target.connection;
        let (store, caller, ns) = connect(connection, target.shm.segment(), Rights::READ_ONLY)?;
        let key = ns.key_for(name.as_bytes()).map_err(|e| e.to_string())?;
        if target.nixl {
            let mut buf =
                vec![0u8; usize::try_from(target.nixl_slot_bytes).unwrap_or(GET_BYTES_MAX)];
            return match nixl::get(connection.deadline(), store, &caller, &key, &mut buf)? {
                Get::Hit { len, .. } => write_out(&buf, len),
                Get::Miss(reason) => Ok(Some(format!("miss: {reason:?}"))),
            };
        }
        for _ in 0..GET_ATTEMPTS {
            let len = match value_len(&store, &caller, &key)? {
                Ok(len) => len,
                Err(reason) => return Ok(Some(format!("miss: {reason:?}"))),
            };
            let mut plain;
            let mut shared;
            let buf: &mut [u8] = if target.shm.shm {
                // The server writes the value into the segment; it is written out from there.
                shared = store.shared_buffer(len).ok_or_else(|| {
                    format!(
                        "the value's {len} bytes do not fit the {}-byte shared segment; raise \
                         --shm-segment",
                        target.shm.shm_segment
                    )
                })?;
                &mut shared
            } else {
                plain = vec![0u8; len];
                &mut plain
            };
            match store.get_into(&caller, &key, buf) {
                Ok(Get::Hit { len, .. }) => return write_out(buf, len),
                Ok(Get::Miss(reason)) => return Ok(Some(format!("miss: {reason:?}"))),
                // Deleted and stored again, longer, since the lookup: look it up again.
                Err(StoreError::BufferTooSmall { .. }) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!("the value kept changing length while it was read ({GET_ATTEMPTS} tries)"))
    })();
    match result {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(miss)) => {
            eprintln!("gpucache get: {miss}");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("gpucache get: {e}");
            ExitCode::from(1)
        }
    }
}

fn write_out(buf: &[u8], len: u64) -> Result<Option<String>, String> {
    let len = usize::try_from(len).unwrap_or(0).min(buf.len());
    std::io::stdout().write_all(&buf[..len]).map_err(|e| e.to_string())?;
    Ok(None)
}

/// Prints the store's counters.
pub(crate) fn stat(target: &StatTarget) -> ExitCode {
    let result = (|| -> Result<String, String> {
        let segment =
            target.shm.then_some(Segment { bytes: STAT_SEGMENT_BYTES, pages: Pages::Normal });
        let (store, _, _) = connect(&target.connection, segment, Rights::READ_ONLY)?;
        let info = store.info();
        let epoch = store.epoch();
        if epoch.0 == 0 {
            let how = if target.shm { " over the same-host path (--shm)" } else { "" };
            return Err(format!("no answer from {}{how}", target.connection.addr));
        }
        let s = store.stats();
        let mut text = format!(
            "store: {:?} {:?}\nepoch: {}\ncommitted blocks: {}\nretained bytes: {}\nin-flight requests: {}\nregistrations: {}\nquarantined regions: {} ({} bytes)\nevictions: {}\ncorrupt dropped: {}",
            info.implementation,
            info.full_policy,
            epoch.0,
            s.committed_blocks,
            s.usage.retained_bytes,
            s.usage.inflight_requests,
            s.usage.registrations,
            s.regions.quarantined,
            s.regions.quarantined_bytes,
            s.evictions,
            s.corrupt_dropped.total()
        );
        let c = store.server_condition().map_err(|e| e.to_string())?;
        let io = match &c.io_failure {
            None => "not tracked".to_owned(),
            Some(None) => "ok".to_owned(),
            Some(Some(why)) => format!("failing: {why}"),
        };
        let free = c.free_bytes.map_or("not tracked".to_owned(), |b| b.to_string());
        text.push_str(&format!(
            "
last I/O: {io}
free bytes: {free}"
        ));
        if target.shm {
            let sh = store.shared_stats();
            text.push_str(&format!(
                "\nshared segment: {} bytes ({} free, {} quarantined); items direct {}, bounced {}; \
                 framed batches {}",
                STAT_SEGMENT_BYTES,
                sh.free_bytes,
                sh.quarantined_bytes,
                sh.direct_items,
                sh.bounced_items,
                sh.framed_batches
            ));
        }
        Ok(text)
    })();
    done(result, "stat")
}
