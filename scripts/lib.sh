# Sourced by the scripts beside it (not run): the one place that resolves the paths they hand to
# other processes, and that decides what a missing program means.
#
# Every path handed on is absolute, because the process that receives it (a test session, a
# server started in a temporary folder) runs in another working directory.

# The repository's top folder, absolute.
og_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# An absolute path for $1, read relative to the repository when it is relative.
og_absolute() {
  case $1 in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$og_repo/$1" ;;
  esac
}

# Cargo's target folder, absolute: $CARGO_TARGET_DIR, else target/ in the repository.
og_target_dir() { og_absolute "${CARGO_TARGET_DIR:-target}"; }

# Exports ONCEGUARD_BIN as an absolute path: as given, else the debug build in the target
# folder. Returns 1 (with the reason on stderr, naming the calling script $1) when there is
# no executable there.
og_require_bin() {
  local who=$1
  ONCEGUARD_BIN=$(og_absolute "${ONCEGUARD_BIN:-$(og_target_dir)/debug/onceguard}")
  export ONCEGUARD_BIN
  if [ ! -x "$ONCEGUARD_BIN" ]; then
    echo "$who: no onceguard binary at $ONCEGUARD_BIN: run \`cargo build -p onceguard\` (or set ONCEGUARD_BIN)" >&2
    return 1
  fi
}

# True where a missing server or program is a failure, not a skip: in CI (CI=true) or with
# ONCEGUARD_REQUIRE_SERVICES=1.
og_required() { [ "${CI:-}" = true ] || [ "${ONCEGUARD_REQUIRE_SERVICES:-}" = 1 ]; }

# og_have PROGRAM WHAT: true when PROGRAM is on PATH. Otherwise prints `SKIPPED: WHAT (no
# PROGRAM; ...)`, the line scripts/test names at the end, and returns 1; where programs are
# required it prints why on stderr and returns 2 instead (a failure).
og_have() {
  command -v "$1" >/dev/null && return 0
  if og_required; then
    echo "$2: $1 is required (CI=true or ONCEGUARD_REQUIRE_SERVICES=1); scripts/services installs it" >&2
    return 2
  fi
  echo "SKIPPED: $2 (no $1; scripts/services installs it)"
  return 1
}
