//! Bucket errors and the one place object_store errors are sorted into kinds.

use std::fmt;

use crate::pack::PackError;

/// What a caller does with a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketErrorKind {
    /// The bucket is unreachable, slow or failing: retry later; never the pack's fault.
    Transient,
    /// A different object already sits at the pack's key: permanent; quarantine the pack.
    Conflict,
    /// The object (or local file) is not a valid pack: the reason is in the message.
    InvalidPack,
    /// No object at the key.
    NotFound,
    /// Configuration, credentials, permissions or an unsupported operation: an operator must act.
    Permanent,
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BucketError {
    pub kind: BucketErrorKind,
    /// Lowercase, self-contained (it includes the cause's text), never a secret.
    pub message: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl BucketError {
    pub(super) fn new(kind: BucketErrorKind, message: impl Into<String>) -> Self {
        BucketError { kind, message: message.into(), source: None }
    }

    pub(super) fn from_store(context: impl fmt::Display, error: object_store::Error) -> Self {
        BucketError { kind: classify(&error), message: format!("{context}: {error}"), source: Some(Box::new(error)) }
    }

    pub(super) fn invalid_pack(key: &str, error: PackError) -> Self {
        BucketError {
            kind: BucketErrorKind::InvalidPack,
            message: format!("{key} is not a valid pack: {error}"),
            source: Some(Box::new(error)),
        }
    }

    pub(super) fn local_io(context: impl fmt::Display, error: std::io::Error) -> Self {
        // A local disk failing (the spool's, or a file:// bucket's) is not the pack's fault: retry later. Only a
        // refusal an operator must fix is permanent.
        BucketError {
            kind: if io_refused_for_good(&error) { BucketErrorKind::Permanent } else { BucketErrorKind::Transient },
            message: format!("{context}: {error}"),
            source: Some(Box::new(error)),
        }
    }

    pub fn is_transient(&self) -> bool {
        self.kind == BucketErrorKind::Transient
    }
}

/// The one place object_store errors are sorted into kinds.
///
/// `Generic` errors are transient unless they carry a 4xx HTTP status other than 408 and 429 (a request the server
/// will refuse again) or a local permission error: connection failures, timeouts and 5xx all land there, and when in
/// doubt, retrying later loses nothing. object_store does not expose the status of a `Generic` error as a type, so it
/// is read from the text of the error chain (`... status code: 400 Bad Request ...`).
pub fn classify(error: &object_store::Error) -> BucketErrorKind {
    use object_store::Error as E;
    match error {
        E::NotFound { .. } => BucketErrorKind::NotFound,
        E::AlreadyExists { .. } | E::Precondition { .. } => BucketErrorKind::Conflict,
        E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::UnknownConfigurationKey { .. }
        | E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented
        | E::NotModified { .. } => BucketErrorKind::Permanent,
        E::JoinError { .. } => BucketErrorKind::Transient,
        E::Generic { source, .. } => classify_generic(source.as_ref()),
        _ => BucketErrorKind::Transient,
    }
}

fn classify_generic(source: &(dyn std::error::Error + 'static)) -> BucketErrorKind {
    let mut current_opt: Option<&(dyn std::error::Error + 'static)> = Some(source);
    while let Some(current) = current_opt {
        if current.downcast_ref::<std::io::Error>().is_some_and(io_refused_for_good) {
            return BucketErrorKind::Permanent;
        }
        if let Some(status) = http_status_in(&current.to_string()) {
            let refused_for_good = (400..500).contains(&status) && status != 408 && status != 429;
            return if refused_for_good { BucketErrorKind::Permanent } else { BucketErrorKind::Transient };
        }
        current_opt = current.source();
    }
    BucketErrorKind::Transient
}

/// A local I/O error an operator must fix (permissions, a read-only filesystem): retrying will not help.
pub(super) fn io_refused_for_good(error: &std::io::Error) -> bool {
    matches!(error.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem)
}

/// The status in object_store's "status code: 400 Bad Request" error text, if any.
fn http_status_in(text: &str) -> Option<u16> {
    let (_, after) = text.split_once("status code: ")?;
    let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
    if digits.len() != 3 {
        return None;
    }
    digits.parse().ok()
}

pub(super) fn permanent(message: String) -> BucketError {
    BucketError::new(BucketErrorKind::Permanent, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generic(text: &str) -> object_store::Error {
        object_store::Error::Generic { store: "S3", source: text.to_string().into() }
    }

    #[test]
    fn classify_sorts_every_kind_of_error() {
        use object_store::Error as E;
        let boxed = || -> Box<dyn std::error::Error + Send + Sync> { "x".into() };
        let cases: Vec<(E, BucketErrorKind)> = vec![
            (E::NotFound { path: "k".into(), source: boxed() }, BucketErrorKind::NotFound),
            (E::AlreadyExists { path: "k".into(), source: boxed() }, BucketErrorKind::Conflict),
            (E::Precondition { path: "k".into(), source: boxed() }, BucketErrorKind::Conflict),
            (E::PermissionDenied { path: "k".into(), source: boxed() }, BucketErrorKind::Permanent),
            (E::Unauthenticated { path: "k".into(), source: boxed() }, BucketErrorKind::Permanent),
            (E::NotImplemented, BucketErrorKind::Permanent),
            (E::NotSupported { source: boxed() }, BucketErrorKind::Permanent),
            (E::UnknownConfigurationKey { store: "S3", key: "k".into() }, BucketErrorKind::Permanent),
            (generic("Error performing PUT http://h/b/k in 2s - error sending request"), BucketErrorKind::Transient),
            (
                generic("Error performing GET http://h/b/k in 1ms - Server returned non-2xx status code: 503 Service Unavailable: "),
                BucketErrorKind::Transient,
            ),
            (
                generic("Error performing PUT http://h/b/k in 1ms - Server returned non-2xx status code: 400 Bad Request: "),
                BucketErrorKind::Permanent,
            ),
            (generic("... status code: 429 Too Many Requests"), BucketErrorKind::Transient),
            (generic("... status code: 408 Request Timeout"), BucketErrorKind::Transient),
            (
                E::Generic {
                    store: "LocalFileSystem",
                    source: Box::new(std::io::Error::from(std::io::ErrorKind::PermissionDenied)),
                },
                BucketErrorKind::Permanent,
            ),
            (
                E::Generic { store: "LocalFileSystem", source: Box::new(std::io::Error::from(std::io::ErrorKind::StorageFull)) },
                BucketErrorKind::Transient,
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(classify(&error), expected, "{error}");
        }
    }
}
