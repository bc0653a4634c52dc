# Sourced by the environment builders: `installer VENV [no-compile]` sets the array `install` to a `uv pip install`
# into VENV.
# uv resolves and downloads in parallel: .venv built in 28 s where pip took about 100, .venv312 in 43 s against 90.
# It reads no pip.conf, so pip's find-links and index from the environment (PIP_FIND_LINKS, PIP_INDEX_URL: a local
# CPU build of torch, a mirror) are passed on. Bytecode is compiled at install, as pip does: where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile its imports again (`no-compile`: not, for
# an environment of which a process imports a small part).
UV_VERSION=0.13.9
installer() {
  local venv=$1 compile=${2:-compile}
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  install=("$venv/bin/uv" pip install --quiet --python "$venv/bin/python")
  if [ "$compile" = compile ]; then install+=(--compile-bytecode); fi
  if [ -n "${PIP_FIND_LINKS:-}" ]; then install+=(--find-links "$PIP_FIND_LINKS"); fi
  if [ -n "${PIP_INDEX_URL:-}" ]; then install+=(--index-url "$PIP_INDEX_URL"); fi
}
