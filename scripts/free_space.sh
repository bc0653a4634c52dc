# Sourced by the environment builders: refuse in one line, before pip starts, where the disk cannot hold the
# build (a full disk midway leaves pip's "[Errno 28] No space left on device" deep in every test that needs it).
need_free_gb() {  # need_free_gb PATH GB WHAT
  local free_kb
  free_kb=$(df -Pk "$1" | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $(( $2 * 1024 * 1024 )) ]; then
    echo "$0: $3 needs about $2 GB free on the filesystem of $1; $(( free_kb / 1024 / 1024 )) GB are free:" \
      "free some space and run it again" >&2
    exit 28
  fi
}
