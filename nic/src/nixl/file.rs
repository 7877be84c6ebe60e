//! [`NixlFile`]: a file registered with the agent's POSIX backend, so blocks can move between
//! a slot and a range of it ([`super::NixlTransfers::read_file`], `write_file`).

use std::fs::File;
use std::os::fd::AsRawFd;

use nixl_sys::{MemType, RegistrationHandle};

use super::agent::{NixlAgent, NixlBackend, Span, call_failed};
use crate::error::NicError;

/// A file registered for NIXL's POSIX backend over `0..registered_bytes`.
#[derive(Debug)]
pub struct NixlFile {
    // Field order is drop order: deregister before the descriptor closes.
    registration: RegistrationHandle,
    file: File,
    registered_bytes: u64,
    readable: bool,
    writable: bool,
}

impl NixlFile {
    /// Registers `file` for ranges within `0..registered_bytes`, creating the agent's POSIX
    /// backend if it does not exist yet. The descriptor's access mode is read once here, so a
    /// transfer the mode forbids is refused before anything is posted.
    pub fn register(
        agent: &mut NixlAgent,
        file: File,
        registered_bytes: u64,
    ) -> Result<Self, NicError> {
        let fd = file.as_raw_fd();
        // SAFETY: F_GETFL only reads the descriptor's flags; `file` owns `fd` and keeps it open.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            let detail = std::io::Error::last_os_error().to_string();
            return Err(NicError::NixlFileAccess { fd, op: "be registered", detail });
        }
        let mode = flags & libc::O_ACCMODE;
        let len = usize::try_from(registered_bytes).ok().filter(|n| *n > 0).ok_or(
            NicError::NixlFileRange { offset: 0, len_bytes: registered_bytes, limit_bytes: 0 },
        )?;
        agent.enable(NixlBackend::Posix)?;
        let span = Span { addr: 0, len, mem: MemType::File, dev_id: fd as u64 };
        let args = agent.args_for(NixlBackend::Posix)?;
        let registration = agent
            .raw()
            .register_memory(&span, Some(&args))
            .map_err(call_failed("registerMem(FILE)"))?;
        Ok(Self {
            registration,
            file,
            registered_bytes,
            readable: mode == libc::O_RDONLY || mode == libc::O_RDWR,
            writable: mode == libc::O_WRONLY || mode == libc::O_RDWR,
        })
    }

    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    pub fn registered_bytes(&self) -> u64 {
        self.registered_bytes
    }

    /// Checks a range before a transfer: inside the registration, allowed by the access mode,
    /// and for reads, inside the file as it is now (a short file is refused, not half-read).
    pub(super) fn check(&self, write: bool, offset: u64, len_bytes: u64) -> Result<(), NicError> {
        let fd = self.fd();
        let (allowed, op, why) = if write {
            (self.writable, "write", "it was opened read-only")
        } else {
            (self.readable, "read", "it was opened write-only")
        };
        if !allowed {
            return Err(NicError::NixlFileAccess { fd, op, detail: why.to_owned() });
        }
        let end = offset.checked_add(len_bytes);
        let range =
            NicError::NixlFileRange { offset, len_bytes, limit_bytes: self.registered_bytes };
        if len_bytes == 0 || end.is_none_or(|e| e > self.registered_bytes) {
            return Err(range);
        }
        if !write {
            let file_bytes = self
                .file
                .metadata()
                .map_err(|e| NicError::NixlFileAccess { fd, op, detail: e.to_string() })?
                .len();
            if end.is_none_or(|e| e > file_bytes) {
                return Err(NicError::NixlFileRange { offset, len_bytes, limit_bytes: file_bytes });
            }
        }
        debug_assert!(self.registration.agent_name().is_some(), "registration dropped early");
        Ok(())
    }
}
