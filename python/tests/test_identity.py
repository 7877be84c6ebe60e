"""Identity and Key: every field that changes the bytes of a block changes its key; keys are
stable, comparable, hashable and decode from their encoding; a chain key names its prefix."""

from __future__ import annotations

import pytest

gpucache = pytest.importorskip("gpucache")

BASE = dict(tenant="default", model="meta-llama/Llama-3-8B", model_revision="main",
            model_config=b'{"hidden": 4096}', tokenizer_revision="main", kv_dtype="f16",
            layout="sglang-page-first", layout_version=1, block_tokens=16)

VARIANTS = {
    "model": dict(model="meta-llama/Llama-3-70B"),
    "model_revision": dict(model_revision="v2"),
    "model_config": dict(model_config=b'{"hidden": 8192}'),
    "tokenizer_revision": dict(tokenizer_revision="v2"),
    "adapter": dict(adapter="lora-a"),
    "adapter_revision": dict(adapter="lora-a", adapter_revision="r2"),
    "kv_dtype": dict(kv_dtype="bf16"),
    "fp8": dict(kv_dtype="fp8_e4m3"),
    "layout": dict(layout="vllm-paged"),
    "layout_version": dict(layout_version=2),
    "tp_shard": dict(tp_rank=1, tp_size=2),
    "tp_size": dict(tp_rank=0, tp_size=2),
    "pp_shard": dict(pp_rank=1, pp_size=2),
    "block_tokens": dict(block_tokens=32),
    "rope": dict(rope={"theta": 500000.0, "scaling": "llama3", "factor": 8.0}),
    "multimodal": dict(multimodal={"processor": "clip", "inputs": b"img"}),
    "quant": dict(quant="per_token"),
    "tenant": dict(tenant="t1"),
}


def first_key(**kw):
    args = dict(BASE)
    args.update(kw)
    return gpucache.Identity(**args).chain_keys([b"h0"])[0]


def test_every_field_separates_keys():
    keys = {"base": first_key()}
    for name, change in VARIANTS.items():
        keys[name] = first_key(**change)
    encodings = {name: bytes(k) for name, k in keys.items()}
    assert len(set(encodings.values())) == len(encodings), encodings.keys()
    # Adapter with and without a revision differ too, and "lora-a" differs from no adapter.
    assert keys["adapter"] != keys["adapter_revision"] != keys["base"]


def test_separated_identities_miss_each_others_blocks(client):
    a = gpucache.Identity(**dict(BASE, model="test/sep-" + __name__)).chain_keys([b"x"])
    b = gpucache.Identity(**dict(BASE, model="test/sep-" + __name__, kv_dtype="bf16"))
    b = b.chain_keys([b"x"])
    client.put(a[0], b"f16 block")
    assert client.get(a[0]) == b"f16 block"
    assert client.get(b[0]) is None
    assert client.exists(b[0]) is False


def test_keys_are_stable_hashable_and_round_trip():
    k1, k2 = first_key(), first_key()
    assert k1 == k2 and hash(k1) == hash(k2) and k1.hex() == k2.hex()
    assert len({k1, k2}) == 1
    assert gpucache.Key.from_bytes(bytes(k1)) == k1
    assert k1.tenant == "default" and k1.blocks == 1
    with pytest.raises(ValueError):
        gpucache.Key.from_bytes(b"not a key")


def test_chain_key_i_names_the_prefix_up_to_i():
    idt = gpucache.Identity(**BASE)
    ks = idt.chain_keys([b"a", b"b", b"c"])
    assert [k.blocks for k in ks] == [1, 2, 3]
    assert idt.chain_keys([b"a", b"b"]) == ks[:2]
    # Another prefix that ends in the same block hash is another key.
    assert idt.chain_keys([b"z", b"b"])[1] != ks[1]
    # The kinds of hash never collide: the int 1, the str "1" and the bytes b"1".
    assert len({bytes(idt.chain_keys([h])[0]) for h in (1, "1", b"1")}) == 3


def test_token_keys_cover_full_blocks_only():
    idt = gpucache.Identity(**dict(BASE, block_tokens=4))
    ks = idt.token_keys(list(range(10)))
    assert len(ks) == 2
    assert idt.token_keys(list(range(8))) == ks
    assert idt.token_keys([0, 1, 2, 3, 9, 9, 9, 9])[0] == ks[0]
    assert idt.token_keys([0, 1, 2, 3, 9, 9, 9, 9])[1] != ks[1]


def test_bad_identities_are_refused():
    for bad in (dict(kv_dtype="f64"), dict(tp_rank=2, tp_size=2), dict(model=""),
                dict(model_revision="has space"), dict(block_tokens=0),
                dict(adapter_revision="r1")):
        with pytest.raises(ValueError):
            gpucache.Identity(**dict(BASE, **bad))


def test_plain_keys_differ_by_tenant_and_name():
    a = gpucache.plain_key("default", "x")
    assert a == gpucache.plain_key("default", b"x")
    assert a != gpucache.plain_key("t1", "x")
    assert a != gpucache.plain_key("default", "y")


def test_block_keys_name_each_block_alone_in_one_call():
    idt = gpucache.Identity(**BASE)
    hashes = [b"a", "b", 7, b"a"]
    keys = idt.block_keys(hashes)
    assert keys == [idt.chain_keys([h])[0] for h in hashes]
    assert keys[0] == keys[3] and len(set(keys)) == 3
    assert all(k.blocks == 1 for k in keys)
    with pytest.raises(ValueError):
        idt.block_keys([b"x"] * (gpucache.BATCH_KEYS_MAX + 1))
