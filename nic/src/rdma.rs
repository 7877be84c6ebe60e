//! The real RDMA verbs backend (sideway, libibverbs loaded at run time), compiled only with the
//! `verbs` cargo feature. Without the feature this module does not exist; a caller that asked
//! for verbs in such a build reports [`VerbsUnavailable::NotBuilt`].
//!
//! Owns: device discovery ([`discover`]), one opened device with its protection domain, one
//! completion queue and one RC queue pair ([`VerbsEndpoint`]), memory registrations, and the
//! connection setup over a TCP control channel ([`EndpointInfo`], [`VerbsEndpoint::connect`]).
//! It implements [`NicEndpoint`] so [`crate::transfer`] drives it exactly like the simulation.
//! It must not own block identity, lifecycle or quarantine; those stay with the caller.
//!
//! Every failure is a typed [`NicError`]: a machine without RDMA gives
//! [`NicError::VerbsUnavailable`] naming what is missing, never a panic. None of this can run
//! on the development machines (no InfiniBand in their kernel); `gpucache-verbs-check` is the
//! test on two RDMA hosts (docs/HARDWARE.md, "RDMA verbs").

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion as IbvMemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};

use crate::error::{NicError, VerbsUnavailable};
use crate::verbs::{
    Access, CompletionStatus, Implementation, LocalKey, MemoryRegion, NicEndpoint, Opcode,
    POLL_ENTRIES_MAX, RegisterHostMemory, RemoteKey, WorkCompletion, WorkRequest,
};

/// ENOSYS: what `ibv_get_device_list` reports on a kernel built without InfiniBand.
const ERRNO_NOSYS: i32 = 38;
/// Outstanding RDMA READs one side lets the peer have in flight (`max_rd_atomic`).
const READS_OUTSTANDING_MAX: u8 = 16;
/// How long [`NicEndpoint::reset`] waits for flushed completions before declaring the endpoint
/// broken.
const DRAIN_DEADLINE_MS: u64 = 1_000;
/// Directories searched for libibverbs when the device list fails, to tell a missing library
/// from a kernel without InfiniBand. `LD_LIBRARY_PATH` entries are searched first.
const LIBRARY_DIRS: [&str; 5] =
    ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/usr/lib"];

/// One RDMA device as discovery saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSummary {
    pub name: String,
    pub guid: String,
    pub transport: String,
}

/// Lists the RDMA devices. No device at all, and every way of not being able to ask, is
/// [`NicError::VerbsUnavailable`] with the reason.
pub fn discover() -> Result<Vec<DeviceSummary>, NicError> {
    let list = device_list()?;
    let devices: Vec<DeviceSummary> = list
        .iter()
        .map(|d| DeviceSummary {
            name: d.name(),
            guid: d.guid().to_string(),
            transport: d.transport_type().to_string(),
        })
        .collect();
    if devices.is_empty() {
        return Err(unavailable(if Path::new("/dev/infiniband").exists() {
            VerbsUnavailable::NoDevice
        } else {
            VerbsUnavailable::NoDeviceNodes
        }));
    }
    Ok(devices)
}

fn unavailable(reason: VerbsUnavailable) -> NicError {
    NicError::VerbsUnavailable { reason }
}

fn device_list() -> Result<DeviceList, NicError> {
    DeviceList::new().map_err(|e| {
        // sideway reports `io::Error::last_os_error()`; the loader stub returns NULL without
        // setting errno when libibverbs could not be loaded, so look for the library too.
        let errno = match e.0 {
            sideway::ibverbs::device::GetDeviceListErrorKind::Ibverbs(io) => {
                io.raw_os_error().unwrap_or(0)
            }
            _ => 0,
        };
        unavailable(classify_list_failure(errno, libibverbs_present(), dev_nodes_present()))
    })
}

/// Why the device list could not be had, from its errno and what is on disk.
fn classify_list_failure(errno: i32, library_present: bool, dev_nodes: bool) -> VerbsUnavailable {
    if !library_present {
        VerbsUnavailable::LibraryMissing
    } else if errno == ERRNO_NOSYS {
        VerbsUnavailable::KernelWithoutInfiniband { errno }
    } else if !dev_nodes {
        VerbsUnavailable::NoDeviceNodes
    } else {
        VerbsUnavailable::DeviceListFailed { errno }
    }
}

fn dev_nodes_present() -> bool {
    Path::new("/dev/infiniband").exists()
}

fn libibverbs_present() -> bool {
    let from_env = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    from_env
        .split(':')
        .filter(|d| !d.is_empty())
        .chain(LIBRARY_DIRS)
        .any(|dir| Path::new(dir).join("libibverbs.so.1").exists())
}

/// Limits and choices for [`VerbsEndpoint`]; [`VerbsConfig::open`] validates and opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// The device by name (`mlx5_0`); the first one listed when `None`.
    pub device: Option<String>,
    /// The device port, counted from 1.
    pub port: u8,
    /// The GID table entry used for RoCE (routable, GRH); ignored on InfiniBand with LIDs.
    pub gid_index: u8,
    /// Send queue depth: the most work requests outstanding at once.
    pub send_queue_depth: u32,
    /// The most memory registrations one endpoint holds.
    pub registrations_max: usize,
    /// The largest single registration.
    pub region_bytes_max: u64,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: 0,
            send_queue_depth: 64,
            registrations_max: 4_096,
            region_bytes_max: 1 << 30,
        }
    }
}

fn call_failed(call: &'static str, e: impl std::error::Error) -> NicError {
    let mut detail = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        source = s.source();
    }
    NicError::VerbsCall { call, detail }
}

impl VerbsConfig {
    /// Opens the device and creates its protection domain, completion queue and an RC queue
    /// pair in RESET. The pair becomes usable after [`VerbsEndpoint::connect`].
    pub fn open(&self) -> Result<VerbsEndpoint, NicError> {
        if self.send_queue_depth == 0 || self.port == 0 || self.registrations_max == 0 {
            return Err(NicError::VerbsCall {
                call: "config",
                detail: "send_queue_depth, port and registrations_max must be non-zero".into(),
            });
        }
        let list = device_list()?;
        let device = match &self.device {
            Some(name) => list.iter().find(|d| d.name() == *name).ok_or_else(|| {
                let present: Vec<String> = list.iter().map(|d| d.name()).collect();
                unavailable(VerbsUnavailable::DeviceNotFound {
                    name: name.clone(),
                    present: present.join(", "),
                })
            })?,
            None => list.iter().next().ok_or_else(|| {
                unavailable(if dev_nodes_present() {
                    VerbsUnavailable::NoDevice
                } else {
                    VerbsUnavailable::NoDeviceNodes
                })
            })?,
        };
        let name = device.name();
        let context = device.open().map_err(|e| call_failed("ibv_open_device", e))?;
        let port_attr =
            context.query_port(self.port).map_err(|e| call_failed("ibv_query_port", e))?;
        let gid = context
            .query_gid(self.port, u32::from(self.gid_index))
            .map_err(|e| call_failed("ibv_query_gid", e))?;
        let pd = context.alloc_pd().map_err(|e| call_failed("ibv_alloc_pd", e))?;
        let mut cq = context
            .create_cq_builder()
            .setup_cqe(self.send_queue_depth)
            .build()
            .map_err(|e| call_failed("ibv_create_cq", e))?;
        // Batches of exactly POLL_ENTRIES_MAX, so taking one batch never polls (and drops) more.
        if let Some(cq) = Arc::get_mut(&mut cq) {
            cq.setup_poll_batch(poll_batch());
        }
        let qp = pd
            .create_qp_builder()
            .setup_send_cq(Arc::clone(&cq))
            .setup_recv_cq(Arc::clone(&cq))
            .setup_max_send_wr(self.send_queue_depth)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| call_failed("ibv_create_qp", e))?;
        let local = EndpointInfo {
            qp_num: qp.qp_number(),
            psn: initial_psn(),
            lid: port_attr.lid(),
            gid: gid.raw,
            mtu: mtu_code(port_attr.active_mtu()),
            region_addr: 0,
            region_len: 0,
            rkey: 0,
        };
        Ok(VerbsEndpoint {
            qp,
            cq,
            regions: HashMap::new(),
            _pd: pd,
            _context: context,
            device: name,
            config: self.clone(),
            local,
            peer: None,
            outstanding: HashMap::new(),
            pending: VecDeque::new(),
            broken: None,
        })
    }
}

fn poll_batch() -> std::num::NonZeroU32 {
    const _: () = assert!(POLL_ENTRIES_MAX > 0 && POLL_ENTRIES_MAX <= 1_024);
    let batch = u32::try_from(POLL_ENTRIES_MAX).unwrap_or(1);
    std::num::NonZeroU32::new(batch).unwrap_or(std::num::NonZeroU32::MIN)
}

/// A 24-bit starting packet sequence number; it need not be secret, only unlikely to repeat
/// across reconnects.
fn initial_psn() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ std::process::id().rotate_left(12)) & PSN_MASK
}

const PSN_MASK: u32 = 0x00ff_ffff;

fn mtu_code(mtu: Mtu) -> u8 {
    match mtu {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

fn mtu_from_code(code: u8) -> Option<Mtu> {
    Some(match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        5 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// What each side tells the other before its queue pair can reach the peer: one fixed-size,
/// big-endian record of [`EndpointInfo::WIRE_BYTES`] bytes, sent by both sides at once, then
/// read:
///
/// | offset | bytes | field |
/// | --- | --- | --- |
/// | 0 | 4 | magic `GCVB` |
/// | 4 | 2 | version (1) |
/// | 6 | 2 | LID (0 on RoCE) |
/// | 8 | 4 | queue pair number (24 bits) |
/// | 12 | 4 | first packet sequence number (24 bits) |
/// | 16 | 16 | GID |
/// | 32 | 8 | exposed region's virtual address (0 when none) |
/// | 40 | 8 | exposed region's length in bytes |
/// | 48 | 4 | exposed region's rkey |
/// | 52 | 1 | active MTU (1 = 256 ... 5 = 4096) |
/// | 53 | 3 | zero |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointInfo {
    pub qp_num: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    pub mtu: u8,
    pub region_addr: u64,
    pub region_len: u64,
    pub rkey: u32,
}

const WIRE_MAGIC: [u8; 4] = *b"GCVB";
const WIRE_VERSION: u16 = 1;

impl EndpointInfo {
    pub const WIRE_BYTES: usize = 56;

    pub fn encode(&self) -> [u8; Self::WIRE_BYTES] {
        let mut b = [0u8; Self::WIRE_BYTES];
        b[0..4].copy_from_slice(&WIRE_MAGIC);
        b[4..6].copy_from_slice(&WIRE_VERSION.to_be_bytes());
        b[6..8].copy_from_slice(&self.lid.to_be_bytes());
        b[8..12].copy_from_slice(&self.qp_num.to_be_bytes());
        b[12..16].copy_from_slice(&self.psn.to_be_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b[32..40].copy_from_slice(&self.region_addr.to_be_bytes());
        b[40..48].copy_from_slice(&self.region_len.to_be_bytes());
        b[48..52].copy_from_slice(&self.rkey.to_be_bytes());
        b[52] = self.mtu;
        b
    }

    /// Checks every field it can: magic, version, 24-bit numbers, a known MTU, zero padding.
    pub fn decode(b: &[u8; Self::WIRE_BYTES]) -> Result<Self, NicError> {
        let bad =
            |detail: String| NicError::Connect { step: "decoding the peer's endpoint", detail };
        let be16 = |at: usize| u16::from_be_bytes([b[at], b[at + 1]]);
        let be32 = |at: usize| u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let be64 = |at: usize| (u64::from(be32(at)) << 32) | u64::from(be32(at + 4));
        if b[0..4] != WIRE_MAGIC {
            return Err(bad(format!("magic {:02x?} is not GCVB", &b[0..4])));
        }
        if be16(4) != WIRE_VERSION {
            return Err(bad(format!("version {} is not {WIRE_VERSION}", be16(4))));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        let info = Self {
            lid: be16(6),
            qp_num: be32(8),
            psn: be32(12),
            gid,
            region_addr: be64(32),
            region_len: be64(40),
            rkey: be32(48),
            mtu: b[52],
        };
        if info.qp_num & !PSN_MASK != 0 || info.psn & !PSN_MASK != 0 {
            return Err(bad(format!(
                "qp {:#x} or psn {:#x} exceeds 24 bits",
                info.qp_num, info.psn
            )));
        }
        if mtu_from_code(info.mtu).is_none() {
            return Err(bad(format!("mtu code {} is not 1..=5", info.mtu)));
        }
        if b[53..56] != [0, 0, 0] {
            return Err(bad("padding is not zero".into()));
        }
        Ok(info)
    }
}

/// Opens the control channel to a listening peer, with `deadline` on the connect and on every
/// later read and write.
pub fn control_connect(addr: &str, deadline: Duration) -> Result<TcpStream, NicError> {
    let step = "connecting the control channel";
    let fail = |detail: String| NicError::Connect { step, detail };
    let mut last = format!("{addr} resolved to no address");
    for sa in addr.to_socket_addrs().map_err(|e| fail(format!("{addr}: {e}")))? {
        match TcpStream::connect_timeout(&sa, deadline) {
            Ok(s) => return with_deadlines(s, deadline),
            Err(e) => last = format!("{sa}: {e}"),
        }
    }
    Err(fail(last))
}

/// Waits up to `deadline` for one peer on `listener`.
pub fn control_accept(listener: &TcpListener, deadline: Duration) -> Result<TcpStream, NicError> {
    let fail = |detail: String| NicError::Connect { step: "accepting the control channel", detail };
    listener.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
    let until = Instant::now() + deadline;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| fail(e.to_string()))?;
                return with_deadlines(s, deadline);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < until => {
                // A control-plane wait for a human starting the other side, not a test sleep.
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                return Err(fail(format!("no peer within {} ms", deadline.as_millis())));
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    }
}

fn with_deadlines(s: TcpStream, deadline: Duration) -> Result<TcpStream, NicError> {
    let fail = |e: std::io::Error| NicError::Connect {
        step: "setting control channel deadlines",
        detail: e.to_string(),
    };
    s.set_read_timeout(Some(deadline)).map_err(fail)?;
    s.set_write_timeout(Some(deadline)).map_err(fail)?;
    s.set_nodelay(true).map_err(fail)?;
    Ok(s)
}

/// Sends ours, then reads the peer's record.
fn exchange(stream: &mut TcpStream, ours: &EndpointInfo) -> Result<EndpointInfo, NicError> {
    stream
        .write_all(&ours.encode())
        .map_err(|e| NicError::Connect { step: "sending our endpoint", detail: e.to_string() })?;
    let mut buf = [0u8; EndpointInfo::WIRE_BYTES];
    stream.read_exact(&mut buf).map_err(|e| NicError::Connect {
        step: "reading the peer's endpoint",
        detail: e.to_string(),
    })?;
    EndpointInfo::decode(&buf)
}

/// The peer's exposed region, as a connect learned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRegion {
    pub rkey: RemoteKey,
    pub len_bytes: u64,
}

struct Registration {
    // Field order is drop order: deregister before the memory goes away.
    _mr: Arc<IbvMemoryRegion>,
    _owned: Option<Box<[u8]>>,
    addr: u64,
    len_bytes: u64,
    rkey: u32,
}

/// One opened device with a protection domain, a completion queue and one RC queue pair.
pub struct VerbsEndpoint {
    // Field order is drop order: the queue pair before its completion queue, registrations
    // before the protection domain, everything before the device context.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    regions: HashMap<u32, Registration>,
    _pd: Arc<ProtectionDomain>,
    _context: Arc<DeviceContext>,
    device: String,
    config: VerbsConfig,
    local: EndpointInfo,
    peer: Option<EndpointInfo>,
    outstanding: HashMap<u64, Opcode>,
    pending: VecDeque<WorkCompletion>,
    /// Set when the queue pair could not be brought back; every later post fails with it.
    broken: Option<String>,
}

impl fmt::Debug for VerbsEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsEndpoint")
            .field("device", &self.device)
            .field("qp_num", &self.local.qp_num)
            .field("registrations", &self.regions.len())
            .field("outstanding", &self.outstanding.len())
            .field("connected", &self.peer.is_some())
            .field("broken", &self.broken)
            .finish()
    }
}

fn access_flags(access: Access) -> AccessFlags {
    let mut flags = AccessFlags::LocalWrite;
    if access.remote_read {
        flags |= AccessFlags::RemoteRead;
    }
    if access.remote_write {
        flags |= AccessFlags::RemoteWrite;
    }
    flags
}

impl VerbsEndpoint {
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Registers memory the caller owns, such as a pool's slots.
    ///
    /// # Safety
    /// `ptr..ptr + len_bytes` must stay valid, and not be freed or moved, until this
    /// registration is deregistered or the endpoint dropped, and no work request may be
    /// outstanding on it when it is.
    pub unsafe fn register_external(
        &mut self,
        ptr: *mut u8,
        len_bytes: usize,
        access: Access,
    ) -> Result<MemoryRegion, NicError> {
        self.check_room(len_bytes as u64)?;
        // SAFETY: the caller keeps the memory valid for the registration's life (above).
        let mr = unsafe { self._pd.reg_mr(ptr as usize, len_bytes, access_flags(access)) }
            .map_err(|e| call_failed("ibv_reg_mr", e))?;
        Ok(self.insert(mr, None, ptr as u64, len_bytes as u64))
    }

    /// The bytes of a registration [`NicEndpoint::register`] allocated; `None` for unknown
    /// keys and for memory the caller registered with [`Self::register_external`].
    pub fn region_bytes_mut(&mut self, lkey: LocalKey) -> Option<&mut [u8]> {
        self.regions.get_mut(&lkey.0)?._owned.as_deref_mut()
    }

    fn check_room(&self, len_bytes: u64) -> Result<(), NicError> {
        if self.regions.len() >= self.config.registrations_max {
            return Err(NicError::RegistrationsFull {
                registered: self.regions.len(),
                max: self.config.registrations_max,
            });
        }
        if len_bytes > self.config.region_bytes_max {
            return Err(NicError::RegionTooLarge {
                len_bytes,
                max_bytes: self.config.region_bytes_max,
            });
        }
        Ok(())
    }

    fn insert(
        &mut self,
        mr: Arc<IbvMemoryRegion>,
        owned: Option<Box<[u8]>>,
        addr: u64,
        len_bytes: u64,
    ) -> MemoryRegion {
        let region =
            MemoryRegion { lkey: LocalKey(mr.lkey()), rkey: RemoteKey(mr.rkey()), len_bytes };
        self.regions.insert(
            mr.lkey(),
            Registration { rkey: mr.rkey(), _mr: mr, _owned: owned, addr, len_bytes },
        );
        region
    }

    /// Connects the queue pair to the peer at the other end of `control`: both sides send an
    /// [`EndpointInfo`] naming the region they expose (`expose`, registered with remote
    /// access), then take their queue pair through INIT, RTR and RTS. Returns the peer's
    /// exposed region, if it named one.
    pub fn connect(
        &mut self,
        control: &mut TcpStream,
        expose: Option<LocalKey>,
    ) -> Result<Option<PeerRegion>, NicError> {
        let mut ours = self.local;
        if let Some(lkey) = expose {
            let r = self.regions.get(&lkey.0).ok_or(NicError::UnknownKey { key: lkey.0 })?;
            ours.region_addr = r.addr;
            ours.region_len = r.len_bytes;
            ours.rkey = r.rkey;
        }
        let peer = exchange(control, &ours)?;
        self.bring_up(&peer)?;
        self.peer = Some(peer);
        Ok((peer.region_len > 0)
            .then_some(PeerRegion { rkey: RemoteKey(peer.rkey), len_bytes: peer.region_len }))
    }

    fn modify(&mut self, attr: &QueuePairAttribute, call: &'static str) -> Result<(), NicError> {
        self.qp.modify(attr).map_err(|e| call_failed(call, e))
    }

    /// RESET to INIT to RTR to RTS against `peer`.
    fn bring_up(&mut self, peer: &EndpointInfo) -> Result<(), NicError> {
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.config.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite,
            );
        self.modify(&init, "ibv_modify_qp(INIT)")?;

        let mtu = mtu_from_code(self.local.mtu.min(peer.mtu)).unwrap_or(Mtu::Mtu1024);
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qp_num)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(READS_OUTSTANDING_MAX)
            .setup_min_rnr_timer(12);
        let mut av = AddressHandleAttribute::new();
        av.setup_dest_lid(peer.lid).setup_port(self.config.port).setup_service_level(0);
        let peer_gid = Gid { raw: peer.gid };
        if !peer_gid.is_zero() {
            // RoCE (and routed InfiniBand) needs the global route header.
            av.setup_grh_src_gid_index(self.config.gid_index)
                .setup_grh_dest_gid(&peer_gid)
                .setup_grh_hop_limit(1);
        }
        rtr.setup_address_vector(&av);
        self.modify(&rtr, "ibv_modify_qp(RTR)")?;

        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(READS_OUTSTANDING_MAX);
        self.modify(&rts, "ibv_modify_qp(RTS)")
    }

    /// Moves up to one batch of completions from the CQ into `pending`.
    fn fill_pending(&mut self) {
        let polled = match self.cq.start_poll() {
            Ok(poller) => poller
                .take(POLL_ENTRIES_MAX)
                .map(|wc| (wc.wr_id(), wc.status(), u64::from(wc.byte_len())))
                .collect::<Vec<_>>(),
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return,
            Err(e) => {
                // Outstanding requests stay without completions: the caller's transfer layer
                // treats that as an unknown outcome and quarantines, which fails closed.
                self.broken = Some(format!("ibv_poll_cq: {e}"));
                return;
            }
        };
        for (wr_id, status, len_bytes) in polled {
            // A completion for nothing we posted cannot retire anything; drop it.
            let Some(opcode) = self.outstanding.remove(&wr_id) else { continue };
            let status = map_status(status);
            self.pending.push_back(WorkCompletion {
                id: crate::verbs::WorkRequestId(wr_id),
                opcode,
                status,
                len_bytes: if status == CompletionStatus::Success { len_bytes } else { 0 },
            });
        }
    }

    /// Completes `request` with `status` without handing it to the device.
    fn refuse(&mut self, request: WorkRequest, status: CompletionStatus) {
        self.pending.push_back(WorkCompletion {
            id: request.id,
            opcode: request.opcode,
            status,
            len_bytes: 0,
        });
    }

    /// ERR, drain, RESET, then back up against the same peer.
    fn fence(&mut self) -> Result<(), NicError> {
        let mut err = QueuePairAttribute::new();
        err.setup_state(QueuePairState::Error);
        self.modify(&err, "ibv_modify_qp(ERR)")?;
        let until = Instant::now() + Duration::from_millis(DRAIN_DEADLINE_MS);
        while !self.outstanding.is_empty() && Instant::now() < until {
            self.fill_pending();
        }
        let undrained = self.outstanding.len();
        self.pending.clear();
        self.outstanding.clear();
        if undrained > 0 {
            return Err(NicError::VerbsCall {
                call: "ibv_poll_cq",
                detail: format!("{undrained} work requests never flushed"),
            });
        }
        let mut reset = QueuePairAttribute::new();
        reset.setup_state(QueuePairState::Reset);
        self.modify(&reset, "ibv_modify_qp(RESET)")?;
        match self.peer {
            Some(peer) => self.bring_up(&peer),
            None => Ok(()),
        }
    }
}

/// Every verbs completion status onto ours. Errors other than the named ones also leave an RC
/// queue pair in error, which is what [`CompletionStatus::RetryExceeded`] tells the caller.
fn map_status(raw: u32) -> CompletionStatus {
    use WorkCompletionStatus as W;
    let is = |s: W| raw == s as u32;
    if is(W::Success) {
        CompletionStatus::Success
    } else if is(W::WorkRequestFlushedError) {
        CompletionStatus::Flushed
    } else if is(W::LocalProtectionError) || is(W::LocalLengthError) || is(W::LocalAccessError) {
        CompletionStatus::LocalProtectionError
    } else if is(W::RemoteAccessError)
        || is(W::RemoteInvalidRequestError)
        || is(W::RemoteOperationError)
    {
        CompletionStatus::RemoteAccessError
    } else {
        CompletionStatus::RetryExceeded
    }
}

impl NicEndpoint for VerbsEndpoint {
    fn implementation(&self) -> Implementation {
        Implementation::Verbs { device: self.device.clone() }
    }

    fn register(&mut self, len_bytes: u64, access: Access) -> Result<MemoryRegion, NicError> {
        self.check_room(len_bytes)?;
        let len = usize::try_from(len_bytes).map_err(|_| NicError::RegionTooLarge {
            len_bytes,
            max_bytes: self.config.region_bytes_max,
        })?;
        let mut owned = vec![0u8; len].into_boxed_slice();
        let addr = owned.as_mut_ptr();
        // SAFETY: the boxed bytes live in the registration and are dropped after the MR
        // (field order of `Registration`); a Box's heap bytes do not move.
        let mr = unsafe { self._pd.reg_mr(addr as usize, len, access_flags(access)) }
            .map_err(|e| call_failed("ibv_reg_mr", e))?;
        Ok(self.insert(mr, Some(owned), addr as u64, len_bytes))
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), NicError> {
        self.regions.remove(&lkey.0).map(drop).ok_or(NicError::UnknownKey { key: lkey.0 })
    }

    fn post(&mut self, request: WorkRequest, local: &mut [u8]) -> Result<(), NicError> {
        if let Some(detail) = &self.broken {
            return Err(NicError::VerbsCall { call: "ibv_post_send", detail: detail.clone() });
        }
        let peer = self.peer.ok_or(NicError::Connect {
            step: "posting",
            detail: "the queue pair is not connected".into(),
        })?;
        let depth = self.config.send_queue_depth as usize;
        let outstanding = self.outstanding.len() + self.pending.len();
        if outstanding >= depth {
            return Err(NicError::QueueFull { outstanding, depth });
        }
        // Checked on the host before the device sees the request, as the simulation does: a
        // request that would fault completes with the status the device would give it, and
        // the device never touches memory outside a registration.
        let len_bytes = local.len() as u64;
        let key = request.lkey.0;
        let addr = local.as_mut_ptr() as u64;
        let local_ok = self.regions.get(&key).is_some_and(|reg| {
            addr >= reg.addr
                && addr.checked_add(len_bytes).is_some_and(|end| end <= reg.addr + reg.len_bytes)
        }) && len_bytes == request.remote.len_bytes;
        let sge_len = u32::try_from(len_bytes).ok().filter(|_| local_ok);
        let Some(sge_len) = sge_len else {
            self.refuse(request, CompletionStatus::LocalProtectionError);
            return Ok(());
        };
        let remote = request.remote;
        let remote_ok = remote.rkey.0 == peer.rkey
            && peer.region_len > 0
            && remote.offset_bytes.checked_add(len_bytes).is_some_and(|end| end <= peer.region_len);
        if !remote_ok {
            self.refuse(request, CompletionStatus::RemoteAccessError);
            return Ok(());
        }
        let remote_addr = peer.region_addr.wrapping_add(remote.offset_bytes);
        let mut guard = self.qp.start_post_send();
        let wr = guard.construct_wr(request.id.0, WorkRequestFlags::Signaled);
        let wr = match request.opcode {
            Opcode::Read => wr.setup_read(remote.rkey.0, remote_addr),
            Opcode::Write => wr.setup_write(remote.rkey.0, remote_addr),
        };
        // SAFETY: `local` lies inside registration `key` (checked above), and the
        // registration contract keeps the slot lent until a completion retires it.
        unsafe { wr.setup_sge(key, addr, sge_len) };
        guard.post().map_err(|e| call_failed("ibv_post_send", e))?;
        self.outstanding.insert(request.id.0, request.opcode);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, entries_max: usize) -> usize {
        let want = entries_max.min(POLL_ENTRIES_MAX);
        if self.pending.len() < want {
            self.fill_pending();
        }
        let n = want.min(self.pending.len());
        out.extend(self.pending.drain(..n));
        n
    }

    fn reset(&mut self) {
        if let Err(e) = self.fence() {
            self.broken = Some(e.to_string());
        }
    }
}

/// Pool slots and other caller-owned memory: `ibv_reg_mr` on the memory's own address and
/// length, so the keys cover exactly those bytes (and a post from anywhere else is refused as
/// `LocalProtectionError` before the device sees it).
impl RegisterHostMemory for VerbsEndpoint {
    unsafe fn register_host(
        &mut self,
        addr: std::ptr::NonNull<u8>,
        len_bytes: usize,
        access: Access,
    ) -> Result<MemoryRegion, NicError> {
        // SAFETY: `register_host`'s caller keeps `addr..addr + len_bytes` valid and in place
        // until the registration is deregistered or this endpoint dropped, which is what
        // `register_external` asks.
        unsafe { self.register_external(addr.as_ptr(), len_bytes, access) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> EndpointInfo {
        EndpointInfo {
            qp_num: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            mtu: 5,
            region_addr: 0x7f00_0000_1000,
            region_len: 4 << 20,
            rkey: 0xdead_beef,
        }
    }

    #[test]
    fn endpoint_info_round_trips() {
        let i = info();
        assert_eq!(EndpointInfo::decode(&i.encode()), Ok(i));
    }

    #[test]
    fn endpoint_info_refuses_what_a_peer_must_never_send() {
        let good = info().encode();
        let mut cases = Vec::new();
        let mut b = good;
        b[0] = b'X';
        cases.push((b, "magic"));
        let mut b = good;
        b[5] = 2;
        cases.push((b, "version"));
        let mut b = good;
        b[8] = 1;
        cases.push((b, "24 bits"));
        let mut b = good;
        b[52] = 9;
        cases.push((b, "mtu code 9"));
        let mut b = good;
        b[55] = 1;
        cases.push((b, "padding"));
        for (bytes, want) in cases {
            let e = EndpointInfo::decode(&bytes).expect_err(want);
            assert!(e.to_string().contains(want), "{e} lacks {want}");
        }
    }

    #[test]
    fn list_failures_name_what_is_missing() {
        assert_eq!(classify_list_failure(38, false, false), VerbsUnavailable::LibraryMissing);
        assert_eq!(
            classify_list_failure(38, true, false),
            VerbsUnavailable::KernelWithoutInfiniband { errno: 38 }
        );
        assert_eq!(classify_list_failure(0, true, false), VerbsUnavailable::NoDeviceNodes);
        assert_eq!(
            classify_list_failure(5, true, true),
            VerbsUnavailable::DeviceListFailed { errno: 5 }
        );
    }

    #[test]
    fn completion_statuses_map_onto_ours() {
        use WorkCompletionStatus as W;
        let cases = [
            (W::Success, CompletionStatus::Success),
            (W::WorkRequestFlushedError, CompletionStatus::Flushed),
            (W::LocalProtectionError, CompletionStatus::LocalProtectionError),
            (W::LocalLengthError, CompletionStatus::LocalProtectionError),
            (W::RemoteAccessError, CompletionStatus::RemoteAccessError),
            (W::RemoteInvalidRequestError, CompletionStatus::RemoteAccessError),
            (W::RetryCounterExceededError, CompletionStatus::RetryExceeded),
            (W::ResponderNotReadyRetryCounterExceededError, CompletionStatus::RetryExceeded),
            (W::FatalError, CompletionStatus::RetryExceeded),
        ];
        for (raw, want) in cases {
            assert_eq!(map_status(raw as u32), want, "{raw:?}");
        }
        assert_eq!(map_status(9_999), CompletionStatus::RetryExceeded);
    }

    /// On this project's development machines there is no InfiniBand at all: discovery must
    /// return the typed reason, never panic, and the reason must say what to install or enable.
    /// On an RDMA host it lists at least one device instead.
    #[test]
    fn discovery_is_typed_on_a_machine_without_rdma() {
        match discover() {
            Ok(devices) => assert!(!devices.is_empty(), "Ok means at least one device"),
            Err(NicError::VerbsUnavailable { reason }) => {
                let shown = reason.to_string();
                let names_a_fix = ["install", "enable", "modprobe", "rdma link add", "check"]
                    .iter()
                    .any(|w| shown.contains(w));
                assert!(names_a_fix, "{shown} names nothing to install or enable");
                // This machine: no /dev/infiniband, so never the generic "no device".
                if !Path::new("/dev/infiniband").exists() {
                    assert_ne!(reason, VerbsUnavailable::NoDevice);
                }
            }
            Err(other) => panic!("discovery failed with an untyped reason: {other}"),
        }
        // Opening follows discovery's verdict, also typed.
        if let Err(e) = VerbsConfig::default().open() {
            assert!(
                matches!(e, NicError::VerbsUnavailable { .. } | NicError::VerbsCall { .. }),
                "{e}"
            );
        }
    }
}
