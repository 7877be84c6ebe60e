//! Caller memory as a byte range: a raw address with a size, an object with the buffer
//! protocol (bytes, bytearray, memoryview, a numpy array), or a torch tensor (duck-typed: its
//! `data_ptr()`, `numel()`, `element_size()`, `is_contiguous()` and a CPU `device`).
//!
//! The stable ABI of Python 3.9 has no buffer-protocol calls (they joined it in 3.11), but
//! `PyObject_GetBuffer`, `PyBuffer_Release` and the `Py_buffer` layout have been exported,
//! unchanged, by every CPython 3 release; they are declared here. A view is held (so a
//! bytearray cannot be resized, nor the memory freed) until the range is dropped.

use std::ffi::{c_char, c_int, c_void};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyInt;

/// `Py_buffer`, as CPython lays it out since 3.3.
#[repr(C)]
struct RawView {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

/// `PyBUF_SIMPLE`: one contiguous run of bytes.
const BUF_SIMPLE: c_int = 0;
/// `PyBUF_WRITABLE`.
const BUF_WRITABLE: c_int = 1;

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawView);
}

/// What keeps a range's memory alive and in place.
enum Hold {
    /// A raw address: the caller vouches for it.
    Raw,
    /// A buffer-protocol view, released on drop.
    View(Box<RawView>),
    /// A tensor, kept referenced.
    Object(#[allow(dead_code)] Py<PyAny>),
}

/// A caller's byte range, valid while this lives.
pub(crate) struct Range {
    pub(crate) ptr: usize,
    pub(crate) len: usize,
    hold: Hold,
}

impl std::fmt::Debug for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Range({:#x}, {})", self.ptr, self.len)
    }
}

impl Range {
    /// A range inside an object that `obj` keeps alive.
    pub(crate) fn held(ptr: usize, len: usize, obj: Py<PyAny>) -> Self {
        Self { ptr, len, hold: Hold::Object(obj) }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        if let Hold::View(view) = &mut self.hold {
            Python::attach(|_| {
                // SAFETY: the view was filled by a successful PyObject_GetBuffer and is
                // released once, here, with the GIL held.
                unsafe { PyBuffer_Release(&mut **view) }
            });
        }
    }
}

/// Which way the bytes go: a destination must be writable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

/// `obj` as a byte range of `size` bytes (all of it when `size` is `None`; a raw address needs
/// `size`).
pub(crate) fn range_of(
    obj: &Bound<'_, PyAny>,
    size: Option<usize>,
    access: Access,
) -> PyResult<Range> {
    if obj.is_instance_of::<PyInt>() {
        let ptr: usize = obj
            .extract()
            .map_err(|_| PyValueError::new_err("a raw address must be a non-negative int"))?;
        let len = size.ok_or_else(|| PyValueError::new_err("a raw address needs size="))?;
        if ptr == 0 {
            return Err(PyValueError::new_err("the address is null"));
        }
        if ptr.checked_add(len).is_none() {
            return Err(PyValueError::new_err("address + size overflows"));
        }
        return Ok(Range { ptr, len, hold: Hold::Raw });
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("element_size")? {
        return tensor_range(obj, size);
    }
    let mut view = Box::new(RawView {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    });
    let flags = if access == Access::Write { BUF_SIMPLE | BUF_WRITABLE } else { BUF_SIMPLE };
    // SAFETY: `obj` is a live object (the GIL is held through `Bound`) and `view` points to
    // writable memory of Py_buffer's size and layout.
    let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
    if rc != 0 {
        let why = PyErr::take(obj.py())
            .map_or_else(|| "no buffer".to_owned(), |e| e.value(obj.py()).to_string());
        let what = match access {
            Access::Write => "a writable contiguous buffer",
            Access::Read => "a contiguous buffer",
        };
        return Err(PyTypeError::new_err(format!(
            "expected an int address, {what} (bytearray, memoryview, numpy array) or a torch \
             tensor, got {}: {why}",
            obj.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
        )));
    }
    let whole = usize::try_from(view.len).unwrap_or(0);
    let ptr = view.buf as usize;
    // Made before the size check, so that a refused size still releases the view.
    let mut range = Range { ptr, len: whole, hold: Hold::View(view) };
    range.len = fit(size, whole)?;
    Ok(range)
}

/// `size` bytes of a `whole`-byte object, refused when it does not fit.
fn fit(size: Option<usize>, whole: usize) -> PyResult<usize> {
    match size {
        None => Ok(whole),
        Some(n) if n <= whole => Ok(n),
        Some(n) => {
            Err(PyValueError::new_err(format!("size={n} exceeds the object's {whole} bytes")))
        }
    }
}

fn tensor_range(t: &Bound<'_, PyAny>, size: Option<usize>) -> PyResult<Range> {
    let device: String = t.getattr("device")?.getattr("type")?.extract()?;
    if device != "cpu" {
        return Err(PyValueError::new_err(format!(
            "a tensor on {device} is not host memory; copy it to a CPU (pinned) tensor"
        )));
    }
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err("the tensor is not contiguous"));
    }
    let numel: usize = t.call_method0("numel")?.extract()?;
    let element: usize = t.call_method0("element_size")?.extract()?;
    let whole =
        numel.checked_mul(element).ok_or_else(|| PyValueError::new_err("tensor size overflows"))?;
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    let len = fit(size, whole)?;
    if ptr == 0 && len > 0 {
        return Err(PyValueError::new_err("the tensor has no storage"));
    }
    Ok(Range { ptr, len, hold: Hold::Object(t.clone().unbind()) })
}

/// Refuses destinations that overlap one another (two writes into the same bytes).
pub(crate) fn disjoint(ranges: &[Range]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, usize)> =
        ranges.iter().enumerate().map(|(i, r)| (r.ptr, r.ptr + r.len, i)).collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[0].1 > w[1].0 && w[0].0 != w[0].1 && w[1].0 != w[1].1 {
            return Err(PyValueError::new_err(format!(
                "destinations {} and {} overlap",
                w[0].2.min(w[1].2),
                w[0].2.max(w[1].2)
            )));
        }
    }
    Ok(())
}

/// A range's address and length, to cross into code that runs without the GIL.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    ptr: usize,
    len: usize,
}

impl Span {
    pub(crate) fn of(r: &Range) -> Self {
        Self { ptr: r.ptr, len: r.len }
    }

    /// The bytes to read.
    ///
    /// # Safety
    /// The range must stay valid and unwritten by others for the borrow's lifetime.
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller keeps the range valid; it is non-empty and non-null.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The bytes to write.
    ///
    /// # Safety
    /// The range must stay valid, and no other reference may touch it, for the borrow's
    /// lifetime.
    pub(crate) unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above, and the caller guarantees exclusivity (see [`disjoint`]).
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}
