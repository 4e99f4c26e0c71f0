"""tokenizer.py - the llama2.c BPE tokenizer (tokenizer.bin), byte for byte
what client/llama/tokenizer.c does, so that both workers score the same ids.

File format: int32 max_token_length, then per piece: float32 score, int32
length, the piece's bytes. Ids 0, 1, 2 are <unk>, BOS and EOS; pieces 3..258
are the byte tokens "<0x00>".."<0xFF>" (ops/fetch-models.sh rewrites the older
export of stories15M's tokenizer into that form).

Text is handled as bytes throughout, as the C code handles char strings: a
story is never decoded to str, so invalid UTF-8 takes the same byte-fallback
path in both implementations.
"""
import re
import struct
from typing import Dict, List

TOK_BOS = 1
TOK_EOS = 2
_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class TokenizerError(ValueError):
    """The tokenizer file is missing or malformed."""


class Tokenizer:
    """`vocab` pieces of a tokenizer.bin; encode() and decode() as tokenizer.h."""

    def __init__(self, path: str, vocab: int):
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            raise TokenizerError(f"cannot open {path}") from None
        if len(raw) < 4:
            raise TokenizerError(f"{path}: bad header (max_token_length)")
        (self.max_len,) = struct.unpack_from("<i", raw, 0)
        if not 0 < self.max_len <= 4096:
            raise TokenizerError(f"{path}: bad header (max_token_length)")
        self.vocab = vocab
        self.pieces: List[bytes] = []
        self.scores: List[float] = []
        off = 4
        for i in range(vocab):
            if off + 8 > len(raw):
                raise TokenizerError(f"{path}: piece {i}: truncated or bad length "
                                     f"(model vocab {vocab})")
            score, length = struct.unpack_from("<fi", raw, off)
            if not 0 <= length <= 4096 or off + 8 + length > len(raw):
                raise TokenizerError(f"{path}: piece {i}: truncated or bad length "
                                     f"(model vocab {vocab})")
            # The C side keeps pieces as NUL-terminated strings: a piece with
            # an embedded NUL reads as its prefix there, so here too.
            piece = raw[off + 8:off + 8 + length].split(b"\0", 1)[0]
            self.pieces.append(piece)
            self.scores.append(score)
            off += 8 + length
        # bsearch over unique pieces in C; on a duplicate piece the lowest id
        # wins here (the shipped tokenizers have none).
        self.ids: Dict[bytes, int] = {}
        for i, p in enumerate(self.pieces):
            self.ids.setdefault(p, i)

    def _chars(self, text: bytes) -> List[int]:
        """Code points as pieces, else their bytes as byte tokens (id = byte + 3),
        walking UTF-8 as tokenizer.c's encode_chars does (at most 4 bytes a
        code point, continuation bytes 10xxxxxx)."""
        out: List[int] = []
        buf = bytearray()
        n = len(text)
        for i in range(n):
            c = text[i]
            if c & 0xC0 != 0x80:
                buf.clear()
            buf.append(c)
            nxt = text[i + 1] if i + 1 < n else 0
            if nxt & 0xC0 == 0x80 and len(buf) < 4:
                continue
            piece_id = self.ids.get(bytes(buf))
            if piece_id is not None:
                out.append(piece_id)
            else:
                out.extend(b + 3 for b in buf)
            buf.clear()
        return out

    def encode(self, text: bytes, bos: bool = True) -> List[int]:
        """BOS when asked, the dummy prefix " " when text is not empty, every
        code point, then repeated merges of the best-scoring adjacent pair
        (the first on ties) until no pair is in the vocabulary."""
        text = text.split(b"\0", 1)[0]
        ids: List[int] = [TOK_BOS] if bos else []
        first = len(ids)
        if text:
            ids.append(self.ids.get(b" ", ord(" ") + 3))
        ids.extend(self._chars(text))
        cap = self.max_len * 2 + 2  # snprintf's room in tokenizer.c, less the NUL

        def pair_id(a: int, b: int) -> int:
            return self.ids.get((self.pieces[a] + self.pieces[b])[:cap], -1)

        pair = [pair_id(ids[i], ids[i + 1]) if i >= first else -1 for i in range(len(ids) - 1)]
        scores = self.scores
        while True:
            best, best_id, at = -1e10, -1, 0
            for i in range(first, len(ids) - 1):
                p = pair[i]
                if p >= 0 and scores[p] > best:
                    best, best_id, at = scores[p], p, i
            if best_id < 0:
                break
            ids[at] = best_id
            del ids[at + 1]
            del pair[at]  # pair[at] is recomputed below; the old pair[at + 1] shifts down
            if at > first:
                pair[at - 1] = pair_id(ids[at - 1], ids[at])
            if at + 1 < len(ids):
                pair[at] = pair_id(ids[at], ids[at + 1])
        return ids

    def decode(self, prev: int, token: int) -> bytes:
        """The bytes of `token` after `prev`: byte tokens become their byte, and
        a piece after BOS loses its leading space."""
        if not 0 <= token < self.vocab:
            return b""
        p = self.pieces[token]
        if prev == TOK_BOS and p.startswith(b" "):
            p = p[1:]
        m = _BYTE_PIECE.fullmatch(p)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return p
