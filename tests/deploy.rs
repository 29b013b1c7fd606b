//! The shipped deployment files hold what the security review asked of them: the systemd unit is valid and sandboxed
//! (checked with systemd's own analyzer), the image runs as a numeric non-root user with a token, and the Kubernetes
//! manifest confines both containers.

use std::path::Path;
use std::process::Command;

const INSTALL_HINT: &str = "systemd-analyze is missing: `apt-get install -y systemd` (Debian/Ubuntu)";
const PROMTOOL_HINT: &str = "promtool is missing: `apt-get install -y prometheus` (Debian/Ubuntu ship it there)";

fn deploy_file(name: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy").join(name)).unwrap()
}

fn systemd_analyze(args: &[&str]) -> (bool, String) {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/capstore.service");
    let output = Command::new("systemd-analyze")
        .args(args)
        .arg(&unit)
        .output()
        .unwrap_or_else(|error| panic!("{INSTALL_HINT} ({error})"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

#[test]
fn the_systemd_unit_verifies_clean_apart_from_the_binary_not_installed_here() {
    let (_, text) = systemd_analyze(&["verify"]);
    let problems: Vec<&str> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .filter(|line| !line.contains("/usr/local/bin/capstore is not executable"))
        .collect();
    assert!(problems.is_empty(), "systemd-analyze verify:\n{text}");
}

#[test]
fn the_systemd_unit_is_sandboxed_to_an_exposure_of_2_or_lower() {
    let (_, text) = systemd_analyze(&["security", "--offline=true"]);
    let exposure: f64 = text
        .lines()
        .find_map(|line| line.split("Overall exposure level for capstore.service:").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{text}"));
    assert!(exposure <= 2.0, "exposure {exposure} > 2.0:\n{text}");
    let unit = deploy_file("capstore.service");
    for directive in [
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=",
        "UMask=0027",
        "StateDirectoryMode=0750",
        "CapabilityBoundingSet=\n",
        "MemoryMax=",
    ] {
        assert!(unit.contains(directive), "the unit lacks {directive:?}");
    }
}

fn promtool(args: &[&str]) -> (bool, String) {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus"))
        .output()
        .unwrap_or_else(|error| panic!("{PROMTOOL_HINT} ({error})"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

#[test]
fn the_alerting_rules_pass_promtool_check_and_their_unit_tests() {
    let (ok, text) = promtool(&["check", "rules", "capstore.rules.yml"]);
    assert!(ok, "promtool check rules:\n{text}");
    let (ok, text) = promtool(&["test", "rules", "capstore.rules.test.yml"]);
    assert!(ok, "promtool test rules:\n{text}");
    // Every alert has a unit test that shows it firing, and a runbook line.
    let rules = deploy_file("prometheus/capstore.rules.yml");
    let tests = deploy_file("prometheus/capstore.rules.test.yml");
    let alerts: Vec<&str> = rules.lines().filter_map(|line| line.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() >= 10, "{alerts:?}");
    for alert in &alerts {
        assert!(tests.contains(&format!("alertname: {alert}\n        exp_alerts:\n")), "no firing test for {alert}");
    }
    assert_eq!(rules.matches("runbook: ").count(), alerts.len(), "every alert needs a runbook line");
}

#[test]
fn the_dashboard_is_grafana_json_whose_panels_all_query_capstore() {
    let dashboard: serde_json::Value = serde_json::from_str(&deploy_file("grafana/capstore.json")).unwrap();
    assert_eq!(dashboard["uid"], "capstore");
    let panels = dashboard["panels"].as_array().unwrap();
    let rows: Vec<&str> = panels.iter().filter(|p| p["type"] == "row").filter_map(|p| p["title"].as_str()).collect();
    assert_eq!(rows, ["Intake", "Spool", "Uploads", "Publishes", "Lease", "Latencies"]);
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{} has no query", panel["title"]);
        for target in targets {
            assert!(target["expr"].as_str().unwrap().contains("capstore_"), "{}", panel["title"]);
        }
    }
}

#[test]
fn the_image_runs_as_a_numeric_user_and_comes_with_a_token() {
    let dockerfile = deploy_file("Dockerfile");
    let user = dockerfile.lines().find_map(|line| line.strip_prefix("USER ")).expect("a USER line");
    assert!(user.split(':').all(|id| id.parse::<u32>().is_ok_and(|id| id != 0)), "USER {user} is not numeric non-root");
    assert!(dockerfile.contains("CAPSTORE_HTTP_LISTEN=0.0.0.0:9464"));
    assert!(dockerfile.contains("CAPSTORE_HTTP_TOKEN_FILE="), "a listen address beyond loopback needs a token");
    let compose = deploy_file("compose.yaml");
    assert!(compose.contains("capstore-http-token") && compose.contains("cap_drop: [ALL]"));
}

#[test]
fn the_kubernetes_manifest_confines_both_containers_and_pins_images() {
    let manifest = deploy_file("kubernetes/capstore-sidecar.yaml");
    for needed in [
        "runAsNonRoot: true",
        "runAsUser: 10001",
        "fsGroup: 10001",
        "seccompProfile: { type: RuntimeDefault }",
        "CAPSTORE_HTTP_TOKEN_FILE",
        "subPath: spool/inbox",
        "defaultMode: 0440",
    ] {
        assert!(manifest.contains(needed), "the manifest lacks {needed:?}");
    }
    for confined in ["allowPrivilegeEscalation: false", "readOnlyRootFilesystem: true", "capabilities: { drop: [ALL] }"]
    {
        assert_eq!(manifest.matches(confined).count(), 2, "both containers need {confined:?}");
    }
    assert_eq!(manifest.matches("limits: { memory:").count(), 2, "both containers need a memory limit");
    for line in manifest.lines().filter(|line| line.trim_start().starts_with("image:")) {
        assert!(!line.contains(":latest") && line.matches(':').count() >= 2, "unpinned image: {line}");
    }
}

/// The cluster example is the cluster the tests start (one shard of three replicas, internal replication, the DDL
/// queue, a replica macro each), and its fleet is what the README describes: a catalog name per daemon, one set of
/// tables, one bucket, each daemon first on a replica of its own and failing over to the other two.
#[test]
fn the_cluster_example_is_one_shard_of_three_replicas_and_a_fleet_with_a_catalog_each() {
    let cluster = deploy_file("cluster/clickhouse/cluster.xml");
    for needed in
        ["<remote_servers>", "<capstore>", "<internal_replication>true</internal_replication>", "<distributed_ddl>"]
    {
        assert!(cluster.contains(needed), "cluster.xml lacks {needed}");
    }
    let harness =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/common/cluster.rs")).unwrap();
    for shared in [
        "<internal_replication>true</internal_replication>",
        "<distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>",
    ] {
        assert!(cluster.contains(shared) && harness.contains(shared), "the example and the tests differ on {shared}");
    }
    let replicas: Vec<&str> = cluster.matches("<replica><host>").collect();
    assert_eq!(replicas.len(), 3);
    let macros: Vec<String> = (0..3).map(|r| deploy_file(&format!("cluster/clickhouse/macros-r{r}.xml"))).collect();
    for (r, text) in macros.iter().enumerate() {
        assert!(text.contains(&format!("<replica>r{r}</replica>")) && text.contains("<shard>01</shard>"), "{text}");
        assert!(cluster.contains(&format!("<host>ch-{r}</host>")));
    }

    let compose = deploy_file("cluster/compose.yaml");
    assert!(compose.contains("CAPSTORE_CATALOG_CLUSTER: capstore"), "catalog.cluster names the cluster of cluster.xml");
    let values = |key: &str| -> Vec<String> {
        compose.lines().filter_map(|line| line.trim().strip_prefix(&format!("{key}: "))).map(str::to_string).collect()
    };
    let names = values("CAPSTORE_CATALOG_NAME");
    let unique: std::collections::BTreeSet<&String> = names.iter().collect();
    assert!(names.len() >= 3 && unique.len() == names.len(), "a catalog name per daemon: {names:?}");
    let firsts = values("CAPSTORE_CATALOG_URL");
    let others = values("CAPSTORE_CATALOG_REPLICA_URLS");
    assert_eq!((firsts.len(), others.len()), (names.len(), names.len()));
    for (first, others) in firsts.iter().zip(&others) {
        let mut all: Vec<&str> = std::iter::once(first.as_str()).chain(others.split(',')).collect();
        all.sort();
        assert_eq!(
            all,
            ["http://ch-0:8123", "http://ch-1:8123", "http://ch-2:8123"],
            "every replica once: {first} {others}"
        );
    }
    let first_unique: std::collections::BTreeSet<&String> = firsts.iter().collect();
    assert_eq!(first_unique.len(), firsts.len(), "each daemon starts on a replica of its own");
    assert_eq!(values("CAPSTORE_BUCKET_URL").len(), 1, "one bucket for the fleet");
    assert!(compose.contains("capstore-http-token") && compose.contains("cap_drop: [ALL]"));
}
