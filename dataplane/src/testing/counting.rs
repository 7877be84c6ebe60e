//! A store decorator for tests of what calls a front makes: it records every keyed call (which
//! call, how many items, on which thread, one thread being one connection) and hands it to the
//! inner store unchanged; a hook can hold up a chosen `get_batch` call.

use std::sync::Mutex;
use std::thread::ThreadId;

use crate::caller::Caller;
use crate::key::PhysicalKey;
use crate::limits::RequestId;
use crate::store::{
    BatchAnswers, BatchGet, BatchPut, Get, Invalidate, Lookup, Put, Store, StoreError,
};

/// A keyed store call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Lookup,
    Get,
    Put,
    Invalidate,
    LookupBatch,
    GetBatch,
    PutBatch,
    InvalidateBatch,
    /// [`Store::get_one`]: one key, lent or copied.
    GetOne,
}

/// One recorded call: which, with how many items, on which thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub call: Call,
    pub items: usize,
    pub thread: ThreadId,
}

/// Runs before the `n`th (from 0) `get_batch` call reaches the inner store.
type BeforeBatch = Box<dyn Fn(usize) + Send + Sync>;

pub struct Counting<S> {
    inner: S,
    seen: Mutex<Vec<Seen>>,
    before_get_batch: Option<BeforeBatch>,
}

impl<S> std::fmt::Debug for Counting<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counting").finish_non_exhaustive()
    }
}

impl<S: Store> Counting<S> {
    pub fn new(inner: S) -> Self {
        Self { inner, seen: Mutex::default(), before_get_batch: None }
    }

    /// Runs `hook` with its index before every `get_batch` call.
    pub fn before_get_batch(mut self, hook: impl Fn(usize) + Send + Sync + 'static) -> Self {
        self.before_get_batch = Some(Box::new(hook));
        self
    }

    /// Every call so far, in order; forgets them.
    pub fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.seen.lock().expect("seen"))
    }

    /// The calls so far as (call, items), in order; forgets them.
    pub fn take_calls(&self) -> Vec<(Call, usize)> {
        self.take().into_iter().map(|s| (s.call, s.items)).collect()
    }

    /// Records a call; returns how many of its kind came before it.
    fn saw(&self, call: Call, items: usize) -> usize {
        let mut seen = self.seen.lock().expect("seen");
        let before = seen.iter().filter(|s| s.call == call).count();
        seen.push(Seen { call, items, thread: std::thread::current().id() });
        before
    }
}

impl<S: Store> crate::store::StoreLayer for Counting<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: Store> crate::store::Store for Counting<S> {
    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        self.saw(Call::Lookup, 1);
        self.inner.lookup(caller, key)
    }
    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        self.saw(Call::Get, 1);
        self.inner.get_into(caller, key, dst)
    }
    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        self.saw(Call::Invalidate, 1);
        self.inner.invalidate(caller, key)
    }
    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        self.saw(Call::Put, 1);
        self.inner.put(caller, key, src, request)
    }
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        self.saw(Call::LookupBatch, keys.len());
        self.inner.lookup_batch(caller, keys)
    }
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let before = self.saw(Call::GetBatch, items.len());
        if let Some(hook) = &self.before_get_batch {
            hook(before);
        }
        self.inner.get_batch(caller, items)
    }
    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn crate::store::GetTo,
    ) -> Result<crate::store::GotOne, StoreError> {
        self.saw(Call::GetOne, 1);
        self.inner.get_one(caller, key, capacity, to)
    }
    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        self.saw(Call::PutBatch, items.len());
        self.inner.put_batch(caller, items)
    }
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        self.saw(Call::InvalidateBatch, keys.len());
        self.inner.invalidate_batch(caller, keys)
    }
    crate::forward_store!(fences, reports, info, reserve, write, commit, abort, scope_keys);
}
