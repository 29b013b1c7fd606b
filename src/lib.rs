//! capstore: a capture storage daemon.
//!
//! Producers hand capstore captures (byte payloads with a little metadata). It acknowledges a capture only once it is
//! fsynced in a local spool, packs captures into immutable packs, uploads sealed packs to an object store and publishes
//! an index of every capture into a ClickHouse catalog. The design, protocols and invariants (I1-I7) are fixed in the
//! project's design document; this crate doc is the map of the code.
//!
//! # Layout
//!
//! - [`config`]: the TOML file, environment overrides and every validation rule.
//! - [`capture`]: what a capture may look like (stream names, labels), shared by every way in.
//! - [`spool`]: the durable local buffer.
//!   - [`spool::pack`]: the pack file format (writer, reader, recovery scan); specified in `specs/pack-format.md`.
//!   - [`spool::writer`]: the group-commit writer thread that owns the `.open` pack; quotas; sealing.
//!   - [`spool::recovery`]: start-time repair of whatever a crash left.
//!   - [`spool::inbox`]: the inbox watcher and `capstore put`.
//!   - [`spool::lock`]: the flock that makes one process the owner of a spool.
//!   - [`spool::durable`]: temp-file + fsync + rename + directory-fsync helpers every state change uses.
//! - [`catalog`]: the ClickHouse catalog.
//!   - [`catalog::client`]: the one ClickHouse client layer: per-request timeouts, version-dependent settings, and
//!     the classification of every failure into definitely-failed / outcome-unknown.
//! - [`bucket`]: the object store: `bucket.url` -> store, pack key layout, upload with verification and bounded
//!   retries, range reads of pack indexes and captures.
//! - [`daemon`]: `capstore run`: start order, signals, shutdown.
//! - [`bench`]: throughput benchmarks with same-run baselines (`capstore bench`).
//!
//! # File states
//!
//! `inbox file` -(append + fsync)-> record in `packs/<id>.open` -(seal)-> `.sealed` -(upload)-> `.uploaded`
//! -(publish)-> deleted. A state change is a rename followed by a directory fsync; see [`spool`].

pub mod bench;
pub mod bucket;
pub mod capture;
pub mod catalog;
pub mod config;
pub mod daemon;
pub mod spool;
pub mod util;

/// Process exit codes (also documented in the README).
pub mod exit_code {
    pub const CLEAN: i32 = 0;
    pub const FATAL: i32 = 1;
    pub const CONFIG_OR_USAGE: i32 = 2;
    pub const CATALOG_HELD: i32 = 3;
    pub const SPOOL_OWNED: i32 = 4;
}
