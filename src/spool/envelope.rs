//! The producer side of the inbox: envelope files and `capstore put`.
//!
//! Envelopes: a file whose name ends in `.capenv` carries metadata in front of the payload, so labels and a content
//! type ride along atomically with the bytes (`capstore put` writes these):
//!
//! ```text
//! capenv1 {"labels":{"k":"v"},"content_type":"image/png","captured_at_ns":1764486916000000000}\n
//! <payload bytes>
//! ```
//!
//! Every field of the JSON object is optional; a plain file's captured_at_ns is its modification time.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::capture;
use crate::durable;

pub const ENVELOPE_EXTENSION: &str = "capenv";
const ENVELOPE_MAGIC: &[u8] = b"capenv1 ";
pub(super) const MAX_ENVELOPE_HEADER: usize = 1024 * 1024;

/// The metadata header of an envelope file.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvelopeHeader {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub captured_at_ns: Option<u64>,
}

pub(super) fn is_envelope_name(name: &str) -> bool {
    name.strip_suffix(ENVELOPE_EXTENSION).is_some_and(|stem| stem.ends_with('.'))
}

/// Split an envelope into its header and payload.
pub fn parse_envelope(mut contents: Vec<u8>) -> Result<(EnvelopeHeader, Vec<u8>), String> {
    if !contents.starts_with(ENVELOPE_MAGIC) {
        return Err("envelope does not start with \"capenv1 \"".into());
    }
    let search_end = contents.len().min(MAX_ENVELOPE_HEADER);
    let newline = contents[..search_end]
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| format!("envelope header has no newline within {MAX_ENVELOPE_HEADER} bytes"))?;
    let header: EnvelopeHeader = serde_json::from_slice(&contents[ENVELOPE_MAGIC.len()..newline])
        .map_err(|e| format!("envelope header is not valid: {e}"))?;
    let payload = contents.split_off(newline + 1);
    Ok((header, payload))
}

pub fn encode_envelope_header(header: &EnvelopeHeader) -> Vec<u8> {
    let mut bytes = ENVELOPE_MAGIC.to_vec();
    bytes.extend(serde_json::to_vec(header).expect("envelope header serializes"));
    bytes.push(b'\n');
    bytes
}

/// `capstore put`: copy a file into the inbox atomically (temp name, fsync, rename, directory fsync) as an envelope.
/// Works whether or not the daemon runs; the daemon (or its next start) ingests it.
pub fn put_file(
    inbox: &Path,
    stream: &str,
    capture_id: Uuid,
    header: &EnvelopeHeader,
    source: &mut dyn io::Read,
) -> io::Result<PathBuf> {
    capture::validate_stream(stream).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let dir = inbox.join(stream);
    durable::create_dirs_with_mode(&dir, durable::INBOX_DIR_MODE)?;
    let target = dir.join(format!("{capture_id}.{ENVELOPE_EXTENSION}"));
    if target.exists() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} is already in the inbox", target.display()),
        ));
    }
    let temp = durable::temp_path_for(&target);
    let result = (|| {
        let mut file = durable::new_file_options().write(true).create_new(true).open(&temp)?;
        file.write_all(&encode_envelope_header(header))?;
        io::copy(source, &mut file)?;
        file.sync_all()?;
        drop(file);
        durable::rename_durable(&temp, &target)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result.map(|()| target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip() {
        let header = EnvelopeHeader {
            labels: BTreeMap::from([("site".into(), "berlin".into())]),
            content_type: Some("text/plain".into()),
            captured_at_ns: Some(42),
        };
        let mut bytes = encode_envelope_header(&header);
        bytes.extend_from_slice(b"payload\nwith newline");
        let (parsed, payload) = parse_envelope(bytes).unwrap();
        assert_eq!(parsed.labels, header.labels);
        assert_eq!(parsed.captured_at_ns, Some(42));
        assert_eq!(payload, b"payload\nwith newline");
        assert!(parse_envelope(b"capenv1 {\"bogus\":1}\nx".to_vec()).unwrap_err().contains("bogus"));
        assert!(parse_envelope(b"plain".to_vec()).is_err());
    }
}
