"""Time to first token of a real model: restoring a prompt prefix through GPUCache against
computing it again.

Starts `gpucache serve` on a FileStore in a temporary directory (loopback, free ports), runs
one writer process over the first max(--prefixes) tokens of a fixed prompt (the model and roles
of python/tests/engines/model_restore.py: a random-initialised LlamaForCausalLM on CPU), then,
for each prefix length P, reader prompts made of the prompt's first P tokens and --suffix new
tokens:

- restore: a reader process builds the keys, asks prefix_len, restores the stored blocks with
  batch_get_into into a torch tensor, builds a DynamicCache and computes only the rest;
- recompute: a process computes the whole prompt in one pass.

Time to first token runs from the request (keys not yet built, nothing cached) to the argmax of
the last prompt position; each process first runs one untimed pass over an unrelated prompt of
the same length, and connects to the server before the clock starts (an engine holds its
connection). Each side runs in --processes fresh processes of --repeat timed repetitions, the
two sides alternating. Prints a markdown table (medians, min-max ranges) and the load average
before and after; --json also writes every sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines"))
import model_restore as mr  # noqa: E402


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()


def ms(xs) -> str:
    return f"{1e3 * statistics.median(xs):.1f} ({1e3 * min(xs):.1f}-{1e3 * max(xs):.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", default="256,1000,1024,2048",
                   help="prefix lengths P in tokens, comma-separated")
    p.add_argument("--suffix", type=int, default=64, help="new tokens after each prefix")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per side and P")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per process")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every process (1: steadier on a shared machine)")
    p.add_argument("--local", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--binary", help="the gpucache binary (default: as the tests find it)")
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args()
    prefixes = [int(x) for x in args.prefixes.split(",")]
    if not prefixes or min(prefixes) < mr.BLOCK_TOKENS:
        p.error(f"prefixes of at least {mr.BLOCK_TOKENS} tokens")
    binary = args.binary or mr.gpucache_binary()
    if binary is None:
        p.error("no gpucache binary: pass --binary or set GPUCACHE_BIN")

    common = [f"--threads={args.threads}", f"--local={args.local}"]
    load_before = uptime()
    rows, samples = [], []
    with tempfile.TemporaryDirectory(prefix="gpucache-ttft-") as tmp, mr.Server(binary, Path(tmp)) as server:
        tmp = Path(tmp)
        srv = f"--server={server.address}"
        w = mr.run_role("write", tmp, "writer", srv, f"--write-tokens={max(prefixes)}", *common)
        for n in prefixes:
            prompt = [f"--prompt-tokens={n}", f"--suffix-tokens={args.suffix}", "--warmup",
                      f"--repeat={args.repeat}", *common]
            restore, recompute, restore_io = [], [], []
            reader = None
            for i in range(args.processes):
                # Alternate which side runs first, so drift in the machine's load hits both.
                order = ("read", "compute") if i % 2 == 0 else ("compute", "read")
                for role in order:
                    if role == "read":
                        reader = mr.run_role("read", tmp, f"read-{n}-{i}", srv, *prompt)
                        restore += [r["ttft_s"] for r in reader["runs"]]
                        restore_io += [r["restore_s"] for r in reader["runs"]]
                    else:
                        full = mr.run_role("compute", tmp, f"compute-{n}-{i}", *prompt)
                        recompute += [r["ttft_s"] for r in full["runs"]]
                if reader["tokens"] != full["tokens"]:
                    raise RuntimeError(f"P={n}: restored and recomputed greedy tokens differ")
            kept = reader["restored_tokens"]
            transport = reader["transport"]
            rows.append((n, reader["prompt_tokens"], kept, reader["restored_bytes"],
                         recompute, restore, restore_io))
            samples.append({"prefix_tokens": n, "prompt_tokens": reader["prompt_tokens"],
                            "restored_tokens": kept, "restored_bytes": reader["restored_bytes"],
                            "recompute_ttft_s": recompute, "restore_ttft_s": restore,
                            "restore_io_s": restore_io})
    load_after = uptime()

    print(f"model: LlamaForCausalLM, 4 layers, hidden 256, float32, CPU, {args.threads} torch threads; "
          f"{w['block_bytes'] // 1024} KiB per {mr.BLOCK_TOKENS}-token block; client local={args.local} "
          f"(transport {transport}); "
          f"{args.processes} processes x {args.repeat} repetitions per cell; ms: median (min-max)")
    print()
    print("| prefix tokens | prompt tokens | restored tokens (of the prefix) | TTFT recompute ms "
          "| TTFT restore ms | of which prefix_len + batch_get_into ms | speed-up (medians) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, total, kept, nbytes, rec, res, io in rows:
        speed = statistics.median(rec) / statistics.median(res)
        print(f"| {n} | {total} | {kept} ({kept / n:.1%}, {nbytes / 2**20:.1f} MiB) | {ms(rec)} "
              f"| {ms(res)} | {ms(io)} | {speed:.2f}x |")
    print()
    print(f"load before: {load_before}")
    print(f"load after:  {load_after}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": samples, "load_before": load_before,
                                               "load_after": load_after}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
