//! Values written for people: sizes (`"64MiB"`), durations (`"15s"`) and secrets that never print.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{GIB, KIB, MIB};

/// A secret string: never shown by `Debug`, `Display` or serialization.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    /// The secret itself; call only where it is handed to a client library.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("<redacted>")
    }
}

/// A byte count written like `"64MiB"`, `"1.5 GB"` or a plain integer of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        if let Ok(bytes) = trimmed.parse::<u64>() {
            return Ok(ByteSize(bytes));
        }
        trimmed
            .parse::<bytesize::ByteSize>()
            .map(|size| ByteSize(size.as_u64()))
            .map_err(|_| format!("{text:?} is not a size like \"64MiB\", \"512KiB\" or a number of bytes"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Exact binary units when they divide evenly, so the printed config reads back to the same value.
        for (unit, factor) in [("GiB", GIB), ("MiB", MIB), ("KiB", KIB)] {
            if self.0 >= factor && self.0.is_multiple_of(factor) {
                return write!(f, "{}{unit}", self.0 / factor);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Bytes(bytes) => Ok(ByteSize(bytes)),
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// A duration written like `"15s"`, `"250ms"` or `"1m 30s"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn secs(seconds: u64) -> Self {
        HumanDuration(Duration::from_secs(seconds))
    }
}

impl FromStr for HumanDuration {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        humantime::parse_duration(text.trim())
            .map(HumanDuration)
            .map_err(|_| format!("{text:?} is not a duration like \"15s\", \"250ms\" or \"1m 30s\""))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// `url` with the password of its userinfo replaced (`https://user:<redacted>@host/`), for printing and logging.
/// Anything that does not parse as `scheme://[userinfo@]rest` is returned as is.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            format!("{scheme}://{user}:<redacted>@{host}{path}")
        }
        None => url.to_string(),
    }
}

/// Whether an object-store option carries a secret (its value is never printed): any name mentioning a secret, key,
/// token, password, credential or signature, except the public access key id.
pub fn is_secret_option(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    let public = name.ends_with("access_key_id") || name.ends_with("key_id");
    let secret_words = ["secret", "key", "token", "password", "credential", "sas", "signature"];
    !public && secret_words.iter().any(|word| name.contains(word))
}
