//! What a capture may look like: the rules every way in (inbox, `capstore put`, HTTP, the library) applies the same way.

use std::collections::BTreeMap;

use uuid::Uuid;

/// What a capture is besides its payload. The pack format stores it in the capture's record and repeats it in the
/// pack's footer ([`crate::pack`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CaptureMeta {
    pub capture_id: Uuid,
    pub stream: String,
    pub captured_at_ns: u64,
    pub labels: BTreeMap<String, String>,
    pub content_type: Option<String>,
    /// Inbox file name the record came from, for exactly-once ingest.
    pub source_name: Option<String>,
}

pub const MAX_STREAM_LEN: usize = 255;
pub const MAX_STREAM_DEPTH: usize = 8;
pub const MAX_SEGMENT_LEN: usize = 64;
pub const MAX_LABELS: usize = 64;
pub const MAX_LABEL_KEY_LEN: usize = 128;
pub const MAX_LABEL_VALUE_LEN: usize = 4096;
pub const MAX_CONTENT_TYPE_LEN: usize = 255;

/// A stream is a path-like name: 1-8 segments joined by '/', each 1-64 of `[A-Za-z0-9._-]`, none starting with '.'.
pub fn validate_stream(stream: &str) -> Result<(), String> {
    if stream.is_empty() {
        return Err("stream name is empty (files must be under inbox/<stream>/)".into());
    }
    if stream.len() > MAX_STREAM_LEN {
        return Err(format!("stream name is {} bytes, more than {MAX_STREAM_LEN}", stream.len()));
    }
    let segments: Vec<&str> = stream.split('/').collect();
    if segments.len() > MAX_STREAM_DEPTH {
        return Err(format!("stream {stream:?} has {} segments, more than {MAX_STREAM_DEPTH}", segments.len()));
    }
    for segment in segments {
        let valid_chars = segment.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if segment.is_empty() || segment.len() > MAX_SEGMENT_LEN || segment.starts_with('.') || !valid_chars {
            return Err(format!(
                "stream {stream:?}: segment {segment:?} must be 1-{MAX_SEGMENT_LEN} characters of letters, digits, \
                 '.', '_' or '-', not starting with '.'"
            ));
        }
    }
    Ok(())
}

pub fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), String> {
    if labels.len() > MAX_LABELS {
        return Err(format!("{} labels, more than {MAX_LABELS}", labels.len()));
    }
    for (key, value) in labels {
        let valid_key = key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '/'));
        if key.is_empty() || key.len() > MAX_LABEL_KEY_LEN || !valid_key {
            return Err(format!(
                "label key {key:?} must be 1-{MAX_LABEL_KEY_LEN} characters of letters, digits, '.', '_', '-', ':' or '/'"
            ));
        }
        if value.len() > MAX_LABEL_VALUE_LEN {
            return Err(format!("label {key:?} value is {} bytes, more than {MAX_LABEL_VALUE_LEN}", value.len()));
        }
    }
    Ok(())
}

pub fn validate_content_type(content_type: &str) -> Result<(), String> {
    if content_type.is_empty()
        || content_type.len() > MAX_CONTENT_TYPE_LEN
        || content_type.chars().any(char::is_control)
    {
        return Err(format!("content type {content_type:?} must be 1-{MAX_CONTENT_TYPE_LEN} printable characters"));
    }
    Ok(())
}

/// Check a whole capture's metadata.
pub fn validate_meta(meta: &CaptureMeta) -> Result<(), String> {
    validate_stream(&meta.stream)?;
    validate_labels(&meta.labels)?;
    if let Some(content_type) = &meta.content_type {
        validate_content_type(content_type)?;
    }
    Ok(())
}

/// Parse a `key=value` label argument.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text.split_once('=').ok_or_else(|| format!("label {text:?} must look like key=value"))?;
    let mut one = BTreeMap::new();
    one.insert(key.to_string(), value.to_string());
    validate_labels(&one)?;
    Ok((key.to_string(), value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_names() {
        for good in ["a", "edge/cam-1", "x.y_z/1/2/3", "A9"] {
            validate_stream(good).unwrap();
        }
        for bad in ["", "/a", "a/", "a//b", ".hidden", "a/.b", "sp ace", "ü", &"x".repeat(65), "1/2/3/4/5/6/7/8/9"] {
            assert!(validate_stream(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn labels() {
        assert_eq!(parse_label("site=berlin").unwrap(), ("site".into(), "berlin".into()));
        assert_eq!(parse_label("k=a=b").unwrap(), ("k".into(), "a=b".into()));
        assert!(parse_label("novalue").unwrap_err().contains("key=value"));
        assert!(parse_label("bad key=1").unwrap_err().contains("bad key"));
    }
}
