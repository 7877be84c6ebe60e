//! The ids the configuration gives reactors and queues. The queues, the reactors and the errors
//! all name them, so they live below all three.

use std::fmt;

/// A reactor's id, explicit in the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReactorId(pub u16);

impl fmt::Display for ReactorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "reactor{}", self.0)
    }
}

/// A queue's id, explicit in the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueId(pub u32);

impl fmt::Display for QueueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "q{}", self.0)
    }
}
