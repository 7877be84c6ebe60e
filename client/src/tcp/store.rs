//! The [`Store`] implementation of [`TcpStore`]: single-key calls as one-item batches, and the
//! GET and PUT batches over frames or the shared segment.

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchGet, BatchPut, Committed, FullPolicy, Get, Implementation,
    Invalidate, Located, Lookup, Put, Reclaimed, Reservation, Reserve, Retirement, Store,
    StoreError, StoreInfo, StoreStats, put_batch_verified,
};
use gpucache_wire::seal::SealKey;
use gpucache_wire::{GetItem, Request, Response, SharedGetItem, SharedPutItem, encode_put_request};

use super::errors::{check_right, transport, unexpected};
use super::land::{land_framed, land_shared_frame};
use super::pipeline::{FrameItems, every_answer, every_item, fill};
use super::shm::{Place, unknown_retirement};
use super::tcp_store::TcpStore;

fn single<T>(
    mut items: Vec<Result<T, StoreError>>,
    operation: &'static str,
) -> Result<T, StoreError> {
    if items.len() != 1 {
        return Err(transport(operation, format!("{} answers for one item", items.len())));
    }
    items.pop().unwrap_or_else(|| Err(transport(operation, "no answer")))
}

impl Store for TcpStore {
    fn info(&self) -> StoreInfo {
        let remote = self.remote_info();
        StoreInfo {
            name: "tcp",
            implementation: remote.map_or(Implementation::Real, |i| i.implementation),
            // Over TCP the remote never holds the caller's memory: every failure is retired.
            // On the shared segment a failed GET may still be written by the server.
            failures_retire: self.config.local.is_none(),
            full_policy: remote.map_or(FullPolicy::Refuse, |i| i.full_policy),
        }
    }

    fn epoch(&self) -> Epoch {
        match self.control(Request::Epoch, "epoch") {
            Ok(Response::Epoch(e)) => e,
            _ => Epoch(0),
        }
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        single(self.lookup_batch(caller, &[key]), "lookup")
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        single(self.get_batch(caller, &mut [BatchGet { key, dst }]), "get")
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        check_right(caller, Right::Write)?;
        match self.call(
            caller,
            Request::Reserve { key: Box::new(key.clone()), len, request },
            "reserve",
        )? {
            Response::Reserve(r) => r,
            other => Err(unexpected("reserve", &other)),
        }
    }

    fn write(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        check_right(caller, Right::Write)?;
        let request = Request::Write {
            reservation: copy_reservation(reservation),
            offset,
            data: src.to_vec(),
        };
        match self.call(caller, request, "write")? {
            Response::Write(r) => r,
            other => Err(unexpected("write", &other)),
        }
    }

    fn commit(&self, caller: &Caller, reservation: &Reservation) -> Result<Committed, StoreError> {
        check_right(caller, Right::Write)?;
        match self.call(
            caller,
            Request::Commit { reservation: copy_reservation(reservation) },
            "commit",
        )? {
            Response::Commit(r) => r,
            other => Err(unexpected("commit", &other)),
        }
    }

    fn abort(
        &self,
        caller: &Caller,
        reservation: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        check_right(caller, Right::Write)?;
        match self.call(caller, Request::Abort { reservation, outcome }, "abort")? {
            Response::Abort(r) => r,
            other => Err(unexpected("abort", &other)),
        }
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        single(self.put_batch(caller, &[BatchPut { key, src, request }]), "put")
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        single(self.invalidate_batch(caller, &[key]), "invalidate")
    }

    /// LOOKUP frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on one connection.
    ///
    /// [`BATCH_ITEMS_MAX`]: gpucache_wire::BATCH_ITEMS_MAX
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        self.keyed_batch(
            caller,
            keys,
            Right::Read,
            "lookup",
            |keys| Request::Lookup { keys },
            |response| match response {
                Response::Lookup(items) => Ok(items),
                other => Err(Box::new(other)),
            },
        )
    }

    /// LOCATE frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on one connection.
    ///
    /// [`BATCH_ITEMS_MAX`]: gpucache_wire::BATCH_ITEMS_MAX
    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        self.keyed_batch(
            caller,
            keys,
            Right::Read,
            "locate",
            |keys| Request::Locate { keys },
            |response| match response {
                Response::Locate(items) => Ok(items),
                other => Err(Box::new(other)),
            },
        )
    }

    /// GET (or, on the same-host path, GET_SHARED) frames within the protocol's limits,
    /// pipelined on one connection. An item whose frame was not answered fails with the
    /// exchange's failure: retired over TCP (its buffer is written only here, after its answer
    /// verified), and on the same-host path not retired when its frame may have been served
    /// straight into the caller's shared buffer (a bounce buffer in that state is quarantined,
    /// and the caller's own buffer is untouched).
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        if let Err(e) = check_right(caller, Right::Read) {
            return every_item(items.len(), &e);
        }
        let arena = match self.arena("get") {
            Ok(a) => a,
            Err(e) => return every_item(items.len(), &e),
        };
        if let ([item], None) = (&mut *items, arena) {
            return vec![self.get_one(caller, item.key, item.dst)];
        }
        let keys: Vec<&PhysicalKey> = items.iter().map(|i| i.key).collect();
        let capacities: Vec<u64> = items.iter().map(|i| i.dst.len() as u64).collect();
        let (frames, places) =
            self.plan_frames(arena, &capacities, |arena, i| Place::of(arena, items[i].dst));
        let encode = |f: usize, id: u64, seal: Option<&SealKey>, out: &mut Vec<u8>| {
            let frame = &frames[f];
            let request = match &frame.offsets {
                None => Request::Get {
                    items: frame
                        .items
                        .clone()
                        .map(|i| GetItem { key: keys[i].clone(), capacity: capacities[i] })
                        .collect(),
                },
                Some(offsets) => Request::GetShared {
                    items: frame
                        .items
                        .clone()
                        .zip(offsets)
                        .map(|(i, &offset)| SharedGetItem {
                            key: keys[i].clone(),
                            offset,
                            capacity: capacities[i],
                        })
                        .collect(),
                },
            };
            request.encode_sealed_frame(id, seal, out)
        };
        let mut dsts: Vec<&mut [u8]> = items.iter_mut().map(|i| &mut *i.dst).collect();
        let mut answers: Vec<Option<Result<Get, StoreError>>> =
            (0..dsts.len()).map(|_| None).collect();
        let outcome =
            self.batch_exchange(caller, "get", frames.len(), true, &encode, |f, frame| {
                let range = frames[f].items.clone();
                let got = match &places[f] {
                    None => land_framed(frame, &mut dsts[range.clone()]),
                    Some(places) => land_shared_frame(frame, places, &mut dsts[range.clone()]),
                };
                fill(&mut answers[range], got, "get");
            });
        // The caller's own shared buffers, which the server writes directly.
        let mut direct = vec![false; dsts.len()];
        for (frame, group) in frames.iter().zip(&places) {
            for (i, place) in frame.items.clone().zip(group.iter().flatten()) {
                direct[i] = matches!(place, Place::Caller(_));
            }
        }
        if let Err(stop) = &outcome {
            // The server may still be writing the ranges of a frame it was sent; the bounce
            // buffers of frames it never got go back to the segment (as do all the others).
            for (f, group) in places.into_iter().enumerate() {
                if stop.maybe_served(f) {
                    group.into_iter().flatten().for_each(Place::quarantine);
                }
            }
        }
        let item_frames: FrameItems = frames.iter().map(|f| f.items.clone()).collect();
        every_answer(answers, &item_frames, &outcome, "get", |i, maybe_served, e| {
            if maybe_served && direct[i] { unknown_retirement(e) } else { e }
        })
    }

    /// PUT (or, on the same-host path, PUT_SHARED) frames within the protocol's limits,
    /// pipelined on one connection; the bytes go into a frame straight from the caller's
    /// slices, hashed in the pass that copies them there. The server only reads what it is
    /// given, so every failure is retired (a bounce buffer whose frame may have been served is
    /// still kept out of reuse).
    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        self.put_items(caller, items, None)
    }

    /// As [`Self::put_batch`], with the caller's checksums sent as they are (the bytes are not
    /// hashed here); the server's store refuses an item whose bytes do not match its checksum.
    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        if expected.len() < items.len() {
            return put_batch_verified(items, expected, |sound| self.put_batch(caller, sound));
        }
        self.put_items(caller, items, Some(expected))
    }

    /// INVALIDATE frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on one connection.
    ///
    /// [`BATCH_ITEMS_MAX`]: gpucache_wire::BATCH_ITEMS_MAX
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        self.keyed_batch(
            caller,
            keys,
            Right::Write,
            "invalidate",
            |keys| Request::Invalidate { keys },
            |response| match response {
                Response::Invalidate(items) => Ok(items),
                other => Err(Box::new(other)),
            },
        )
    }

    fn expire_leases(&self) -> Result<usize, StoreError> {
        match self.control(Request::ExpireLeases, "expire_leases")? {
            Response::ExpireLeases(r) => r.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            other => Err(unexpected("expire_leases", &other)),
        }
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        match self.call(caller, Request::Attest { region }, "attest")? {
            Response::Attest(r) => r,
            other => Err(unexpected("attest", &other)),
        }
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        match self.control(Request::BumpEpoch, "bump_epoch")? {
            Response::BumpEpoch(r) => r,
            other => Err(unexpected("bump_epoch", &other)),
        }
    }

    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        match self.control(Request::ReclaimFenced { epoch }, "reclaim_fenced")? {
            Response::ReclaimFenced(r) => r.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            other => Err(unexpected("reclaim_fenced", &other)),
        }
    }

    fn stats(&self) -> StoreStats {
        match self.control(Request::Stats, "stats") {
            Ok(Response::Stats(s)) => s,
            _ => StoreStats::default(),
        }
    }
}

impl TcpStore {
    /// The batch PUT behind [`Store::put_batch`] and [`Store::put_batch_checked`]: `expected`,
    /// when given, holds one checksum per item.
    fn put_items(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: Option<&[Checksum]>,
    ) -> BatchAnswers<Put> {
        if let Err(e) = check_right(caller, Right::Write) {
            return every_item(items.len(), &e);
        }
        let arena = match self.arena("put") {
            Ok(a) => a,
            Err(e) => return every_item(items.len(), &e),
        };
        if let ([item], None) = (items, arena) {
            let sum = expected.and_then(|e| e.first().copied());
            if let Some(parts) = self.config.stripe.plan(item.src.len())
                && !self.config.credentials.contains_key(&caller.tenant)
            {
                return vec![self.put_striped(
                    caller,
                    item.key,
                    item.src,
                    item.request,
                    sum,
                    &parts,
                )];
            }
            if let Some(answer) = self.put_one(caller, item, sum) {
                return vec![answer];
            }
        }
        let sizes: Vec<u64> = items.iter().map(|i| i.src.len() as u64).collect();
        // Each item's checksum: the caller's, or the one its bounce copy computed.
        let mut sums: Vec<Option<Checksum>> =
            (0..items.len()).map(|i| expected.and_then(|e| e.get(i).copied())).collect();
        let (frames, places) = self.plan_frames(arena, &sizes, |arena, i| {
            let src = items[i].src;
            match Place::of(arena, src)? {
                Place::Bounce(mut b) => {
                    let copied = Checksum::copy_of(&mut b, src);
                    sums[i] = sums[i].or(copied);
                    Some(Place::Bounce(b))
                }
                direct => Some(direct),
            }
        });
        let encode = |f: usize, id: u64, seal: Option<&SealKey>, out: &mut Vec<u8>| {
            let frame = &frames[f];
            let batch = items.get(frame.items.clone()).unwrap_or_default();
            match &frame.offsets {
                None => encode_put_request(
                    id,
                    seal,
                    batch,
                    expected.and_then(|e| e.get(frame.items.clone())),
                    out,
                ),
                Some(offsets) => Request::PutShared {
                    items: batch
                        .iter()
                        .zip(offsets)
                        .zip(frame.items.clone())
                        .map(|((item, &offset), i)| SharedPutItem {
                            key: item.key.clone(),
                            request: item.request,
                            offset,
                            len: item.src.len() as u64,
                            checksum: sums[i].unwrap_or_else(|| Checksum::of(item.src)),
                        })
                        .collect(),
                }
                .encode_sealed_frame(id, seal, out),
            }
        };
        let mut answers: Vec<Option<Result<Put, StoreError>>> =
            (0..items.len()).map(|_| None).collect();
        let outcome =
            self.batch_exchange(caller, "put", frames.len(), false, &encode, |f, frame| {
                let range = frames[f].items.clone();
                let got = match (Response::from_frame(frame), frames[f].offsets.is_some()) {
                    (Ok(Response::Put(a)), false) | (Ok(Response::PutShared(a)), true) => Ok(a),
                    (Ok(other), _) => Err(unexpected("put", &other)),
                    (Err(e), _) => Err(transport("put", e)),
                };
                fill(&mut answers[range], got, "put");
            });
        if let Err(stop) = &outcome {
            // The server only reads these ranges, and refuses bytes that no longer match
            // their checksum; bounce buffers it may have been reading are still kept out of
            // reuse.
            for (f, group) in places.into_iter().enumerate() {
                if stop.maybe_served(f) {
                    group.into_iter().flatten().for_each(Place::quarantine);
                }
            }
        }
        let item_frames: FrameItems = frames.iter().map(|f| f.items.clone()).collect();
        every_answer(answers, &item_frames, &outcome, "put", |_, _, e| e)
    }
}

fn copy_reservation(r: &Reservation) -> Reservation {
    Reservation { region: r.region, epoch: r.epoch, len: r.len, request: r.request }
}
