# Sourced by scripts/setup.sh, scripts/test.sh and the bench scripts: where the peers' venvs
# live, so that every script finds them in one place. Paths are absolute.
_gpucache_target="${CARGO_TARGET_DIR:-target}"
case "$_gpucache_target" in /*) ;; *) _gpucache_target="$PWD/$_gpucache_target" ;; esac
MOONCAKE_VENV="${GPUCACHE_MOONCAKE_VENV:-$_gpucache_target/bench-venv}"
NIXL_VENV="${GPUCACHE_NIXL_VENV:-$_gpucache_target/nixl-venv}"
PY_VENV="${GPUCACHE_PY_VENV:-$_gpucache_target/py-venv}"
MOTO_VENV="${GPUCACHE_MOTO_VENV:-$_gpucache_target/moto-venv}"
VLLM_VENV="${GPUCACHE_VLLM_VENV:-$_gpucache_target/vllm-venv}"
# Where scripts/setup.sh puts the gpucache wheel it builds.
PY_WHEELS="$_gpucache_target/py-wheels"
case "$MOONCAKE_VENV" in /*) ;; *) MOONCAKE_VENV="$PWD/$MOONCAKE_VENV" ;; esac
case "$NIXL_VENV" in /*) ;; *) NIXL_VENV="$PWD/$NIXL_VENV" ;; esac
case "$PY_VENV" in /*) ;; *) PY_VENV="$PWD/$PY_VENV" ;; esac
case "$MOTO_VENV" in /*) ;; *) MOTO_VENV="$PWD/$MOTO_VENV" ;; esac
case "$VLLM_VENV" in /*) ;; *) VLLM_VENV="$PWD/$VLLM_VENV" ;; esac
unset _gpucache_target
# The binaries the Mooncake wheel ships that the tests and the bench start.
MOONCAKE_BINS=(mooncake_master mooncake_http_metadata_server mooncake_client)

# Prints the NIXL wheel's library folder inside the venv $1 (for LD_LIBRARY_PATH); returns 1
# when there is none.
nixl_lib_dir() {
    local libs
    libs="$(find "$1" -type d -name .nixl_cu12.mesonpy.libs -print -quit 2>/dev/null || true)"
    [ -n "$libs" ] && printf '%s\n' "$libs"
}
