//! The `gpucache` command-line tool. Subcommands arrive with their issues; today it decodes keys.
fn main() {}
