//! MGET and MSET: many keys read with one lookup batch and one get batch, or stored with put
//! batches, answering what the same commands one key at a time would.

use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{BatchGet, BatchPut, Lookup, MissReason, Put, StoreError};
use gpucache_wire::namespace::chain_link;
use gpucache_wire::resp::Reply;

use super::keys::{NotStored, RACE_ATTEMPTS, exists_text, looked_len, read_value};
use super::reply::shown;
use super::session::RespSession;

/// MSET's answer when pair `at` (from 0) was not stored. `batched` is `(end, stored)` when the
/// pairs after it up to `end` went to the store in the same batch, `stored` of them stored.
fn mset_stopped(
    pairs: &[(&[u8], &[u8])],
    at: usize,
    why: NotStored,
    batched: Option<(usize, usize)>,
) -> Reply {
    let why = match why {
        NotStored::Exists | NotStored::Absent => exists_text(),
        NotStored::Reply(Reply::Error(text)) => {
            text.strip_prefix("ERR ").unwrap_or(&text).to_owned()
        }
        NotStored::Reply(other) => format!("{other:?}"),
    };
    let n = pairs.len();
    let rest = match batched {
        Some((end, stored)) if end == at + 2 => format!(
            "pair {end} went to the store with it in one batch and was {}stored{}",
            if stored == 1 { "" } else { "not " },
            if end < n { ", the rest were not tried" } else { "" },
        ),
        Some((end, stored)) if end > at + 2 => format!(
            "pairs {} to {end} went to the store with it in one batch and {stored} of them were \
             stored{}",
            at + 2,
            if end < n { ", the rest were not tried" } else { "" },
        ),
        _ => "the rest were not tried".to_owned(),
    };
    Reply::err(format!(
        "MSET stopped at pair {} of {n} (key '{}'); the pairs before it were stored, {rest}: {why}",
        at + 1,
        shown(pairs[at].0),
    ))
}

/// One key of an MGET's batch read.
enum BatchRead {
    /// Its value, `None`, or the error that answers the MGET.
    Read(Result<Option<Vec<u8>>, Reply>),
    /// Replaced by a longer value between the lookup and the read: read it again.
    Again,
}

impl RespSession<'_> {
    /// Reads `keys` with one lookup batch and one get batch: the value or `None` per key, in
    /// order, for the keys up to the one whose length takes the values together past `budget`
    /// (that one included, so that reading it finds the limit passed); the keys after it are
    /// left unread (`None` in the answer), so the buffers stay within `budget` and one value.
    fn read_batch(&self, keys: &[PhysicalKey], budget: usize) -> Vec<Option<BatchRead>> {
        let refs: Vec<&PhysicalKey> = keys.iter().collect();
        let mut reads: Vec<Option<BatchRead>> = (0..keys.len()).map(|_| None).collect();
        let mut wanted: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut total: usize = 0;
        for (i, looked) in self.store.lookup_batch(self.caller, &refs).into_iter().enumerate() {
            match looked_len(looked) {
                Err(r) => reads[i] = Some(BatchRead::Read(Err(r))),
                Ok(None) => reads[i] = Some(BatchRead::Read(Ok(None))),
                Ok(Some(len)) => {
                    wanted.push((i, vec![0u8; len]));
                    total = total.saturating_add(len);
                }
            }
            if total > budget {
                break;
            }
        }
        let mut items: Vec<BatchGet<'_>> =
            wanted.iter_mut().map(|(i, value)| BatchGet { key: &keys[*i], dst: value }).collect();
        let mut answers = self.store.get_batch(self.caller, &mut items).into_iter();
        drop(items);
        for (i, value) in wanted {
            let got = answers.next().unwrap_or_else(|| {
                Err(StoreError::Backend {
                    operation: "get",
                    detail: "the store left this key unanswered".into(),
                    retirement: gpucache_dataplane::store::Retirement::Retired,
                })
            });
            reads[i] = Some(match read_value(got, value) {
                Some(read) => BatchRead::Read(read),
                None => BatchRead::Again,
            });
        }
        reads
    }

    /// MGET: one value or nil per key. The values together may be as large as one request may
    /// be, so that a reply cannot grow without bound. The keys are read as one lookup batch and
    /// one get batch; the answer is what reading them one by one, in order, answers (the first
    /// key that fails, or passes the limit, answers instead). A key read again because its
    /// value changed under the batch, or one past the limit, is read on its own.
    pub(super) fn mget(&self, keys: &[Vec<u8>]) -> Reply {
        let max = self.shared.config.limits.request_bytes_max;
        // The keys up to the first that does not map into the namespace: that one answers
        // once every key before it has been read.
        let mut physical = Vec::with_capacity(keys.len());
        let mut live = Vec::with_capacity(keys.len());
        let mut refused = None;
        for plain in keys {
            match self.live_key(plain) {
                Ok((key, is_live)) => {
                    physical.push(key);
                    live.push(is_live);
                }
                Err(r) => {
                    refused = Some(r);
                    break;
                }
            }
        }
        let reads = self.read_batch(&physical, max);
        let mut values = Vec::with_capacity(keys.len());
        let mut total: usize = 0;
        for ((key, read), is_live) in physical.iter().zip(reads).zip(live) {
            let value = match read {
                // Expired, but the store could not remove it.
                _ if !is_live => Ok(None),
                Some(BatchRead::Read(read)) => read,
                Some(BatchRead::Again) => self.read_within(key, RACE_ATTEMPTS - 1),
                None => self.read(key),
            };
            match value {
                Ok(Some(v)) => {
                    total += v.len();
                    if total > max {
                        return Reply::err(format!(
                            "MGET values exceed {max} bytes together; ask for fewer keys"
                        ));
                    }
                    values.push(Reply::Bulk(v));
                }
                Ok(None) => values.push(Reply::Nil),
                Err(r) => return r,
            }
        }
        if let Some(r) = refused {
            return r;
        }
        Reply::Array(values)
    }

    /// MSET: stores pairs in order, each as SET would; stops at the first one not stored. The
    /// keys are looked up as one batch first; each run of pairs whose keys are free then goes to
    /// the store as one put batch, and a pair whose key is not free (or whose value or key is
    /// refused before the store is asked) is stored as SET stores it, on its own. So the pairs
    /// after one that is not stored are not tried, unless they went to the store in the same
    /// batch (its key taken or the store refusing it after the lookup), which the answer says.
    pub(super) fn mset(&self, args: &[Vec<u8>]) -> Reply {
        let pairs: Vec<(&[u8], &[u8])> =
            args.chunks_exact(2).map(|p| (&p[0][..], &p[1][..])).collect();
        // The keys of the pairs up to the first the store would not be asked about.
        let keys: Vec<PhysicalKey> = pairs
            .iter()
            .map_while(|(plain, value)| {
                (!value.is_empty()).then(|| self.live_key(plain).ok().map(|(k, _)| k)).flatten()
            })
            .collect();
        let refs: Vec<&PhysicalKey> = keys.iter().collect();
        let free: Vec<bool> = if refs.is_empty() {
            Vec::new()
        } else {
            let looked = self.store.lookup_batch(self.caller, &refs);
            looked.iter().map(|l| matches!(l, Ok(Lookup::Miss(MissReason::Absent)))).collect()
        };
        let mut i = 0;
        while i < pairs.len() {
            let run = (i..keys.len()).take_while(|&j| free.get(j) == Some(&true)).count();
            if run == 0 {
                if let Err(why) = self.store_value(pairs[i].0, pairs[i].1, false) {
                    return mset_stopped(&pairs, i, why, None);
                }
                // Like SET without an expiry, MSET leaves its keys without a deadline.
                self.shared.expiries.forget(chain_link(pairs[i].0));
                i += 1;
                continue;
            }
            let batch: Vec<BatchPut<'_>> = (i..i + run)
                .map(|j| BatchPut { key: &keys[j], src: pairs[j].1, request: None })
                .collect();
            let mut answers: Vec<Option<Result<Put, StoreError>>> =
                self.store.put_batch(self.caller, &batch).into_iter().map(Some).collect();
            answers.resize_with(run, || None);
            for j in i..i + run {
                let answer = answers[j - i].take().unwrap_or_else(|| {
                    Err(StoreError::Backend {
                        operation: "put",
                        detail: "the store left this pair unanswered".into(),
                        retirement: gpucache_dataplane::store::Retirement::Retired,
                    })
                });
                if let Err(why) = self.settle(&keys[j], pairs[j].1, false, answer) {
                    let later = &answers[j + 1 - i..];
                    let mut stored = 0;
                    for (k, a) in (j + 1..).zip(later) {
                        if matches!(a, Some(Ok(Put::Committed(_)))) {
                            self.shared.expiries.forget(chain_link(pairs[k].0));
                            stored += 1;
                        }
                    }
                    return mset_stopped(&pairs, j, why, Some((i + run, stored)));
                }
                self.shared.expiries.forget(chain_link(pairs[j].0));
            }
            i += run;
        }
        Reply::ok()
    }
}
