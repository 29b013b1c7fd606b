//! Command-line interface: one file per subcommand group. Commands print data on stdout (`--json` where output is
//! data), diagnostics on stderr, and exit with the codes in [`capstore::exit_code`].

mod bench;
mod catalog_cmd;
mod config_cmd;
mod daemon_cmd;
mod debug;
mod delete_cmd;
mod export_cmd;
mod put;
mod read_cmd;
mod spool_cmd;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use capstore::config::{Config, LogFormat};
use capstore::exit_code;

#[derive(Parser)]
#[command(name = "capstore", version, about = "Capture storage daemon: spool, packs, bucket, ClickHouse catalog")]
pub struct Cli {
    /// Config file (default: $CAPSTORE_CONFIG, else built-in defaults); every key can be overridden by
    /// CAPSTORE_<SECTION>_<KEY> environment variables.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon until SIGTERM/SIGINT.
    Run,
    /// Print the effective configuration (secrets redacted), or every problem with it (exit 2); `--online` also
    /// checks the catalog, bucket, spool directory and HTTP address this configuration names.
    CheckConfig(config_cmd::CheckConfigArgs),
    /// Copy files into the inbox atomically; prints "<capture_id>\t<file>" per file.
    Put(put::PutArgs),
    /// Read one capture back (byte-identical, CRC verified).
    Get(read_cmd::GetArgs),
    /// List published captures by stream, time range and labels.
    Ls(read_cmd::LsArgs),
    /// Export captures (a query or a list of ids) into a directory (resumable) or as a tar on standard output.
    Export(export_cmd::ExportArgs),
    /// Delete captures by id, or by stream, time range and labels: asks the running daemon, which publishes the
    /// deletion (versioned, so `tail` shows it); counts first, and confirms on a terminal (--yes elsewhere).
    Delete(delete_cmd::DeleteArgs),
    /// Print published captures in version order (after version N), optionally following new publishes.
    Tail(read_cmd::TailArgs),
    /// The running daemon's status snapshot.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Publish packs that are in the bucket but missing from the catalog, listing the bucket (run while the daemon is
    /// stopped). The repair for a lost spool whose packs the catalog's upload intents do not name.
    Reconcile(catalog_cmd::ReconcileArgs),
    /// Check every published pack against the bucket: present, valid, same size, SHA-256 and record count.
    Verify {
        #[arg(long)]
        json: bool,
    },
    /// Offline spool tools.
    #[command(subcommand)]
    Spool(spool_cmd::SpoolCommand),
    /// The publisher lease of this catalog.
    #[command(subcommand)]
    Lease(catalog_cmd::LeaseCommand),
    /// Remove orphan catalog rows below the watermark and lease rows below the head term.
    Gc,
    /// Move tables created before schema 6 onto tables partitioned by month, so that retention horizons drop whole
    /// months (run while every daemon of the tables is stopped; the old tables are kept as *_unpartitioned).
    Repartition,
    /// Benchmarks with same-run baselines.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Test helpers (not a stable interface).
    #[command(subcommand, hide = true)]
    Debug(debug::DebugCommand),
}

pub fn main() -> i32 {
    let cli = Cli::parse();
    if let Command::CheckConfig(args) = cli.command {
        return config_cmd::check_config(cli.config.as_deref(), args);
    }
    let config = match load_config(cli.config.as_deref()) {
        Ok(config) => config,
        Err(code) => return code,
    };
    // Tools print their results; their own progress logs would only clutter a terminal or a pipe.
    let quiet_by_default = !matches!(cli.command, Command::Run | Command::Debug(_));
    init_logging(&config, quiet_by_default);
    let result = match cli.command {
        Command::Run => daemon_cmd::run(config),
        Command::CheckConfig(_) => unreachable!("handled above"),
        Command::Put(args) => put::put(&config, args),
        Command::Spool(command) => spool_cmd::run(&config, command),
        Command::Get(args) => read_cmd::get(&config, args),
        Command::Ls(args) => read_cmd::ls(&config, args),
        Command::Export(args) => export_cmd::export(&config, args),
        Command::Delete(args) => delete_cmd::delete(&config, args),
        Command::Tail(args) => read_cmd::tail(&config, args),
        Command::Status { json } => daemon_cmd::status(&config, json),
        Command::Reconcile(args) => catalog_cmd::reconcile(&config, args),
        Command::Verify { json } => catalog_cmd::verify(&config, json),
        Command::Lease(command) => catalog_cmd::lease(&config, command),
        Command::Gc => catalog_cmd::gc(&config),
        Command::Repartition => catalog_cmd::repartition(&config),
        Command::Bench(command) => bench::run(&config, cli.config.as_deref(), command),
        Command::Debug(command) => debug::run(&config, command),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("capstore: {error:#}");
            exit_code::FATAL
        }
    }
}

/// Load and validate; on failure print every problem and return exit code 2.
pub fn load_config(path: Option<&std::path::Path>) -> Result<Config, i32> {
    let config = Config::load(path).and_then(|config| config.validate().map(|()| config));
    config.map_err(|error| {
        eprintln!("capstore: invalid configuration:");
        for problem in &error.problems {
            eprintln!("  {problem}");
        }
        exit_code::CONFIG_OR_USAGE
    })
}

fn init_logging(config: &Config, quiet_by_default: bool) {
    let level = if quiet_by_default && config.log.level == "info" { "warn" } else { config.log.level.as_str() };
    let filter =
        tracing_subscriber::EnvFilter::try_new(level).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a log file or the journal gets plain text that grep and operators can read.
    let on_terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(on_terminal);
    let _ = match config.log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// A progress bar (`total` known) or spinner on stderr for a long operation, drawn only when stderr is a terminal:
/// piped or redirected output (and `--json` on stdout) stays clean.
fn progress(total: Option<u64>, what: &str) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let target = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let (bar, template) = match total {
        Some(total) => {
            (ProgressBar::with_draw_target(Some(total), target), "{prefix}: {wide_bar} {pos}/{len} {msg} ({eta})")
        }
        None => (ProgressBar::with_draw_target(None, target), "{prefix}: {spinner} {msg} ({elapsed})"),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar.set_prefix(what.to_string());
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// The runtime every async command runs on.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Runtime::new()?)
}

/// Own the spool (lock and recovery), as an offline tool that publishes must; `Err(exit code)` after printing who
/// owns it and `hint` when another process does.
fn own_spool(config: &Config, hint: &str) -> anyhow::Result<Result<capstore::spool::Spool, i32>> {
    match capstore::spool::Spool::open(&config.spool) {
        Ok((spool, _recovery)) => Ok(Ok(spool)),
        Err(error @ capstore::spool::SpoolError::Locked(_)) => {
            eprintln!("capstore: {error}; {hint}");
            Ok(Err(exit_code::SPOOL_OWNED))
        }
        Err(error) => Err(error.into()),
    }
}

/// The capture ids of an ids file (one per line, blank lines skipped; an id listed twice counts once), or
/// `Err(exit code 2)` after naming the line that is not a capture id.
fn read_ids_file(path: &std::path::Path, command: &str) -> anyhow::Result<Result<Vec<uuid::Uuid>, i32>> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --ids {}", path.display()))?;
    let mut ids = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (number, line) in text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty()) {
        let problem = match uuid::Uuid::parse_str(line.trim()) {
            Ok(id) if id.is_nil() => "the nil UUID is not a capture id".to_string(),
            Ok(id) => {
                if seen.insert(id) {
                    ids.push(id);
                }
                continue;
            }
            Err(_) => format!("{:?} is not a UUID", line.trim()),
        };
        eprintln!("capstore {command}: --ids {} line {}: {problem}", path.display(), number + 1);
        return Ok(Err(exit_code::CONFIG_OR_USAGE));
    }
    Ok(Ok(ids))
}
