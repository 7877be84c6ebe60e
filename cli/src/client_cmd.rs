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

use gpucache_backends::resp::IdentityTemplate;
use gpucache_backends::shm::{Pages, SEGMENT_BYTES_MAX, SEGMENT_BYTES_MIN};
use gpucache_backends::tcp::proto::SealAlgorithm;
use gpucache_backends::tcp::{ClientConfig, Credentials, LocalConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::store::{Get, Put, Store};

/// Largest value `gpucache get` will receive.
const GET_BYTES_MAX: usize = 64 << 20;

/// Where and as whom to connect.
#[derive(Debug, clap::Args)]
pub(crate) struct Target {
    /// The native listener of a running `gpucache serve`.
    #[arg(long, default_value = "127.0.0.1:7470")]
    addr: SocketAddr,
    /// The tenant to act as.
    #[arg(long, default_value = "default")]
    tenant: String,
    /// Seconds each request may take.
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
    /// Take the same-host shared-memory path: the Unix socket the server offers over TCP, with
    /// a memfd segment shared with it. Fails when the server offers none.
    #[arg(long)]
    shm: bool,
    /// Size of the shared segment with --shm (K, M, G are binary); `get --shm` reads values up
    /// to this size.
    #[arg(long, requires = "shm", default_value = "64M", value_parser = parse_segment)]
    shm_segment: u64,
    /// Back the segment with 2 MiB huge pages (needs vm.nr_hugepages; see docs/OPERATIONS.md).
    #[arg(long, requires = "shm")]
    huge_pages: bool,
    /// Move the block's bytes over NIXL (the server needs `[nixl] enabled = true`; this build
    /// needs the `nixl` feature and libnixl_capi.so, see docs/OPERATIONS.md).
    #[arg(long, conflicts_with = "shm")]
    nixl: bool,
    /// With --nixl: the largest value `get --nixl` receives (this side's registered slot; the
    /// server's nixl.slot_bytes bounds it as well).
    #[arg(long, requires = "nixl", default_value = "4M", value_parser = parse_nixl_slot)]
    nixl_slot_bytes: u64,
}

fn parse_nixl_slot(text: &str) -> Result<u64, String> {
    let bytes = crate::units::parse_size(text)?;
    if (1..=GET_BYTES_MAX as u64).contains(&bytes) {
        Ok(bytes)
    } else {
        Err(format!("{text:?} is outside 1..={GET_BYTES_MAX} bytes"))
    }
}

/// A NIXL client over `store`, attached to the server's agent, with one slot of `slot_bytes`.
#[cfg(feature = "nixl")]
fn nixl_client(
    target: &Target,
    store: TcpStore,
    caller: &Caller,
    slot_bytes: usize,
) -> Result<gpucache_nic::nixl::NixlClient, String> {
    use gpucache_backends::pool::{HugePagePolicy, Lock, Tier};
    use gpucache_nic::nixl::{NixlClient, NixlClientConfig};
    let config = NixlClientConfig {
        agent_name: format!("gpucache-cli-{}", std::process::id()),
        slot_bytes: slot_bytes.max(1),
        slots: 1,
        deadline: Duration::from_secs(target.deadline_s.max(1)),
        huge_pages: HugePagePolicy::default().prefer(Tier::Huge2M).lock(Lock::Off),
    };
    let client = NixlClient::new(store, config).map_err(|e| format!("--nixl: {e}"))?;
    client.attach(caller).map_err(|e| format!("--nixl: attaching to the server's agent: {e}"))?;
    Ok(client)
}

/// Without the feature `--nixl` is refused with the typed reason.
#[cfg(not(feature = "nixl"))]
fn nixl_unavailable() -> String {
    let reason = gpucache_nic::NixlUnavailable::NotBuilt;
    format!("--nixl: {}", gpucache_nic::NicError::NixlUnavailable { reason })
}

/// PUT over NIXL: one slot of the value's size, RESERVE_PUT, WRITE, COMMIT_PUT.
fn nixl_put(
    target: &Target,
    store: TcpStore,
    caller: &Caller,
    key: &gpucache_dataplane::key::PhysicalKey,
    data: &[u8],
) -> Result<Put, String> {
    #[cfg(feature = "nixl")]
    {
        let client = nixl_client(target, store, caller, data.len())?;
        client.put(caller, key, data, None).map_err(|e| format!("--nixl: {e}"))
    }
    #[cfg(not(feature = "nixl"))]
    {
        let _ = (target, store, caller, key, data);
        Err(nixl_unavailable())
    }
}

/// GET over NIXL into `dst`: STAGE_GET, READ into this side's slot, verify, copy, RELEASE.
fn nixl_get(
    target: &Target,
    store: TcpStore,
    caller: &Caller,
    key: &gpucache_dataplane::key::PhysicalKey,
    dst: &mut [u8],
) -> Result<Get, String> {
    #[cfg(feature = "nixl")]
    {
        let client = nixl_client(target, store, caller, dst.len())?;
        client.get(caller, key, dst).map_err(|e| format!("--nixl: {e}"))
    }
    #[cfg(not(feature = "nixl"))]
    {
        let _ = (target, store, caller, key, dst);
        Err(nixl_unavailable())
    }
}

fn parse_segment(text: &str) -> Result<u64, String> {
    let bytes = crate::units::parse_size(text)?;
    if (SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&bytes) {
        Ok(bytes)
    } else {
        Err(format!("{text:?} is outside {}..={} bytes", SEGMENT_BYTES_MIN, SEGMENT_BYTES_MAX))
    }
}

fn connect(
    target: &Target,
    rights: Rights,
) -> Result<(TcpStore, Caller, IdentityTemplate), String> {
    let tenant = TenantId::parse(&target.tenant).map_err(|e| format!("--tenant: {e}"))?;
    let caller = Caller::new(tenant.clone(), rights);
    let mut config = ClientConfig::new(target.addr, caller.clone());
    config.deadline = Duration::from_secs(target.deadline_s.max(1));
    config.client_name = "gpucache-cli".into();
    if target.shm {
        let mut local = LocalConfig::negotiated();
        local.segment_bytes = target.shm_segment;
        local.pages = if target.huge_pages { Pages::Huge } else { Pages::Normal };
        config.local = Some(local);
    }
    if let (Some(path), Some(key_id)) = (&target.secret_file, &target.key_id) {
        let seal = SealAlgorithm::from_name(&target.seal)
            .ok_or_else(|| format!("--seal: {:?} is not blake3 or hmac-sha256", target.seal))?;
        let credentials =
            Credentials::from_key_file(path, key_id).map_err(|e| format!("--secret-file: {e}"))?;
        config = config.with_credentials(tenant.clone(), Credentials { seal, ..credentials });
    }
    let namespace = IdentityTemplate::for_tenant(&tenant).map_err(|e| e.to_string())?;
    Ok((TcpStore::new(config), caller, namespace))
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

/// Stores FILE (or standard input) under NAME.
pub(crate) fn put(target: &Target, name: &str, file: Option<&PathBuf>) -> ExitCode {
    let result = (|| -> Result<String, String> {
        let mut data = Vec::new();
        match file {
            Some(p) => data = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?,
            None => {
                std::io::stdin().read_to_end(&mut data).map_err(|e| format!("stdin: {e}"))?;
            }
        }
        let (store, caller, ns) = connect(target, Rights::READ_WRITE)?;
        let key = ns.key_for(name.as_bytes()).map_err(|e| e.to_string())?;
        let shared = if target.shm {
            // The server reads the value straight out of the segment.
            let mut buf = store.shared_buffer(data.len()).ok_or_else(|| {
                format!(
                    "{} bytes do not fit the {}-byte shared segment; raise --shm-segment",
                    data.len(),
                    target.shm_segment
                )
            })?;
            buf.copy_from_slice(&data);
            Some(buf)
        } else {
            None
        };
        let src: &[u8] = shared.as_deref().unwrap_or(&data);
        let put = if target.nixl {
            if data.is_empty() {
                return Err("--nixl: an empty value cannot be stored".into());
            }
            nixl_put(target, store, &caller, &key, &data)?
        } else {
            store.put(&caller, &key, src, None).map_err(|e| e.to_string())?
        };
        match put {
            Put::Committed(sum) => {
                Ok(format!("stored {} bytes (checksum {:016x})", data.len(), sum.0))
            }
            Put::AlreadyCommitted => Ok("already stored (values are create-only)".into()),
            Put::Busy => Err("another writer holds the key; try again".into()),
            Put::Refused(r) => Err(format!("refused: {r}")),
        }
    })();
    done(result, "put")
}

/// Writes the value under NAME to standard output; exit code 3 on a miss.
pub(crate) fn get(target: &Target, name: &str) -> ExitCode {
    let result = (|| -> Result<Option<String>, String> {
        let (store, caller, ns) = connect(target, Rights::READ_ONLY)?;
        let key = ns.key_for(name.as_bytes()).map_err(|e| e.to_string())?;
        let mut plain;
        let mut shared;
        let buf: &mut [u8] = if target.shm {
            // The server writes the value into the segment; it is written out from there.
            let len = usize::try_from(target.shm_segment).unwrap_or(usize::MAX).min(GET_BYTES_MAX);
            shared = store.shared_buffer(len).ok_or_else(|| {
                format!("cannot take {len} bytes of the shared segment (--shm-segment)")
            })?;
            &mut shared
        } else if target.nixl {
            plain = vec![0u8; usize::try_from(target.nixl_slot_bytes).unwrap_or(GET_BYTES_MAX)];
            &mut plain
        } else {
            plain = vec![0u8; GET_BYTES_MAX];
            &mut plain
        };
        let got = if target.nixl {
            nixl_get(target, store, &caller, &key, buf)?
        } else {
            store.get_into(&caller, &key, buf).map_err(|e| e.to_string())?
        };
        match got {
            Get::Hit { len, .. } => {
                let len = usize::try_from(len).unwrap_or(0);
                std::io::stdout().write_all(&buf[..len]).map_err(|e| e.to_string())?;
                Ok(None)
            }
            Get::Miss(reason) => Ok(Some(format!("miss: {reason:?}"))),
        }
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

/// Prints the store's counters.
pub(crate) fn stat(target: &Target) -> ExitCode {
    let result = (|| -> Result<String, String> {
        let (store, _, _) = connect(target, Rights::READ_ONLY)?;
        let info = store.info();
        let epoch = store.epoch();
        if epoch.0 == 0 {
            let how = if target.shm { " over the same-host path (--shm)" } else { "" };
            return Err(format!("no answer from {}{how}", target.addr));
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
            s.corrupt_dropped
        );
        if target.shm {
            let sh = store.shared_stats();
            text.push_str(&format!(
                "\nshared segment: {} bytes ({} free, {} quarantined); items direct {}, bounced {}; \
                 framed batches {}",
                target.shm_segment,
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
