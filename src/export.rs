//! Exporting captures in bulk, and the framings exports and multi-gets are written in.
//!
//! An [`Export`] walks a selection (a listing query, a list of ids, or a range of versions) page by page. A page is
//! at most [`EXPORT_PAGE_BYTES`] of payload (one capture at least) and [`EXPORT_PAGE`] captures of a query or a
//! version range ([`EXPORT_IDS_PAGE`] of an id list, the ids one multi-get statement holds). It costs one catalog
//! read (the listing page, the log page, or one multi-get statement) and one coalesced ranged read per bucket pack
//! ([`Reader::read_located`]), and is handed over whole, so memory is one page whatever the export's size. After each
//! page the export reports where it stands as a resume token: the listing's cursor (which pins the catalog's
//! watermark, so a resumed export continues the same snapshot), `ids:<n>` for an id list, or
//! `versions:<through>/<tail position>` for a version range (pinned at its last version likewise). States: `next
//! page` -> `page handed over` (resume token advanced) -> ... -> `done` (no token).
//!
//! Framings: a directory (one file per capture, named by its id, and `manifest.jsonl`), or a tar stream (the same
//! files; the manifest split per page, `manifest/<page>.jsonl`, so nothing accumulates), with a [`manifest_line`]
//! per id.

use bytes::Bytes;
use uuid::Uuid;

use crate::catalog::query::{keep_within, CaptureLocation, ListQuery, TailPosition};
use crate::reader::{Found, ReadError, Reader, GET_MANY_MAX};

/// Captures per page of a query or version-range export. Each page's catalog read costs about the same whatever
/// its size up to here (tens of ms on a 2-core server), so small captures come out at the bucket's pace, not the
/// catalog's.
pub const EXPORT_PAGE: usize = 5000;
/// The largest page a caller may ask for (a listing page's limit).
pub const EXPORT_PAGE_MAX: usize = 10_000;
/// Ids per page of an id-list export or a multi-get: the ids of one multi-get statement.
pub const EXPORT_IDS_PAGE: usize = GET_MANY_MAX;
/// Payload bytes per page, at most (one capture at least): what an export or a multi-get holds in memory at once,
/// with the coalesced reads in flight (up to 4 x 16 MiB); together under 100 MiB.
pub const EXPORT_PAGE_BYTES: usize = 32 << 20;
const TAR_BLOCK: usize = 512;

/// What to export.
#[derive(Debug, Clone)]
pub enum Selection {
    /// Published captures by stream, time range and labels (the listing's order: captured_at_ns, capture_id).
    Query(ListQuery),
    /// These ids, in this order.
    Ids(Vec<Uuid>),
    /// The captures published after `after` up to version `through` (or the watermark when the export starts, if
    /// lower or not given), in tail order, each version as published (an id posted again appears at each of its
    /// versions).
    Versions { after: TailPosition, through: Option<u64> },
}

/// One page of an export.
#[derive(Debug)]
pub struct ExportPage {
    /// In selection order; [`Found::Unknown`] for an id asked that nothing knows (only with [`Selection::Ids`]),
    /// [`Found::Unreadable`] for a damaged record or a lost pack object (the export goes on with the others).
    pub captures: Vec<(Uuid, Found)>,
    /// The retention horizons published in a version range's page, after its captures: (version, before_ns). From
    /// each on, every capture captured before `before_ns` is gone (see [`crate::catalog::query::horizon_entry`]).
    pub horizons: Vec<(u64, u64)>,
    /// Where the next page starts: give it to [`Export::new`] to resume after this page. `None` once done.
    pub resume: Option<String>,
}

pub struct Export<'a> {
    reader: &'a Reader,
    selection: Selection,
    /// The listing cursor, or the index of the next id.
    position: Option<String>,
    done: bool,
    /// Captures per page of a query or a version range ([`EXPORT_PAGE`] unless set).
    page_captures: usize,
}

impl<'a> Export<'a> {
    /// An export of `selection`, from its start or from a `resume` token a page of the same selection handed over.
    pub fn new(reader: &'a Reader, selection: Selection, resume: Option<String>) -> Result<Export<'a>, String> {
        if let (Selection::Ids(_), Some(token)) = (&selection, &resume) {
            if token.strip_prefix("ids:").and_then(|n| n.parse::<usize>().ok()).is_none() {
                return Err(format!("resume token {token:?} is not one of an id-list export"));
            }
        }
        let mut resume = resume;
        if let (Selection::Query(query), Some(token)) = (&selection, &resume) {
            let cursor = query_token_cursor(query, token)?;
            crate::catalog::query::validate_cursor(&cursor)?;
            resume = Some(cursor);
        }
        if let (Selection::Versions { after, through }, Some(token)) = (&selection, &resume) {
            let (token_through, position) = versions_token(token)?;
            if through.is_some_and(|through| through < token_through) {
                return Err(format!("resume token {token:?} is of an export through version {token_through}"));
            }
            if position.version < after.version {
                return Err(format!("resume token {token:?} is before version {}", after.version));
            }
        }
        Ok(Export { reader, selection, position: resume, done: false, page_captures: EXPORT_PAGE })
    }

    /// Pages of at most `captures` captures (1 to [`EXPORT_PAGE_MAX`]) of a query or a version range; an id list's
    /// pages stay at [`EXPORT_IDS_PAGE`] at most.
    pub fn with_page_captures(mut self, captures: usize) -> Self {
        self.page_captures = captures.clamp(1, EXPORT_PAGE_MAX);
        self
    }

    /// The next page, or `None` when the selection is exhausted.
    pub async fn next_page(&mut self) -> Result<Option<ExportPage>, ReadError> {
        if self.done {
            return Ok(None);
        }
        let mut horizons = Vec::new();
        let (captures, resume) = match &self.selection {
            Selection::Query(query) => {
                let page_query =
                    ListQuery { limit: self.page_captures as u64, cursor: self.position.clone(), ..query.clone() };
                let page = self.reader.catalog().list(&page_query).await?;
                let page = page.cut_by(EXPORT_PAGE_BYTES, |location| location.payload_len as usize);
                (self.reader.read_located(located(page.captures)).await?, page.next_cursor)
            }
            Selection::Ids(ids) => {
                let start = self.position.as_deref().and_then(|t| t.strip_prefix("ids:")?.parse().ok()).unwrap_or(0);
                let start = start.min(ids.len());
                let batch = &ids[start..(start + EXPORT_IDS_PAGE.min(self.page_captures)).min(ids.len())];
                let mut locations = self.reader.catalog().newest_rows(batch).await?;
                let sizes =
                    batch.iter().map(|id| locations.get(id).map_or(0, |location| location.payload_len as usize));
                let kept = keep_within(sizes, EXPORT_PAGE_BYTES);
                let located = batch[..kept].iter().map(|id| (*id, locations.remove(id))).collect();
                let end = start + kept;
                (self.reader.read_asked(located).await?, (end < ids.len()).then(|| format!("ids:{end}")))
            }
            Selection::Versions { after, through } => {
                // The snapshot is pinned in the token, as a listing cursor pins its watermark.
                let (through, from) = match &self.position {
                    Some(token) => versions_token(token).expect("checked by Export::new, or written by this export"),
                    // Up to the watermark: what is not published yet is not exported (a later export after
                    // this one's last version takes it).
                    None => {
                        let watermark = self.reader.catalog().watermark().await?;
                        (through.map_or(watermark, |through| through.min(watermark)), *after)
                    }
                };
                let page = self.reader.catalog().tail_page(from, Some(through), self.page_captures as u64).await?;
                let page = page.cut_by(EXPORT_PAGE_BYTES, |location| location.payload_len as usize);
                let done = page.caught_up() || page.next.version >= through;
                let resume = (!done).then(|| format!("versions:{through}/{}", page.next));
                horizons = page.horizons;
                (self.reader.read_located(located(page.captures)).await?, resume)
            }
        };
        self.done = resume.is_none();
        self.position = resume.clone();
        // A query's token names the query too, so that it cannot resume another one.
        let resume = match &self.selection {
            Selection::Query(query) => resume.map(|cursor| format!("q{}:{cursor}", query_digest(query))),
            _ => resume,
        };
        Ok(Some(ExportPage { captures, horizons, resume }))
    }
}

/// Catalog rows as [`Reader::read_located`] takes them.
fn located(captures: Vec<CaptureLocation>) -> Vec<(Uuid, Option<CaptureLocation>)> {
    captures
        .into_iter()
        .filter_map(|location| Some((Uuid::parse_str(&location.capture_id).ok()?, Some(location))))
        .collect()
}

/// A short digest of what a query selects (stream, time range, labels): the prefix of its export's resume tokens.
fn query_digest(query: &ListQuery) -> String {
    use sha2::Digest;
    let selection = serde_json::json!([query.stream, query.since_ns, query.until_ns, query.labels]);
    hex::encode(&sha2::Sha256::digest(selection.to_string().as_bytes())[..6])
}

/// The listing cursor in a resume token of a query export, `q<digest>:<cursor>`, if the digest is `query`'s; a bare
/// cursor (the tokens of an older build) is taken as it is.
fn query_token_cursor(query: &ListQuery, token: &str) -> Result<String, String> {
    let Some((digest, cursor)) = token.strip_prefix('q').and_then(|rest| rest.split_once(':')) else {
        return Ok(token.to_string());
    };
    if digest != query_digest(query) {
        return Err(format!("resume token {token:?} is of another query (its stream, time range or labels differ)"));
    }
    Ok(cursor.to_string())
}

/// The last version and the position in a resume token of a version-range export, `versions:<through>/<position>`.
fn versions_token(token: &str) -> Result<(u64, TailPosition), String> {
    let bad = || format!("resume token {token:?} is not one of a version-range export");
    let (through, position) = token.strip_prefix("versions:").and_then(|rest| rest.split_once('/')).ok_or_else(bad)?;
    Ok((through.parse().map_err(|_| bad())?, TailPosition::parse(position).map_err(|_| bad())?))
}

/// The manifest line of what a read found for `id`: the capture's metadata, or `"error": "not found"` (an id asked
/// that neither the catalog nor the spool knows), or `"error": "unreadable"` (the reason goes to the log or the
/// terminal, never into the manifest).
pub fn manifest_line(id: Uuid, found: &Found) -> serde_json::Value {
    match found {
        Found::Capture(capture) => serde_json::json!({
            "capture_id": id,
            "stream": capture.meta.stream,
            "captured_at_ns": capture.meta.captured_at_ns,
            "labels": capture.meta.labels,
            "content_type": capture.meta.content_type,
            "size": capture.payload.len(),
            "crc32c": crc32c::crc32c(&capture.payload),
            "version": capture.version,
            "source": capture.source,
        }),
        Found::Unknown => serde_json::json!({"capture_id": id, "error": "not found"}),
        Found::Deleted { version } => serde_json::json!({"capture_id": id, "deleted": true, "version": version}),
        Found::Unreadable(_) => serde_json::json!({"capture_id": id, "error": "unreadable"}),
    }
}

/// One regular file in ustar framing: the header block, the bytes (not copied), zero padding to a whole block.
pub fn tar_file(name: &str, modified_ns: u64, bytes: Bytes) -> [Bytes; 3] {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(bytes.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(modified_ns / 1_000_000_000);
    // Names are capture ids or manifest names: short ASCII, always accepted.
    let _ = header.set_path(name);
    header.set_cksum();
    let padding = (TAR_BLOCK - bytes.len() % TAR_BLOCK) % TAR_BLOCK;
    [Bytes::copy_from_slice(header.as_bytes()), bytes, Bytes::from(vec![0u8; padding])]
}

/// The end of a tar archive: two zero blocks.
pub fn tar_end() -> Bytes {
    Bytes::from(vec![0u8; 2 * TAR_BLOCK])
}

/// One page in tar framing: its captures' files, and their manifest lines in page order.
pub struct TarPage {
    pub chunks: Vec<Bytes>,
    pub lines: Vec<(Uuid, serde_json::Value)>,
    /// Captures written, ids asked that nothing knows, captures that could not be read (and why).
    pub written: u64,
    pub missing: u64,
    pub unreadable: Vec<(Uuid, String)>,
    pub resume: Option<String>,
}

/// The page's captures as tar files (the payloads are not copied) and their manifest lines.
pub fn tar_page(page: ExportPage) -> TarPage {
    let mut tar = TarPage {
        chunks: Vec::new(),
        lines: Vec::new(),
        written: 0,
        missing: 0,
        unreadable: Vec::new(),
        resume: page.resume,
    };
    for (id, found) in page.captures {
        tar.lines.push((id, manifest_line(id, &found)));
        match found {
            Found::Capture(capture) => {
                tar.chunks.extend(tar_file(&id.to_string(), capture.meta.captured_at_ns, capture.payload.into()));
                tar.written += 1;
            }
            Found::Unknown => tar.missing += 1,
            // A deletion in a version range: its manifest line is all it is.
            Found::Deleted { .. } => {}
            Found::Unreadable(reason) => tar.unreadable.push((id, reason)),
        }
    }
    for (version, before_ns) in page.horizons {
        let entry = serde_json::to_value(crate::catalog::query::horizon_entry(version, before_ns))
            .expect("a horizon entry is two numbers");
        tar.lines.push((Uuid::nil(), entry));
    }
    tar
}

impl TarPage {
    /// `manifest/<number>.jsonl`: the page's lines and, when more follows, `{"resume": token}`.
    pub fn manifest(&self, number: u64) -> [Bytes; 3] {
        let mut text = String::new();
        let resume = self.resume.iter().map(|token| serde_json::json!({ "resume": token }));
        for line in self.lines.iter().map(|(_, line)| line.clone()).chain(resume) {
            text.push_str(&line.to_string());
            text.push('\n');
        }
        tar_file(&format!("manifest/{number:06}.jsonl"), crate::util::now_ns(), Bytes::from(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_export_token_resumes_its_own_query_only() {
        let query = |stream: &str| ListQuery { stream: Some(stream.into()), ..ListQuery::default() };
        let cursor = "7.123.0190b1d4-7c1e-7000-8000-000000000001.5";
        let token = format!("q{}:{cursor}", query_digest(&query("cam/a")));
        assert_eq!(query_token_cursor(&query("cam/a"), &token).unwrap(), cursor);
        let refused = query_token_cursor(&query("cam/b"), &token).unwrap_err();
        assert!(refused.contains("another query"), "{refused}");
        let labelled = ListQuery { labels: [("k".to_string(), "v".to_string())].into(), ..query("cam/a") };
        assert!(query_token_cursor(&labelled, &token).is_err(), "labels are part of the query");
        assert_eq!(query_token_cursor(&query("cam/b"), cursor).unwrap(), cursor, "an older build's bare cursor");
    }

    #[test]
    fn tar_files_read_back_with_the_tar_crate() {
        let mut archive_bytes = Vec::new();
        for (name, payload) in [("a", vec![1u8; 700]), ("b", Vec::new()), ("manifest/000001.jsonl", b"{}\n".to_vec())] {
            for chunk in tar_file(name, 1_700_000_000_000_000_000, Bytes::from(payload)) {
                archive_bytes.extend_from_slice(&chunk);
            }
        }
        archive_bytes.extend_from_slice(&tar_end());
        let mut archive = tar::Archive::new(archive_bytes.as_slice());
        let entries: Vec<(String, usize, u64)> = archive
            .entries()
            .unwrap()
            .map(|entry| {
                let mut entry = entry.unwrap();
                let name = entry.path().unwrap().display().to_string();
                let mtime = entry.header().mtime().unwrap();
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
                (name, bytes.len(), mtime)
            })
            .collect();
        let expected: Vec<(String, usize, u64)> = vec![
            ("a".into(), 700, 1_700_000_000),
            ("b".into(), 0, 1_700_000_000),
            ("manifest/000001.jsonl".into(), 3, 1_700_000_000),
        ];
        assert_eq!(entries, expected);
    }
}
