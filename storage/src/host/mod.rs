//! Host memory that stores, transports and devices share: one place for huge pages, locked
//! pages and memfd segments.
//!
//! - [`arena`]: a pre-faulted region carved into block-sized pieces, for payloads that must not
//!   fault pages in on the write path.
//! - [`pool`]: huge-page backed (or locked, or plain) pools whose slots are registered with a
//!   transport or a device.
//! - [`segment`]: sealed memfd segments mapped by a client and its server, the descriptor
//!   passing that hands one over, and the arena that lends buffers inside it.

pub mod arena;
pub mod pool;
pub mod segment;
