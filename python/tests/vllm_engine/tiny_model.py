"""A tiny random-weight Llama and a tokenizer trained here, saved as a Hugging Face model
folder that vLLM loads offline: no weights are downloaded anywhere. The same seed makes the same
folder, so every engine process of a test serves the same model.

    python tiny_model.py DIR
"""

from __future__ import annotations

import json
import os
import sys

# Four layers of width 256: small enough to load in seconds on two cores, deep enough that a
# restored prefix saves measurable prefill time.
LAYERS, WIDTH, HEADS, VOCAB, CONTEXT = 4, 256, 4, 2048, 8192
SEED = 20261207
WORDS = (
    "cache block prefix token layer key value tier memory disk server engine request "
    "attention model batch page chunk restore store hit miss node rank shard tenant "
    "epoch lease fence write read copy host device queue bound limit deadline"
).split()


def corpus(lines: int):
    import random

    rng = random.Random(SEED)
    for _ in range(lines):
        yield " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(24))


def make(folder: str) -> str:
    """Writes the model folder (once: an existing complete folder is reused); returns it."""
    done = os.path.join(folder, "gpucache-tiny-model.json")
    if os.path.exists(done):
        return folder
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(corpus(4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=CONTEXT,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    with open(done, "w") as f:
        json.dump({"layers": LAYERS, "width": WIDTH, "vocab": VOCAB, "seed": SEED}, f)
    return folder


def prompt(words: int, seed: int) -> str:
    """A prompt of about `words` words (a few tokens each) drawn with `seed`."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(words))


if __name__ == "__main__":
    print(make(sys.argv[1]))
