//! The client of the native GPCW service, as a [`Store`], over pooled connections (one pool per
//! tenant and rights), each exchange with a deadline. A single-key call is one request frame
//! and its answer. A batch call ([`Store::lookup_batch`], [`Store::get_batch`],
//! [`Store::put_batch`], [`Store::invalidate_batch`]) is one exchange on one connection: the
//! batch is split into as few frames as the protocol's limits allow ([`BATCH_ITEMS_MAX`]
//! items, [`PAYLOAD_BYTES_MAX`] payload bytes), every frame is sent without waiting for the
//! answers before it (at most [`FRAMES_IN_FLIGHT_MAX`] unanswered), and each answer is landed
//! as it arrives. Every item gets its own answer; when the exchange breaks, every item whose
//! frame was not answered gets the failure, with the retirement its buffer is in.
//!
//! A tenant with [`Credentials`] in the configuration opens sealed sessions (ADR 0012): every
//! request is sealed with the session key and every answer's seal is checked before anything in
//! it is used; an answer that does not verify is a transport failure, never data.
//!
//! Over TCP the remote store never touches the caller's memory: a GET's bytes arrive in a frame
//! and are copied into the caller's buffer only after their checksum verifies, and a PUT's bytes
//! are sent before the call returns. So every failure, transport failures included, is retired
//! (`failures_retire` is true). A transport failure is never a hit: the caller recomputes.
//!
//! On the same host ([`LocalConfig`]) the client talks to the server's Unix socket instead and
//! hands it a sealed shared segment at connect; payloads then move through the segment, with
//! the same answers. A buffer from [`TcpStore::shared_buffer`] lives in the segment, so a GET
//! into it is written there by the server directly (no copy here) and a PUT from it is read from
//! there; any other buffer goes through a bounce buffer of the segment (one copy here, none
//! through the socket). The store verifies a block's checksum over the bytes it wrote into the
//! segment (that is what a hit means), so the client does not hash them again. A failed call
//! whose server side may still be writing a caller's shared buffer reports
//! [`Retirement::Unknown`]; a bounce buffer in that state is quarantined for good.
//!
//! The files, from the bottom up: `parts` (how a large PUT is split for striping), `config`
//! (how to reach a server), `errors` (failures as store errors), `conn` (one connection),
//! `shm` (the same-host path's bookkeeping), `tcp_store` (the [`TcpStore`] state), `hello`
//! (opening sessions), `exchange` (one request and its answer), `pool` (the pools and single
//! calls), `control` (the calls beside the trait), `pipeline` (batch exchanges), `land`
//! (landing GET answers), `single` (the one-item fast paths), `stripe` (one large PUT over
//! several connections), `store` (the `Store` implementation) and `staging` (the stage calls).
//!
//! [`Store`]: gpucache_dataplane::store::Store
//! [`Store::lookup_batch`]: gpucache_dataplane::store::Store::lookup_batch
//! [`Store::get_batch`]: gpucache_dataplane::store::Store::get_batch
//! [`Store::put_batch`]: gpucache_dataplane::store::Store::put_batch
//! [`Store::invalidate_batch`]: gpucache_dataplane::store::Store::invalidate_batch
//! [`BATCH_ITEMS_MAX`]: gpucache_wire::BATCH_ITEMS_MAX
//! [`PAYLOAD_BYTES_MAX`]: gpucache_wire::PAYLOAD_BYTES_MAX
//! [`Credentials`]: crate::Credentials
//! [`Retirement::Unknown`]: gpucache_dataplane::store::Retirement::Unknown

mod config;
mod conn;
mod control;
mod errors;
mod exchange;
mod hello;
mod land;
mod parts;
mod pipeline;
mod pool;
mod shm;
mod single;
mod staging;
mod store;
mod stripe;
mod tcp_store;

pub use config::{ClientConfig, HANDSHAKE_DEADLINE_DEFAULT, LocalConfig};
pub use control::PURGE_ROUNDS_MAX;
pub use hello::ConnectError;
pub use parts::{
    STRIPE_PART_BYTES_MIN, STRIPE_PARTS_DEFAULT, STRIPE_PARTS_MAX, STRIPE_THRESHOLD_DEFAULT,
    Stripe, split,
};
pub use pipeline::{FRAME_PAYLOAD_TARGET, FRAMES_IN_FLIGHT_MAX};
pub use shm::SharedStats;
pub use tcp_store::TcpStore;
