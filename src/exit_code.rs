//! Process exit codes of `capstore` (also documented in the README and the systemd unit).

pub const CLEAN: i32 = 0;
pub const FATAL: i32 = 1;
pub const CONFIG_OR_USAGE: i32 = 2;
pub const CATALOG_HELD: i32 = 3;
pub const SPOOL_OWNED: i32 = 4;
