"""Train the embedded byte-level BPE tokenizer with HF ``tokenizers``.

``python -m train.tokenizer --corpus data/corpus --out models/target --vocab 4096``
writes ``tokenizer.json`` + ``tokenizer_config.json`` loadable with
``transformers.AutoTokenizer.from_pretrained``. Trained on the train splits only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from corpus.sources import EOS_TEXT


def train_tokenizer(corpus_dir: Path, out_dir: Path, vocab_size: int = 4096) -> None:
    """Train byte-level BPE on ``{code,prose}.train.txt`` and save it in HF layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    files = [str(corpus_dir / f"{d}.train.txt") for d in ("code", "prose")]
    tok.train(files, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TEXT, "bos_token": EOS_TEXT, "pad_token": EOS_TEXT,
        "unk_token": None, "model_max_length": 1024, "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS_TEXT, "bos_token": EOS_TEXT, "pad_token": EOS_TEXT}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--out", type=Path, default=Path("models/target"))
    ap.add_argument("--vocab", type=int, default=4096)
    a = ap.parse_args()
    train_tokenizer(a.corpus, a.out, a.vocab)
    print(f"tokenizer written to {a.out}")


if __name__ == "__main__":
    main()
