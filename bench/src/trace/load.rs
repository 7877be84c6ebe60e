//! Reading a prefix-reuse trace: one JSON object per line with `hash_ids`, the request's prefix
//! blocks in order (other fields are read when present and otherwise ignored).
//!
//! A block is the whole chain of ids up to and including it, so the same id behind two
//! different prefixes is two blocks, as it is two keys in the store. Blocks are numbered densely
//! in order of first appearance.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use gpucache_dataplane::identity::CHAIN_HASHES_MAX;
use serde::Deserialize;

/// Most requests one trace may hold.
pub(super) const REQUESTS_MAX: usize = 10_000_000;
/// Most block references one trace may hold (over all its requests).
pub(super) const REFS_MAX: u64 = 100_000_000;
/// Longest line accepted, in bytes.
const LINE_BYTES_MAX: usize = 1 << 20;

#[derive(Debug, Deserialize)]
struct Line {
    hash_ids: Vec<u64>,
    /// The prompt's tokens; when it is short of the blocks' capacity, the last block is partial.
    #[serde(default)]
    input_length: Option<u64>,
}

/// Tokens per block the traces' ids stand for.
pub(super) const BLOCK_TOKENS: u32 = 512;

/// The tokens of a request's last block: fewer than [`BLOCK_TOKENS`] when the prompt ends
/// inside it.
fn last_block_tokens(blocks: usize, input_length: Option<u64>) -> u32 {
    let full = u64::from(BLOCK_TOKENS);
    let before = (blocks as u64).saturating_sub(1) * full;
    match input_length {
        Some(n) if n > before && n < before + full => {
            u32::try_from(n - before).unwrap_or(BLOCK_TOKENS)
        }
        _ => BLOCK_TOKENS,
    }
}

/// A trace: every request's blocks (dense numbers) and the ids behind them.
#[derive(Debug, Clone)]
pub struct Trace {
    pub name: String,
    /// Per request, its blocks as dense numbers (each a distinct chain).
    pub requests: Vec<Vec<u32>>,
    /// Per request, the trace's own ids of its blocks, in order: the chain of block `i` is
    /// `ids[..=i]`.
    pub ids: Vec<Vec<u64>>,
    /// Per request, the tokens its last block holds ([`BLOCK_TOKENS`] when it is full).
    pub last_tokens: Vec<u32>,
    unique: usize,
}

impl Trace {
    /// A trace from each request's ids, numbering the chains.
    pub fn from_ids(name: &str, requests: impl IntoIterator<Item = Vec<u64>>) -> Self {
        let mut numbers: HashMap<(u32, u64), u32> = HashMap::new();
        let mut out = Trace {
            name: name.to_owned(),
            requests: Vec::new(),
            ids: Vec::new(),
            last_tokens: Vec::new(),
            unique: 0,
        };
        for ids in requests {
            let mut parent = u32::MAX; // no parent: the first block of a chain
            let blocks = ids
                .iter()
                .map(|&id| {
                    let next = u32::try_from(numbers.len()).unwrap_or(u32::MAX);
                    parent = *numbers.entry((parent, id)).or_insert(next);
                    parent
                })
                .collect();
            out.requests.push(blocks);
            out.ids.push(ids);
            out.last_tokens.push(BLOCK_TOKENS);
        }
        out.unique = numbers.len();
        out
    }

    /// Reads `path`, keeping at most `limit` requests (all when `None`).
    pub fn read(path: &Path, limit: Option<usize>) -> Result<Self, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut reader = BufReader::new(file);
        let mut requests = Vec::new();
        let mut last_tokens = Vec::new();
        let mut refs = 0u64;
        let mut line = String::new();
        let mut number = 0usize;
        let keep = limit.unwrap_or(REQUESTS_MAX).min(REQUESTS_MAX);
        while requests.len() < keep {
            line.clear();
            number += 1;
            let n = Read::by_ref(&mut reader)
                .take(LINE_BYTES_MAX as u64 + 1)
                .read_line(&mut line)
                .map_err(|e| format!("{}:{number}: {e}", path.display()))?;
            if n == 0 {
                break;
            }
            if n > LINE_BYTES_MAX {
                return Err(format!(
                    "{}:{number}: line longer than {LINE_BYTES_MAX} bytes",
                    path.display()
                ));
            }
            if line.trim().is_empty() {
                continue;
            }
            let parsed: Line = serde_json::from_str(&line)
                .map_err(|e| format!("{}:{number}: not a trace line: {e}", path.display()))?;
            if parsed.hash_ids.is_empty() || parsed.hash_ids.len() > CHAIN_HASHES_MAX {
                return Err(format!(
                    "{}:{number}: {} hash_ids (a request needs 1 to {CHAIN_HASHES_MAX})",
                    path.display(),
                    parsed.hash_ids.len()
                ));
            }
            refs += parsed.hash_ids.len() as u64;
            if refs > REFS_MAX {
                return Err(format!("{}: more than {REFS_MAX} block references", path.display()));
            }
            last_tokens.push(last_block_tokens(parsed.hash_ids.len(), parsed.input_length));
            requests.push(parsed.hash_ids);
        }
        if requests.is_empty() {
            return Err(format!("{}: no requests", path.display()));
        }
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let mut trace = Self::from_ids(&name, requests);
        trace.last_tokens = last_tokens;
        Ok(trace)
    }

    /// Distinct blocks (chains).
    pub fn unique_blocks(&self) -> usize {
        self.unique
    }

    /// Block references over all requests.
    pub fn refs(&self) -> u64 {
        self.requests.iter().map(|r| r.len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_not_ids_name_blocks() {
        let t = Trace::from_ids("t", [vec![7, 8], vec![7, 9], vec![8]]);
        assert_eq!(t.requests, vec![vec![0, 1], vec![0, 2], vec![3]]);
        assert_eq!(t.unique_blocks(), 4);
        assert_eq!(t.refs(), 5);
    }

    #[test]
    fn a_prompt_that_ends_inside_its_last_block_makes_that_block_partial() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("t.jsonl");
        let lines = [
            "{\"input_length\": 6758, \"hash_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}",
            "{\"input_length\": 1024, \"hash_ids\": [1, 2]}",
            "{\"hash_ids\": [1, 2]}",
            "{\"input_length\": 5000, \"hash_ids\": [1, 2]}",
        ];
        std::fs::write(&path, lines.join("\n")).unwrap_or_else(|e| panic!("{e}"));
        let t = Trace::read(&path, None).unwrap_or_else(|e| panic!("{e}"));
        // 6758 - 13 * 512 = 102 tokens; a whole last block, no length, or a length that does
        // not end in the last block all leave it full.
        assert_eq!(t.last_tokens, vec![102, 512, 512, 512]);
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("t.jsonl");
        std::fs::write(&path, "{\"hash_ids\": [1, 2]}\n{\"hash_ids\": []}\n")
            .unwrap_or_else(|e| panic!("{e}"));
        let e = Trace::read(&path, None).err().unwrap_or_default();
        assert!(e.contains(":2:") && e.contains("0 hash_ids"), "{e}");
        let t = Trace::read(&path, Some(1)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.requests.len(), 1);
        std::fs::write(&path, "{\"ids\": [1]}\n").unwrap_or_else(|e| panic!("{e}"));
        let e = Trace::read(&path, None).err().unwrap_or_default();
        assert!(e.contains(":1: not a trace line"), "{e}");
    }
}
