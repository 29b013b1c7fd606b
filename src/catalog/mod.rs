//! The ClickHouse catalog: the tables that map every capture to its pack, the publisher lease and the publishes
//! watermark (design document, sections 6 and 7).
//!
//! - [`client`]: the only way the catalog talks to ClickHouse. Every other catalog module goes through
//!   [`client::CatalogClient`] and branches on [`client::ErrorKind`].

pub mod client;
