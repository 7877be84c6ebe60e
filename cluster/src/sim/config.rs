//! What a run is asked to do ([`SimConfig`], [`SimFaults`]), what it did ([`SimReport`]), and
//! the rules it checks ([`SimCheck`], [`SimFailure`]).

use std::fmt;

/// What a stale hit's detail says when the node served a copy it should have dropped
/// (under [`SimFaults::skip_drop_on_apply`]).
pub const KEPT_COPY: &str = "served a copy it kept after a view handed the key back";
/// What a stale hit's detail says when the node served a key, or a copy it wrote, before its
/// view had settled (under [`SimFaults::ignore_settlement`]).
pub const UNSETTLED: &str = "served a key before its view had settled";

/// Simulated milliseconds per step.
pub const STEP_MS: u64 = 10;
/// Node slots a run may ever use (the first members plus every new node that joins).
pub const NODES_MAX: usize = 1024;
/// Clients a run may have.
pub const CLIENTS_MAX: usize = 256;
/// Keys clients may touch.
pub const KEYS_MAX: usize = 1 << 16;
/// Key digests the rebalance check follows through every change of the member set. The
/// clients' keys are the first of them, so the check also says which of those a change moved.
pub const SAMPLE_KEYS: usize = 2048;

/// Faults a test switches on to show that the checks can fail. A real run leaves them off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimFaults {
    /// Nodes keep in their store the keys [`NodeFence::apply`](gpucache_dataplane::shard::NodeFence::apply) hands back.
    pub skip_drop_on_apply: bool,
    /// Nodes serve and admit every key they own as if their view had settled
    /// ([`NodeFence::servable`](gpucache_dataplane::shard::NodeFence::servable) is not
    /// asked).
    pub ignore_settlement: bool,
}

/// What to simulate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    pub seed: u64,
    /// Members at the start (the run keeps the count within an eighth of this).
    pub nodes: usize,
    pub clients: usize,
    pub steps: u64,
    /// Keys clients touch.
    pub keys: usize,
    pub faults: SimFaults,
}

impl SimConfig {
    /// 128 nodes, 16 clients, 1024 keys and 2000 steps, with no faults.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            nodes: 128,
            clients: 16,
            steps: 2000,
            keys: 1024,
            faults: SimFaults::default(),
        }
    }
}

/// What a run did. Two runs of one configuration give equal reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimReport {
    pub steps: u64,
    pub gets: u64,
    pub hits: u64,
    pub misses: u64,
    pub puts: u64,
    pub puts_acked: u64,
    /// Requests a node refused as routed by an older epoch (each one made a refresh).
    pub stale_refusals: u64,
    /// Requests sent to a node that had not applied the client's epoch yet.
    pub node_behind: u64,
    /// Requests sent to a node that was down.
    pub unreachable: u64,
    /// PUTs a node refused to admit (lease lost, draining, not a member, not the owner).
    pub not_admitting: u64,
    /// GETs a node answered as a miss because the key came to it with a view that had not
    /// settled yet.
    pub settling_misses: u64,
    /// PUTs (a client's or a fill leader's) a node refused as [`NotAdmitting::Settling`](gpucache_dataplane::shard::NotAdmitting::Settling).
    pub settling_refusals: u64,
    /// Times a node's settled epoch rose.
    pub settle_raises: u64,
    /// The most epochs the coordinator's view was ahead of the settled epoch it computed.
    pub max_unsettled_epochs: u64,
    /// Liveness records the coordinator let go after a node lost its lease.
    pub lease_lapses: u64,
    pub fills_led: u64,
    pub fills_joined: u64,
    pub fills_finished: u64,
    pub fills_failed: u64,
    /// begin_fill calls a directory refused (drain, credits, bounds, epoch).
    pub fills_refused: u64,
    /// Fills a directory fenced when its node applied a newer view.
    pub fenced: u64,
    /// Leaders and joiners told their fill was fenced.
    pub fenced_notices: u64,
    /// Fills whose node crashed under them.
    pub fills_lost: u64,
    /// Nodes the view came to list: new ones, and ones that had left it (a new life of a node
    /// the view still lists replaces its entry and is no join).
    pub joins: u64,
    /// Members removed: graceful leaves, crashed members and finished drains.
    pub leaves: u64,
    /// Membership changes the rules refused, leaving the view as it was (removing the last
    /// member, for one): the coordinator tries a removal again on a later step.
    pub refused_changes: u64,
    pub crashes: u64,
    /// Crashed nodes that restarted with a new registration.
    pub restarts: u64,
    pub lease_losses: u64,
    pub drains: u64,
    pub outages: u64,
    pub slow_nodes: u64,
    /// View applies on nodes that skipped at least one epoch.
    pub skipped_epochs: u64,
    /// Keys nodes dropped because a view they applied moved them away.
    pub dropped_on_apply: u64,
    /// PUTs acknowledged at an epoch older than that of the key's previous acknowledgement:
    /// an old owner that had not applied a view yet took a write after the new owner did.
    pub reordered_acks: u64,
    /// Views an inbox dropped because it was full.
    pub inbox_overflows: u64,
    /// Hits the stale check could not decide: the key's log had let its oldest
    /// acknowledgements go, and none of those it kept was of an epoch old enough.
    pub unchecked_hits: u64,
    /// The largest share of the sample whose owner changed in one membership change.
    pub max_moved_fraction: f64,
    /// The coordinator's epoch at the end.
    pub final_epoch: u64,
    pub final_members: usize,
}

/// The rules checked after every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimCheck {
    /// The configuration is outside the bounds of the simulation.
    Config,
    /// A hit returned bytes that no PUT of that key wrote.
    WrongHit,
    /// A hit at epoch E returned something other than the newest version acknowledged, before
    /// the GET was sent, by a PUT at an epoch no later than E.
    StaleHit,
    /// A membership change moved other keys than it had to, or a join moved an unlikely
    /// share of them.
    Rebalance,
    /// A directory's credits are not exactly one fill's cost per fill in flight.
    Credits,
    /// A directory made a second leader for a key while the first was still filling it.
    SingleFlight,
    /// The coordinator let a node's registration go while the node still admitted writes
    /// under it (the node must presume its lease lapsed no later than the coordinator).
    Lease,
}

impl SimCheck {
    pub fn name(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::WrongHit => "wrong hit",
            Self::StaleHit => "stale hit",
            Self::Rebalance => "rebalance",
            Self::Credits => "credits",
            Self::SingleFlight => "single flight",
            Self::Lease => "lease",
        }
    }
}

/// The first rule a run broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimFailure {
    pub seed: u64,
    /// The step it broke in (0: before the first step).
    pub step: u64,
    pub check: SimCheck,
    /// What happened, with the history that led to it.
    pub detail: String,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {}, step {}: {}: {}", self.seed, self.step, self.check.name(), self.detail)
    }
}

impl std::error::Error for SimFailure {}

/// Refuses a configuration outside the bounds the simulation was sized for.
pub(super) fn check_config(cfg: &SimConfig) -> Result<(), SimFailure> {
    let broken = if cfg.nodes < 8 || cfg.nodes > NODES_MAX / 2 {
        Some(format!("{} nodes; 8 to {} are simulated", cfg.nodes, NODES_MAX / 2))
    } else if cfg.clients == 0 || cfg.clients > CLIENTS_MAX {
        Some(format!("{} clients; 1 to {CLIENTS_MAX} are simulated", cfg.clients))
    } else if cfg.keys == 0 || cfg.keys > KEYS_MAX {
        Some(format!("{} keys; 1 to {KEYS_MAX} are simulated", cfg.keys))
    } else {
        None
    };
    match broken {
        None => Ok(()),
        Some(detail) => {
            Err(SimFailure { seed: cfg.seed, step: 0, check: SimCheck::Config, detail })
        }
    }
}
