//! The per-connection replay window over sealed request ids.

use gpucache_wire::WireError;

/// How many request ids below the highest one seen a connection remembers. An id further below
/// is refused as too old. A client that pipelines fewer requests than this never sees that.
pub const REPLAY_WINDOW_IDS: u64 = 1024;

const WORD_BITS: u64 = 64;
const WORDS: usize = (REPLAY_WINDOW_IDS / WORD_BITS) as usize;
const _: () = assert!(REPLAY_WINDOW_IDS.is_multiple_of(WORD_BITS) && WORDS > 0);

/// The request ids one sealed connection has accepted: the highest, and a bitmap of the
/// [`REPLAY_WINDOW_IDS`] ids at and below it (bit `i` is id `top - i`). Ids need not be
/// contiguous or in order; each is accepted once. Id 0 is never accepted.
#[derive(Debug, Clone, Default)]
pub struct ReplayWindow {
    top: u64,
    seen: [u64; WORDS],
}

impl ReplayWindow {
    pub fn new() -> Self {
        Self::default()
    }

    /// Accepts `id` once: [`WireError::Replayed`] for 0, an id seen before, or one at least
    /// [`REPLAY_WINDOW_IDS`] below the highest accepted.
    pub fn accept(&mut self, id: u64) -> Result<(), WireError> {
        let refused = Err(WireError::Replayed { request_id: id });
        if id == 0 {
            return refused;
        }
        if id > self.top {
            self.shift(id - self.top);
            self.top = id;
            self.set(0);
            return Ok(());
        }
        let below = self.top - id;
        if below >= REPLAY_WINDOW_IDS || self.get(below) {
            return refused;
        }
        self.set(below);
        Ok(())
    }

    fn get(&self, i: u64) -> bool {
        let (w, b) = split(i);
        self.seen.get(w).is_some_and(|word| word & (1 << b) != 0)
    }

    fn set(&mut self, i: u64) {
        let (w, b) = split(i);
        if let Some(word) = self.seen.get_mut(w) {
            *word |= 1 << b;
        }
    }

    /// Moves every bit `by` places up (older); bits pushed past the window are forgotten.
    fn shift(&mut self, by: u64) {
        if by >= REPLAY_WINDOW_IDS {
            self.seen = [0; WORDS];
            return;
        }
        let (words, bits) = split(by);
        for w in (0..WORDS).rev() {
            let high = w.checked_sub(words).and_then(|s| self.seen.get(s)).copied().unwrap_or(0);
            let low = if bits == 0 {
                0
            } else {
                w.checked_sub(words + 1)
                    .and_then(|s| self.seen.get(s))
                    .map_or(0, |v| v >> (WORD_BITS - bits))
            };
            if let Some(word) = self.seen.get_mut(w) {
                *word = (high << bits) | low;
            }
        }
    }
}

/// Word index and bit index of window position `i` (< [`REPLAY_WINDOW_IDS`]).
fn split(i: u64) -> (usize, u64) {
    (usize::try_from(i / WORD_BITS).unwrap_or(usize::MAX), i % WORD_BITS)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    /// The window's rule, stated plainly over every id ever accepted.
    fn model_accepts(accepted: &BTreeSet<u64>, id: u64) -> bool {
        let top = accepted.last().copied().unwrap_or(0);
        id != 0 && !accepted.contains(&id) && (id > top || top - id < REPLAY_WINDOW_IDS)
    }

    proptest! {
        #[test]
        fn window_matches_the_model(steps in prop::collection::vec((0u64..3000, any::<bool>()), 1..400)) {
            let mut window = ReplayWindow::new();
            let mut accepted = BTreeSet::new();
            let mut last = 0u64;
            for (delta, forward) in steps {
                // Mostly forward steps with gaps, sometimes back into (or past) the window.
                let id = if forward { last.saturating_add(delta % 70) } else { last.saturating_sub(delta) };
                let expected = model_accepts(&accepted, id);
                let got = window.accept(id);
                prop_assert_eq!(got.is_ok(), expected, "id {} after {:?}", id, accepted.last());
                if expected {
                    accepted.insert(id);
                    last = last.max(id);
                } else {
                    prop_assert_eq!(got, Err(WireError::Replayed { request_id: id }));
                }
            }
        }
    }

    #[test]
    fn repeats_zero_and_old_ids_are_refused() {
        let mut w = ReplayWindow::new();
        assert!(w.accept(0).is_err());
        assert_eq!(w.accept(5), Ok(()));
        assert!(w.accept(5).is_err());
        assert_eq!(w.accept(3), Ok(()), "an unseen id below the top is fine");
        assert!(w.accept(3).is_err());
        assert_eq!(w.accept(5 + REPLAY_WINDOW_IDS), Ok(()));
        assert!(w.accept(5).is_err(), "now older than the window");
        assert_eq!(w.accept(6), Ok(()), "the oldest id still inside the window");
        assert_eq!(w.accept(u64::MAX), Ok(()));
        assert!(w.accept(u64::MAX).is_err());
    }
}
