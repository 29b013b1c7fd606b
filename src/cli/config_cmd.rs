//! `capstore check-config`.

use std::path::Path;

use capstore::exit_code;

pub fn check_config(path: Option<&Path>) -> i32 {
    match super::load_config(path) {
        Ok(config) => {
            print!("{}", config.to_redacted_toml());
            exit_code::CLEAN
        }
        Err(code) => code,
    }
}
