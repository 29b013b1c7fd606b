//! capstore: a capture storage daemon.
//!
//! Producers hand capstore captures (byte payloads with a little metadata). It acknowledges a capture only once it is
//! fsynced in a local spool, packs captures into immutable packs, uploads sealed packs to an object store and publishes
//! an index of every capture into a ClickHouse catalog. The design, protocols and invariants (I1-I7) are fixed in the
//! project's design document; this crate doc is the map of the code.
//!
//! # Layout
//!
//! Top to bottom as the data flows; a module imports only from modules listed below it.
//!
//! - [`daemon`]: `capstore run`: the start order, signals, the publishing loop, the one way down, and the systemd
//!   notifications (readiness, status, watchdog).
//! - [`http`]: the HTTP API of `capstore run`: server and token check, capture endpoints, metrics.
//! - [`pipeline`]: the stages from sealed pack to published capture: uploader, indexer (`pending_index`), reconcile,
//!   the status board; and the changes the lease holder publishes on request or by policy: deletion, retention.
//! - [`export`]: bulk reads page by page (a listing query or a list of ids), and the directory and tar framings.
//! - [`reader`]: reading captures back (catalog location, one range read, CRC), from the spool when still local.
//! - [`spool`]: the durable local buffer: open and recovery, the group-commit writer, inbox ingest, the owner lock,
//!   and [`spool::layout`], the only code that renames or deletes spool files.
//! - [`bucket`]: the object store: key layout, verified uploads, range reads, backends.
//! - [`catalog`]: ClickHouse: the client (the one error classifier), schema, the publisher lease (table protocol and
//!   keeper), fenced publish (of packs, and of deletions), reads.
//! - [`config`]: the TOML file, environment overrides, every validation rule, units.
//! - [`pack`]: the pack file format (codec, scan, writer, sealed reader, hasher), specified in `specs/pack-format.md`.
//! - [`capture`]: what a capture is and the rules every way in applies.
//! - [`durable`], [`retry`], [`telemetry`], [`failpoint`], [`exit_code`], [`util`]: crash-safe file steps; the one
//!   backoff policy and outage log; liveness and latency histograms; test-only crash and stall points; the process
//!   exit codes; clocks.
//!
//! The `capstore` binary (`src/main.rs`, `src/cli/`) parses commands, sets up logging and calls into these modules;
//! its benchmarks live in `src/cli/bench/`.
//!
//! # Embedding
//!
//! A Rust program runs the daemon inside its own process with [`run_in_process`] and appends captures through the
//! [`SpoolWriter`] it hands over (an [`Ack`] means the record is fsynced); [`Reader`] reads captures back, and
//! [`PackFile`] reads a pack file directly. These re-exports are the library's interface; the modules are public so
//! that the binary and the integration tests reach the same code, not as a stable API.
//!
//! # File states
//!
//! `inbox file` -(append + fsync)-> record in `packs/<id>.open` -(seal)-> `.sealed` -(upload)-> `.uploaded`
//! -(publish)-> deleted. A state change is a rename followed by a directory fsync; see [`spool::layout`].

pub mod bucket;
pub mod capture;
pub mod catalog;
pub mod config;
pub mod daemon;
pub mod durable;
pub mod exit_code;
pub mod export;
pub mod failpoint;
pub mod http;
pub mod pack;
pub mod pipeline;
pub mod reader;
pub mod retry;
pub mod spool;
pub mod telemetry;
pub mod util;

pub use capture::CaptureMeta;
pub use config::Config;
pub use daemon::{run_in_process, DaemonError};
pub use pack::PackFile;
pub use reader::{ReadCapture, Reader};
pub use spool::writer::{Ack, AppendError, SpoolWriter};
