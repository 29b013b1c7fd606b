//! Command-line interface: one file per subcommand group. Commands print data on stdout (`--json` where output is
//! data), diagnostics on stderr, and exit with the codes in [`capstore::exit_code`].

mod bench;
mod config_cmd;
mod put;
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
    /// Print the effective configuration (secrets redacted), or every problem with it (exit 2).
    CheckConfig,
    /// Copy files into the inbox atomically; prints "<capture_id>\t<file>" per file.
    Put(put::PutArgs),
    /// Offline spool tools.
    #[command(subcommand)]
    Spool(spool_cmd::SpoolCommand),
    /// Benchmarks with same-run baselines.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Test helpers (not a stable interface).
    #[command(subcommand, hide = true)]
    Debug(bench::DebugCommand),
}

pub fn main() -> i32 {
    let cli = Cli::parse();
    if let Command::CheckConfig = cli.command {
        return config_cmd::check_config(cli.config.as_deref());
    }
    let config = match load_config(cli.config.as_deref()) {
        Ok(config) => config,
        Err(code) => return code,
    };
    init_logging(&config);
    let result = match cli.command {
        Command::Run => run_daemon(config),
        Command::CheckConfig => unreachable!("handled above"),
        Command::Put(args) => put::put(&config, args),
        Command::Spool(command) => spool_cmd::run(&config, command),
        Command::Bench(command) => bench::run(command),
        Command::Debug(command) => bench::debug(&config, command),
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

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log.level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match config.log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

fn run_daemon(config: Config) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
    match runtime.block_on(capstore::daemon::run(config)) {
        Ok(code) => Ok(code),
        Err(error) => {
            tracing::error!(%error, "capstore stopped");
            eprintln!("capstore: {error}");
            Ok(error.exit_code())
        }
    }
}
