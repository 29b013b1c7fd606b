//! `capstore bench spool`: append throughput with group commit beside `dd ... conv=fdatasync` of the same bytes.
//!
//! Concurrent producers append captures of one size through the group-commit writer until `total_bytes` are
//! acknowledged; the baseline is `dd if=/dev/zero bs=1M count=N conv=fdatasync` writing the same number of bytes into
//! the same directory. Each size runs `repeats` times, alternating with dd, and the median is reported, because these
//! machines are shared and noisy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use uuid::Uuid;

use capstore::capture::CaptureMeta;
use capstore::spool::writer::{spawn_writer, WriterSettings};
use capstore::spool::SpoolPaths;

use super::median;

#[derive(Debug, Clone, Serialize)]
pub struct SpoolBenchRow {
    pub capture_bytes: u64,
    pub captures: u64,
    pub total_bytes: u64,
    pub spool_seconds: f64,
    pub spool_mb_per_s: f64,
    pub captures_per_s: f64,
    pub fsyncs: u64,
    pub dd_seconds: f64,
    pub dd_mb_per_s: f64,
    /// spool MB/s divided by dd MB/s.
    pub ratio_to_dd: f64,
}

pub struct SpoolBenchOptions {
    pub dir: PathBuf,
    pub capture_sizes: Vec<u64>,
    pub total_bytes: u64,
    pub producers: usize,
    pub repeats: usize,
}

pub async fn spool_append(options: &SpoolBenchOptions) -> std::io::Result<Vec<SpoolBenchRow>> {
    std::fs::create_dir_all(&options.dir)?;
    let mut rows = Vec::new();
    for &capture_bytes in &options.capture_sizes {
        let captures = (options.total_bytes / capture_bytes).max(1);
        let total_bytes = captures * capture_bytes;
        let mut spool_runs = Vec::new();
        let mut dd_runs = Vec::new();
        let mut fsyncs = 0;
        for _ in 0..options.repeats {
            // Alternate the two so drift in machine load hits both alike.
            dd_runs.push(run_dd(&options.dir, total_bytes)?);
            let (seconds, run_fsyncs) = run_spool(&options.dir, capture_bytes, captures, options.producers).await?;
            spool_runs.push(seconds);
            fsyncs = run_fsyncs;
        }
        let spool_seconds = median(&mut spool_runs);
        let dd_seconds = median(&mut dd_runs);
        let megabytes = total_bytes as f64 / 1e6;
        rows.push(SpoolBenchRow {
            capture_bytes,
            captures,
            total_bytes,
            spool_seconds,
            spool_mb_per_s: megabytes / spool_seconds,
            captures_per_s: captures as f64 / spool_seconds,
            fsyncs,
            dd_seconds,
            dd_mb_per_s: megabytes / dd_seconds,
            ratio_to_dd: dd_seconds / spool_seconds,
        });
    }
    Ok(rows)
}

fn run_dd(dir: &Path, total_bytes: u64) -> std::io::Result<f64> {
    let target = dir.join("dd-baseline.bin");
    let megabytes = total_bytes.div_ceil(1024 * 1024);
    let started = Instant::now();
    let status = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", target.display()))
        .arg("bs=1M")
        .arg(format!("count={megabytes}"))
        .arg("conv=fdatasync")
        .stderr(std::process::Stdio::null())
        .status()?;
    let seconds = started.elapsed().as_secs_f64();
    std::fs::remove_file(&target)?;
    if !status.success() {
        return Err(std::io::Error::other(format!("dd failed: {status}")));
    }
    // dd wrote whole MiB; scale to the bytes the spool wrote so MB/s compare like for like.
    Ok(seconds * total_bytes as f64 / (megabytes * 1024 * 1024) as f64)
}

async fn run_spool(dir: &Path, capture_bytes: u64, captures: u64, producers: usize) -> std::io::Result<(f64, u64)> {
    let spool_dir = dir.join(format!("spool-bench-{}", Uuid::now_v7()));
    let paths = SpoolPaths::new(&spool_dir);
    for sub in [&paths.root, &paths.packs] {
        std::fs::create_dir_all(sub)?;
    }
    let settings = WriterSettings {
        pack_max_bytes: 64 * 1024 * 1024,
        pack_max_records: 1_000_000,
        pack_max_age: Duration::from_secs(3600),
        max_capture_bytes: capture_bytes.max(1),
        max_bytes: 0,
        min_free_bytes: 0,
    };
    let (writer, thread) = spawn_writer(paths, settings, Arc::default());
    // Incompressible, non-constant payload so checksums do real work. Every producer hands over the same immutable
    // buffer (a reference count, not a copy), as dd writes the same buffer again and again: the run measures the
    // spool's own work (checksums, the copy into the page cache, fsyncs), not the producers' allocations.
    let payload = bytes::Bytes::from(
        (0..capture_bytes).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect::<Vec<u8>>(),
    );
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..producers {
        let writer = writer.clone();
        let payload = payload.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < captures {
                let meta = CaptureMeta {
                    capture_id: Uuid::now_v7(),
                    stream: "bench".into(),
                    captured_at_ns: capstore::util::now_ns(),
                    labels: BTreeMap::new(),
                    content_type: None,
                    source_name: None,
                };
                writer.append(meta, payload.clone()).await.map_err(std::io::Error::other)?;
            }
            Ok::<(), std::io::Error>(())
        }));
    }
    for task in tasks {
        task.await.map_err(std::io::Error::other)??;
    }
    let fsyncs = writer.stats().snapshot().fsyncs;
    writer.close();
    drop(writer);
    tokio::task::spawn_blocking(move || thread.join()).await.map_err(std::io::Error::other)?;
    let seconds = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&spool_dir)?;
    Ok((seconds, fsyncs))
}
