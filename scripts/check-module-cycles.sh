#!/usr/bin/env bash
# Fails when any crate of the workspace has a module import cycle:
# module a names something of module b (a `use`, a path in a type, a trait bound, a struct
# literal, a macro call) while b, directly or through others, names something of a. A parent
# module and its child count like any two modules. Test modules are included.
#
# The check is crawk's (`crawk deps --cycles`, Tarjan's strongly connected components over
# every `crate::`/`super::` reference). It is installed with `cargo install --locked` into
# $CARGO_TARGET_DIR/tools/crawk (target/tools/crawk by default) when missing, which takes a
# few minutes once; later runs reuse it. Before the workspace is checked, the tool is run on a
# two-module crate with a cycle, so a tool that reports nothing (or words its answer anew) fails
# here instead of passing every crate.
set -euo pipefail
cd "$(dirname "$0")/.."

# 0.6.0: the newest release whose locked dependencies build on the workspace's Rust (1.95).
crawk_version=0.6.0
tools="${CARGO_TARGET_DIR:-target}/tools"
crawk="$tools/crawk/bin/crawk"
if ! "$crawk" --version 2>/dev/null | grep -q "crawk $crawk_version"; then
    echo "check-module-cycles: installing crawk $crawk_version into $tools/crawk"
    cargo install crawk --version "$crawk_version" --locked --quiet \
        --root "$tools/crawk" --target-dir "$tools/crawk-build"
    # The build folder is only needed for the install (it is a few hundred MB).
    rm -rf "$tools/crawk-build"
fi

none="No dependency cycles found."

# Proof that the tool finds a cycle: a crate whose modules a and b name each other.
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
mkdir -p "$probe/src"
printf '[package]\nname = "cycle-probe"\nversion = "0.0.0"\nedition = "2024"\n\n[workspace]\n' \
    >"$probe/Cargo.toml"
printf 'pub mod a {\n    pub struct A(pub crate::b::B);\n}\npub mod b {\n    pub struct B;\n    pub fn f(_: &crate::a::A) {}\n}\n' \
    >"$probe/src/lib.rs"
found="$("$crawk" -p "$probe" deps --cycles --include-tests 2>&1)"
if [ "$found" = "$none" ] || ! grep -q "a -> b" <<<"$found" || ! grep -q "b -> a" <<<"$found"; then
    echo "check-module-cycles: crawk did not report the cycle a <-> b of its probe crate:" >&2
    echo "$found" >&2
    exit 1
fi

failed=0
checked=0
# The workspace members, as the root Cargo.toml lists them. (fuzz/ is a workspace of its own
# whose targets are single files; crawk's `cargo metadata` would rewrite its lockfile.)
members="$(sed -n 's/^members *= *\[\(.*\)\]/\1/p' Cargo.toml | tr -d '" ' | tr ',' ' ')"
if [ -z "$members" ]; then
    echo "check-module-cycles: no members = [...] line in Cargo.toml" >&2
    exit 1
fi
for crate in $members; do
    answer="$("$crawk" -p "$crate" deps --cycles --include-tests --show-apis 2>&1)" || {
        echo "check-module-cycles: crawk failed on $crate:" >&2
        echo "$answer" >&2
        exit 1
    }
    checked=$((checked + 1))
    if [ "$answer" != "$none" ]; then
        printf '\n%s: module import cycles\n%s\n' "$crate" "$answer" >&2
        failed=1
    fi
done
if [ "$failed" -ne 0 ]; then
    echo "check-module-cycles: break each cycle by moving what both modules use into a module below both" >&2
    exit 1
fi
echo "check-module-cycles: no module import cycles in $checked crates (crawk $crawk_version)"
