"""A character-level tokenizer as a real ``transformers.PreTrainedTokenizerFast``.

One token per character of printable ASCII plus newline (96 symbols) and four specials, 100 ids in all:

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4 '\\n'   5 ' '   6 '!' ... 99 '~'

Built with the ``tokenizers`` library (a BPE model with no merges is exactly a character vocabulary),
so ``save_pretrained(dir)`` writes tokenizer.json and ``AutoTokenizer.from_pretrained(dir)`` loads it
back the way the engine server and SGLang load any tokenizer. Encoding adds BOS in front (a template
post-processor); the completion's end is EOS, which the model learns to emit.
"""

from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ALPHABET = "\n" + "".join(chr(c) for c in range(0x20, 0x7F))


def build_char_tokenizer():
    """A PreTrainedTokenizerFast over SPECIAL_TOKENS + ALPHABET (vocabulary size 100)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()  # join characters without separators
    bos_id = vocab[BOS]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # generation pads prompts on the left
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer


def save_char_tokenizer(path: str | Path):
    """Build and save_pretrained into path; returns the tokenizer."""
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(str(path))
    return tokenizer
