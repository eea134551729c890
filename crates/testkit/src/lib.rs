//! Onceguard's test kit: the store conformance suite and the property-test model.
//!
//! Any store runs the whole suite with one line in its tests:
//!
//! ```text
//! onceguard_testkit::conformance_tests!(|| async { onceguard_testkit::TestStore::new(MyStore::new()) });
//! onceguard_testkit::property_tests!(|| async { onceguard_testkit::TestStore::new(MyStore::new()) });
//! ```
//!
//! The factory is called once per test and must give a fresh, empty store (its own file,
//! schema or key prefix), so that tests run in parallel. Time-dependent cases move a
//! [`onceguard_core::ManualClock`]; nothing sleeps to make time pass.

#![forbid(unsafe_code)]

use std::any::Any;
use std::sync::Arc;

use onceguard_core::Store;

pub use proptest;

pub mod conformance;
#[cfg(feature = "harness")]
pub mod harness;
pub mod model;
pub mod redis_process;
pub mod services;

/// A fresh store for one test, and whatever must live as long as it (a temporary directory, a
/// schema to drop).
pub struct TestStore {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// The clock a shared store decides by in place of its server's, which the cases move.
    pub clock: Option<Arc<onceguard_core::ManualClock>>,
    _keep: Box<dyn Any + Send + Sync>,
}

impl TestStore {
    /// A store that needs nothing kept alive.
    pub fn new(store: impl Store) -> Self {
        Self { store: Arc::new(store), clock: None, _keep: Box::new(()) }
    }

    /// A store with something that must outlive it (dropped after the store).
    pub fn with(store: impl Store, keep: impl Any + Send + Sync) -> Self {
        Self { store: Arc::new(store), clock: None, _keep: Box::new(keep) }
    }

    /// The same, deciding by `clock` (the [`onceguard_core::StoreClock::Given`] it was built with).
    pub fn on_clock(self, clock: Arc<onceguard_core::ManualClock>) -> Self {
        Self { clock: Some(clock), ..self }
    }

    /// What a conformance case takes.
    pub fn subject(&self) -> conformance::Subject {
        conformance::Subject { store: self.store.clone(), clock: self.clock.clone() }
    }
}

/// What a store factory may return: a store, or `None` when the store's server is not running
/// and the suite is skipped (see [`services::available`]).
pub trait IntoTestStore {
    /// The store, if the suite runs.
    fn into_test_store(self) -> Option<TestStore>;
}

impl IntoTestStore for TestStore {
    fn into_test_store(self) -> Option<TestStore> {
        Some(self)
    }
}

impl IntoTestStore for Option<TestStore> {
    fn into_test_store(self) -> Option<TestStore> {
        self
    }
}

/// The claim a front end hands the guard for the store request `req`, waiting up to `wait`
/// (the guard builds the store's request from it again: the lease, retention, run and cost
/// must be within the guard's limits; an in-flight quota comes from the tenant's settings).
pub fn through_the_door(req: &onceguard_core::ClaimRequest, wait: std::time::Duration) -> onceguard_core::Claim {
    onceguard_core::Claim {
        verify_hook: false,
        scope: req.scope.clone(),
        fingerprint: req.fingerprint.clone(),
        lease: Some(req.lease),
        retention: Some(req.retention),
        wait: Some(wait),
        run: req.run.clone(),
        cost: Some(req.cost),
        summary: None,
    }
}

/// Generates one `#[tokio::test]` per conformance case, each on a fresh store from `$make`
/// (an `async` closure returning a [`TestStore`], or `Option<TestStore>` to skip).
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@cases $make;
            absent_key_is_acquired,
            held_key_answers_in_flight,
            completed_key_replays_byte_for_byte,
            other_fingerprint_is_a_mismatch_and_changes_nothing,
            stale_fences_change_nothing,
            lease_expiry_gives_a_recovery_with_the_last_checkpoint,
            reported_unknown_gives_a_recovery_at_once,
            retryable_failure_releases_the_key,
            permanent_failure_replays,
            extend_pushes_the_lease_out,
            retention_expiry_makes_the_key_new,
            an_unfinished_attempt_outlives_its_retention,
            a_switch_on_the_records_run_refuses_its_takeover,
            a_switch_engaged_during_a_wait_refuses_the_waiter,
            fences_grow_across_expiry_sweep_and_purge,
            sweep_deletes_only_expired_records_in_batches,
            tenants_are_isolated,
            namespaces_are_isolated,
            concurrent_claims_acquire_exactly_once,
            purge_racing_a_completion_leaves_no_record,
            waiting_claim_receives_the_replay,
            waiting_claim_is_bounded,
            waiting_claim_recovers_when_the_lease_passes,
            repeated_completion_is_idempotent,
            listing_filters_and_pages,
            checkpoints_are_bounded_keeping_the_newest,
            tenants_and_api_keys,
            budget_charges_each_key_once,
            concurrent_claims_never_exceed_the_budget,
            budget_cost_and_deadline,
            in_flight_quota_counts_live_leases,
            claim_rate_per_tenant,
            control_documents,
            revoked_leases_make_holders_stale,
            audit_log_pages_newest_first,
            audit_log_prunes_old_entries,
            a_batch_answers_as_its_claims_one_by_one,
            concurrent_batches_overlapping_in_keys_acquire_each_key_once,
            a_batch_of_fenced_calls_answers_as_its_calls_one_by_one,
            replace_writes_only_over_the_record_read,
            replace_control_writes_only_over_the_document_expected,
            a_sealed_value_never_leaves_unopened,
            an_approved_call_acquires_once,
            a_denied_call_is_refused_for_good,
            an_undecided_approval_expires,
            another_fingerprint_is_a_mismatch_and_keeps_the_approval,
            a_switch_refuses_a_call_pending_approval,
            a_waiting_claim_gets_the_decision,
            approvals_are_written_over_the_one_read,
            a_batch_asks_each_key_needing_approval,
            a_notice_is_taken_once_per_attempt,
            an_approval_lets_its_call_run_once,
            a_decision_is_kept_for_the_namespaces_retention,
            observe_mode_asks_no_approver,
            another_request_never_takes_an_approved_key,
            an_approved_call_never_runs_again_after_its_retention,
            a_recovery_completes_as_reconciled,
            the_recovery_gate_decides_in_the_stores_claim,
            verify_lets_only_a_verifying_caller_recover,
            ask_turns_a_recovery_into_one_approved_rerun,
            ask_fails_or_reconciles_a_recovery_by_decision,
            a_decided_recovery_is_written_by_the_next_claim_if_its_writer_stopped,
            an_approval_of_a_recovery_lets_no_new_call_run,
            another_call_of_a_released_recovered_key_is_a_mismatch,
            a_rolled_back_run_compensates_each_effect_once,
            a_compensation_failing_permanently_is_kept,
            concurrent_rollback_starts_start_once,
            rollbacks_are_listed_by_run_a_page_at_a_time,
            a_task_lives_as_long_as_its_effect,
            a_task_is_recovered_whatever_the_recovery_policy,
            a_rollback_waits_for_its_effects_and_ends_at_its_start,
            compensations_ask_no_approver_and_a_refused_task_blocks_none,
            task_namespaces_are_reserved,
            observe_mode_counts_each_would_be_outcome,
            a_canary_enforces_its_share_of_keys,
            switching_modes_under_load_keeps_each_key_acquired_once,
            a_runaway_run_trips_its_rule_once_across_two_instances,
            symptom_counts_add_up_across_instances,
            a_control_document_is_created_once,
            a_spend_rule_trips_and_releases_itself,
            a_rule_set_anew_counts_from_nothing,
            a_tripwire_can_roll_the_offending_run_back,
            a_tripwire_turns_a_canary_back_to_observe_once,
            eight_instances_turn_a_canary_to_observe_once_a_round,
            an_instance_off_the_stores_clock_refuses_claims_past_the_bound
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let make = $make;
                let Some(test_store) = $crate::IntoTestStore::into_test_store(make().await) else { return };
                let case = $crate::conformance::$case(test_store.subject());
                if ::tokio::time::timeout(std::time::Duration::from_secs(120), case).await.is_err() {
                    panic!("the case did not finish within 120 s");
                }
                drop(test_store);
            }
        )*
    };
}

/// Generates the property test: random operations from several simulated workers, run against
/// a fresh store from `$make` and against [`model::Model`], which must agree on every answer.
#[macro_export]
macro_rules! property_tests {
    ($make:expr) => {
        $crate::property_tests!($make, 64);
    };
    ($make:expr, $cases:expr) => {
        #[test]
        fn store_agrees_with_the_model() {
            let runtime = ::tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            let probe = $make;
            if runtime.block_on(async { $crate::IntoTestStore::into_test_store(probe().await) }).is_none() {
                return;
            }
            let config = $crate::model::proptest_config($cases);
            let mut runner = $crate::proptest::test_runner::TestRunner::new(config);
            let result = runner.run(&$crate::model::ops_strategy(), |ops| {
                let make = $make;
                runtime.block_on(async {
                    let test_store =
                        $crate::IntoTestStore::into_test_store(make().await).expect("the store was available");
                    let result = $crate::model::check(test_store.store.clone(), test_store.clock.clone(), &ops).await;
                    drop(test_store);
                    result
                })
            });
            if let Err(e) = result {
                panic!("the store disagrees with the model: {e}");
            }
        }
    };
}
