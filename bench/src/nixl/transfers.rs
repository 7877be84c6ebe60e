//! The NIXL paths: this process's [`NixlAgent`] and [`NixlTransfers`] (with the contract's
//! bookkeeping per block) and a bare nixl-sys agent (one reposted request), both against one
//! peer process: this executable as `gpucache-bench nixl-peer`, connected back over loopback
//! TCP for metadata, block descriptors and the byte checks.
//!
//! Control frames are a little-endian u32 length and that many bytes. The peer sends its
//! metadata and its block's descriptor, receives this process's two agents' metadata, then
//! answers commands: `fill SEED LEN` (write the pattern into its block), `sum LEN` (the checksum
//! of the block's first LEN bytes) and `bye`.

use std::ffi::{CStr, c_char};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::registry::{RegisteredPool, SlotLease};
use gpucache_nic::nixl::{
    NixlAgent, NixlBackend, NixlLimits, NixlOutcome, NixlSlots, NixlTransfers, RemoteBlock,
};
use gpucache_storage::host::pool::{HugePagePolicy, Lock};
use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, XferDescList, XferOp,
    XferRequest, XferStatus,
};

use super::paths::{PathRun, Point, checksum, pattern, timed};
use super::plan::{BLOCK_BYTES_MAX, CONTROL_DEADLINE, PEER_METADATA_MAX, PathName, Plan};
use crate::service::process::ChildGuard;
use gpucache_service::units::{narrow, size_label};

/// Largest control frame (metadata is a few KiB).
const FRAME_BYTES_MAX: usize = 1 << 20;
/// The tenant the bench's leases are checked out for.
const TENANT: &str = "bench";
/// Seed of what the peer holds before a READ.
const PEER_SEED: u64 = 0x5eed_0001;
/// Seed of what this process writes.
const PARENT_SEED: u64 = 0x5eed_0002;

const OURS_NOTE: &str = "gpucache-nic NixlTransfers: per block checkout 1 slot of a registered \
                         huge-page pool, READ/WRITE with a deadline, release; peer is a second \
                         process";
const RAW_NOTE: &str = "bare nixl-sys agent: one transfer request made per size and reposted, \
                        post + status polling only; same peer memory";

/// The rows the NIXL paths of `plan` produce, in order.
pub(super) fn path_names(plan: &Plan) -> Vec<&'static str> {
    let mut names = Vec::new();
    if plan.wants(PathName::Nixl) {
        names.extend(["nixl-write", "nixl-read"]);
    }
    if plan.wants(PathName::NixlRaw) {
        names.extend(["nixl-raw-write", "nixl-raw-read"]);
    }
    names
}

// ------------------------------------------------------------------------------------------
// Control channel

fn send(stream: &mut TcpStream, bytes: &[u8]) -> Result<(), String> {
    let len = u32::try_from(bytes.len()).map_err(|_| "control frame too long".to_owned())?;
    stream.write_all(&len.to_le_bytes()).map_err(|e| format!("control send: {e}"))?;
    stream.write_all(bytes).map_err(|e| format!("control send: {e}"))
}

fn recv(stream: &mut TcpStream) -> Result<Vec<u8>, String> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(|e| format!("control receive: {e}"))?;
    let len = narrow(u64::from(u32::from_le_bytes(len)));
    if len > FRAME_BYTES_MAX {
        return Err(format!("control frame of {len} bytes (at most {FRAME_BYTES_MAX})"));
    }
    let mut bytes = vec![0; len];
    stream.read_exact(&mut bytes).map_err(|e| format!("control receive: {e}"))?;
    Ok(bytes)
}

fn recv_text(stream: &mut TcpStream) -> Result<String, String> {
    String::from_utf8(recv(stream)?).map_err(|e| format!("control frame not UTF-8: {e}"))
}

// ------------------------------------------------------------------------------------------
// Memory for the bare agent

/// A heap buffer registered with the bare agent.
#[derive(Debug)]
struct RawBuffer {
    bytes: Vec<u8>,
}

impl MemoryRegion for RawBuffer {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.bytes.as_ptr()
    }
    fn size(&self) -> usize {
        self.bytes.len()
    }
}

impl NixlDescriptor for RawBuffer {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// The bare nixl-sys agent and its registered buffer.
struct Raw {
    // Field order is drop order: the registration goes before the agent and the buffer.
    _registration: RegistrationHandle,
    agent: Agent,
    buffer: RawBuffer,
}

fn nixl(call: &'static str) -> impl FnOnce(nixl_sys::NixlError) -> String {
    move |e| format!("NIXL {call}: {e}")
}

impl Raw {
    fn new(name: &str, bytes: usize) -> Result<Self, String> {
        let agent = Agent::new(name).map_err(nixl("createAgent"))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(nixl("getPluginParams"))?;
        agent.create_backend("UCX", &params).map_err(nixl("createBackend"))?;
        let buffer = RawBuffer { bytes: vec![0; bytes] };
        let registration = agent.register_memory(&buffer, None).map_err(nixl("registerMem"))?;
        Ok(Self { _registration: registration, agent, buffer })
    }

    fn request(&mut self, op: XferOp, remote: &RemoteBlock) -> Result<XferRequest, String> {
        let len = narrow(remote.len_bytes);
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl("createXferDlist"))?;
        local.add_desc(self.buffer.bytes.as_mut_ptr().expose_provenance(), len, 0);
        let mut far = XferDescList::new(MemType::Dram).map_err(nixl("createXferDlist"))?;
        far.add_desc(narrow(remote.addr), len, remote.dev_id);
        self.agent
            .create_xfer_req(op, &local, &far, &remote.agent, None)
            .map_err(nixl("createXferReq"))
    }

    /// Posts `request` and polls it to the end (or `deadline` from now).
    fn post(&self, request: &XferRequest, deadline: Duration) -> Result<(), String> {
        let started = Instant::now();
        if !self.agent.post_xfer_req(request, None).map_err(nixl("postXferReq"))? {
            return Ok(());
        }
        loop {
            match self.agent.get_xfer_status(request).map_err(nixl("getXferStatus"))? {
                XferStatus::Success => return Ok(()),
                XferStatus::InProgress => {}
            }
            if started.elapsed() >= deadline {
                return Err(format!("a bare NIXL transfer still in flight after {deadline:?}"));
            }
            std::hint::spin_loop();
        }
    }
}

// ------------------------------------------------------------------------------------------
// This process's side

fn pool_for(agent: &NixlAgent, slot_bytes: usize) -> Result<RegisteredPool<NixlSlots>, String> {
    let policy = HugePagePolicy::default().lock(Lock::Off);
    NixlSlots::pool(agent, 1, slot_bytes, policy).map_err(|e| format!("NIXL pool: {e}"))
}

/// A running peer and both agents of this process, connected to it.
pub(super) struct Session {
    agent: NixlAgent,
    pool: RegisteredPool<NixlSlots>,
    xfers: NixlTransfers,
    tenant: TenantId,
    raw: Option<Raw>,
    stream: TcpStream,
    block: RemoteBlock,
    peer: ChildGuard,
}

impl Session {
    /// Starts the peer with a block of the plan's largest size and exchanges metadata.
    pub(super) fn start(scratch: &Path, plan: &Plan) -> Result<Self, String> {
        let slot_bytes = narrow(plan.largest());
        let pid = std::process::id();
        let mut agent =
            NixlAgent::new(&format!("gpucache-bench-{pid}")).map_err(|e| format!("{e}"))?;
        agent.enable(NixlBackend::Ucx).map_err(|e| format!("{e}"))?;
        let pool = pool_for(&agent, slot_bytes)?;
        let raw = if plan.wants(PathName::NixlRaw) {
            Some(Raw::new(&format!("gpucache-bench-raw-{pid}"), slot_bytes)?)
        } else {
            None
        };
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(|e| format!("control listener: {e}"))?;
        let port = listener.local_addr().map_err(|e| format!("control listener: {e}"))?.port();
        let exe =
            std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
        let mut command = Command::new(exe);
        command.args(["nixl-peer", "--connect", &port.to_string()]);
        command.args(["--slot-bytes", &slot_bytes.to_string()]);
        let log = scratch.join("nixl-peer.log");
        let mut peer = ChildGuard::spawn("gpucache-bench nixl-peer", command, &log, false)?;
        let mut stream = gpucache_nic::nixl::accept_before(
            &listener,
            Instant::now() + CONTROL_DEADLINE,
            || peer.exited().map(|status| status.to_string()),
        )?;
        stream.set_read_timeout(Some(CONTROL_DEADLINE)).map_err(|e| format!("control: {e}"))?;
        let _ = stream.set_nodelay(true);
        let md = recv(&mut stream)?;
        let block = RemoteBlock::decode(&recv(&mut stream)?)
            .map_err(|e| format!("the peer's block descriptor: {e}"))?;
        let name = agent.load_peer(&md).map_err(|e| format!("{e}"))?;
        if name != block.agent {
            return Err(format!("the peer is {name:?} but its block names {:?}", block.agent));
        }
        let mut mds = vec![agent.local_metadata().map_err(|e| format!("{e}"))?];
        if let Some(raw) = &raw {
            raw.agent.load_remote_md(&md).map_err(nixl("loadRemoteMD"))?;
            mds.push(raw.agent.get_local_md().map_err(nixl("getLocalMD"))?);
        }
        send(&mut stream, mds.len().to_string().as_bytes())?;
        for md in &mds {
            send(&mut stream, md)?;
        }
        let tenant = TenantId::parse(TENANT).map_err(|e| format!("bench tenant: {e}"))?;
        let xfers = NixlTransfers::new(NixlLimits::default());
        Ok(Self { agent, pool, xfers, tenant, raw, stream, block, peer })
    }

    /// The UCX version loaded in this process, when it can be asked.
    pub(super) fn ucx_version(&self) -> Option<String> {
        ucx_version()
    }

    fn ask(&mut self, command: &str) -> Result<String, String> {
        send(&mut self.stream, command.as_bytes())?;
        let answer = recv_text(&mut self.stream)?;
        match answer.strip_prefix("ok") {
            Some(rest) => Ok(rest.trim().to_owned()),
            None => Err(format!("the peer answered {command:?} with {answer:?}")),
        }
    }

    fn peer_sum(&mut self, len: usize) -> Result<u64, String> {
        let text = self.ask(&format!("sum {len}"))?;
        text.parse().map_err(|e| format!("the peer's checksum {text:?}: {e}"))
    }

    /// Every NIXL row of `plan`, all sizes.
    pub(super) fn measure(&mut self, plan: &Plan) -> Vec<PathRun> {
        let mut rows: Vec<PathRun> = Vec::new();
        if plan.wants(PathName::Nixl) {
            rows.push(PathRun::new("nixl-write", OURS_NOTE));
            rows.push(PathRun::new("nixl-read", OURS_NOTE));
        }
        if plan.wants(PathName::NixlRaw) {
            rows.push(PathRun::new("nixl-raw-write", RAW_NOTE));
            rows.push(PathRun::new("nixl-raw-read", RAW_NOTE));
        }
        for &size in &plan.sizes {
            let mut at = 0;
            if plan.wants(PathName::Nixl) {
                eprintln!("bench: {}: nixl", size_label(size));
                for op in [XferOp::Write, XferOp::Read] {
                    let point = self.ours(op, size, plan).unwrap_or_else(|e| {
                        eprintln!("bench: {}: {}: {e}", size_label(size), rows[at].name);
                        Point::failed(size, e)
                    });
                    rows[at].points.push(point);
                    at += 1;
                }
            }
            if plan.wants(PathName::NixlRaw) {
                eprintln!("bench: {}: nixl-raw", size_label(size));
                for op in [XferOp::Write, XferOp::Read] {
                    let point = self.bare(op, size, plan).unwrap_or_else(|e| {
                        eprintln!("bench: {}: {}: {e}", size_label(size), rows[at].name);
                        Point::failed(size, e)
                    });
                    rows[at].points.push(point);
                    at += 1;
                }
            }
        }
        rows
    }

    /// One block through [`NixlTransfers`]: checkout, READ or WRITE, release.
    fn one(
        &mut self,
        op: XferOp,
        remote: &RemoteBlock,
        fill: Option<&[u8]>,
    ) -> Result<Option<u64>, String> {
        let lease: SlotLease = self
            .pool
            .checkout(&self.tenant, 1, None)
            .map_err(|e| format!("checkout: {e}"))?
            .pop()
            .ok_or("checkout returned no slot")?;
        let len = narrow(remote.len_bytes);
        if let Some(bytes) = fill {
            let slot = self.pool.slot_bytes_mut(&lease).ok_or("a fresh lease has no bytes")?;
            slot[..len].copy_from_slice(bytes);
        }
        let outcome = match op {
            XferOp::Write => self.xfers.write(&self.agent, &mut self.pool, &lease, remote),
            XferOp::Read => self.xfers.read(&self.agent, &mut self.pool, &lease, remote),
        }
        .map_err(|e| format!("{e}"))?;
        if let NixlOutcome::Unknown { cause, .. } = outcome {
            return Err(format!("outcome unknown ({cause:?}); the slot is quarantined"));
        }
        // With a fill (the checked block), report the checksum of the slot's front.
        let sum = match fill {
            Some(_) => Some(checksum(
                &self.pool.slot_bytes_mut(&lease).ok_or("a done lease has no bytes")?[..len],
            )),
            None => None,
        };
        self.xfers.release(&mut self.pool, &lease).map_err(|e| format!("release: {e}"))?;
        Ok(sum)
    }

    fn ours(&mut self, op: XferOp, size: u64, plan: &Plan) -> Result<Point, String> {
        let len = narrow(size);
        let remote = RemoteBlock { len_bytes: size, ..self.block.clone() };
        // The check, untimed (and the connection's set-up on the very first one).
        let verified = match op {
            XferOp::Write => {
                let data = pattern(PARENT_SEED ^ size, len);
                self.one(op, &remote, Some(&data))?;
                self.peer_sum(len)? == checksum(&data)
            }
            XferOp::Read => {
                self.ask(&format!("fill {PEER_SEED} {len}"))?;
                let zeros = vec![0u8; len];
                let got = self.one(op, &remote, Some(&zeros))?;
                got == Some(checksum(&pattern(PEER_SEED, len)))
            }
        };
        let mut samples =
            timed(plan.warmup, plan.iterations, |_| self.one(op, &remote, None).map(drop))?;
        Ok(Point::from_samples(size, &mut samples, verified))
    }

    fn bare(&mut self, op: XferOp, size: u64, plan: &Plan) -> Result<Point, String> {
        let len = narrow(size);
        let remote = RemoteBlock { len_bytes: size, ..self.block.clone() };
        let deadline = NixlLimits::default().deadline;
        let Some(raw) = self.raw.as_mut() else { return Err("no bare agent".into()) };
        let request = raw.request(op, &remote)?;
        let verified = match op {
            XferOp::Write => {
                let data = pattern(PARENT_SEED ^ size ^ 1, len);
                raw.buffer.bytes[..len].copy_from_slice(&data);
                raw.post(&request, deadline)?;
                self.peer_sum(len)? == checksum(&data)
            }
            XferOp::Read => {
                self.ask(&format!("fill {} {len}", PEER_SEED + 1))?;
                let Some(raw) = self.raw.as_mut() else { return Err("no bare agent".into()) };
                raw.buffer.bytes[..len].fill(0);
                raw.post(&request, deadline)?;
                checksum(&raw.buffer.bytes[..len]) == checksum(&pattern(PEER_SEED + 1, len))
            }
        };
        let Some(raw) = self.raw.as_ref() else { return Err("no bare agent".into()) };
        let mut samples = timed(plan.warmup, plan.iterations, |_| raw.post(&request, deadline))?;
        Ok(Point::from_samples(size, &mut samples, verified))
    }

    /// Says goodbye and waits for the peer to exit (its guard stops it otherwise).
    pub(super) fn finish(mut self) {
        if send(&mut self.stream, b"bye").is_ok()
            && let Some(status) = self.peer.wait_until(Instant::now() + CONTROL_DEADLINE)
            && !status.success()
        {
            eprintln!("bench: the NIXL peer exited with {status}");
        }
    }
}

// ------------------------------------------------------------------------------------------
// The peer

/// The `gpucache-bench nixl-peer` role: one registered block, lent for the whole run.
pub(super) fn peer_main(port: u16, slot_bytes: usize) -> Result<(), String> {
    if slot_bytes == 0 || slot_bytes > narrow(BLOCK_BYTES_MAX) {
        return Err(format!("--slot-bytes {slot_bytes} is outside 1..={}", BLOCK_BYTES_MAX));
    }
    let mut agent = NixlAgent::new(&format!("gpucache-bench-peer-{}", std::process::id()))
        .map_err(|e| format!("{e}"))?;
    agent.enable(NixlBackend::Ucx).map_err(|e| format!("{e}"))?;
    let mut pool = pool_for(&agent, slot_bytes)?;
    let tenant = TenantId::parse(TENANT).map_err(|e| format!("bench tenant: {e}"))?;
    let lease = pool
        .checkout(&tenant, 1, None)
        .map_err(|e| format!("checkout: {e}"))?
        .pop()
        .ok_or("checkout returned no slot")?;
    let mine = NixlSlots::block(&pool, &lease, slot_bytes as u64).map_err(|e| format!("{e}"))?;
    let mut stream =
        TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect {port}: {e}"))?;
    let _ = stream.set_nodelay(true);
    send(&mut stream, &agent.local_metadata().map_err(|e| format!("{e}"))?)?;
    send(&mut stream, &mine.encode().map_err(|e| format!("{e}"))?)?;
    let count: usize = recv_text(&mut stream)?.parse().map_err(|e| format!("md count: {e}"))?;
    if count > PEER_METADATA_MAX {
        return Err(format!("{count} agents' metadata announced"));
    }
    for _ in 0..count {
        agent.load_peer(&recv(&mut stream)?).map_err(|e| format!("{e}"))?;
    }
    loop {
        let command = recv_text(&mut stream)?;
        let words: Vec<&str> = command.split(' ').collect();
        let slot = pool.slot_bytes_mut(&lease).ok_or("the peer's lease has no bytes")?;
        let len_of = |w: &str| -> Result<usize, String> {
            w.parse::<usize>()
                .ok()
                .filter(|n| *n <= slot_bytes)
                .ok_or_else(|| format!("length {w:?} outside 0..={slot_bytes}"))
        };
        let reply = match words.as_slice() {
            ["bye"] => return Ok(()),
            ["fill", seed, len] => {
                let seed: u64 = seed.parse().map_err(|e| format!("seed {seed:?}: {e}"))?;
                let len = len_of(len)?;
                slot[..len].copy_from_slice(&pattern(seed, len));
                "ok".to_owned()
            }
            ["sum", len] => format!("ok {}", checksum(&slot[..len_of(len)?])),
            _ => format!("unknown command {command:?}"),
        };
        send(&mut stream, reply.as_bytes())?;
    }
}

// ------------------------------------------------------------------------------------------
// UCX version

/// Asks the libucp that NIXL's UCX plugin loaded into this process for its version string.
fn ucx_version() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let path = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.rsplit('/').next().is_some_and(|f| f.starts_with("libucp")))?;
    let c_path = std::ffi::CString::new(path).ok()?;
    // SAFETY: RTLD_NOLOAD only finds a library already mapped into this process (it loads and
    // initialises nothing); the handle is released below.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: `handle` came from dlopen above; the name is a NUL-terminated literal.
    let sym = unsafe { libc::dlsym(handle, c"ucp_get_version_string".as_ptr()) };
    let version = (!sym.is_null()).then(|| {
        // SAFETY: ucp_get_version_string is `const char *(void)` in every UCX release, and
        // returns a pointer to a static NUL-terminated string.
        let f: extern "C" fn() -> *const c_char = unsafe { std::mem::transmute(sym) };
        let text = f();
        // SAFETY: see above: a static, NUL-terminated string owned by libucp.
        (!text.is_null()).then(|| unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
    });
    // SAFETY: releases the reference RTLD_NOLOAD took; the library stays mapped (NIXL holds it).
    unsafe { libc::dlclose(handle) };
    version.flatten()
}
