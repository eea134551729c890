//! The API tests: one binary, one harness (`helpers::spawn_app`).

mod admin;
mod bad_input;
mod blast_radius;
mod claims;
mod concurrency;
mod helpers;
mod isolation;
mod observability;
