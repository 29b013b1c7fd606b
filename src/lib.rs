//! capstore: capture storage daemon library.
//!
//! Layout:
//! - [`spool`]: the local spool; [`spool::pack`] is the on-disk pack format (writer, recovery, reader).

pub mod spool;
