//! `capstore spool inspect|verify`: offline views of a spool. Neither takes the spool lock, so both work beside a
//! running daemon (a pack that moves on while being read is reported as such, not as damage).

use std::time::SystemTime;

use clap::Subcommand;
use serde::Serialize;

use capstore::config::Config;
use capstore::exit_code;
use capstore::pack::{PackError, PackFile};
use capstore::spool::inbox::walk_inbox;
use capstore::spool::{list_packs, PackState, SpoolPaths};

#[derive(Subcommand)]
pub enum SpoolCommand {
    /// List packs by state with sizes, record counts and ages.
    Inspect {
        #[arg(long)]
        json: bool,
    },
    /// Check every sealed and uploaded pack (checksums, footer, trailer); exit 1 on any problem.
    Verify {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Serialize)]
struct PackRow {
    pack_id: String,
    state: PackState,
    bytes: u64,
    /// Unknown (null) for the open pack, which is still being written.
    records: Option<u64>,
    age_seconds: f64,
    problem: Option<String>,
}

#[derive(Serialize)]
struct Inventory {
    spool: String,
    spool_id: Option<String>,
    packs: Vec<PackRow>,
    totals: Vec<StateTotal>,
    inbox_files: usize,
    quarantined_files: usize,
}

#[derive(Serialize)]
struct StateTotal {
    state: PackState,
    packs: u64,
    bytes: u64,
    records: u64,
}

pub fn run(config: &Config, command: SpoolCommand) -> anyhow::Result<i32> {
    let paths = SpoolPaths::new(&config.spool.dir);
    if !paths.packs.is_dir() {
        eprintln!("capstore spool: {} is not a spool (no packs/ directory)", paths.root.display());
        return Ok(exit_code::FATAL);
    }
    match command {
        SpoolCommand::Inspect { json } => inspect(&paths, json),
        SpoolCommand::Verify { json } => verify(&paths, json),
    }
}

fn inventory(paths: &SpoolPaths, full_check: bool) -> anyhow::Result<Inventory> {
    let now = SystemTime::now();
    let mut packs = Vec::new();
    let listings = list_packs(paths)?;
    // A full check reads every byte of every pack: show how far it is on a terminal.
    let bar = if full_check { Some(super::progress(Some(listings.len() as u64), "spool verify")) } else { None };
    for listing in listings {
        if let Some(bar) = &bar {
            bar.inc(1);
        }
        let age_seconds = now.duration_since(listing.modified).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let (records, problem) = match listing.state {
            PackState::Open => (None, None),
            PackState::Sealed | PackState::Uploaded => match check_pack(&listing.path, full_check) {
                Ok(records) => (Some(records), None),
                Err(PackError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) => (None, Some(error.to_string())),
            },
        };
        packs.push(PackRow {
            pack_id: listing.pack_id.to_string(),
            state: listing.state,
            bytes: listing.bytes,
            records,
            age_seconds,
            problem,
        });
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let totals = PackState::ALL
        .into_iter()
        .map(|state| {
            let rows = packs.iter().filter(|p| p.state == state);
            StateTotal {
                state,
                packs: rows.clone().count() as u64,
                bytes: rows.clone().map(|p| p.bytes).sum(),
                records: rows.filter_map(|p| p.records).sum(),
            }
        })
        .collect();
    let quarantined_files = walk_quarantine(&paths.quarantine);
    Ok(Inventory {
        spool: paths.root.display().to_string(),
        spool_id: capstore::spool::peek_spool_id(&paths.root).map(|id| id.to_string()),
        packs,
        totals,
        inbox_files: walk_inbox(&paths.inbox)?.len(),
        quarantined_files,
    })
}

fn walk_quarantine(dir: &std::path::Path) -> usize {
    walk_inbox(dir)
        .map(|files| files.iter().filter(|f| f.extension().is_none_or(|e| e != "reason")).count())
        .unwrap_or(0)
}

fn check_pack(path: &std::path::Path, full_check: bool) -> Result<u64, PackError> {
    let pack = PackFile::open(path)?;
    if full_check {
        pack.verify()?;
    }
    Ok(pack.entries().len() as u64)
}

fn inspect(paths: &SpoolPaths, json: bool) -> anyhow::Result<i32> {
    let inventory = inventory(paths, false)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&inventory)?);
        return Ok(exit_code::CLEAN);
    }
    println!("spool {} (id {})", inventory.spool, inventory.spool_id.as_deref().unwrap_or("none yet"));
    println!("{:<36}  {:<8}  {:>12}  {:>8}  {:>9}", "pack_id", "state", "bytes", "records", "age");
    for pack in &inventory.packs {
        let records = pack.records.map_or("-".to_string(), |r| r.to_string());
        let problem = pack.problem.as_deref().map(|p| format!("  PROBLEM: {p}")).unwrap_or_default();
        println!(
            "{:<36}  {:<8}  {:>12}  {:>8}  {:>8.1}s{problem}",
            pack.pack_id,
            pack.state.extension(),
            pack.bytes,
            records,
            pack.age_seconds
        );
    }
    for total in &inventory.totals {
        println!(
            "total {:<8} packs {:>6}  bytes {:>12}  records {:>9}",
            total.state.extension(),
            total.packs,
            total.bytes,
            total.records
        );
    }
    println!("inbox files waiting: {}   quarantined files: {}", inventory.inbox_files, inventory.quarantined_files);
    Ok(exit_code::CLEAN)
}

fn verify(paths: &SpoolPaths, json: bool) -> anyhow::Result<i32> {
    let inventory = inventory(paths, true)?;
    let problems: Vec<&PackRow> = inventory.packs.iter().filter(|p| p.problem.is_some()).collect();
    let checked = inventory.packs.iter().filter(|p| p.state != PackState::Open).count();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "checked_packs": checked,
                "problems": problems,
                "quarantined_files": inventory.quarantined_files,
            }))?
        );
    } else {
        for pack in &problems {
            println!("BAD  {} ({}): {}", pack.pack_id, pack.state.extension(), pack.problem.as_deref().unwrap_or(""));
        }
        println!(
            "checked {checked} packs: {} bad; {} files in quarantine",
            problems.len(),
            inventory.quarantined_files
        );
    }
    Ok(if problems.is_empty() { exit_code::CLEAN } else { exit_code::FATAL })
}
