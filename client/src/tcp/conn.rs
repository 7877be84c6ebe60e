//! One pooled connection to the server: its socket (TCP, or the Unix socket on the same host),
//! its reused buffers and frame decoder, and the session key of a sealed session.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::ops::Range;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use gpucache_wire::FrameDecoder;
use gpucache_wire::seal::SealKey;

pub(super) const READ_CHUNK_BYTES: usize = 256 << 10;
/// Largest request buffer a connection keeps between requests.
pub(super) const OUT_BUFFER_KEEP_BYTES: usize = 8 << 20;

/// A connection's socket: TCP, or the server's Unix socket on the same host.
#[derive(Debug)]
pub(super) enum Stream {
    Tcp(TcpStream),
    Local(UnixStream),
}

impl Stream {
    pub(super) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(t),
            Self::Local(s) => s.set_read_timeout(t),
        }
    }

    pub(super) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(t),
            Self::Local(s) => s.set_write_timeout(t),
        }
    }

    /// A second handle on the same socket, for the thread that sends a batch's frames while
    /// this one reads their answers.
    pub(super) fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Local(s) => Self::Local(s.try_clone()?),
        })
    }

    pub(super) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Local(s) => s.shutdown(how),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Local(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Local(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write_vectored(bufs),
            Self::Local(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Local(s) => s.flush(),
        }
    }
}

#[derive(Debug)]
pub(super) struct Conn {
    pub(super) stream: Stream,
    /// The request being sent, reused between requests.
    pub(super) out: Vec<u8>,
    pub(super) decoder: FrameDecoder,
    pub(super) buf: Vec<u8>,
    /// Bytes of `buf` read from the socket and not yet fed to the decoder: the start of the
    /// next answer, when several answers arrived in one read.
    pub(super) pending: Range<usize>,
    /// The session key of a sealed session.
    pub(super) seal: Option<SealKey>,
    /// The cluster epoch this connection said it routes by (CLUSTER), if it said one.
    pub(super) declared: Option<u64>,
}
