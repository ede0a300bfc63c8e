//! Sequence numbers of one engine's event stream: what to do with the next
//! message (apply, skip a duplicate, fetch a gap from the replay endpoint, or
//! start over because the engine restarted). Pure, so every case is tested.

/// What to do with a live message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Apply,
    /// Already applied (it arrived again after a replay covered it).
    Duplicate,
    /// Messages `from..seq` never arrived: replay them first.
    Gap {
        from: u64,
    },
    /// The sequence went back without a replay to explain it: a new engine
    /// process (vLLM numbers from 0 at start). Forget the worker and resync.
    Reset,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Sequencer {
    /// The sequence number expected next; `None` before the first message.
    next: Option<u64>,
    /// The last sequence number a replay delivered: live messages up to it were
    /// queued while replaying and are duplicates.
    replayed_to: Option<u64>,
}

impl Sequencer {
    /// The sequence number expected next.
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// Classify a live message's sequence number.
    pub fn on_live(&self, seq: u64) -> Step {
        match self.next {
            None => Step::Apply,
            Some(n) if seq == n => Step::Apply,
            Some(n) if seq > n => Step::Gap { from: n },
            Some(_) if self.replayed_to.is_some_and(|r| seq <= r) => Step::Duplicate,
            Some(_) => Step::Reset,
        }
    }

    /// A replay from the start found nothing: the engine has published nothing
    /// yet, so its first message will be `seq` (vLLM numbers from 0).
    pub fn expect(&mut self, seq: u64) {
        if self.next.is_none() {
            self.next = Some(seq);
        }
    }

    /// `seq` was applied (live or replayed).
    pub fn applied(&mut self, seq: u64) {
        self.next = Some(seq + 1);
        if self.replayed_to.is_some_and(|r| seq > r) {
            self.replayed_to = None;
        }
    }

    /// A replay delivered messages up to `seq`.
    pub fn replayed(&mut self, seq: u64) {
        self.applied(seq);
        self.replayed_to = Some(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_gap_duplicate_and_reset() {
        let mut s = Sequencer::default();
        assert_eq!(
            s.on_live(5),
            Step::Apply,
            "the first message sets the start"
        );
        s.applied(5);
        assert_eq!(s.on_live(6), Step::Apply);
        s.applied(6);
        assert_eq!(s.on_live(9), Step::Gap { from: 7 });
        // The replay delivers 7..=9 (the buffer holds 9 too).
        s.replayed(9);
        // A late live copy of 8 (reordered) is a duplicate...
        assert_eq!(s.on_live(8), Step::Duplicate);
        assert_eq!(s.on_live(10), Step::Apply);
        s.applied(10);
        // ...but once past the replay, going back means a new engine.
        assert_eq!(s.on_live(0), Step::Reset);
        assert_eq!(s.next(), Some(11));
    }

    #[test]
    fn an_empty_replay_at_start_expects_sequence_zero() {
        let mut s = Sequencer::default();
        s.expect(0);
        // The engine's first messages were lost: fetch them.
        assert_eq!(s.on_live(3), Step::Gap { from: 0 });
        s.applied(3);
        s.expect(0);
        assert_eq!(s.next(), Some(4), "only before anything was applied");
    }
}
