//! The offline references a replay is read against, computed over the same reference sequence
//! with the same prefix-hit counting as the store replay:
//!
//! - [`belady`]: on each insertion into a full cache, the resident block (or the incoming one)
//!   whose next reference lies farthest in the future leaves; a block never referenced again is
//!   the farthest of all, so it never displaces one that is referenced again.
//! - [`lru`]: plain least recently used, where a prefix hit touches a block and a PUT of a block
//!   already resident does not (as the store's create-only PUT answers `AlreadyCommitted`
//!   without touching the policy).
//!
//! Both walk each request the same way: count leading resident blocks as hits, stop at the first
//! miss, then insert every block from there to the end that is not resident.

use std::collections::{BTreeMap, BTreeSet};

use super::load::Trace;

/// Hits and references of one offline run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub hits: u64,
    pub refs: u64,
}

impl Outcome {
    pub fn ratio(self) -> f64 {
        crate::stats::share(self.hits, self.refs)
    }
}

/// No further reference.
const NEVER: u64 = u64::MAX;

/// For every position of the flattened reference sequence, the position of the same block's
/// next reference ([`NEVER`] when there is none).
fn next_uses(trace: &Trace) -> Vec<u64> {
    let total = trace.refs();
    let mut next = vec![NEVER; usize::try_from(total).unwrap_or(usize::MAX)];
    let mut seen = vec![NEVER; trace.unique_blocks()];
    let mut pos = total;
    for req in trace.requests.iter().rev() {
        for &b in req.iter().rev() {
            pos -= 1;
            let p = usize::try_from(pos).unwrap_or(usize::MAX);
            next[p] = seen[b as usize];
            seen[b as usize] = pos;
        }
    }
    next
}

/// Belady's bound at `capacity` blocks.
pub fn belady(trace: &Trace, capacity: u64) -> Outcome {
    let next = next_uses(trace);
    // Each resident block's next reference; the set orders them so the farthest is last.
    let mut key = vec![None::<u64>; trace.unique_blocks()];
    let mut by_next: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut out = Outcome { hits: 0, refs: 0 };
    let mut pos = 0usize;
    for req in &trace.requests {
        let mut missed = false;
        for &b in req {
            let n = next[pos];
            pos += 1;
            out.refs += 1;
            let slot = &mut key[b as usize];
            if let Some(old) = *slot {
                by_next.remove(&(old, b));
                by_next.insert((n, b));
                *slot = Some(n);
                if !missed {
                    out.hits += 1;
                }
                continue;
            }
            missed = true;
            if (by_next.len() as u64) >= capacity {
                match by_next.last().copied() {
                    // The incoming block is needed no sooner than every resident: keep them.
                    Some((far, _)) if n >= far => continue,
                    Some((far, victim)) => {
                        by_next.remove(&(far, victim));
                        key[victim as usize] = None;
                    }
                    None => continue, // capacity 0
                }
            }
            by_next.insert((n, b));
            key[b as usize] = Some(n);
        }
    }
    out
}

/// Plain LRU at `capacity` blocks.
pub fn lru(trace: &Trace, capacity: u64) -> Outcome {
    let mut stamp_of = vec![None::<u64>; trace.unique_blocks()];
    let mut by_stamp: BTreeMap<u64, u32> = BTreeMap::new();
    let mut clock = 0u64;
    let mut out = Outcome { hits: 0, refs: 0 };
    for req in &trace.requests {
        out.refs += req.len() as u64;
        let mut i = 0;
        while i < req.len() {
            let b = req[i];
            let Some(old) = stamp_of[b as usize] else { break };
            by_stamp.remove(&old);
            clock += 1;
            by_stamp.insert(clock, b);
            stamp_of[b as usize] = Some(clock);
            out.hits += 1;
            i += 1;
        }
        for &b in &req[i..] {
            if stamp_of[b as usize].is_some() || capacity == 0 {
                continue;
            }
            if by_stamp.len() as u64 >= capacity
                && let Some((_, victim)) = by_stamp.pop_first()
            {
                stamp_of[victim as usize] = None;
            }
            clock += 1;
            by_stamp.insert(clock, b);
            stamp_of[b as usize] = Some(clock);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(requests: &[&[u64]]) -> Trace {
        Trace::from_ids("t", requests.iter().map(|r| r.to_vec()))
    }

    #[test]
    fn unlimited_capacity_gives_the_prefix_reuse_bound() {
        // Request 2 reuses 0,1 then misses; request 3 reuses 0,1,2.
        let t = trace(&[&[0, 1, 2], &[0, 1, 3], &[0, 1, 2]]);
        assert_eq!(belady(&t, 100), Outcome { hits: 5, refs: 9 });
        assert_eq!(lru(&t, 100), Outcome { hits: 5, refs: 9 });
    }

    #[test]
    fn belady_keeps_what_is_needed_next_and_lru_forgets_it() {
        // Capacity 2, one-block requests. LRU: 0, 1 stored; 2 evicts 0 -> {1,2}; 0 misses,
        // evicts 1 -> {2,0}; 1 misses, evicts 2 -> {0,1}: no hits. Belady: 2 is never used
        // again, so it is not admitted; 0 and 1 hit: 2 hits.
        let t = trace(&[&[0], &[1], &[2], &[0], &[1]]);
        assert_eq!(lru(&t, 2), Outcome { hits: 0, refs: 5 });
        assert_eq!(belady(&t, 2), Outcome { hits: 2, refs: 5 });
    }

    #[test]
    fn a_resident_block_after_the_first_miss_is_no_hit() {
        // Capacity 2. [0,1] -> {0,1}; [2] evicts 0 -> {1,2}; [0,1]: 0 misses, so the resident
        // 1 behind it is no hit. Belady keeps 0 and 1 (2 is never used again): 2 hits.
        let t = trace(&[&[0, 1], &[2], &[0, 1]]);
        assert_eq!(lru(&t, 2), Outcome { hits: 0, refs: 5 });
        assert_eq!(belady(&t, 2), Outcome { hits: 2, refs: 5 });
    }

    #[test]
    fn next_uses_point_at_the_following_reference_of_the_same_block() {
        let t = trace(&[&[0, 1], &[0], &[0, 1]]);
        assert_eq!(next_uses(&t), vec![2, 4, 3, NEVER, NEVER]);
    }
}
