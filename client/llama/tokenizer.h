/*
 * tokenizer.h - the llama2.c BPE tokenizer (tokenizer.bin format): encode
 * text into token ids with a leading dummy space and byte fallback, and
 * decode ids back into text pieces.
 *
 * File format: int32 max_token_length, then per piece: float score, int32
 * length, the piece's bytes. Ids 0, 1, 2 are <unk>, BOS and EOS; pieces 3..258
 * are the byte tokens "<0x00>".."<0xFF>" (ops/fetch-models.sh rewrites the
 * older export of stories15M's tokenizer into that form).
 */
#ifndef KVSTASH_LLAMA_TOKENIZER_H
#define KVSTASH_LLAMA_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#define TOK_BOS 1u
#define TOK_EOS 2u

typedef struct tokenizer tokenizer;

/* Load `vocab` pieces from `path`. Returns NULL with a message in err. */
tokenizer *tok_load(const char *path, uint32_t vocab, char *err, size_t errlen);
void tok_free(tokenizer *t);

/*
 * Encode `text` as llama2.c does: BOS when bos is set, the dummy prefix " "
 * when text is not empty, every UTF-8 code point as its piece (or its bytes
 * as byte tokens), then repeated merges of the best-scoring adjacent pair.
 * Writes at most strlen(text) + 2 ids into ids (caller-sized) and returns
 * how many, or -1 when out of memory.
 */
long tok_encode(const tokenizer *t, const char *text, int bos, uint32_t *ids);

/* The text of `id` after `prev`: byte tokens become their byte, and a piece
 * after BOS loses its leading space. Returns a pointer into the tokenizer or
 * into a per-tokenizer byte buffer (valid until the next call). */
const char *tok_decode(tokenizer *t, uint32_t prev, uint32_t id);

uint32_t tok_vocab(const tokenizer *t);

#endif
