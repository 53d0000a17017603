# Sourced first by the user-facing scripts: `-h` / `--help` prints the script's header comment (its usage) and
# exits, before the script installs or starts anything; `usage_error MESSAGE` prints the message and the usage to
# stderr and exits 2.
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
usage_error() { { echo "$(basename "$0"): $*"; usage; } >&2; exit 2; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
