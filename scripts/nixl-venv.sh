# Sourced by scripts/test.sh, scripts/bench-nixl.sh and scripts/gpu-check.sh: the NIXL wheel
# (nixl-cu12, no dependencies) in a venv under the build folder, made and checked by
# scripts/setup.sh.
. scripts/peers-env.sh

# Prints the wheel's library folder under the venv $1 (for LD_LIBRARY_PATH), running
# `scripts/setup.sh nixl` first (which installs it when missing and proves it loads). Prints
# nothing and returns 1 when it cannot be made ready; setup's reason is on stderr.
nixl_libs() {
    GPUCACHE_NIXL_VENV="$1" scripts/setup.sh nixl >&2 || return 1
    nixl_lib_dir "$1"
}
