//! The Prometheus alert rules in `deploy/prometheus/`: every alert names metrics the server
//! exports and links to an existing section of `docs/RUNBOOK.md`; `promtool check rules` accepts
//! the file and `promtool test rules` fires each alert on the series that should raise it.
//!
//! promtool comes with Debian's `prometheus` package (`scripts/services` installs it). Without it
//! the promtool part is skipped with a `SKIPPED:` line, except in CI, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use onceguard_testkit::services;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).expect("crates/server is two levels down").to_owned()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(workspace().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The rules of one kind (`- alert:` or `- record:`) as written in the rules file: each one's
/// name, and its lines up to the next rule or group.
fn rules_of(rules: &str, kind: &str) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = Vec::new();
    let mut inside = false;
    for line in rules.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed.strip_prefix(kind) {
            found.push((name.trim().to_owned(), String::new()));
            inside = true;
        } else if ["- alert:", "- record:", "- name:"].iter().any(|p| trimmed.starts_with(p)) {
            inside = false;
        } else if let Some((_, body)) = found.last_mut().filter(|_| inside) {
            body.push_str(line);
            body.push('\n');
        }
    }
    found
}

fn alerts(rules: &str) -> Vec<(String, String)> {
    rules_of(rules, "- alert:")
}

/// The value of `field: "…"` in an alert's lines.
fn field<'a>(body: &'a str, field: &str) -> Option<&'a str> {
    body.lines().find_map(|l| l.trim().strip_prefix(&format!("{field}:"))).map(|v| v.trim().trim_matches('"'))
}

/// GitHub's anchor for a heading: lower case, spaces to dashes, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The `onceguard_*` metric names an expression uses; a recording rule's name
/// (`level:onceguard_…:operations`) is not one.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("onceguard_") {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let recorded = rest[..start].ends_with(':');
        if !recorded {
            names.push(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

#[test]
fn every_alert_uses_exported_metrics_and_links_to_its_runbook_section() {
    let rules = read("deploy/prometheus/onceguard-alerts.yml");
    let runbook = read("docs/RUNBOOK.md");
    let declared = read("crates/http/src/metrics.rs");
    let sections: Vec<String> = runbook.lines().filter_map(|l| l.strip_prefix("## ")).map(anchor).collect();
    let alerts = alerts(&rules);
    assert!(alerts.len() >= 5, "stuck keys, mismatches, stale completions, store, denials at least");
    for (name, body) in &alerts {
        assert!(name.starts_with("Onceguard"), "{name}");
        assert!(matches!(field(body, "severity"), Some("warning" | "critical")), "{name}: a severity");
        for annotation in ["summary", "description", "dashboard"] {
            assert!(body.contains(&format!("{annotation}:")), "{name}: no {annotation}");
        }
        let url = field(body, "runbook_url").unwrap_or_else(|| panic!("{name}: no runbook_url"));
        let (page, section) = url.split_once('#').unwrap_or_else(|| panic!("{name}: {url} names no section"));
        assert!(page.ends_with("docs/RUNBOOK.md"), "{name}: {url}");
        assert!(sections.iter().any(|s| s == section), "{name}: no section '{section}' in docs/RUNBOOK.md");
        for metric in metric_names(body) {
            let base = metric.trim_start_matches("onceguard_");
            let registered = |n: &str| declared.contains(&format!("\"{n}\""));
            let known = registered(base)
                || ["_total", "_bucket", "_count", "_sum"]
                    .iter()
                    .any(|suffix| base.strip_suffix(suffix).is_some_and(registered));
            assert!(known, "{name}: {metric} is not a metric the server exports");
        }
    }
    // A recording rule reads exported metrics, and every one an alert reads is defined here.
    let recorded = rules_of(&rules, "- record:");
    for (name, body) in &recorded {
        for metric in metric_names(body) {
            let base = metric.trim_start_matches("onceguard_");
            let base =
                ["_total", "_bucket", "_count", "_sum"].iter().find_map(|s| base.strip_suffix(s)).unwrap_or(base);
            assert!(declared.contains(&format!("\"{base}\"")), "{name}: {metric} is not a metric the server exports");
        }
    }
    for (name, body) in &alerts {
        for word in body.split(|c: char| c.is_whitespace() || "()".contains(c)) {
            if word.contains(":onceguard_") {
                assert!(recorded.iter().any(|(r, _)| r == word), "{name}: {word} is no recording rule of the file");
            }
        }
    }
    // And every section of the runbook past its introduction belongs to an alert.
    for section in &sections {
        assert!(
            alerts.iter().any(|(_, body)| body.contains(&format!("RUNBOOK.md#{section}\""))),
            "the runbook section '{section}' has no alert"
        );
    }
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    if Command::new("promtool").arg("--version").output().is_err() {
        assert!(!services::required(), "promtool is missing and CI=true requires it; run scripts/services");
        services::skipped("promtool check of the alert rules (no promtool; Debian's prometheus package has it)");
        return;
    }
    let dir = workspace().join("deploy/prometheus");
    for args in [["check", "rules", "onceguard-alerts.yml"], ["test", "rules", "onceguard-alerts.test.yml"]] {
        let out = Command::new("promtool").args(args).current_dir(&dir).output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "promtool {}: {said}", args.join(" "));
        println!("promtool {}: {}", args.join(" "), said.trim());
    }
}
