//! `capstore run`: the long-running process.
//!
//! Start order: config (checked by the caller) -> spool lock -> spool recovery -> writer -> inbox ingest -> READY.
//! The catalog, lease and upload stages join this order in their own modules; until they exist the daemon keeps
//! captures durable in the spool and seals packs, which is what ingest needs to work when the catalog is away.
//!
//! Signals (through `signal-hook`, on a thread of their own): the first SIGTERM or SIGINT stops intake, lets files in
//! flight finish, seals the open pack and exits 0; a second one exits at once with code 1, which is still safe because
//! everything acknowledged is already fsynced. SIGHUP is accepted and ignored (logged): configuration is read once at
//! start, so a reload means a restart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

use crate::config::Config;
use crate::spool::inbox::Ingestor;
use crate::spool::writer::{spawn_writer, WriterSettings};
use crate::spool::{Spool, SpoolError};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Spool(#[from] SpoolError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

impl DaemonError {
    pub fn exit_code(&self) -> i32 {
        match self {
            DaemonError::Spool(SpoolError::Locked(_)) => crate::exit_code::SPOOL_OWNED,
            _ => crate::exit_code::FATAL,
        }
    }
}

/// Run until a shutdown signal; returns the exit code.
pub async fn run(config: Config) -> Result<i32, DaemonError> {
    // Signals first: a SIGTERM that arrives during recovery must still mean "stop cleanly", not death by default action.
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    spawn_signal_thread(shutdown_tx).map_err(DaemonError::Signals)?;
    let (spool, recovery) = Spool::open(&config.spool)?;
    let paths = spool.paths().clone();
    let (writer, writer_thread) = spawn_writer(paths.clone(), WriterSettings::from_config(&config.spool));
    let ingestor = Ingestor::new(
        paths.clone(),
        writer.clone(),
        config.spool.max_capture_bytes.0,
        config.spool.inbox_rescan_interval.0,
    );
    let ingest_task = tokio::spawn(ingestor.run(shutdown_rx));
    tracing::info!(
        catalog = %config.catalog_name,
        spool = %paths.root.display(),
        spool_id = %spool.id(),
        recovered_records = recovery.records_recovered,
        "capstore running: ingesting into the spool"
    );

    let _ = ingest_task.await;
    tracing::info!("shutting down: intake stopped, sealing the open pack");
    writer.close();
    drop(writer);
    tokio::task::spawn_blocking(move || writer_thread.join()).await.ok();
    tracing::info!("stopped cleanly");
    drop(spool);
    Ok(crate::exit_code::CLEAN)
}

/// First SIGTERM/SIGINT: ask for a graceful stop. Second: exit at once (the spool is durable, so this is safe).
fn spawn_signal_thread(shutdown_tx: watch::Sender<bool>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let stopping = Arc::new(AtomicBool::new(false));
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for signal in signals.forever() {
            if signal == SIGHUP {
                tracing::info!("SIGHUP ignored: configuration is read at start; restart to apply changes");
                continue;
            }
            if stopping.swap(true, Ordering::SeqCst) {
                tracing::warn!(signal, "second signal: exiting at once");
                std::process::exit(crate::exit_code::FATAL);
            }
            tracing::info!(signal, "shutdown requested");
            let _ = shutdown_tx.send(true);
        }
    })?;
    Ok(())
}
