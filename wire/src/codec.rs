//! Body primitives: little-endian integers, tagged options, length-prefixed text, bytes and
//! keys, and batch counts. The [`Writer`] records the first limit an encoding breaks instead of
//! failing at every call; the [`Reader`] fails at the first byte it cannot accept.

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::{KEY_BYTES_MAX, PhysicalKey};

use super::text::{self, intern};
use super::{BATCH_ITEMS_MAX, BODY_BYTES_MAX, TEXT_BYTES_MAX, WireError};

/// `usize` to `u64`; lossless on every target this builds for, saturating otherwise.
pub(super) fn wide(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Appends a message body to a buffer.
pub(super) struct Writer<'a> {
    out: &'a mut Vec<u8>,
    error: Option<WireError>,
}

impl<'a> Writer<'a> {
    pub(super) fn new(out: &'a mut Vec<u8>) -> Self {
        Self { out, error: None }
    }

    /// The first limit the encoding broke, if any.
    pub(super) fn finish(self) -> Result<(), WireError> {
        self.error.map_or(Ok(()), Err)
    }

    pub(super) fn fail(&mut self, error: WireError) {
        if self.error.is_none() {
            self.error = Some(error);
        }
    }

    /// Where the next byte goes; see [`Self::rewind`].
    pub(super) fn mark(&self) -> usize {
        self.out.len()
    }

    /// Drops everything written after `mark`.
    pub(super) fn rewind(&mut self, mark: usize) {
        self.out.truncate(mark);
    }

    pub(super) fn u8(&mut self, v: u8) {
        self.out.push(v);
    }

    pub(super) fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }

    /// `0`, or `1` then the value.
    pub(super) fn option_u64(&mut self, v: Option<u64>) {
        match v {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
        }
    }

    /// A `u32` length. A length over `u32::MAX` is far over [`BODY_BYTES_MAX`], so it fails the
    /// whole encoding.
    pub(super) fn len(&mut self, n: usize) {
        match u32::try_from(n) {
            Ok(n) => self.u32(n),
            Err(_) => {
                self.fail(WireError::TooLarge { len: wide(n), max: wide(BODY_BYTES_MAX) });
                self.u32(u32::MAX);
            }
        }
    }

    /// Length-prefixed UTF-8, clipped to [`TEXT_BYTES_MAX`] at a character boundary.
    pub(super) fn text(&mut self, s: &str) {
        let mut end = s.len().min(TEXT_BYTES_MAX);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        let clipped = s.get(..end).unwrap_or_default();
        self.len(clipped.len());
        self.out.extend_from_slice(clipped.as_bytes());
    }

    /// Fixed-size bytes, without a length.
    pub(super) fn raw(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }

    /// Fixed-size bytes, without a length, and their checksum, computed in the same pass as
    /// the copy ([`Checksum::extend_of`]).
    pub(super) fn raw_hashed(&mut self, b: &[u8]) -> Checksum {
        Checksum::extend_of(self.out, b)
    }

    /// Length-prefixed bytes.
    pub(super) fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.out.extend_from_slice(b);
    }

    /// A key as its length-prefixed GPCK encoding.
    pub(super) fn key(&mut self, key: &PhysicalKey) {
        self.bytes(key.encoded());
    }

    pub(super) fn tenant(&mut self, tenant: &TenantId) {
        self.text(tenant.as_str());
    }

    /// A batch count, refused over [`BATCH_ITEMS_MAX`].
    pub(super) fn count(&mut self, n: usize) {
        if n > BATCH_ITEMS_MAX {
            self.fail(WireError::TooMany {
                what: text::BATCH,
                count: wide(n),
                max: wide(BATCH_ITEMS_MAX),
            });
        }
        self.len(n);
    }
}

/// Reads a message body front to back.
pub(super) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(body: &'a [u8]) -> Self {
        Self { rest: body }
    }

    /// Refuses anything left over.
    pub(super) fn finish(self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes { count: wide(self.rest.len()) })
        }
    }

    pub(super) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if n > self.rest.len() {
            return Err(WireError::Truncated { what });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(
        &mut self,
        what: &'static str,
    ) -> Result<[u8; N], WireError> {
        let bytes = self.take(N, what)?;
        bytes.try_into().map_err(|_| WireError::Truncated { what })
    }

    pub(super) fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(super) fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(super) fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(super) fn magic(&mut self) -> Result<[u8; 4], WireError> {
        self.array(text::WIRE_ERROR)
    }

    pub(super) fn bool(&mut self, what: &'static str) -> Result<bool, WireError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(WireError::UnknownTag { what, tag }),
        }
    }

    pub(super) fn option_u64(&mut self, what: &'static str) -> Result<Option<u64>, WireError> {
        match self.u8(text::OPTION)? {
            0 => Ok(None),
            1 => self.u64(what).map(Some),
            tag => Err(WireError::UnknownTag { what: text::OPTION, tag }),
        }
    }

    /// A `u32` length that must fit in what is left (so nothing is allocated for bytes that
    /// are not there).
    pub(super) fn len(&mut self, what: &'static str) -> Result<usize, WireError> {
        let n = self.u32(what)?;
        let n = usize::try_from(n).map_err(|_| WireError::Truncated { what })?;
        if n > self.rest.len() {
            return Err(WireError::Truncated { what });
        }
        Ok(n)
    }

    pub(super) fn text(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.len(what)?;
        if n > TEXT_BYTES_MAX {
            return Err(WireError::TooMany { what, count: wide(n), max: wide(TEXT_BYTES_MAX) });
        }
        let bytes = self.take(n, what)?;
        std::str::from_utf8(bytes).map(str::to_owned).map_err(|_| WireError::Malformed { what })
    }

    /// Text mapped onto a known static string, or onto `unknown`.
    pub(super) fn static_text(
        &mut self,
        what: &'static str,
        unknown: &'static str,
    ) -> Result<&'static str, WireError> {
        Ok(intern(&self.text(what)?).unwrap_or(unknown))
    }

    pub(super) fn bytes(&mut self) -> Result<Vec<u8>, WireError> {
        self.bytes_ref().map(<[u8]>::to_vec)
    }

    /// Everything left, consumed.
    pub(super) fn take_rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.rest)
    }

    /// Length-prefixed bytes, borrowed from the body.
    pub(super) fn bytes_ref(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.len(text::BYTES)?;
        self.take(n, text::BYTES)
    }

    /// A strictly decoded GPCK key; `index` names it in the error.
    pub(super) fn key(&mut self, index: usize) -> Result<PhysicalKey, WireError> {
        let n = self.len(text::KEY)?;
        if n > KEY_BYTES_MAX {
            return Err(WireError::TooMany {
                what: text::KEY_BYTES,
                count: wide(n),
                max: wide(KEY_BYTES_MAX),
            });
        }
        let bytes = self.take(n, text::KEY)?;
        PhysicalKey::decode(bytes).map_err(|e| WireError::BadKey {
            index: u32::try_from(index).unwrap_or(u32::MAX),
            detail: e.to_string(),
        })
    }

    pub(super) fn tenant(&mut self) -> Result<TenantId, WireError> {
        let name = self.text(text::TENANT)?;
        TenantId::parse(&name).map_err(|_| WireError::Malformed { what: text::TENANT })
    }

    /// A batch count, refused over [`BATCH_ITEMS_MAX`].
    pub(super) fn count(&mut self) -> Result<usize, WireError> {
        let n = self.u32(text::BATCH)?;
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if n > BATCH_ITEMS_MAX {
            return Err(WireError::TooMany {
                what: text::BATCH,
                count: wide(n),
                max: wide(BATCH_ITEMS_MAX),
            });
        }
        Ok(n)
    }

    /// Room for a batch of `n` items: never more than the bytes left, since every item takes
    /// at least one.
    pub(super) fn batch<T>(&self, n: usize) -> Vec<T> {
        Vec::with_capacity(n.min(self.rest.len()))
    }
}
