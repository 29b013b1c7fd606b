//! `capstore check-config [--online]`: the effective configuration, or every problem with it; with `--online`, also
//! whether the catalog, the bucket, the spool directory and the HTTP address work for this configuration, one
//! `ok`/`FAIL` line per check with its reason. It changes nothing that lasts: the grants and bucket probes remove what
//! they create (a DROP the user may not run, and capstore never needs, is reported), and no database is created.

use std::path::{Path, PathBuf};
use std::time::Instant;

use capstore::bucket::Bucket;
use capstore::catalog::client::CatalogClient;
use capstore::catalog::lease::LeaseTimings;
use capstore::catalog::schema::{installed_version, probe_grants, GrantsProbe, SCHEMA_VERSION, STAMPED_AT_START};
use capstore::catalog::Tables;
use capstore::config::Config;
use capstore::exit_code;

#[derive(clap::Args)]
pub struct CheckConfigArgs {
    /// Also connect: ClickHouse (version, grants, schema), the bucket (write, conditional create, delete), the spool
    /// directory (local filesystem, free space) and the HTTP listen address. Exit 2 if any check fails.
    #[arg(long)]
    online: bool,
}

pub fn check_config(path: Option<&Path>, args: CheckConfigArgs) -> i32 {
    let config = match super::load_config(path) {
        Ok(config) => config,
        Err(code) => return code,
    };
    if !args.online {
        print!("{}", config.to_redacted_toml());
        return exit_code::CLEAN;
    }
    let runtime = match super::runtime() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("capstore: {error:#}");
            return exit_code::FATAL;
        }
    };
    let checks = runtime.block_on(online_checks(&config));
    for check in &checks {
        let mark = if check.passed { "ok  " } else { "FAIL" };
        println!("{mark} {}: {}", check.name, check.detail);
    }
    let failed = checks.iter().filter(|check| !check.passed).count();
    println!("{} checks, {failed} failed", checks.len());
    if failed == 0 {
        exit_code::CLEAN
    } else {
        exit_code::CONFIG_OR_USAGE
    }
}

struct Check {
    name: &'static str,
    passed: bool,
    detail: String,
}

fn pass(name: &'static str, detail: impl Into<String>) -> Check {
    Check { name, passed: true, detail: detail.into() }
}

fn fail(name: &'static str, detail: impl Into<String>) -> Check {
    Check { name, passed: false, detail: detail.into() }
}

async fn online_checks(config: &Config) -> Vec<Check> {
    let mut checks = catalog_checks(config).await;
    checks.push(bucket_check(config).await);
    checks.extend(spool_checks(config));
    checks.push(http_check(config));
    checks
}

async fn catalog_checks(config: &Config) -> Vec<Check> {
    let url = capstore::config::units::redact_url(&config.catalog.url);
    let started = Instant::now();
    let client = match CatalogClient::connect(&config.catalog).await {
        Ok(client) => client,
        Err(error) => {
            let reason = format!("{url}: {error}");
            return vec![fail("catalog reachable", reason)];
        }
    };
    let mut checks = vec![pass("catalog reachable", format!("{url} answered in {} ms", started.elapsed().as_millis()))];
    let version = client.server_version();
    checks.push(pass("catalog version", format!("ClickHouse {version}")));
    checks.push(read_settings_check(&client, config).await);
    checks.push(publish_settings_check(&client, config).await);
    let tables = Tables::from_config(&config.catalog);
    let database = &tables.database;
    checks.push(match probe_grants(&client, &tables).await {
        Ok(GrantsProbe::Granted { left_behind }) if left_behind.is_empty() => pass(
            "catalog grants",
            format!("create table, create view, insert, select and alter delete work in database {database}"),
        ),
        Ok(GrantsProbe::Granted { left_behind }) => pass(
            "catalog grants",
            format!(
                "create table, create view, insert, select and alter delete work in database {database}; DROP was \
                 refused (capstore never drops), so the probe left {} behind: drop it by hand",
                left_behind.join(" and ")
            ),
        ),
        Ok(GrantsProbe::NoDatabase) => pass(
            "catalog grants",
            format!(
                "database {database} does not exist yet: the daemon creates it at its first start (CREATE DATABASE \
                 needed); table grants not probed: run this again after the first start"
            ),
        ),
        Ok(GrantsProbe::Refused { grant, error }) => {
            fail("catalog grants", format!("{grant} refused in database {database}: {error}"))
        }
        Err(error) => fail("catalog grants", error.to_string()),
    });
    checks.push(match installed_version(&client, &tables).await {
        Ok(None) => pass("catalog schema", "no tables yet: the daemon creates them at its first start"),
        Ok(Some(found @ STAMPED_AT_START..=SCHEMA_VERSION)) => {
            pass("catalog schema", format!("version {found}, which this build reads and writes"))
        }
        Ok(Some(found)) if found > SCHEMA_VERSION => fail(
            "catalog schema",
            format!("version {found}, newer than this build ({SCHEMA_VERSION}): upgrade capstore"),
        ),
        Ok(Some(found)) => {
            pass("catalog schema", format!("version {found}: the daemon upgrades it to {STAMPED_AT_START} at start"))
        }
        Err(error) => fail("catalog schema", error.to_string()),
    });
    checks
}

/// Whether the catalog user's settings profile lets a read carry the settings every read of capstore sends (a
/// constraint or a read-only profile refuses them all), and the one a read of a few granules adds.
async fn read_settings_check(client: &CatalogClient, config: &Config) -> Check {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct One {
        _one: u8,
    }
    if let Err(error) = client.fetch_few::<One>("SELECT toUInt8(1) AS _one").await {
        return fail("catalog read settings", error.to_string());
    }
    // A profile that allows no value of a limit bounds reads by its own, which may be none at all.
    for setting in client.read_limits_fixed_by_profile() {
        let sql = format!("SELECT value FROM system.settings WHERE name = '{setting}'");
        match client.fetch_few::<String>(&sql).await.map(|values| values.into_iter().next()) {
            Ok(Some(value)) if value.trim() == "0" => {
                return fail(
                    "catalog read settings",
                    format!(
                        "the settings profile does not let a read set {setting} and sets it to 0 (no limit): reads \
                         would not be bounded on the server; let a request set it, or give it a limit in the profile"
                    ),
                )
            }
            Ok(_) => {}
            Err(error) => return fail("catalog read settings", error.to_string()),
        }
    }
    let bounds = client.read_limit_bounds();
    let limits = match bounds.is_empty() {
        true => format!(
            "reads may set their time and memory limits (catalog.request_timeout {}, catalog.read_max_memory {})",
            config.catalog.request_timeout,
            bytesize::ByteSize(config.catalog.read_max_memory.0)
        ),
        false => bounds.join("; "),
    };
    match client.small_reads_on_one_thread() {
        true => pass("catalog read settings", format!("{limits} and max_threads = 1 for reads of a few granules")),
        false => pass(
            "catalog read settings",
            format!(
                "{limits}; the settings profile does not let them set max_threads, so reads of a few granules run \
                 with the profile's (on 18.16 one thread is 10-30% faster for those)"
            ),
        ),
    }
}

/// Whether the catalog user's settings profile lets a lease claim or a publish carry its `max_execution_time`
/// (`lease.publish_timeout`): the fence's timing rests on it, so it is never bounded otherwise than configured.
async fn publish_settings_check(client: &CatalogClient, config: &Config) -> Check {
    let timings = LeaseTimings::from_config(&config.lease, client);
    match client.execute_deciding("SELECT 1", timings.statement_cap()).await {
        Ok(()) => pass(
            "catalog publish settings",
            format!(
                "lease claims and publishes may set max_execution_time (lease.publish_timeout {})",
                config.lease.publish_timeout
            ),
        ),
        Err(error) => fail("catalog publish settings", error.to_string()),
    }
}

async fn bucket_check(config: &Config) -> Check {
    let url = capstore::config::units::redact_url(&config.bucket.url);
    let bucket = match Bucket::from_config(config) {
        Ok(bucket) => bucket,
        Err(error) => return fail("bucket", format!("{url}: {error}")),
    };
    match bucket.probe_conditional_create().await {
        Ok(key) => pass("bucket", format!("{url}: wrote, read back, refused a second create of, and deleted {key}")),
        Err((step, error)) => fail("bucket", format!("{url}: {step} failed: {error}")),
    }
}

/// The spool directory, or the nearest existing parent (the daemon creates the rest).
fn existing_ancestor(dir: &Path) -> Option<PathBuf> {
    dir.ancestors().find(|path| path.exists()).map(Path::to_path_buf)
}

fn spool_checks(config: &Config) -> Vec<Check> {
    let spool = &config.spool;
    let dir = spool.dir.display().to_string();
    let Some(existing) = existing_ancestor(&spool.dir) else {
        return vec![fail("spool directory", format!("{dir}: no part of the path exists"))];
    };
    if !existing.is_dir() {
        return vec![fail("spool directory", format!("{dir}: {} is not a directory", existing.display()))];
    }
    let mut checks = Vec::new();
    let writable = nix::unistd::access(&existing, nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK);
    let created = if existing == spool.dir { "exists" } else { "is created at start under" };
    checks.push(match writable {
        Ok(()) => match capstore::durable::shared_filesystem_name(&existing) {
            Ok(None) => pass("spool directory", format!("{dir} {created} {}: local filesystem", existing.display())),
            Ok(Some(fs_name)) if spool.allow_shared_filesystem => pass(
                "spool directory",
                format!("{dir}: on {fs_name}, allowed by spool.allow_shared_filesystem (flock may not be trusted)"),
            ),
            Ok(Some(fs_name)) => fail(
                "spool directory",
                format!("{dir}: on a {fs_name} filesystem, where flock cannot be trusted; use a local disk"),
            ),
            Err(error) => fail("spool directory", format!("{dir}: cannot read its filesystem: {error}")),
        },
        Err(errno) => fail("spool directory", format!("{}: not writable by this user: {errno}", existing.display())),
    });
    checks.push(match capstore::durable::free_bytes(&existing) {
        Ok(free) => {
            let (floor, quota) = (spool.min_free_bytes.0, spool.max_bytes.0);
            let detail = format!(
                "{} free; spool.min_free_bytes {} (appends stop below it), spool.max_bytes {}",
                bytesize::ByteSize(free),
                bytesize::ByteSize(floor),
                bytesize::ByteSize(quota)
            );
            if free <= floor {
                fail("spool free space", detail)
            } else {
                pass("spool free space", detail)
            }
        }
        Err(error) => fail("spool free space", format!("{dir}: {error}")),
    });
    checks
}

fn http_check(config: &Config) -> Check {
    let listen = &config.http.listen;
    match std::net::TcpListener::bind(listen.as_str()) {
        Ok(listener) => {
            let bound = listener.local_addr().map_or_else(|_| listen.clone(), |addr| addr.to_string());
            pass("http listen", format!("{bound} is free"))
        }
        Err(error) => fail("http listen", format!("{listen}: {error} (is a daemon already running?)")),
    }
}
