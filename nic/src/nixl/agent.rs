//! The per-process NIXL agent: backends on request, peers' metadata in a bounded table.

use std::collections::BTreeSet;

use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, NixlError, OptArgs};

use super::common::{NixlProbe, PEERS_MAX};
use crate::error::{NicError, NixlUnavailable};

/// The NIXL backends this crate drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NixlBackend {
    /// Host (or GPU) memory to a peer agent's memory over the network.
    Ucx,
    /// Host memory to and from files on this host.
    Posix,
}

impl NixlBackend {
    /// The plugin name NIXL knows it by.
    pub fn plugin(self) -> &'static str {
        match self {
            Self::Ucx => "UCX",
            Self::Posix => "POSIX",
        }
    }
}

/// A NIXL call's failure as this crate's error.
pub(super) fn call_failed(call: &'static str) -> impl FnOnce(NixlError) -> NicError {
    move |e| NicError::NixlCall { call, detail: e.to_string() }
}

/// Refuses before any call that would abort the process when `libnixl_capi.so` is absent
/// (the stub library aborts on every entry point but this check).
fn library_loaded() -> Result<(), NixlUnavailable> {
    if nixl_sys::is_stub() { Err(NixlUnavailable::LibraryMissing) } else { Ok(()) }
}

fn plugins_of(agent: &Agent) -> Result<Vec<String>, NixlError> {
    let list = agent.get_available_plugins()?;
    list.iter().map(|p| p.map(str::to_owned)).collect()
}

pub(super) fn probe() -> Result<NixlProbe, NixlUnavailable> {
    library_loaded()?;
    let agent = Agent::new(&format!("gpucache-probe-{}", std::process::id()))
        .map_err(|e| NixlUnavailable::AgentCreate { detail: e.to_string() })?;
    let plugins = plugins_of(&agent)
        .map_err(|e| NixlUnavailable::AgentCreate { detail: format!("listing plugins: {e}") })?;
    Ok(NixlProbe { plugins })
}

/// One NIXL agent. Create one per process and share it (by `&`/`&mut`) between its pools and
/// transfers; it is `Send`, so it may move to the thread that drives it.
///
/// Its metadata ([`Self::local_metadata`]) names every memory registered so far: export it
/// after registering pools and files, and export it again after registering more.
#[derive(Debug)]
pub struct NixlAgent {
    agent: Agent,
    name: String,
    backends: BTreeSet<NixlBackend>,
    peers: BTreeSet<String>,
}

impl NixlAgent {
    /// Creates the agent named `name` (unique among the agents that will exchange metadata).
    /// No backend yet: see [`Self::enable`].
    pub fn new(name: &str) -> Result<Self, NicError> {
        let unavailable = |reason| NicError::NixlUnavailable { reason };
        library_loaded().map_err(unavailable)?;
        let agent = Agent::new(name)
            .map_err(|e| unavailable(NixlUnavailable::AgentCreate { detail: e.to_string() }))?;
        Ok(Self { agent, name: name.to_owned(), backends: BTreeSet::new(), peers: BTreeSet::new() })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The backend plugins NIXL can load here.
    pub fn plugins(&self) -> Result<Vec<String>, NicError> {
        plugins_of(&self.agent).map_err(call_failed("getAvailPlugins"))
    }

    /// Creates `backend` on this agent unless it exists already. Enable the backends before
    /// registering memory: a registration only reaches the backends that exist at the time.
    pub fn enable(&mut self, backend: NixlBackend) -> Result<(), NicError> {
        if self.backends.contains(&backend) {
            return Ok(());
        }
        let name = backend.plugin();
        let plugins = self.plugins()?;
        if !plugins.iter().any(|p| p == name) {
            return Err(NicError::NixlUnavailable {
                reason: NixlUnavailable::BackendMissing {
                    name: name.to_owned(),
                    available: plugins.join(", "),
                },
            });
        }
        let create = || -> Result<(), NixlError> {
            let (_mems, params) = self.agent.get_plugin_params(name)?;
            self.agent.create_backend(name, &params)?;
            Ok(())
        };
        create().map_err(|e| NicError::NixlUnavailable {
            reason: NixlUnavailable::BackendCreate { name: name.to_owned(), detail: e.to_string() },
        })?;
        self.backends.insert(backend);
        tracing::info!(agent = %self.name, backend = name, "NIXL backend created");
        Ok(())
    }

    pub fn is_enabled(&self, backend: NixlBackend) -> bool {
        self.backends.contains(&backend)
    }

    /// This agent's metadata (its backends' connection info and registered memory), to hand to
    /// peers over the control channel.
    pub fn local_metadata(&self) -> Result<Vec<u8>, NicError> {
        self.agent.get_local_md().map_err(call_failed("getLocalMD"))
    }

    /// Loads a peer's metadata and returns the peer's agent name. Loading a known peer again
    /// replaces its metadata. A new peer beyond [`PEERS_MAX`] is refused (and not kept).
    pub fn load_peer(&mut self, metadata: &[u8]) -> Result<String, NicError> {
        let peer = self.agent.load_remote_md(metadata).map_err(call_failed("loadRemoteMD"))?;
        if !self.peers.contains(&peer) && self.peers.len() >= PEERS_MAX {
            // The library kept it; drop it again so the table stays bounded.
            let _ = self.agent.invalidate_remote_md(&peer);
            return Err(NicError::NixlPeersFull { peers: self.peers.len(), max: PEERS_MAX });
        }
        self.peers.insert(peer.clone());
        Ok(peer)
    }

    /// Drops a peer's metadata (its connection goes with it). Returns whether it was loaded.
    pub fn forget_peer(&mut self, peer: &str) -> Result<bool, NicError> {
        if !self.peers.remove(peer) {
            return Ok(false);
        }
        self.agent.invalidate_remote_md(peer).map_err(call_failed("invalidateRemoteMD"))?;
        Ok(true)
    }

    pub fn knows_peer(&self, peer: &str) -> bool {
        self.peers.contains(peer)
    }

    pub fn peers(&self) -> impl Iterator<Item = &str> {
        self.peers.iter().map(String::as_str)
    }

    pub(super) fn raw(&self) -> &Agent {
        &self.agent
    }

    /// Optional arguments that pin a request or registration to `backend`.
    pub(super) fn args_for(&self, backend: NixlBackend) -> Result<OptArgs, NicError> {
        let handle =
            self.agent.get_backend(backend.plugin()).ok_or_else(|| NicError::NixlUnavailable {
                reason: NixlUnavailable::BackendMissing {
                    name: backend.plugin().to_owned(),
                    available: "not enabled on this agent (call NixlAgent::enable)".to_owned(),
                },
            })?;
        let mut args = OptArgs::new().map_err(call_failed("optArgs"))?;
        args.add_backend(&handle).map_err(call_failed("optArgs.addBackend"))?;
        Ok(args)
    }
}

/// One contiguous span to register: host memory (address, length) or a file (offset 0,
/// length, descriptor as device id).
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) mem: MemType,
    pub(super) dev_id: u64,
}

impl MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        std::ptr::with_exposed_provenance(self.addr)
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        self.mem
    }
    fn device_id(&self) -> u64 {
        self.dev_id
    }
}
