//! `capstore export`: published captures (by stream, time range and labels) or a list of ids, out of the catalog and
//! bucket, into a directory or as a tar stream on standard output. Byte-identical (every record's CRC checked), one
//! catalog statement and one coalesced ranged read per bucket pack per page of [`capstore::export::EXPORT_PAGE`] captures (500 of an id list), memory one
//! page, progress on a terminal. A capture whose record cannot be read (damaged, or its pack object gone) is listed in
//! the manifest as `"error": "unreadable"` with the reason on stderr, the others are exported, and the exit code is 1.
//!
//! A directory export is resumable: each page's files are written, then its manifest lines appended to
//! `manifest.jsonl`; at most once a second (and at the end), after one syncfs of all that, `.capstore-export` is
//! replaced atomically with the resume token and the manifest's length. `--resume` truncates the manifest to that
//! length (pages written after the last recorded one are written again) and goes on from the token, so every
//! capture is in the manifest once however often, and however abruptly, the export was stopped.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use capstore::bucket::Bucket;
use capstore::catalog::query::{ListQuery, TailPosition};
use capstore::config::Config;
use capstore::exit_code;
use capstore::export::{manifest_line, tar_end, tar_page, Export, ExportPage, Selection};
use capstore::reader::Found;
use capstore::reader::Reader;

const STATE_FILE: &str = ".capstore-export";
/// How often the resume state advances (after a sync of the directory's filesystem).
const STATE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Args)]
pub struct ExportArgs {
    #[arg(long, conflicts_with = "ids")]
    stream: Option<String>,
    /// Captured at or after: RFC 3339, a date (YYYY-MM-DD) or nanoseconds since the epoch.
    #[arg(long, value_parser = super::read_cmd::parse_time, conflicts_with = "ids")]
    since: Option<u64>,
    /// Captured before: RFC 3339, a date or nanoseconds since the epoch.
    #[arg(long, value_parser = super::read_cmd::parse_time, conflicts_with = "ids")]
    until: Option<u64>,
    /// Only captures with this label; repeatable (all must match).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = capstore::capture::parse_label, conflicts_with = "ids")]
    labels: Vec<(String, String)>,
    /// Export what was published after this version (or `<version>:<capture_id>` tail position), in version order, each
    /// version as published, instead of a query.
    #[arg(long, value_name = "VERSION", value_parser = TailPosition::parse, conflicts_with_all = ["ids", "stream", "since", "until", "labels"])]
    after_version: Option<TailPosition>,
    /// With --after-version: up to and including this version (default: the watermark when the export starts).
    #[arg(long, value_name = "VERSION", requires = "after_version")]
    through_version: Option<u64>,
    /// Export the capture ids in this file (one per line) instead of a query; ids nothing knows are listed in the
    /// manifest as not found.
    #[arg(long, value_name = "FILE")]
    ids: Option<PathBuf>,
    /// Write into this directory: one file per capture, named by its id, and manifest.jsonl.
    #[arg(long, value_name = "DIR", required_unless_present = "tar", conflicts_with = "tar")]
    out: Option<PathBuf>,
    /// Write a tar stream to standard output instead (the files, and manifest/<page>.jsonl per page).
    #[arg(long)]
    tar: bool,
    /// With --out: go on from where an earlier export into the same directory stopped.
    #[arg(long, requires = "out")]
    resume: bool,
    /// Captures per page (one catalog read each, held in memory together, at most 32 MiB of payload), 1-10000;
    /// an id list's pages are 500 at most.
    #[arg(long, value_name = "N", default_value_t = capstore::export::EXPORT_PAGE as u64, value_parser = clap::value_parser!(u64).range(1..=capstore::export::EXPORT_PAGE_MAX as u64))]
    page_size: u64,
    /// Stop after about this many captures (whole pages); --resume continues.
    #[arg(long, value_name = "N")]
    max_captures: Option<u64>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ExportState {
    /// What is exported (the query, or the ids file's path and its ids' digest): a resume must ask the same.
    selection: String,
    /// Where the next page starts; `None` when the export is complete.
    resume: Option<String>,
    /// Bytes of manifest.jsonl that belong to pages finished.
    manifest_bytes: u64,
    exported: u64,
}

pub fn export(config: &Config, args: ExportArgs) -> anyhow::Result<i32> {
    let selection = match &args.ids {
        Some(path) => match super::read_ids_file(path, "export")? {
            Ok(ids) => Selection::Ids(ids),
            Err(code) => return Ok(code),
        },
        None if args.after_version.is_some() => {
            Selection::Versions { after: args.after_version.unwrap_or_default(), through: args.through_version }
        }
        None => {
            if let Some(stream) = &args.stream {
                if let Err(problem) = capstore::capture::validate_stream(stream) {
                    eprintln!("capstore export: --stream {stream:?}: {problem}");
                    return Ok(exit_code::CONFIG_OR_USAGE);
                }
            }
            Selection::Query(ListQuery {
                stream: args.stream.clone(),
                since_ns: args.since,
                until_ns: args.until,
                labels: args.labels.iter().cloned().collect(),
                ..Default::default()
            })
        }
    };
    let runtime = super::runtime()?;
    runtime.block_on(async {
        let catalog = capstore::catalog::connect_reader(config).await?;
        // Published captures are all in the bucket: the spool is not scanned.
        let reader = Reader::new(catalog, Arc::new(Bucket::from_config(config)?), None);
        match &args.out {
            Some(dir) => export_to_dir(&reader, selection, dir, &args).await,
            None => export_to_tar(&reader, selection, &args).await,
        }
    })
}

async fn export_to_dir(reader: &Reader, selection: Selection, dir: &Path, args: &ExportArgs) -> anyhow::Result<i32> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let state_path = dir.join(STATE_FILE);
    let manifest_path = dir.join("manifest.jsonl");
    let mut state = if args.resume {
        let text = std::fs::read_to_string(&state_path)
            .with_context(|| format!("--resume: no earlier export in {} ({STATE_FILE} missing)", dir.display()))?;
        let state: ExportState =
            serde_json::from_str(&text).with_context(|| format!("--resume: {STATE_FILE} is damaged"))?;
        if state.selection != describe(&selection) {
            eprintln!(
                "capstore export: {} holds an export of {}; --resume must ask for the same",
                dir.display(),
                state.selection
            );
            return Ok(exit_code::CONFIG_OR_USAGE);
        }
        if state.resume.is_none() {
            eprintln!("capstore export: the export in {} is complete already", dir.display());
            return Ok(exit_code::CLEAN);
        }
        state
    } else {
        if state_path.exists() {
            eprintln!("capstore export: {} holds an export already; add --resume to continue it", dir.display());
            return Ok(exit_code::CONFIG_OR_USAGE);
        }
        ExportState { selection: describe(&selection), resume: None, manifest_bytes: 0, exported: 0 }
    };
    // Lines of a page written after the last recorded one are written again: drop them.
    std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(&manifest_path)
        .and_then(|file| file.set_len(state.manifest_bytes))
        .with_context(|| format!("cannot open {}", manifest_path.display()))?;
    let mut manifest = std::io::BufWriter::new(std::fs::OpenOptions::new().append(true).open(&manifest_path)?);
    let mut export = Export::new(reader, selection, state.resume.take())
        .map_err(anyhow::Error::msg)?
        .with_page_captures(args.page_size as usize);
    let bar = super::progress(None, "export");
    let mut this_run = 0u64;
    let (mut missing, mut unreadable) = (0u64, 0u64);
    let mut last_sync = std::time::Instant::now();
    while let Some(ExportPage { captures, horizons, resume }) = export.next_page().await? {
        let mut lines = String::new();
        let mut page_written = 0;
        for (id, found) in captures {
            match &found {
                Found::Capture(capture) => {
                    let path = dir.join(id.to_string());
                    std::fs::write(&path, &capture.payload)
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    page_written += 1;
                }
                Found::Unknown => missing += 1,
                Found::Deleted { .. } => {
                    // Deleted later in the range: the directory holds what the range ends with.
                    let path = dir.join(id.to_string());
                    match std::fs::remove_file(&path) {
                        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                            return Err(anyhow::Error::new(error).context(format!("cannot remove {}", path.display())))
                        }
                        _ => {}
                    }
                }
                Found::Unreadable(reason) => {
                    unreadable += 1;
                    bar.suspend(|| eprintln!("capstore export: capture {id} unreadable: {reason}"));
                }
            }
            lines.push_str(&manifest_line(id, &found).to_string());
            lines.push('\n');
        }
        manifest.write_all(lines.as_bytes())?;
        manifest.flush()?;
        for (version, before_ns) in horizons {
            // A retention horizon in the range: the directory holds what the range ends with, as for a deletion.
            remove_captured_before(dir, &manifest_path, before_ns)?;
            let line = format!("{}\n", capstore::catalog::query::horizon_entry(version, before_ns));
            manifest.write_all(line.as_bytes())?;
            manifest.flush()?;
            lines.push_str(&line);
        }
        state.manifest_bytes += lines.len() as u64;
        state.exported += page_written;
        this_run += page_written;
        state.resume = resume;
        bar.set_message(format!("{this_run} captures"));
        let stopping = state.resume.is_none() || args.max_captures.is_some_and(|max| this_run >= max);
        // The state advances only right after a sync of everything before it, at most once a second (a crash
        // re-exports the pages since): one syncfs, not a fsync per file.
        if stopping || last_sync.elapsed() >= STATE_INTERVAL {
            let dir_file = std::fs::File::open(dir)?;
            nix::unistd::syncfs(&dir_file).with_context(|| format!("cannot sync {}", dir.display()))?;
            write_state(&state_path, &state)?;
            last_sync = std::time::Instant::now();
        }
        if stopping {
            break;
        }
    }
    bar.finish_and_clear();
    let complete = state.resume.is_none();
    eprintln!(
        "capstore export: {this_run} captures written to {} ({} in all){}{}{}",
        dir.display(),
        state.exported,
        if missing > 0 { format!(", {missing} ids not found") } else { String::new() },
        if unreadable > 0 { format!(", {unreadable} unreadable (listed in the manifest)") } else { String::new() },
        if complete { "; complete" } else { "; stopped early: --resume continues" }
    );
    Ok(if missing + unreadable > 0 { exit_code::FATAL } else { exit_code::CLEAN })
}

/// Remove the files of the captures whose last manifest line (the version the directory holds) has a
/// `captured_at_ns` before `before_ns`: a retention horizon of the range. (A capture posted again later in the range
/// with a later time keeps its file; one deleted later has none.)
fn remove_captured_before(dir: &Path, manifest_path: &Path, before_ns: u64) -> anyhow::Result<()> {
    use std::io::BufRead;
    let manifest =
        std::fs::File::open(manifest_path).with_context(|| format!("cannot read {}", manifest_path.display()))?;
    // Each id's time as the directory holds it now: `None` once deleted.
    let mut held: std::collections::HashMap<uuid::Uuid, Option<u64>> = std::collections::HashMap::new();
    for line in std::io::BufReader::new(manifest).lines() {
        let line: serde_json::Value = serde_json::from_str(&line?).unwrap_or_default();
        let Some(id) = line["capture_id"].as_str().and_then(|id| uuid::Uuid::parse_str(id).ok()) else { continue };
        if line["deleted"] == true {
            held.insert(id, None);
        } else if let Some(at) = line["captured_at_ns"].as_u64().filter(|_| line.get("error").is_none()) {
            held.insert(id, Some(at));
        }
    }
    for (id, at) in held {
        if at.is_none_or(|at| at >= before_ns) {
            continue;
        }
        let path = dir.join(id.to_string());
        match std::fs::remove_file(&path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(anyhow::Error::new(error).context(format!("cannot remove {}", path.display())))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Replace the state atomically (temp file, fsync, rename): a crash leaves the old state or the new one.
fn write_state(path: &Path, state: &ExportState) -> anyhow::Result<()> {
    let text = serde_json::to_string(state)?;
    capstore::durable::write_file_durable(path, text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The selection as the state records it: a resume must ask for the same.
fn describe(selection: &Selection) -> String {
    match selection {
        Selection::Query(query) => format!(
            "captures of stream {:?}, since {:?}, until {:?}, labels {:?}",
            query.stream, query.since_ns, query.until_ns, query.labels
        ),
        Selection::Ids(ids) => {
            use sha2::Digest;
            let mut digest = sha2::Sha256::new();
            for id in ids {
                digest.update(id.as_bytes());
            }
            format!("{} listed ids (sha256 {})", ids.len(), hex::encode(digest.finalize()))
        }
        Selection::Versions { after, through } => match through {
            Some(through) => format!("captures published after {after} through version {through}"),
            None => format!("captures published after {after} through the watermark at its start"),
        },
    }
}

async fn export_to_tar(reader: &Reader, selection: Selection, args: &ExportArgs) -> anyhow::Result<i32> {
    let mut out = std::io::BufWriter::with_capacity(1 << 20, std::io::stdout().lock());
    let mut export =
        Export::new(reader, selection, None).map_err(anyhow::Error::msg)?.with_page_captures(args.page_size as usize);
    let bar = super::progress(None, "export");
    let (mut written, mut missing, mut page_number) = (0u64, 0u64, 0u64);
    while let Some(page) = export.next_page().await? {
        page_number += 1;
        let tar = tar_page(page);
        for chunk in tar.chunks.iter().chain(&tar.manifest(page_number)) {
            out.write_all(chunk)?;
        }
        for (id, reason) in &tar.unreadable {
            bar.suspend(|| eprintln!("capstore export: capture {id} unreadable: {reason}"));
        }
        written += tar.written;
        missing += tar.missing + tar.unreadable.len() as u64;
        bar.set_message(format!("{written} captures"));
        if args.max_captures.is_some_and(|max| written >= max) {
            break;
        }
    }
    out.write_all(&tar_end())?;
    out.flush()?;
    bar.finish_and_clear();
    Ok(if missing > 0 { exit_code::FATAL } else { exit_code::CLEAN })
}
