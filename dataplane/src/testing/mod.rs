//! The conformance suite every store and every registered pool runs unchanged.
//!
//! - [`model`]: property tests that drive a store through random interleavings of put, get,
//!   lookup, invalidate, quarantine, attestation, lease expiry and epoch bumps across several
//!   tenants, and compare every answer and every usage counter with a reference model.
//! - [`rules`]: one targeted test per contract rule, the batch calls' rules among them.
//! - [`pool`]: the registration rules for any [`crate::registry::PoolMemory`].
//!
//! A backend wires it in with [`conformance_suite!`] (and pools with [`pool_conformance_suite!`]),
//! passing a function that builds a fresh [`Subject`] from limits and a manual clock.

pub mod counting;
pub mod fixture;
pub mod model;
pub mod pool;
pub mod process;
pub mod rules;
mod subject;

/// The seeded generator, for tests that name it from here.
pub use crate::rng;
pub use subject::{EvictionLog, MakeSubject, Subject, cases};

/// Expands to one `#[test]` per conformance rule and per model property, for the store built
/// by `$make` (an expression of type `fn(ResourceLimits, ManualClock) -> Subject`).
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@tests $make;
            model_single_tenant, model_multi_tenant, model_tight_limits,
            exact_hit_needs_committed_physical_key, same_logical_other_physical_is_incompatible,
            prefix_hit_is_whole_block_and_needs_equal_shape, lookup_and_get_refuse_other_tenants,
            rights_are_enforced, only_committed_is_readable, corrupt_block_is_a_miss_and_dropped,
            get_into_small_buffer_fails_retired, put_is_create_only, request_replay_is_idempotent,
            request_ids_expire_and_are_capped, abort_retired_frees_everything,
            unknown_outcome_quarantines_and_stays_charged, lease_expiry_quarantines_never_frees,
            attestation_needs_owner_or_admin, fence_reclaims_only_older_epochs,
            stale_reservations_refuse_writes_after_bump, region_ids_never_recycled,
            refusals_carry_numbers, full_store_follows_its_policy,
            registrations_count_committed_and_quarantined,
            incomplete_commit_is_refused, write_bounds_are_checked, failures_report_retirement,
            batch_answers_equal_single_key_answers, batch_put_duplicates_behave_as_sequential_puts,
            batch_partial_failure_retires_per_key, empty_batch_answers_nothing,
            corrupt_block_in_batch_is_a_miss_for_that_key_only
        );
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let make: &$crate::testing::MakeSubject = &$make;
                $crate::testing::run(stringify!($name), make);
            }
        )*
    };
}

/// Runs the named conformance test against `make`.
pub fn run(name: &str, make: &MakeSubject) {
    match name {
        "model_single_tenant" => model::run(make, model::Profile::SingleTenant),
        "model_multi_tenant" => model::run(make, model::Profile::MultiTenant),
        "model_tight_limits" => model::run(make, model::Profile::TightLimits),
        other => rules::run(other, make),
    }
}
