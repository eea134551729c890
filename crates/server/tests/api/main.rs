//! The API tests: one binary, one harness (`helpers::spawn_app`).

mod admin;
mod approvals;
mod bad_input;
mod batch;
mod blast_radius;
mod claims;
mod concurrency;
mod encryption;
mod helpers;
mod isolation;
mod observability;
mod outcomes_kept;
mod rollback;
