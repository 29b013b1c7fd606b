//! Environment overrides: every key as `CAPSTORE_<SECTION>_<KEY>` (top-level keys: `CAPSTORE_<KEY>`), and the
//! `*_file` secrets.

use std::path::PathBuf;

use super::{ConfigProblem, Secret};

/// Environment variable that names the config file when `--config` is not given.
pub const CONFIG_PATH_ENV: &str = "CAPSTORE_CONFIG";
/// Environment variables with the `CAPSTORE_` prefix that are not config keys.
const NON_KEY_ENV: &[&str] = &[CONFIG_PATH_ENV, "CAPSTORE_FAILPOINTS"];

/// How an environment override's text is turned into a TOML value for its key.
#[derive(Clone, Copy)]
pub(super) enum ValueKind {
    Text,
    Integer,
    Boolean,
    /// A list of strings, comma separated in the environment (`a,b`).
    List,
    /// Not settable from the environment (tables).
    Table,
}

/// Every key with the kind of value it takes: the source of truth for environment overrides.
pub(super) const KEYS: &[(&str, &str, ValueKind)] = {
    use ValueKind::*;
    &[
        ("", "catalog_name", Text),
        ("", "shutdown_grace", Text),
        ("spool", "dir", Text),
        ("spool", "max_bytes", Text),
        ("spool", "min_free_bytes", Text),
        ("spool", "max_capture_bytes", Text),
        ("spool", "pack_max_bytes", Text),
        ("spool", "pack_max_records", Integer),
        ("spool", "pack_max_age", Text),
        ("spool", "allow_shared_filesystem", Boolean),
        ("spool", "inbox_rescan_interval", Text),
        ("bucket", "url", Text),
        ("bucket", "prefix", Text),
        ("bucket", "endpoint", Text),
        ("bucket", "region", Text),
        ("bucket", "allow_http", Boolean),
        ("bucket", "virtual_hosted_style", Boolean),
        ("bucket", "access_key_id", Text),
        ("bucket", "secret_access_key", Text),
        ("bucket", "secret_access_key_file", Text),
        ("bucket", "session_token", Text),
        ("bucket", "session_token_file", Text),
        ("bucket", "options", Table),
        ("upload", "batch_packs", Integer),
        ("upload", "concurrency", Integer),
        ("upload", "part_size", Text),
        ("catalog", "url", Text),
        ("catalog", "replica_urls", List),
        ("catalog", "database", Text),
        ("catalog", "table_prefix", Text),
        ("catalog", "user", Text),
        ("catalog", "password", Text),
        ("catalog", "password_file", Text),
        ("catalog", "ca_file", Text),
        ("catalog", "request_timeout", Text),
        ("catalog", "read_max_memory", Text),
        ("catalog", "async_insert", Boolean),
        ("catalog", "reconcile_on_start", Boolean),
        ("catalog", "cluster", Text),
        ("catalog", "max_index_attempts", Integer),
        ("catalog", "batch_max_rows", Integer),
        ("catalog", "batch_max_bytes", Text),
        ("lease", "ttl", Text),
        ("lease", "publish_timeout", Text),
        ("lease", "clock_skew", Text),
        ("lease", "start_wait", Text),
        ("http", "listen", Text),
        ("http", "token_file", Text),
        ("http", "allowed_origins", List),
        ("http", "allowed_hosts", List),
        ("http", "max_connections", Integer),
        ("http", "body_timeout", Text),
        ("http", "max_inflight_bytes", Text),
        ("http", "max_concurrent_reads", Integer),
        ("log", "level", Text),
        ("log", "format", Text),
        ("", "retention", Table),
        ("lifecycle", "retention_interval", Text),
        ("lifecycle", "retention_batch", Integer),
        ("lifecycle", "compaction", Boolean),
        ("lifecycle", "compaction_interval", Text),
        ("lifecycle", "compaction_small_pack_bytes", Text),
        ("lifecycle", "compaction_min_age", Text),
        ("lifecycle", "compaction_pass_bytes", Text),
        ("lifecycle", "read_grace", Text),
        ("lifecycle", "purge", Boolean),
    ]
};

fn env_name(section: &str, key: &str) -> String {
    if section.is_empty() {
        format!("CAPSTORE_{}", key.to_uppercase())
    } else {
        format!("CAPSTORE_{}_{}", section.to_uppercase(), key.to_uppercase())
    }
}

fn dotted(section: &str, key: &str) -> String {
    if section.is_empty() {
        key.to_string()
    } else {
        format!("{section}.{key}")
    }
}

pub(super) fn apply_env_overrides(
    table: &mut toml::Table,
    env: &[(String, String)],
    problems: &mut Vec<ConfigProblem>,
) {
    for (name, text) in env {
        if !name.starts_with("CAPSTORE_") || NON_KEY_ENV.contains(&name.as_str()) {
            continue;
        }
        let Some(&(section, key, kind)) = KEYS.iter().find(|(s, k, _)| env_name(s, k) == *name) else {
            problems.push(ConfigProblem {
                key: name.clone(),
                problem: "unknown environment override: no such config key".into(),
            });
            continue;
        };
        let value = match kind {
            ValueKind::Text => toml::Value::String(text.clone()),
            ValueKind::Integer => match text.trim().parse::<i64>() {
                Ok(n) => toml::Value::Integer(n),
                Err(_) => {
                    problems.push(ConfigProblem {
                        key: name.clone(),
                        problem: format!("{text:?} is not an integer ({})", dotted(section, key)),
                    });
                    continue;
                }
            },
            ValueKind::Boolean => match text.trim() {
                "true" | "1" | "yes" => toml::Value::Boolean(true),
                "false" | "0" | "no" => toml::Value::Boolean(false),
                _ => {
                    problems.push(ConfigProblem {
                        key: name.clone(),
                        problem: format!("{text:?} is not a boolean ({})", dotted(section, key)),
                    });
                    continue;
                }
            },
            ValueKind::List => toml::Value::Array(
                text.split(',')
                    .map(str::trim)
                    .filter(|item| !item.is_empty())
                    .map(|item| toml::Value::String(item.to_string()))
                    .collect(),
            ),
            ValueKind::Table => {
                problems.push(ConfigProblem {
                    key: name.clone(),
                    problem: format!("{} is a table and cannot be set from the environment", dotted(section, key)),
                });
                continue;
            }
        };
        if section.is_empty() {
            table.insert(key.to_string(), value);
            continue;
        }
        let section_table = table.entry(section.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        match section_table {
            toml::Value::Table(inner) => {
                inner.insert(key.to_string(), value);
            }
            _ => problems.push(ConfigProblem { key: section.to_string(), problem: "must be a table".into() }),
        }
    }
}

pub(super) fn resolve_secret(
    secret: &mut Option<Secret>,
    file_opt: &Option<PathBuf>,
    key: &str,
    problems: &mut Vec<ConfigProblem>,
) {
    let Some(file) = file_opt else { return };
    if secret.is_some() {
        problems.push(ConfigProblem {
            key: format!("{key}_file"),
            problem: format!("set either {key} or {key}_file, not both"),
        });
        return;
    }
    match std::fs::read_to_string(file) {
        Ok(text) => *secret = Some(Secret::new(text.trim())),
        Err(e) => problems.push(ConfigProblem {
            key: format!("{key}_file"),
            problem: format!("cannot read {}: {e}", file.display()),
        }),
    }
}
