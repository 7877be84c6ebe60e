# Sourced by scripts/test.sh and scripts/bench-nixl.sh: the NIXL wheel in a venv under the build
# folder. nixl-cu12 ships libnixl_capi.so and the UCX it loads; --no-deps keeps torch and the
# CUDA wheels out (nothing here needs them).
NIXL_WHEEL="nixl-cu12==1.5.1"

# Prints the wheel's library folder under the venv $1 (for LD_LIBRARY_PATH), making the venv
# and installing the wheel first when it is not there. Prints nothing and returns 1 on failure.
nixl_libs() {
    local venv="$1" libs
    libs="$(find "$venv" -type d -name .nixl_cu12.mesonpy.libs -print -quit 2>/dev/null || true)"
    if [ -z "$libs" ]; then
        echo "installing the NIXL wheel ($NIXL_WHEEL, no dependencies) at $venv" >&2
        python3 -m venv "$venv" >&2 || return 1
        "$venv/bin/pip" install --quiet --no-deps "$NIXL_WHEEL" numpy >&2 || return 1
        libs="$(find "$venv" -type d -name .nixl_cu12.mesonpy.libs -print -quit)"
    fi
    [ -n "$libs" ] && printf '%s\n' "$libs"
}
