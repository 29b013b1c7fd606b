//! `capstore debug ...`: hidden helpers for crash and lease tests (not a stable interface).

use std::io::Write;

use clap::Subcommand;

use capstore::catalog::lease::{LeaseKeeper, StartError};
use capstore::config::Config;
use capstore::exit_code;

use super::bench::deterministic_payload;

#[derive(Subcommand)]
pub enum DebugCommand {
    /// Own the spool, take the catalog's publisher lease (with the start wait) and keep renewing it until killed;
    /// prints "HELD <term> <holder>" once held.
    HoldLease,
    /// Append a deterministic stream of captures to the spool, printing "ACK <capture_id> <len>" after each fsync.
    AppendStream {
        /// Stop after this many captures (default: run until killed).
        #[arg(long)]
        max: Option<u64>,
        /// Concurrent appenders, so batches form as in production.
        #[arg(long, default_value_t = 8)]
        producers: usize,
    },
}

pub fn run(config: &Config, command: DebugCommand) -> anyhow::Result<i32> {
    let runtime = crate::cli::runtime()?;
    match command {
        DebugCommand::AppendStream { max, producers } => runtime.block_on(append_stream(config, max, producers)),
        DebugCommand::HoldLease => runtime.block_on(hold_lease(config)),
    }
}

async fn hold_lease(config: &Config) -> anyhow::Result<i32> {
    let (spool, _recovery) = capstore::spool::Spool::open(&config.spool)?;
    let (client, tables) = capstore::catalog::connect(config).await?;
    let keeper = LeaseKeeper::for_catalog(&client, &tables, config, spool.id());
    let (_shutdown_tx, mut shutdown_rx) = tokio::sync::watch::channel(false);
    let lease = match keeper.start(config.start_wait(), &mut shutdown_rx).await {
        Ok(lease) => lease,
        Err(error @ StartError::Refused { .. }) => {
            eprintln!("capstore: {error}");
            return Ok(exit_code::CATALOG_HELD);
        }
        Err(error) => return Err(error.into()),
    };
    let status = lease.handle().status();
    println!("HELD {} {}", status.lease_term, lease.handle().identity().holder());
    std::io::stdout().flush()?;
    lease.until_latched().await;
    drop(spool);
    Ok(exit_code::CATALOG_HELD)
}

async fn append_stream(config: &Config, max: Option<u64>, producers: usize) -> anyhow::Result<i32> {
    use capstore::capture::CaptureMeta;
    use capstore::spool::writer::{spawn_writer, WriterSettings};
    let spool = match crate::cli::own_spool(config, "one appender per spool")? {
        Ok(spool) => spool,
        Err(exit_code) => return Ok(exit_code),
    };
    let (writer, thread) =
        spawn_writer(spool.paths().clone(), WriterSettings::from_config(&config.spool), spool.index());
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stdout = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let mut tasks = Vec::new();
    for _ in 0..producers {
        let (writer, next, stdout) = (writer.clone(), next.clone(), stdout.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if max.is_some_and(|max| n >= max) {
                    return Ok::<(), anyhow::Error>(());
                }
                let capture_id = uuid::Uuid::now_v7();
                // Sizes cycle through empty, small and a few larger captures so packs seal on bytes too.
                let len = [0usize, 1, 100, 1000, 20_000, 300_000][(n % 6) as usize];
                let meta = CaptureMeta {
                    capture_id,
                    stream: "crash/test".into(),
                    captured_at_ns: capstore::util::now_ns(),
                    labels: [("n".to_string(), n.to_string())].into(),
                    content_type: None,
                    source_name: None,
                };
                writer.append(meta, deterministic_payload(capture_id, len)).await?;
                let mut out = stdout.lock().expect("stdout lock");
                writeln!(out, "ACK {capture_id} {len}")?;
                out.flush()?;
            }
        }));
    }
    for task in tasks {
        task.await??;
    }
    writer.close();
    drop(writer);
    tokio::task::spawn_blocking(move || thread.join()).await?;
    drop(spool);
    Ok(exit_code::CLEAN)
}
