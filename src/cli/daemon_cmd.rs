//! `capstore run` and `capstore status`: the daemon, and a look at the one running on this spool.

use anyhow::Context;

use capstore::config::Config;
use capstore::exit_code;

pub fn run(config: Config) -> anyhow::Result<i32> {
    match super::runtime()?.block_on(capstore::daemon::run(config)) {
        Ok(code) => Ok(code),
        Err(error) => {
            eprintln!("capstore: {error}");
            Ok(error.exit_code())
        }
    }
}

/// `capstore status`: the daemon's last status snapshot, and whether that daemon is still alive.
pub fn status(config: &Config, json: bool) -> anyhow::Result<i32> {
    let path = config.spool.dir.join(capstore::pipeline::status::STATUS_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("no status at {} (has `capstore run` started on this spool?)", path.display()))?;
    let snapshot: serde_json::Value = serde_json::from_str(&text)?;
    let running = snapshot["pid"].as_u64().is_some_and(|pid| {
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        nix::sys::signal::kill(pid, None).is_ok() && capstore::spool::SpoolLock::acquire(&config.spool.dir).is_err()
    });
    if json {
        let mut snapshot = snapshot;
        snapshot["running"] = serde_json::Value::Bool(running);
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        println!("daemon {} (status of {})", if running { "RUNNING" } else { "NOT RUNNING" }, snapshot["updated_at"]);
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    }
    Ok(if running { exit_code::CLEAN } else { exit_code::FATAL })
}
