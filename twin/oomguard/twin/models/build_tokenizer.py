"""Build the twin's small offline tokenizer (twin/oomguard/twin/models/<model>/tokenizer*.json).

The twin has no weights and no hub access, but vLLM needs a tokenizer for text prompts, chat and
`prompt_logprobs` (it refuses them under `--skip-tokenizer-init`). This trains a byte-level BPE
with 1,024 entries (any UTF-8 text tokenizes; ids stay far below the model's 32,000) on this
repository's own docs and runbooks, with Llama's special-token ids (<unk> 0, <s> 1, </s> 2, as
in the model's config.json) and a plain chat template. Deterministic for a given corpus; the
committed files are what the tests use, so rebuilding is needed only to change the tokenizer:

    .venv/bin/python twin/oomguard/twin/models/build_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]  # twin/oomguard/twin/models -> the checkout
MODELS = ("tiny-llama", "llama-3-8b", "llama-3.2-3b")  # the same files in each twin model folder
VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus() -> list[str]:
    files = sorted([*REPO.glob("docs/*.md"), *REPO.glob("runbooks/*.md"), REPO / "README.md"])
    return [f.read_text() for f in files if f.is_file()]


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    return tok


def main() -> None:
    tok = build()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 65536,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    for name in MODELS:
        out = HERE / name
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"wrote {out / 'tokenizer.json'} ({tok.get_vocab_size()} entries)")


if __name__ == "__main__":
    main()
