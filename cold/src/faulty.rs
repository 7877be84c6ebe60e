//! [`FaultyObjects`]: any [`ColdObjects`] with seeded faults, for tests of what sits above.
//!
//! Each call draws from one seeded generator, so a seed replays the same faults in the same
//! order of calls. A fault is one of: a server error before the call reaches the store
//! (nothing happened), a timeout before it (nothing happened), a lost acknowledgement (a PUT
//! or DELETE took effect but its caller is told it failed), a torn range (a GET hands back
//! only part of what it read), or latency (the call waits `latency_ms` first; a read whose
//! caller allows less waits that long and times out). Every injected failure is `Transient`,
//! as the real ones are.

use std::ops::Range;
use std::sync::Mutex;
use std::time::Duration;

use gpucache_dataplane::rng::SplitMix64;

use crate::objects::{ColdError, ColdObjects};

/// How often each fault strikes, in calls per thousand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    pub seed: u64,
    pub server_errors: u32,
    pub timeouts: u32,
    pub lost_acks: u32,
    pub torn_ranges: u32,
    /// Calls per thousand that wait [`FaultPlan::latency_ms`] before they go on.
    pub slow: u32,
    pub latency_ms: u64,
}

impl FaultPlan {
    /// No faults at all.
    pub fn none(seed: u64) -> Self {
        Self {
            seed,
            server_errors: 0,
            timeouts: 0,
            lost_acks: 0,
            torn_ranges: 0,
            slow: 0,
            latency_ms: 0,
        }
    }
}

/// Which fault a call met, for the log a test keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    None,
    ServerError,
    Timeout,
    LostAck,
    TornRange,
    Slow,
}

/// A store with seeded faults (see the module documentation).
#[derive(Debug)]
pub struct FaultyObjects<S> {
    inner: S,
    plan: FaultPlan,
    rng: Mutex<SplitMix64>,
    log: Mutex<Vec<FaultKind>>,
}

/// Calls whose fault a store remembers, for [`FaultyObjects::faults`].
const FAULT_LOG_MAX: usize = 1 << 16;

impl<S: ColdObjects> FaultyObjects<S> {
    pub fn new(inner: S, plan: FaultPlan) -> Self {
        Self {
            inner,
            plan,
            rng: Mutex::new(SplitMix64::new(plan.seed)),
            log: Mutex::new(Vec::new()),
        }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The fault each call met, in call order (the first [`FAULT_LOG_MAX`] calls).
    pub fn faults(&self) -> Vec<FaultKind> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// This call's fault, among those that apply to it.
    fn draw(&self, lost_ack: bool, torn: bool) -> FaultKind {
        let roll = self.rng.lock().unwrap_or_else(|e| e.into_inner()).next_u64() % 1000;
        let p = &self.plan;
        let shares = [
            (p.server_errors, FaultKind::ServerError, true),
            (p.timeouts, FaultKind::Timeout, true),
            (p.lost_acks, FaultKind::LostAck, lost_ack),
            (p.torn_ranges, FaultKind::TornRange, torn),
            (p.slow, FaultKind::Slow, true),
        ];
        let mut edge = 0u64;
        let mut kind = FaultKind::None;
        for (share, fault, applies) in shares {
            if !applies {
                continue;
            }
            edge += u64::from(share);
            if roll < edge {
                kind = fault;
                break;
            }
        }
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if log.len() < FAULT_LOG_MAX {
            log.push(kind);
        }
        kind
    }

    /// A slow call's wait, at most `within`; whether the call may go on after it.
    fn wait(&self, within: Option<Duration>) -> bool {
        let latency = Duration::from_millis(self.plan.latency_ms);
        let allowed = within.unwrap_or(latency);
        std::thread::sleep(latency.min(allowed));
        latency <= allowed
    }
}

fn injected(operation: &'static str, key: &str, what: &str) -> ColdError {
    ColdError::Transient {
        operation,
        key: key.to_owned(),
        detail: format!("simulated {what} (seeded fault)"),
    }
}

impl<S: ColdObjects> ColdObjects for FaultyObjects<S> {
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError> {
        match self.draw(true, false) {
            FaultKind::ServerError => Err(injected("put", key, "server error 500")),
            FaultKind::Timeout => Err(injected("put", key, "timeout")),
            FaultKind::LostAck => {
                self.inner.put_new(key, bytes)?;
                Err(injected("put", key, "lost acknowledgement"))
            }
            FaultKind::Slow => {
                self.wait(None);
                self.inner.put_new(key, bytes)
            }
            _ => self.inner.put_new(key, bytes),
        }
    }

    fn head(&self, key: &str) -> Result<Option<u64>, ColdError> {
        match self.draw(false, false) {
            FaultKind::ServerError => Err(injected("head", key, "server error 500")),
            FaultKind::Timeout => Err(injected("head", key, "timeout")),
            FaultKind::Slow => {
                self.wait(None);
                self.inner.head(key)
            }
            _ => self.inner.head(key),
        }
    }

    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        within: Duration,
    ) -> Result<Vec<u8>, ColdError> {
        match self.draw(false, true) {
            FaultKind::ServerError => Err(injected("get", key, "server error 500")),
            FaultKind::Timeout => Err(injected("get", key, "timeout")),
            FaultKind::TornRange => {
                let mut bytes = self.inner.get_range(key, range, within)?;
                bytes.truncate(bytes.len() / 2);
                Ok(bytes)
            }
            FaultKind::Slow if !self.wait(Some(within)) => {
                Err(injected("get", key, "timeout after latency"))
            }
            _ => self.inner.get_range(key, range, within),
        }
    }

    fn delete(&self, key: &str) -> Result<(), ColdError> {
        match self.draw(true, false) {
            FaultKind::ServerError => Err(injected("delete", key, "server error 500")),
            FaultKind::Timeout => Err(injected("delete", key, "timeout")),
            FaultKind::LostAck => {
                self.inner.delete(key)?;
                Err(injected("delete", key, "lost acknowledgement"))
            }
            FaultKind::Slow => {
                self.wait(None);
                self.inner.delete(key)
            }
            _ => self.inner.delete(key),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError> {
        match self.draw(false, false) {
            FaultKind::ServerError => Err(injected("list", prefix, "server error 500")),
            FaultKind::Timeout => Err(injected("list", prefix, "timeout")),
            FaultKind::Slow => {
                self.wait(None);
                self.inner.list(prefix)
            }
            _ => self.inner.list(prefix),
        }
    }
}
