//! The shared read/write admission gate and the pressure it watches.
//!
//! The executor reports a small [`PressureSnapshot`] with each completion poll; the owners'
//! snapshots are combined by maximum. The gate closes as soon as any observation reaches its high
//! watermark and reopens only when every observation is at or below its low watermark, so it
//! does not flap around one threshold. It knows nothing of health, pause or quarantine.

/// The executor's pressure facts for one poll. Query jobs carry no payload, so there is no
/// query byte count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PressureSnapshot {
    pub queued_query_jobs: u32,
    pub queued_get_jobs: u32,
    pub queued_put_jobs: u32,
    pub queued_get_payload_bytes: u64,
    pub queued_put_payload_bytes: u64,
    /// Age of the oldest queued or running job; zero when there is none.
    pub oldest_job_age_ms: u64,
}

impl PressureSnapshot {
    pub fn queued_jobs(&self) -> u64 {
        u64::from(self.queued_query_jobs)
            + u64::from(self.queued_get_jobs)
            + u64::from(self.queued_put_jobs)
    }

    pub fn queued_payload_bytes(&self) -> u64 {
        self.queued_get_payload_bytes.saturating_add(self.queued_put_payload_bytes)
    }

    /// Field-wise maximum: how several owners' reports combine into the replica's pressure.
    pub fn max(self, other: Self) -> Self {
        Self {
            queued_query_jobs: self.queued_query_jobs.max(other.queued_query_jobs),
            queued_get_jobs: self.queued_get_jobs.max(other.queued_get_jobs),
            queued_put_jobs: self.queued_put_jobs.max(other.queued_put_jobs),
            queued_get_payload_bytes: self
                .queued_get_payload_bytes
                .max(other.queued_get_payload_bytes),
            queued_put_payload_bytes: self
                .queued_put_payload_bytes
                .max(other.queued_put_payload_bytes),
            oldest_job_age_ms: self.oldest_job_age_ms.max(other.oldest_job_age_ms),
        }
    }

    /// The value the gate compares for `observation`.
    pub fn value(&self, observation: Observation) -> u64 {
        match observation {
            Observation::QueuedJobs => self.queued_jobs(),
            Observation::QueuedPayloadBytes => self.queued_payload_bytes(),
            Observation::OldestJobAge => self.oldest_job_age_ms,
        }
    }
}

/// One quantity the gate watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Observation {
    /// Queued QUERY, GET and PUT jobs together.
    QueuedJobs,
    /// Payload bytes of queued GET and PUT jobs.
    QueuedPayloadBytes,
    /// Milliseconds since the oldest queued or running job was submitted.
    OldestJobAge,
}

impl Observation {
    pub const ALL: [Self; 3] = [Self::QueuedJobs, Self::QueuedPayloadBytes, Self::OldestJobAge];
}

impl std::fmt::Display for Observation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::QueuedJobs => "queued_jobs",
            Self::QueuedPayloadBytes => "queued_payload_bytes",
            Self::OldestJobAge => "oldest_job_age_ms",
        })
    }
}

/// A high/low pair: reaching `high` closes the gate, `low` or less lets it reopen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watermark {
    pub high: u64,
    pub low: u64,
}

/// The watermarks of every observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PressureWatermarks {
    pub queued_jobs: Watermark,
    pub queued_payload_bytes: Watermark,
    pub oldest_job_age_ms: Watermark,
}

impl Default for PressureWatermarks {
    fn default() -> Self {
        const MIB: u64 = 1 << 20;
        Self {
            queued_jobs: Watermark { high: 512, low: 256 },
            queued_payload_bytes: Watermark { high: 1024 * MIB, low: 512 * MIB },
            oldest_job_age_ms: Watermark { high: 2_000, low: 500 },
        }
    }
}

impl PressureWatermarks {
    pub fn get(&self, observation: Observation) -> Watermark {
        match observation {
            Observation::QueuedJobs => self.queued_jobs,
            Observation::QueuedPayloadBytes => self.queued_payload_bytes,
            Observation::OldestJobAge => self.oldest_job_age_ms,
        }
    }

    /// Every low watermark must lie strictly below its high one; equal marks would let the gate
    /// reopen on the very value that closed it.
    pub fn validate(&self) -> Result<(), WatermarkError> {
        for observation in Observation::ALL {
            let Watermark { high, low } = self.get(observation);
            if low >= high {
                return Err(WatermarkError { observation, low, high });
            }
        }
        Ok(())
    }
}

/// A watermark pair that cannot give hysteresis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{observation} low watermark {low} is not below its high watermark {high}")]
pub struct WatermarkError {
    pub observation: Observation,
    pub low: u64,
    pub high: u64,
}

/// Whether new storage work may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateState {
    Open,
    /// Closed since `trigger` reached `value`, at or above its `high` watermark.
    Closed {
        trigger: Observation,
        value: u64,
        high: u64,
    },
}

/// What one observation did to the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateChange {
    Unchanged,
    Closed { trigger: Observation, value: u64, high: u64 },
    Reopened,
}

/// The hysteresis gate.
#[derive(Debug, Clone)]
pub struct AdmissionGate {
    watermarks: PressureWatermarks,
    state: GateState,
}

impl AdmissionGate {
    /// An open gate with validated watermarks.
    pub fn new(watermarks: PressureWatermarks) -> Result<Self, WatermarkError> {
        watermarks.validate()?;
        Ok(Self { watermarks, state: GateState::Open })
    }

    pub fn state(&self) -> GateState {
        self.state
    }

    pub fn is_open(&self) -> bool {
        self.state == GateState::Open
    }

    pub fn watermarks(&self) -> &PressureWatermarks {
        &self.watermarks
    }

    /// Applies one (already combined) snapshot.
    pub fn observe(&mut self, snapshot: &PressureSnapshot) -> GateChange {
        match self.state {
            GateState::Open => {
                let tripped = Observation::ALL.into_iter().find_map(|trigger| {
                    let value = snapshot.value(trigger);
                    let high = self.watermarks.get(trigger).high;
                    (value >= high).then_some((trigger, value, high))
                });
                match tripped {
                    Some((trigger, value, high)) => {
                        self.state = GateState::Closed { trigger, value, high };
                        GateChange::Closed { trigger, value, high }
                    }
                    None => GateChange::Unchanged,
                }
            }
            GateState::Closed { .. } => {
                let all_low = Observation::ALL
                    .into_iter()
                    .all(|o| snapshot.value(o) <= self.watermarks.get(o).low);
                if all_low {
                    self.state = GateState::Open;
                    GateChange::Reopened
                } else {
                    GateChange::Unchanged
                }
            }
        }
    }
}
