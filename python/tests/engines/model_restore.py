"""A real model restoring its prompt prefix through GPUCache, one role per process.

The model is transformers' `LlamaForCausalLM` with a small random-initialised configuration
(a fixed seed, nothing downloaded), on CPU. The prompt is a fixed sequence of token ids drawn
from a seeded generator, so every process builds the same one without a tokenizer.

Roles (the first argument), each run as its own process by the tests and the TTFT bench:

- `write`: runs the first `--write-tokens` tokens of the prompt in one forward pass, cuts the
  prefix KV of every full block into one object per block (all layers' K and V) and PUTs the
  blocks through `gpucache.Client.batch_put_from` under `Identity.token_keys` keys.
- `read`: a fresh process with nothing cached. Its prompt is the first `--prompt-tokens`
  tokens, then `--suffix-tokens` of another sequence no writer ran. It builds the keys, asks the server how many leading blocks it holds (`prefix_len`),
  restores them with `batch_get_into` straight into one torch tensor, builds a `DynamicCache`
  from it and computes only the rest of the prompt, then continues greedily.
- `compute`: the same continuation over KV the process computes itself: with
  `--keep-tokens 0` one full pass over the whole prompt; with `--keep-tokens R` it first runs the
  writer's pass (`--write-tokens`), keeps that KV's first R tokens (the bytes a reader restoring
  R tokens gets) and continues exactly as the reader does, so the two must agree bit for bit.

Each role writes a JSON report (`--report`) and, for `read` and `compute`, the logits of every
position it computed plus every greedy step (`--logits`, `torch.save`). `read` and `compute`
time the first token (`runs`: one entry per `--repeat`, from the request to the argmax of the
last prompt position; `--warmup` runs one untimed pass over an unrelated prompt first).

Block object layout (`LAYOUT`, version 1): a contiguous tensor of shape
`[layers, 2 (K then V), kv_heads, BLOCK_TOKENS, head_dim]` in the model's dtype.

This module also holds what the tests and the bench share: the `gpucache serve` child process
(`Server`) and the model variants the miss tests use.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BLOCK_TOKENS = 16
MODEL_NAME = "gpucache-e2e/tiny-llama-random"
LAYOUT = "e2e-hf-block-layer-kv-head-token-dim"
LAYOUT_VERSION = 1
TENANT = "e2e"
VOCAB = 512
#: Longest prompt any role accepts (the model's position table is this long).
PROMPT_TOKENS_MAX = 4096
#: Greedy steps after the prompt.
CONTINUE_TOKENS_DEFAULT = 32
#: Most timed repetitions one process runs.
REPEAT_MAX = 100
#: Threads torch may use: fixed, so every process reduces in the same order.
TORCH_THREADS_DEFAULT = 2

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def model_config(variant: str):
    """The model's configuration; `wide` differs only in its MLP width (a different model)."""
    from transformers import LlamaConfig

    if variant not in ("base", "wide"):
        raise ValueError(f"unknown model variant {variant!r} (base, wide)")
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512 if variant == "base" else 768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=PROMPT_TOKENS_MAX,
        tie_word_embeddings=False,
    )


def build_model(variant: str, kv_dtype: str, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(variant)).eval()
    return model.to(getattr(torch, DTYPES[kv_dtype]))


def prompt_ids(seed: int, n: int) -> list[int]:
    """The first `n` token ids of the fixed prompt of `seed` (a prefix of any longer one)."""
    import torch

    if not 0 < n <= PROMPT_TOKENS_MAX:
        raise ValueError(f"prompt of {n} tokens: 1..={PROMPT_TOKENS_MAX}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (PROMPT_TOKENS_MAX,), generator=g)[:n].tolist()


def identity(args, model):
    """The cache identity of this model: its configuration text, seed, dtype and layout."""
    import gpucache

    config_text = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    return gpucache.Identity(
        tenant=TENANT,
        model=MODEL_NAME,
        model_revision=f"seed-{args.model_seed}",
        model_config=config_text,
        tokenizer_revision=args.tokenizer_revision,
        kv_dtype=args.kv_dtype,
        layout=LAYOUT,
        layout_version=LAYOUT_VERSION,
        block_tokens=BLOCK_TOKENS,
    )


def kv_shape(model) -> tuple[int, int, int]:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_key_value_heads, head_dim


def block_bytes(model) -> int:
    layers, heads, head_dim = kv_shape(model)
    return layers * 2 * heads * BLOCK_TOKENS * head_dim * model.dtype.itemsize


def forward(model, ids: list[int], cache):
    """One forward pass of `ids` after what `cache` holds; returns the logits `[len(ids), V]`."""
    import torch

    # transformers 5 names the cache argument `cache`; older releases `past_key_values`.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, **{name: cache})
    return out.logits[0]


def layer_kv(cache, layer: int):
    """Layer `layer`'s K and V tensors `[1, heads, tokens, head_dim]` of a `DynamicCache`."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def cache_from(model, ks, vs):
    """A `DynamicCache` holding these per-layer K and V tensors."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(ks, vs)):
        cache.update(k, v, layer)
    return cache


def pack_blocks(model, cache, blocks: int):
    """The first `blocks` full blocks of `cache` as one tensor `[blocks, layers, 2, H, B, D]`."""
    import torch

    layers, heads, head_dim = kv_shape(model)
    out = torch.empty((blocks, layers, 2, heads, BLOCK_TOKENS, head_dim), dtype=model.dtype)
    t = blocks * BLOCK_TOKENS
    for layer in range(layers):
        for which, x in enumerate(layer_kv(cache, layer)):
            x = x[0, :, :t].reshape(heads, blocks, BLOCK_TOKENS, head_dim).permute(1, 0, 2, 3)
            out[:, layer, which] = x
    return out


def unpack_blocks(model, buf):
    """Per-layer K and V tensors `[1, H, blocks * B, D]` (contiguous) from packed blocks."""
    layers, heads, head_dim = kv_shape(model)
    blocks = buf.shape[0]
    ks, vs = [], []
    for layer in range(layers):
        for which, out in ((0, ks), (1, vs)):
            x = buf[:, layer, which].permute(1, 0, 2, 3).reshape(1, heads, blocks * BLOCK_TOKENS, head_dim)
            out.append(x.contiguous())
    return ks, vs


def digest(t) -> str:
    """SHA-256 of a tensor's bytes (row-major)."""
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def greedy(model, cache, last_logits, steps: int):
    """`steps` greedy tokens after a prompt whose last logits are `last_logits`; returns the
    tokens and the logits each step chose from (the first row is `last_logits`)."""
    import torch

    tokens, rows = [], [last_logits]
    for _ in range(steps):
        tok = int(torch.argmax(rows[-1]))
        tokens.append(tok)
        rows.append(forward(model, [tok], cache)[-1])
    return tokens, torch.stack(rows[:-1])


def connect(args):
    import gpucache

    # One batch call carries every block of the longest prompt.
    if PROMPT_TOKENS_MAX // BLOCK_TOKENS > gpucache.BATCH_ITEMS_MAX:
        raise RuntimeError(f"{PROMPT_TOKENS_MAX // BLOCK_TOKENS} blocks exceed BATCH_ITEMS_MAX")
    local = {"auto": "auto", "on": True, "off": False}[args.local]
    return gpucache.Client(args.server, tenant=TENANT, local=local, timeout_s=args.timeout_s)


def setup_torch(args):
    import torch

    torch.set_num_threads(args.threads)


def role_write(args) -> dict:
    setup_torch(args)
    model = build_model(args.model, args.kv_dtype, args.model_seed)
    ids = prompt_ids(args.prompt_seed, args.write_tokens)
    cache = cache_from(model, [], [])
    forward(model, ids, cache)
    blocks = len(ids) // BLOCK_TOKENS
    packed = pack_blocks(model, cache, blocks)
    keys = identity(args, model).token_keys(ids)
    if len(keys) != blocks:
        raise RuntimeError(f"token_keys gave {len(keys)} keys for {blocks} full blocks")
    client = connect(args)
    try:
        put = client.batch_put_from(keys, [packed[i] for i in range(blocks)])
    finally:
        client.close()
    return {
        "blocks": blocks,
        "block_bytes": block_bytes(model),
        "put": [bool(p) for p in put],
        "keys": [bytes(k).hex() for k in keys],
        "digests": [digest(packed[i]) for i in range(blocks)],
    }


def restore(model, ident, client, ids: list[int]):
    """Restores the longest stored prefix of `ids` (leaving at least one token to compute):
    answers the packed blocks restored, `prefix_len`'s answer, and what each get returned."""
    import torch

    keys = ident.token_keys(ids)
    # The last prompt token is always computed: its logits pick the first new token.
    usable = keys[: (len(ids) - 1) // BLOCK_TOKENS]
    present = client.prefix_len(usable) if usable else 0
    layers, heads, head_dim = kv_shape(model)
    buf = torch.empty((present, layers, 2, heads, BLOCK_TOKENS, head_dim), dtype=model.dtype)
    got = client.batch_get_into(usable[:present], [buf[i] for i in range(present)]) if present else []
    want = block_bytes(model)
    # The restored prefix ends at the first block that missed or came back with another size.
    restored = 0
    while restored < present and got[restored] == want:
        restored += 1
    return buf[:restored], present, got


def reader_prompt(args) -> list[int]:
    """The reader's prompt: the first `--prompt-tokens` of the fixed prompt, then
    `--suffix-tokens` of another sequence (`--suffix-seed`) that no writer ran."""
    ids = prompt_ids(args.prompt_seed, args.prompt_tokens)
    if args.suffix_tokens:
        if args.suffix_seed == args.prompt_seed:
            raise ValueError("--suffix-seed must differ from --prompt-seed")
        ids += prompt_ids(args.suffix_seed, args.suffix_tokens)
    if len(ids) > PROMPT_TOKENS_MAX:
        raise ValueError(f"a prompt of {len(ids)} tokens: at most {PROMPT_TOKENS_MAX}")
    return ids


def warm_up(args, model, n: int) -> None:
    """One untimed pass over `n` tokens of an unrelated sequence, so the timed passes do not
    pay for first-call set-up inside torch."""
    forward(model, prompt_ids(args.prompt_seed + 1_000_003, n), cache_from(model, [], []))


def finish(args, model, cache, logits, first: int, report: dict):
    """Continues greedily after the timed first token; answers the report (with `tokens`), the
    prompt logits and the greedy steps' logits."""
    tokens, steps = greedy(model, cache, logits[-1], args.continue_tokens)
    if tokens[0] != first:
        raise RuntimeError("the first greedy token is not the timed one")
    report["tokens"] = tokens
    return report, logits, steps


def role_read(args):
    setup_torch(args)
    model = build_model(args.model, args.kv_dtype, args.model_seed)
    ident = identity(args, model)
    ids = reader_prompt(args)
    if args.warmup:
        warm_up(args, model, len(ids))
    t_connect = time.perf_counter()
    client = connect(args)
    connect_s = time.perf_counter() - t_connect
    transport = client.transport
    runs = []
    try:
        for _ in range(args.repeat):
            # Every repetition starts from nothing in this process: new keys, new buffers.
            t0 = time.perf_counter()
            buf, present, got = restore(model, ident, client, ids)
            t_restored = time.perf_counter()
            kept = buf.shape[0] * BLOCK_TOKENS
            # Nothing restored: the same empty cache a full pass starts from.
            cache = cache_from(model, *unpack_blocks(model, buf)) if kept else cache_from(model, [], [])
            logits = forward(model, ids[kept:], cache)
            first = int(logits[-1].argmax())
            t_first = time.perf_counter()
            runs.append({"restore_s": t_restored - t0, "ttft_s": t_first - t0})
    finally:
        client.close()
    return finish(args, model, cache, logits, first, {
        "prompt_tokens": len(ids),
        "prefix_len": present,
        "gets": got,
        "restored_tokens": kept,
        "restored_bytes": buf.shape[0] * block_bytes(model),
        "restored_digests": [digest(buf[i]) for i in range(buf.shape[0])],
        "transport": transport,
        "connect_s": connect_s,
        "runs": runs,
    })


def role_compute(args):
    setup_torch(args)
    model = build_model(args.model, args.kv_dtype, args.model_seed)
    ids = reader_prompt(args)
    keep = args.keep_tokens
    if keep % BLOCK_TOKENS or not 0 <= keep < len(ids):
        raise ValueError(f"--keep-tokens {keep}: a multiple of {BLOCK_TOKENS} below the prompt")
    if keep and not keep <= min(args.write_tokens, args.prompt_tokens):
        raise ValueError("--keep-tokens needs keep <= --write-tokens and keep <= --prompt-tokens")
    if args.warmup:
        warm_up(args, model, len(ids))
    runs = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        if keep:
            # The writer's pass, then exactly the tensors a reader restoring `keep` tokens holds.
            writer = cache_from(model, [], [])
            forward(model, prompt_ids(args.prompt_seed, args.write_tokens), writer)
            packed = pack_blocks(model, writer, keep // BLOCK_TOKENS)
            cache = cache_from(model, *unpack_blocks(model, packed))
        else:
            cache = cache_from(model, [], [])
        logits = forward(model, ids[keep:], cache)
        first = int(logits[-1].argmax())
        runs.append({"ttft_s": time.perf_counter() - t0})
    digests = [digest(packed[i]) for i in range(packed.shape[0])] if keep else []
    report = {"prompt_tokens": len(ids), "kept_tokens": keep, "digests": digests, "runs": runs}
    return finish(args, model, cache, logits, first, report)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=["write", "read", "compute"])
    p.add_argument("--server", help="host:port of a running `gpucache serve` (write, read)")
    p.add_argument("--local", choices=["auto", "on", "off"], default="auto",
                   help="the client's same-host path (gpucache.Client local=)")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--model", choices=["base", "wide"], default="base")
    p.add_argument("--model-seed", type=int, default=1234)
    p.add_argument("--kv-dtype", choices=sorted(DTYPES), default="f32")
    p.add_argument("--tokenizer-revision", default="synthetic-v1")
    p.add_argument("--prompt-seed", type=int, default=7)
    p.add_argument("--write-tokens", type=int, default=0, help="tokens the writer ran")
    p.add_argument("--prompt-tokens", type=int, default=0, help="tokens of the reader's prompt")
    p.add_argument("--suffix-tokens", type=int, default=0,
                   help="read/compute: new tokens after the prompt's first --prompt-tokens")
    p.add_argument("--suffix-seed", type=int, default=8)
    p.add_argument("--keep-tokens", type=int, default=0, help="compute: prefix tokens kept")
    p.add_argument("--repeat", type=int, default=1,
                   help="read/compute: timed repetitions in this process (the last one is reported)")
    p.add_argument("--warmup", action="store_true",
                   help="read/compute: one untimed pass over an unrelated prompt first")
    p.add_argument("--continue-tokens", type=int, default=CONTINUE_TOKENS_DEFAULT)
    p.add_argument("--threads", type=int, default=TORCH_THREADS_DEFAULT)
    p.add_argument("--report", required=True, help="JSON report path")
    p.add_argument("--logits", help="read/compute: torch.save path of the logits")
    args = p.parse_args(argv)
    if args.role in ("write", "read") and not args.server:
        p.error(f"{args.role} needs --server")
    if args.role == "write" and args.write_tokens < BLOCK_TOKENS:
        p.error(f"write needs --write-tokens of at least one block ({BLOCK_TOKENS})")
    if args.role in ("read", "compute") and args.prompt_tokens < 1:
        p.error(f"{args.role} needs --prompt-tokens")
    if not 1 <= args.repeat <= REPEAT_MAX:
        p.error(f"--repeat: 1..={REPEAT_MAX}")
    return args


def main(argv=None) -> int:
    import torch

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.role == "write":
        report = role_write(args)
    else:
        report, logits, steps = (role_read if args.role == "read" else role_compute)(args)
        if args.logits:
            torch.save({"prompt": logits, "steps": steps}, args.logits)
    Path(args.report).write_text(json.dumps(report))
    return 0


# ---------------------------------------------------------------------------------------------
# The server child the tests and the bench share.

#: How long a starting server may take to print its start line.
START_PATIENCE_S = 60.0
#: How long a stopped server may take to exit.
STOP_PATIENCE_S = 20.0
#: Most log lines a starting server may write before its start line.
START_LINES_MAX = 200


def gpucache_binary() -> str | None:
    """The `gpucache` binary: `GPUCACHE_BIN`, else this checkout's build folder (debug, then
    release), else PATH."""
    if os.environ.get("GPUCACHE_BIN"):
        return os.environ["GPUCACHE_BIN"]
    repo = Path(__file__).resolve().parents[3]
    target = Path(os.environ.get("CARGO_TARGET_DIR") or repo / "target")
    for profile in ("debug", "release"):
        b = target / profile / "gpucache"
        if b.is_file() and os.access(b, os.X_OK):
            return str(b)
    return shutil.which("gpucache")


class Server:
    """`gpucache serve` on a FileStore under `root`, on free loopback ports (port 0: the start
    line says which), stopped by PID."""

    def __init__(self, binary: str, root: Path):
        self.binary = binary
        self.root = Path(root)
        self.store = self.root / "store"
        self.config = self.root / "serve.toml"
        self.config.write_text(
            "[store]\n"
            'kind = "file"\n'
            f'root = "{self.store}"\n'
            # A file per block: the damage test finds and flips one block's file.
            'layout = "files"\n'
            "[listen]\n"
            'native = "127.0.0.1:0"\n'
            'resp = "127.0.0.1:0"\n'
            'metrics = "127.0.0.1:0"\n'
            "[[tenants]]\n"
            f'name = "{TENANT}"\n'
            'rights = ["read", "write"]\n'
        )
        self.proc = None
        self.address = None
        self.log: list[str] = []

    def start(self) -> "Server":
        self.proc = subprocess.Popen(
            [self.binary, "serve", "--config", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        lines: queue.Queue = queue.Queue(START_LINES_MAX)

        def drain(stream):
            for line in stream:
                try:
                    lines.put_nowait(line.rstrip("\n"))
                except queue.Full:
                    pass  # after the start line nobody reads: the rest is drained away

        threading.Thread(target=drain, args=(self.proc.stderr,), daemon=True).start()
        deadline = time.monotonic() + START_PATIENCE_S
        self.log = []
        while len(self.log) < START_LINES_MAX:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and lines.empty():
                    break
                continue
            self.log.append(line)
            m = re.search(r"listening native=(\S+)", line)
            if m:
                self.address = m.group(1)
                return self
        self.kill()
        raise RuntimeError("gpucache serve did not start:\n" + "\n".join(self.log))

    def stop(self) -> None:
        """SIGTERM to its PID; it must exit cleanly (status 0) within STOP_PATIENCE_S."""
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_PATIENCE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"gpucache serve did not stop within {STOP_PATIENCE_S} s of SIGTERM")
        self.proc = None
        if code != 0:
            raise RuntimeError(f"gpucache serve exited with status {code}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_PATIENCE_S)
        self.proc = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.proc is not None:
            self.stop()
        else:
            self.kill()


def block_file_of(store: Path, key_bytes: bytes) -> Path:
    """The one block file whose header names `key_bytes` (a block file is a 4 KiB-padded header
    carrying the whole key, then the payload: docs/adr/0008-file-layout.md)."""
    found = []
    for path in sorted((store / "blocks").glob("*/*.blk")):
        with open(path, "rb") as f:
            header = f.read(header_len(path))
        if key_bytes in header:
            found.append(path)
    if len(found) != 1:
        raise RuntimeError(f"expected one block file naming the key, found {found}")
    return found[0]


def header_len(path: Path) -> int:
    """The header length field of a block file (bytes 8..12, little-endian)."""
    with open(path, "rb") as f:
        head = f.read(12)
    if len(head) < 12:
        raise RuntimeError(f"{path}: shorter than a block header")
    return int.from_bytes(head[8:12], "little")


def flip_byte(path: Path, pos: int) -> None:
    """XORs the byte at `pos` of `path` with 0x5A."""
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        if len(b) != 1:
            raise RuntimeError(f"{path}: no byte at {pos}")
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))


#: Longest one role's process may run.
ROLE_PATIENCE_S = 600.0


def run_role(role: str, report_dir: Path, name: str, *args: str) -> dict:
    """Runs this script as its own process in `role` and answers its JSON report; for `read`
    and `compute` the report's `logits` names the saved logits file."""
    report = Path(report_dir) / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), role, "--report", str(report), *args]
    logits = None
    if role != "write":
        logits = Path(report_dir) / f"{name}.pt"
        cmd += ["--logits", str(logits)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=ROLE_PATIENCE_S)
    if done.returncode != 0:
        raise RuntimeError(f"{role} ({name}) exited {done.returncode}:\n{done.stderr[-4000:]}")
    out = json.loads(report.read_text())
    if logits is not None:
        out["logits"] = str(logits)
    return out


if __name__ == "__main__":
    sys.exit(main())
