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
//!   - [`spool::writer`]: the group-commit writer thread that owns the `.open` pack, its syncer thread (fsyncs,
//!     acknowledgements) and sealer thread; quotas.
//!   - [`spool::hasher`]: the pack's SHA-256, computed on a thread of its own while the pack is written.
//!   - [`spool::recovery`]: start-time repair of whatever a crash left.
//!   - [`spool::inbox`]: the inbox watcher and `capstore put`.
//!   - [`spool::lock`]: the flock that makes one process the owner of a spool.
//!   - [`spool::durable`]: temp-file + fsync + rename + directory-fsync helpers every state change uses.
//! - [`catalog`]: ClickHouse: client and error classification, schema, the publisher lease, fenced publish, reads.
//! - [`bucket`]: the object store: key layout, verified uploads, range reads.
//! - [`pipeline`]: uploader, indexer (`pending_index`), reconcile, and the supervisor behind `capstore run`.
//! - [`http`]: the HTTP API of `capstore run`: ingest, reads, status, metrics, health.
//! - [`reader`]: reading captures back (catalog location, one range read, CRC), from the spool when still local.
//! - [`failpoint`]: test-only crash points for crash tests.
//! - [`bench`]: throughput benchmarks with same-run baselines (`capstore bench`).
//!
//! # File states
//!
//! `inbox file` -(append + fsync)-> record in `packs/<id>.open` -(seal)-> `.sealed` -(upload)-> `.uploaded`
//! -(publish)-> deleted. A state change is a rename followed by a directory fsync; see [`spool`].

pub mod bucket;
pub mod capture;
pub mod catalog;
pub mod config;
pub mod daemon;
pub mod durable;
pub mod failpoint;
pub mod http;
pub mod pack;
pub mod pipeline;
pub mod reader;
pub mod retry;
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
