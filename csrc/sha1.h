/* sha1.h: SHA1 for checkpoint names and one-pass prefix lookup.
 *
 * A checkpoint is named by the SHA1 of its prompt bytes, and a lookup needs
 * the digest of the prompt's first n bytes for every distinct stored length
 * n.  kvs_sha1_prefixes() gets all of them in one pass over the prompt by
 * finishing a copy of the running state at each length, so a lookup costs
 * one hash of the prompt plus one or two blocks per length, whatever the
 * number of stored checkpoints.  Those finishing blocks are independent of
 * one another and of the pass, which is one chain of dependent blocks: they
 * are compressed beside it, two messages at a time on SHA-NI, sixteen at a
 * time with AVX-512 where the lengths are dense, so that they add little
 * to the pass itself.
 *
 * The block function is chosen at run time (dispatch.h).  Nothing here
 * allocates; the caller owns every buffer.
 */
#ifndef KVS_SHA1_H
#define KVS_SHA1_H

#include <stddef.h>
#include <stdint.h>

#define KVS_SHA1_DIGEST 20
#define KVS_SHA1_BLOCK 64

typedef struct {
    uint32_t state[5];
    uint64_t total;             /* bytes hashed so far */
    uint8_t buf[KVS_SHA1_BLOCK];
    size_t buflen;
} kvs_sha1_ctx;

void kvs_sha1_begin(kvs_sha1_ctx *ctx);
void kvs_sha1_update(kvs_sha1_ctx *ctx, const uint8_t *data, size_t len);
/* Writes the digest of everything hashed so far; ctx is left unchanged, so
 * hashing can go on (this is what makes one-pass prefixes possible). */
void kvs_sha1_digest(const kvs_sha1_ctx *ctx, uint8_t out[KVS_SHA1_DIGEST]);

void kvs_sha1(const uint8_t *data, size_t len, uint8_t out[KVS_SHA1_DIGEST]);

/* Digest of data[:lengths[i]] into out + 20*i for every i < n, in one pass.
 * order is scratch space for n indices, and out doubles as scratch for
 * the sort and for each length's state until its digest lands there (the
 * caller's memory, so nothing here allocates).  Returns 0, or the index + 1
 * of the first length > len (out is then unspecified). */
size_t kvs_sha1_prefixes(const uint8_t *data, size_t len,
                         const uint64_t *lengths, size_t n,
                         size_t *order, uint8_t *out);

/* Digest matches over a forest of prefixes, in one pass over data.
 *
 * Node i stands for "data's first lengths[i] bytes hash to digests[20*i]".
 * A chain of checkpoint blocks is a path in the forest: a block's text
 * extends its parent's, so a node can match only where its parent did,
 * and is tried only then.  A lookup therefore hashes the prompt once, up
 * to the longest node tried, and finishes one digest per node tried: the
 * roots no longer than len plus the children of every match, however many
 * nodes hang below the roots that did not match.
 *
 * The forest is linked (so that the caller can add and remove nodes in
 * place): the roots are first_root, next_sibling[first_root], ...; node
 * i's children are first_child[i], next_sibling[first_child[i]], ...; -1
 * ends a list.  A child no longer than its parent, or longer than len, is
 * never tried; an index outside 0..n_nodes-1, or a list longer than
 * n_nodes (a cycle), ends its list.  heap is scratch for n_nodes indices;
 * matched receives the matching nodes (at most n_nodes), shortest first.
 * Returns the number of matches. */
size_t kvs_sha1_forest(const uint8_t *data, size_t len,
                       const uint64_t *lengths, const uint8_t *digests, size_t n_nodes,
                       int32_t first_root, const int32_t *first_child, const int32_t *next_sibling,
                       uint32_t *heap, uint32_t *matched);

/* HMAC-SHA1 (RFC 2104), for the keyed names of sealed checkpoints: a
 * sealed file is named by HMAC-SHA1(name key, text) instead of SHA1(text).
 * The HMAC's inner hash is SHA1(key ^ ipad || text), so the one pass over a
 * prompt that gives the SHA1 of every prefix gives the inner hash of every
 * prefix too when it starts from the state after the key's ipad block; each
 * keyed name then costs one more block (the outer hash of 20 bytes).  So
 * the keyed variants below cost what the plain ones do, plus one block per
 * digest. */
typedef struct {
    uint32_t inner[5];          /* the state after the block key ^ ipad */
    uint32_t outer[5];          /* the state after the block key ^ opad */
} kvs_hmac_key;

/* A key of at most 64 bytes is used as it is; a longer one is hashed first
 * (RFC 2104). */
void kvs_hmac_sha1_key(kvs_hmac_key *k, const uint8_t *key, size_t len);

void kvs_hmac_sha1(const kvs_hmac_key *k, const uint8_t *data, size_t len, uint8_t out[KVS_SHA1_DIGEST]);

/* kvs_sha1_prefixes with HMAC-SHA1 digests under key (NULL: plain SHA1). */
size_t kvs_sha1_prefixes_keyed(const uint8_t *data, size_t len,
                               const uint64_t *lengths, size_t n,
                               size_t *order, uint8_t *out, const kvs_hmac_key *key);

/* The same pass giving each prefix's inner hash, SHA1(key ^ ipad || prefix),
 * without the outer block: a lookup compares lookup tags (below) with it and
 * finishes the HMAC only where a tag matches. */
size_t kvs_hmac_sha1_inner_prefixes(const uint8_t *data, size_t len,
                                    const uint64_t *lengths, size_t n,
                                    size_t *order, uint8_t *out, const kvs_hmac_key *key);

/* HMAC-SHA1 from an inner hash (out may be inner). */
void kvs_hmac_sha1_outer(const kvs_hmac_key *k, const uint8_t inner[KVS_SHA1_DIGEST], uint8_t out[KVS_SHA1_DIGEST]);

/* A sealed file's lookup tag: the first KVS_LOOKUP_TAG bytes of the inner
 * hash of its text.  It rules out a prefix with the inner hash alone, so a
 * keyed lookup costs what a plain one does, plus one outer block per tag
 * that matches (the file itself, or one chance in 2^64).  Too short to let
 * anyone extend the inner hash, and keyed like the name. */
#define KVS_LOOKUP_TAG 8

/* kvs_sha1_forest with HMAC-SHA1 digests under key (NULL: plain SHA1).
 * tags (NULL: none) holds KVS_LOOKUP_TAG bytes per node: a node whose tag is
 * not all zero is confirmed (outer block, digest compare) only when its tag
 * matches the inner hash; a node without one always is.
 *
 * With outer 0 the nodes' digests are the inner hashes themselves,
 * SHA1(key ^ ipad || prefix): a SHA1 of the prefix in a namespace (a model's
 * plain files are named so, docs/semantics.md §17), which costs what a plain
 * lookup does; tags are then ignored. */
size_t kvs_sha1_forest_keyed(const uint8_t *data, size_t len,
                             const uint64_t *lengths, const uint8_t *digests, size_t n_nodes,
                             int32_t first_root, const int32_t *first_child, const int32_t *next_sibling,
                             uint32_t *heap, uint32_t *matched, const kvs_hmac_key *key, const uint8_t *tags,
                             int outer);

/* The block function in use, for tests of each path in isolation. */
void kvs_sha1_blocks(uint32_t state[5], const uint8_t *p, size_t nblocks);

#endif
