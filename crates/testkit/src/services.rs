//! Whether the servers that store suites need are running, and what to do when they are not.
//!
//! In CI (`CI=true`) or with `ONCEGUARD_REQUIRE_SERVICES=1`, a missing server fails the suite
//! loudly. Elsewhere (a developer's fresh machine) the suite is skipped, and a line on stderr
//! says so and how to enable it; `scripts/test` repeats those lines at the end of the run.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Whether a missing server must fail the run.
pub fn required() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    set("CI") || set("ONCEGUARD_REQUIRE_SERVICES")
}

/// Whether something listens at `addr` (`host:port`), within a second.
pub fn listening(addr: &str) -> bool {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map(|a| a.collect()).unwrap_or_default();
    addrs.iter().any(|a| TcpStream::connect_timeout(a, Duration::from_secs(1)).is_ok())
}

/// Answers whether the suite `suite` can run against the server at `addr`. When it cannot:
/// panics if servers are [`required`], else prints one `SKIPPED:` line with `how` to enable it.
pub fn available(suite: &str, addr: &str, how: &str) -> bool {
    if listening(addr) {
        return true;
    }
    assert!(!required(), "{suite}: no server at {addr}, and CI=true / ONCEGUARD_REQUIRE_SERVICES=1 requires it. {how}");
    skipped(&format!("{suite} (no server at {addr}; {how})"));
    false
}

/// Prints one `SKIPPED:` line straight to the process's stderr (the test harness captures
/// `eprintln!` of passing tests; this line must show).
pub fn skipped(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED: {what}");
}

/// The `host:port` of a server URL such as `postgres://user@host:5432/db` or
/// `redis://host:6379/0` (`default_port` when it names none).
pub fn addr_of_url(url: &str, default_port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    if host.contains(':') { host.to_owned() } else { format!("{host}:{default_port}") }
}

#[cfg(test)]
mod tests {
    #[test]
    fn addresses_come_out_of_urls() {
        assert_eq!(super::addr_of_url("postgres://u:p@db.local:6543/x?schema=a", 5432), "db.local:6543");
        assert_eq!(super::addr_of_url("postgres://127.0.0.1/test", 5432), "127.0.0.1:5432");
        assert_eq!(super::addr_of_url("redis://127.0.0.1:6379/0", 6379), "127.0.0.1:6379");
    }
}
