"""The real models' tokenizers, offline.

    real_clip_tokenizer(pad="<|endoftext|>")  -> CLIP's BPE tokenizer (CLIP-L and OpenCLIP bigG share it)
    real_t5_tokenizer(length, near=None)      -> T5's sentencepiece tokenizer, from a `spiece.model` file

CLIP: the vocabulary is OpenAI's `bpe_simple_vocab_16e6.txt.gz` as open_clip ships it (MIT licence, its
LICENSE beside it in data/tokenizers/), made into the vocabulary and merges that transformers' CLIPTokenizer
reads exactly as open_clip's SimpleTokenizer makes them: 256 byte symbols, the same with the end-of-word mark,
one token per merge (the first 48894), then <|startoftext|> and <|endoftext|>: 49408 tokens. SDXL's second
tokenizer pads with "!" (pad="!").

T5: no package on the registries ships T5's sentencepiece model (`spiece.model`, Apache-2.0), so lora_lab
does not ship it either: it is read from a `spiece.model` beside the --t5xxl file, and where there is none
the error says so.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

from .builders import DATA_DIR
from .kinds import ModelLoadError

CLIP_BPE = DATA_DIR / "tokenizers" / "bpe_simple_vocab_16e6.txt.gz"
CLIP_TOKENS = 77
_MERGES = 49152 - 256 - 2  # open_clip's SimpleTokenizer reads this many merges


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet, as CLIP uses it: printable bytes stand for themselves."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@functools.lru_cache(maxsize=1)
def clip_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary (token -> id) and merges, from the shipped BPE file."""
    lines = gzip.decompress(CLIP_BPE.read_bytes()).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1:_MERGES + 1]]
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def real_clip_tokenizer(pad: str = "<|endoftext|>"):
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocabulary()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_TOKENS, pad_token=pad)


def real_t5_tokenizer(length: int, near: str | Path | None = None):
    from transformers import T5Tokenizer

    spiece = Path(near).parent / "spiece.model" if near else None
    if spiece is None or not spiece.is_file():
        raise ModelLoadError("T5-XXL's tokenizer is not shipped with lora_lab (no package ships its "
                             "spiece.model): put spiece.model (google/t5-v1_1-xxl) beside the --t5xxl file")
    return T5Tokenizer(vocab_file=str(spiece), model_max_length=length, legacy=True)
