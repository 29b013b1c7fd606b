//! `capstore put`: hand files to the spool through the inbox, whether or not the daemon runs.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use uuid::Uuid;

use capstore::capture;
use capstore::config::Config;
use capstore::exit_code;
use capstore::spool::envelope::{put_file, EnvelopeHeader};
use capstore::spool::SpoolPaths;

#[derive(Args)]
pub struct PutArgs {
    /// Stream name, e.g. "edge/cam-1".
    #[arg(long)]
    stream: String,
    /// Capture id to use (only with a single FILE); default: a new UUIDv7 per file.
    #[arg(long)]
    id: Option<Uuid>,
    /// A label carried with the capture, as key=value; repeatable.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = capture::parse_label)]
    labels: Vec<(String, String)>,
    /// Content type recorded with the capture.
    #[arg(long)]
    content_type: Option<String>,
    /// Files to capture ("-" reads standard input).
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

pub fn put(config: &Config, args: PutArgs) -> anyhow::Result<i32> {
    if let Err(problem) = capture::validate_stream(&args.stream) {
        eprintln!("capstore put: --stream: {problem}");
        return Ok(exit_code::CONFIG_OR_USAGE);
    }
    if args.id.is_some() && args.files.len() != 1 {
        eprintln!("capstore put: --id applies to exactly one FILE, got {}", args.files.len());
        return Ok(exit_code::CONFIG_OR_USAGE);
    }
    if let Some(content_type) = &args.content_type {
        if let Err(problem) = capture::validate_content_type(content_type) {
            eprintln!("capstore put: --content-type: {problem}");
            return Ok(exit_code::CONFIG_OR_USAGE);
        }
    }
    let labels: BTreeMap<String, String> = args.labels.into_iter().collect();
    if let Err(problem) = capture::validate_labels(&labels) {
        eprintln!("capstore put: --label: {problem}");
        return Ok(exit_code::CONFIG_OR_USAGE);
    }
    let paths = SpoolPaths::new(&config.spool.dir);
    for file in &args.files {
        let capture_id = args.id.unwrap_or_else(Uuid::now_v7);
        let header = EnvelopeHeader {
            labels: labels.clone(),
            content_type: args.content_type.clone(),
            captured_at_ns: Some(capstore::util::now_ns()),
        };
        let mut source: Box<dyn std::io::Read> = if file.as_os_str() == "-" {
            Box::new(std::io::stdin().lock())
        } else {
            let metadata = std::fs::metadata(file).with_context(|| format!("cannot read {}", file.display()))?;
            if metadata.len() > config.spool.max_capture_bytes.0 {
                anyhow::bail!(
                    "{} is {} bytes, more than spool.max_capture_bytes = {}",
                    file.display(),
                    metadata.len(),
                    config.spool.max_capture_bytes
                );
            }
            Box::new(std::fs::File::open(file).with_context(|| format!("cannot open {}", file.display()))?)
        };
        put_file(&paths.inbox, &args.stream, capture_id, &header, &mut source)
            .with_context(|| format!("cannot put {} into {}", file.display(), paths.inbox.display()))?;
        println!("{capture_id}\t{}", file.display());
    }
    Ok(exit_code::CLEAN)
}
