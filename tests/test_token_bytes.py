"""A logprob entry's `bytes` for a SentencePiece vocabulary with byte fallback (Llama 2,
Gemma, Mistral's older models): a raw byte is written `<0xNN>` and is that one byte, a
word piece's `▁` is a space. The demo tokenizer is byte-level BPE, so this one is made
here: a Unigram vocabulary of the 256 byte pieces and a few words, with the decoder
SentencePiece conversions give, which mlx-lm streams with its SPM detokenizer."""

from pathlib import Path

from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import Unigram
from transformers import PreTrainedTokenizerFast

from kvroute.backend.token_bytes import TokenBytes

WORDS = ["▁hello", "▁world", "▁", "he", "llo", "o", "l", "h", "e", "w", "r", "d"]


def spm_tokenizer(folder: Path):
    vocab = ([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
             + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
             + [(w, -float(i + 1)) for i, w in enumerate(WORDS)])
    tok = Tokenizer(Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return load_tokenizer(folder)


def test_spm_byte_pieces_are_their_byte_and_word_pieces_their_text_and_space(tmp_path):
    tok = spm_tokenizer(tmp_path)
    assert isinstance(tok.detokenizer, SPMStreamingDetokenizer)  # the path under test
    ids = tok.encode("hello 🙂 world", add_special_tokens=False)
    pieces = tok._tokenizer.convert_ids_to_tokens(ids)
    assert pieces == ["▁hello", "▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "▁world"]
    token_bytes = TokenBytes(tok)
    got = [token_bytes(i) for i in ids]
    # Each byte of the emoji is one byte, not U+FFFD's three (what decoding it alone gives).
    assert got[2:6] == [[0xF0], [0x9F], [0x99], [0x82]]
    assert tok.decode(ids[2:3]) == "\ufffd"
    assert bytes(got[-1]) == b" world"
    # Joined, they are the text (with the space SentencePiece puts before the first word).
    assert b"".join(bytes(b) for b in got) == " hello 🙂 world".encode()
    assert token_bytes(tok.eos_token_id) == list(b"</s>")  # a special token: its text
    # The entries' `token` strings keep the word pieces' spaces (decoded alone, `▁world`
    # is "world"), a lone byte of a character is U+FFFD, as OpenAI's read.
    assert tok.decode(ids[-1:]) == "world"
    assert [token_bytes.text(i) for i in ids] == [" hello", " ", *["\ufffd"] * 4, " world"]
