//! Who is asking: the authenticated tenant of a request and what it may do. Transports fill it
//! in from their authentication; the store checks it against the key's tenant.

use crate::identity::TenantId;

/// A right a caller may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Right {
    Read,
    Write,
    Admin,
}

impl std::fmt::Display for Right {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Admin => "admin",
        })
    }
}

/// The rights of one caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rights {
    pub read: bool,
    pub write: bool,
    pub admin: bool,
}

impl Rights {
    pub const READ_WRITE: Rights = Rights { read: true, write: true, admin: false };
    pub const READ_ONLY: Rights = Rights { read: true, write: false, admin: false };
    pub const ALL: Rights = Rights { read: true, write: true, admin: true };

    pub fn has(self, right: Right) -> bool {
        match right {
            Right::Read => self.read,
            Right::Write => self.write,
            Right::Admin => self.admin,
        }
    }
}

/// An authenticated caller. Reads and writes are confined to the caller's own tenant whatever
/// its rights; `admin` additionally allows attesting another tenant's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: TenantId,
    pub rights: Rights,
}

impl Caller {
    pub fn new(tenant: TenantId, rights: Rights) -> Self {
        Self { tenant, rights }
    }
}
