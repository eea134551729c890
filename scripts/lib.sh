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

# The benchmarks' programs (nginx, wrk): installed from Debian when missing and run as root,
# else a failure naming the package. Sets NGINX to nginx's path.
og_bench_tools() {
  local who=$1 tool
  shift
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null && ! [ -x "/usr/sbin/$tool" ]; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "$who: installing $tool (Debian package)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$tool" >/dev/null
      else
        echo "$who: $tool is needed (Debian: apt-get install $tool)" >&2; return 1
      fi
    fi
  done
  NGINX=$(command -v nginx || echo /usr/sbin/nginx)
}

# The benchmarks' release build: builds it (quietly) and sets BIN to it, in $CARGO_TARGET_DIR,
# else ~/.cache/onceguard/target (kept out of the repository's debug builds).
og_release_bin() {
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/onceguard/target}"
  cargo build --release --locked -q -p onceguard
  BIN=$(og_absolute "$CARGO_TARGET_DIR")/release/onceguard
}

# A free TCP port on 127.0.0.1.
# The TypeScript client's dev dependencies, installed with `npm ci` in the current directory
# (clients/typescript) when its package-lock.json changed since the last install (a stamp in
# node_modules/). $1 names the script, for its messages.
og_npm_ci_stamped() {
  local stamp="node_modules/.onceguard-package-lock.sha256" want
  want=$(sha256sum package-lock.json | cut -d' ' -f1)
  [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
  echo "$1: installing the dev dependencies (npm ci)"
  if ! npm ci --no-audit --no-fund --loglevel=error >/dev/null; then
    echo "$1: npm ci failed" >&2
    return 1
  fi
  echo "$want" >"$stamp"
}

og_free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits up to 10 s for something to listen on 127.0.0.1:$1; fails naming the caller $2.
og_wait_port() {
  for _ in $(seq 1 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "${2:-wait}: nothing listens on 127.0.0.1:$1" >&2; return 1
}

# CPU time (user + system, in clock ticks) of processes, all their threads.
og_cpu_ticks() { # pid...
  local t=0 pid
  for pid in "$@"; do
    t=$((t + $(awk '{ print $14 + $15 }' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$t"
}
