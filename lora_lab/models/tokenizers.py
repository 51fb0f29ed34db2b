"""The real models' tokenizers, offline.

    real_clip_tokenizer(pad="<|endoftext|>")  -> CLIP's BPE tokenizer (CLIP-L and OpenCLIP bigG share it)
    real_t5_tokenizer(length)                 -> T5's sentencepiece (Unigram) tokenizer, T5TokenizerFast

CLIP: the vocabulary is OpenAI's `bpe_simple_vocab_16e6.txt.gz` as open_clip ships it (MIT licence, its
LICENSE beside it in data/tokenizers/), made into the vocabulary and merges that transformers' CLIPTokenizer
reads exactly as open_clip's SimpleTokenizer makes them: 256 byte symbols, the same with the end-of-word mark,
one token per merge (the first 48894), then <|startoftext|> and <|endoftext|>: 49408 tokens. SDXL's second
tokenizer pads with "!" (pad="!").

T5: the vocabulary of T5 / T5 v1.1 (Google's, Apache-2.0: 32000 sentencepiece pieces and 100 <extra_id_N>)
as the Hugging Face tokenizers JSON that stable-diffusion.cpp embeds (its C array decoded, from the PyPI sdist
of stable-diffusion-cpp-python; MIT), shipped gzipped in data/tokenizers/ with LICENSE.t5; read by
transformers' T5TokenizerFast: "A long paragraph for summarization." gives transformers' own test's ids.
"""

from __future__ import annotations

import functools
import gzip

from .builders import DATA_DIR

CLIP_BPE = DATA_DIR / "tokenizers" / "bpe_simple_vocab_16e6.txt.gz"
T5_JSON = DATA_DIR / "tokenizers" / "t5_tokenizer.json.gz"
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


def real_t5_tokenizer(length: int):
    """T5's tokenizer (Flux's and SD3.5's T5-XXL) from the shipped JSON, `length` tokens at most."""
    from tokenizers import Tokenizer
    from transformers import T5TokenizerFast

    tok = Tokenizer.from_str(gzip.decompress(T5_JSON.read_bytes()).decode("utf-8"))
    return T5TokenizerFast(tokenizer_object=tok, model_max_length=length, eos_token="</s>", unk_token="<unk>",
                           pad_token="<pad>", extra_ids=100)
