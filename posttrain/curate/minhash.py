"""Vectorised MinHash signatures and LSH banding, in numpy, for near-duplicate detection.

The work is split so that the expensive, embarrassingly parallel half (shingling and signatures)
runs per shard in worker processes, and the cheap global half (banding, candidate verification,
clustering) runs once in the parent on compact ``uint32`` arrays:

1. ``word_hashes``: every text is lower-cased and cut into words at ASCII whitespace and
   punctuation; each word gets a polynomial hash, computed for all the bytes of a batch of texts
   at once from one prefix sum (no Python loop over words).
2. ``shingle_hashes``: overlapping ``k``-word shingles (``shingle="words"``) are combined from word
   hashes; texts shorter than ``k`` words get one shingle of all their words. With
   ``shingle="chars"`` the shingles are ``k``-byte windows of the words joined by single spaces
   (``char_shingle_hashes``), which see a two-word edit of a short text that 5-word shingles cannot.
   ``sign_by_length`` does both in one pass, by length: characters for short texts, words for long
   ones (curate's default; the lanes are explained in ``posttrain.curate.dedup.NearDedupStage``).
3. ``signatures_from_shingles``: one-permutation MinHash (Li, Owen & Zhang, "One permutation
   hashing", NIPS 2012) with optimal densification (Shrivastava, "Optimal densification for fast
   and accurate minwise hashing", ICML 2017). Each shingle is hashed once: the hash's high bits pick
   one of ``num_perm`` bins, its low 32 bits are the value, and a bin keeps its minimum
   (``np.minimum.at`` over the whole batch). An empty bin takes the value of the first non-empty bin
   in a fixed, seeded order of the other bins. For two sets the bin agrees with probability
   ``|A ∩ B| / |A ∪ B|`` (Jaccard): the first bin of the order that is non-empty in ``A ∪ B`` holds
   the union's minimum of that bin, shared by both exactly when it lies in ``A ∩ B`` (Broder, "On the
   resemblance and containment of documents", 1997). The cost is one hash per shingle instead of
   ``num_perm``, so signing no longer dominates. With sets much larger than ``num_perm`` the
   estimate's variance is below that of ``num_perm`` permutations (sampling without replacement, Li
   et al. 2012); densification keeps it close to it for small sets.
4. ``lsh_candidate_pairs``: the signature is cut into ``bands × rows``; two texts are candidates
   when all rows of any band agree, which happens with probability ``1 - (1 - s^r)^b`` at Jaccard
   ``s`` (Leskovec, Rajaraman & Ullman, *Mining of Massive Datasets*, ch. 3.4). Curate's 22 × 5
   finds a pair at Jaccard 0.7 with probability 0.98; 14 × 8 finds one at 0.8 with ≥ 0.92.
5. Verification keeps candidates whose Jaccard similarity reaches the threshold, removing the
   chance collisions banding lets through: exactly, from each text's set of shingle hashes
   (``exact_jaccard``; the default), or from the signature agreement (``signature_agreement``, a
   MinHash estimate with standard deviation about ``sqrt(J(1-J)/num_perm)``, 0.04 at 112 bins).
   Only the texts in candidate pairs have their sets read back. ``connected_components`` groups the
   verified pairs into duplicate clusters.

Hashes. Words and character windows get a polynomial hash mod 2^64 from one prefix sum per batch,
mixed by the splitmix64 finaliser and cut to 32 bits (the set values); the bin hash is splitmix64 of
that value xor a seeded key. Everything is seeded, so hashers with the same
``(num_perm, shingle_size, seed)`` agree on every machine and shards signed apart can be compared.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)
_EMPTY = np.uint32(0xFFFFFFFF)  # signature of a text without words: never shared by real shingles

# ASCII whitespace and punctuation separate words; every other byte (letters, digits, UTF-8
# continuation bytes of non-ASCII letters) belongs to a word.
_IS_WORD_BYTE = np.ones(256, dtype=bool)
for _c in b" \t\n\r\x0b\x0c!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~":
    _IS_WORD_BYTE[_c] = False
for _c in range(32):
    _IS_WORD_BYTE[_c] = False
# A byte's term in a word's polynomial hash: its value + 1 (so a zero byte still counts); 0 between words. As
# ``bytes.translate`` tables (one C pass over a batch; the numpy gathers ``table[data]`` they replace took a
# third of ``word_hashes``): the terms, and 1 for a word byte. 0xFF never occurs in UTF-8 (nor in the
# encoder's output with surrogatepass), so the one term that does not fit in a byte, 256, is never needed.
_WORD_TERMS = bytes(b + 1 if _IS_WORD_BYTE[b] and b < 0xFF else 0 for b in range(256))
_WORD_FLAGS = bytes(int(_IS_WORD_BYTE[b]) for b in range(256))


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of a 1-D array by one sort: numpy 2's ``np.unique`` hashes first (slower on these
    integer arrays) and imports ``numpy.ma`` on its first call (12 ms of a 2-second process)."""
    ordered = np.sort(values, axis=None)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered


def unique_pairs(pairs: np.ndarray, n: int) -> np.ndarray:
    """``np.unique(pairs, axis=0)`` for ``[m, 2]`` pairs of indices below ``n`` with ``i < j``, through one int64
    key per pair (``i·n + j``): ``np.unique(axis=0)`` is several times slower."""
    keys = sorted_unique(pairs[:, 0].astype(np.int64) * np.int64(n) + pairs[:, 1])
    return np.stack((keys // n, keys % n), axis=1)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijective mixer that spreads every input bit over all output bits (a new array;
    ``_splitmix64_inplace`` holds the arithmetic)."""
    mixed = np.array(values, dtype=np.uint64)
    _splitmix64_inplace(mixed, np.empty_like(mixed))
    return mixed


def _per_text(starts: np.ndarray, encoded: list[bytes]) -> np.ndarray:
    """How many of ``starts`` (sorted byte offsets into the texts joined by one separator byte) fall in each text."""
    ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) + 1)
    return np.diff(np.searchsorted(starts, ends), prepend=0).astype(np.int64)


def _random_uint64(rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, np.iinfo(np.uint64).max, size=shape, dtype=np.uint64, endpoint=True)


class MinHasher:
    """Signatures of ``num_perm`` one-permutation MinHash bins over ``shingle_size``-word (or -character) shingles; seeded, picklable.

    Two hashers with the same ``(num_perm, shingle_size, seed)`` give identical signatures on every
    machine, so shards signed by different processes can be compared. Texts are processed in
    batches of about ``batch_bytes`` so every temporary array stays small and cache-resident (large
    fresh allocations cost page faults that dominate the arithmetic).
    """

    def __init__(
        self,
        num_perm: int = 112,
        shingle_size: int = 5,
        seed: int = 0,
        batch_bytes: int = 1 << 17,
        shingle: str = "words",
    ):
        if num_perm < 1 or shingle_size < 1:
            raise ValueError("num_perm and shingle_size must be ≥ 1")
        if shingle not in ("words", "chars"):
            raise ValueError(f"shingle must be 'words' or 'chars' (got {shingle!r})")
        self.num_perm, self.shingle_size, self.seed, self.shingle = num_perm, shingle_size, seed, shingle
        self.batch_bytes = batch_bytes
        rng = np.random.default_rng(seed)
        self._base = _random_uint64(rng, (1,))[0] | np.uint64(1)  # odd, so invertible mod 2^64
        self._base_inverse = np.uint64(pow(int(self._base), -1, 1 << 64))
        self._shingle_mult = _random_uint64(rng, (shingle_size,)) | np.uint64(1)
        self._bin_key = _random_uint64(rng, (1,))[0]  # seeds the one hash that bins and ranks shingles
        # Densification: an empty bin j takes the value of the first non-empty bin in borrow[j]
        # (j itself, then the other bins in a seeded random order; the same order for every text).
        others = np.arange(num_perm, dtype=np.int64)
        self._borrow = np.stack([np.concatenate(([j], rng.permutation(np.delete(others, j)))) for j in range(num_perm)])
        self._powers = np.ones(1, np.uint64)
        self._inverse_powers = np.ones(1, np.uint64)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_powers"] = state["_inverse_powers"] = np.ones(1, np.uint64)  # rebuilt on demand
        return state

    def _ensure_powers(self, length: int) -> None:
        if self._powers.size > length:
            return
        size = max(length + 1, 2 * self._powers.size)
        self._powers = np.full(size, self._base, dtype=np.uint64)
        self._powers[0] = 1
        np.multiply.accumulate(self._powers, out=self._powers)
        self._inverse_powers = np.full(size, self._base_inverse, dtype=np.uint64)
        self._inverse_powers[0] = 1
        np.multiply.accumulate(self._inverse_powers, out=self._inverse_powers)

    # -- words and shingles -------------------------------------------------------------------
    def word_hashes(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Hash every word of every text: returns ``(hashes [W] uint64, words_per_text [n] int64)``.

        A word ``w`` hashes to ``splitmix64(Σ_i (w_i + 1) · B^i mod 2^64)``, a polynomial hash
        computed for all words at once from one prefix sum: with ``P[t] = Σ_{k<t} c_k B^k`` over the
        batch's bytes, the word at ``[s, e)`` is ``(P[e] - P[s]) · B^{-s}`` (``B`` odd, so ``B^{-1}``
        exists mod 2^64). Polynomial hashes mod 2^64 can be made to collide by an adversary
        (Thue-Morse strings); deduplication does not face one.
        """
        encoded = [text.lower().encode("utf-8", "surrogatepass") for text in texts]
        joined = b" ".join(encoded)
        if not joined:
            return np.zeros(0, np.uint64), np.zeros(len(texts), np.int64)
        terms = np.frombuffer(joined.translate(_WORD_TERMS), dtype=np.uint8)
        edges = np.diff((terms != 0).view(np.int8), prepend=np.int8(0), append=np.int8(0))
        # Word starts (+1) and ends (-1, after a word's last byte) alternate; nonzero of a bool array is the fast one.
        bounds = np.flatnonzero(edges != 0)
        starts, ends = bounds[0::2], bounds[1::2]
        self._ensure_powers(terms.size)
        prefix = np.empty(terms.size + 1, dtype=np.uint64)
        prefix[0] = 0
        np.multiply(terms.astype(np.uint64), self._powers[: terms.size], out=prefix[1:])  # faster than mixed types
        np.add.accumulate(prefix, out=prefix)
        hashes = _splitmix64((prefix[ends] - prefix[starts]) * self._inverse_powers[starts])
        return hashes, _per_text(starts, encoded)

    def char_shingle_hashes(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Hashes of ``k``-byte shingles of each text's words joined by single spaces (UTF-8 bytes:
        ``k`` characters of ASCII text, fewer of accented or non-Latin text).

        The text is lower-cased and cut into words by the same byte rule as ``word_hashes``; every
        run of whitespace and punctuation between two words becomes one space, so formatting and
        punctuation do not count, and a shingle may span a word boundary. Each ``k``-gram of that
        stream gets the polynomial hash ``Σ_i (c_i + 1) · B^i`` from one prefix sum, as words do;
        a text of fewer than ``k`` characters is one shingle. Returns ``(hashes [S] uint64 (not yet
        mixed), shingles_per_text [n])`` in text order.
        """
        encoded = [text.lower().encode("utf-8", "surrogatepass") for text in texts]
        joined = b" ".join(encoded)
        data = np.frombuffer(joined, dtype=np.uint8)
        if data.size == 0:
            return np.zeros(0, np.uint64), np.zeros(len(texts), np.int64)
        is_word = np.frombuffer(joined.translate(_WORD_FLAGS), dtype=bool)
        owner = np.searchsorted(np.cumsum([len(e) + 1 for e in encoded]), np.arange(data.size), side="right")
        # A separator byte stays where a word byte follows in the same text and an earlier byte of
        # that text was a word byte: one space between words, none at either end.
        next_is_word = np.append(is_word[1:], False)
        same_text_next = np.append(owner[1:] == owner[:-1], False)
        seen_word = np.maximum.accumulate(np.where(is_word, np.arange(data.size), -1))
        after_word = np.append(-1, seen_word[:-1]) >= np.searchsorted(owner, owner, side="left")
        keep = is_word | (next_is_word & same_text_next & after_word)
        stream = np.where(is_word[keep], data[keep], np.uint8(32)).astype(np.uint64)
        stream_owner = owner[keep]
        per_text = np.bincount(stream_owner, minlength=len(texts)).astype(np.int64)
        k = self.shingle_size
        self._ensure_powers(stream.size)
        prefix = np.zeros(stream.size + 1, dtype=np.uint64)
        prefix[1:] = (stream + np.uint64(1)) * self._powers[: stream.size]
        np.add.accumulate(prefix, out=prefix)
        text_start = np.concatenate(([0], np.cumsum(per_text)[:-1])).astype(np.int64)
        text_end = text_start + per_text
        counts = np.where(per_text >= k, per_text - k + 1, np.minimum(per_text, 1))
        # Start and end of every shingle: k-grams of long texts, the whole of short ones.
        starts = np.repeat(text_start, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
        ends = np.minimum(starts + k, np.repeat(text_end, counts))
        hashes = (prefix[ends] - prefix[starts]) * self._inverse_powers[starts]
        return hashes, counts.astype(np.int64)

    def shingle_hashes(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """32-bit hashes of ``k``-word (or ``k``-character) shingles: ``(hashes [S] uint64 < 2^32, shingles_per_text [n])``."""
        if self.shingle == "chars":
            hashes, counts = self.char_shingle_hashes(texts)
            return _splitmix64(hashes) & _MASK32, counts
        return self._word_shingles(*self.word_hashes(texts))

    def _word_shingles(self, words: np.ndarray, per_text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``k``-word shingles from ``word_hashes``'s output, as ``shingle_hashes`` returns them."""
        k = self.shingle_size
        n_words = words.size
        text_start = np.concatenate(([0], np.cumsum(per_text)[:-1])).astype(np.int64)
        # partial[m][i] = Σ_{j<m} words[i+j] · mult_j, built up one word of context at a time; the partial sums
        # are kept only when a text has 1..k-1 words (they are its one shingle).
        short = np.flatnonzero((per_text > 0) & (per_text < k))
        combined = words * self._shingle_mult[0]
        partial_by_len = [combined.copy()] if k > 1 and short.size else []
        for j in range(1, k):
            if j < n_words:
                combined[: n_words - j] += words[j:] * self._shingle_mult[j]
            if j < k - 1 and short.size:
                partial_by_len.append(combined.copy())
        # A full shingle starts at i when its k-th word belongs to the same text.
        full_count = np.maximum(per_text - k + 1, 0)
        valid = np.zeros(n_words + 1, dtype=np.int8)
        np.add.at(valid, text_start[full_count > 0], 1)
        np.add.at(valid, (text_start + full_count)[full_count > 0], -1)
        full_index = np.flatnonzero(np.cumsum(valid[:-1]) > 0)
        hashes = combined[full_index]
        counts = full_count.copy()
        # Texts with 1..k-1 words: one shingle made of all their words, placed in text order.
        if short.size:
            short_hash = np.empty(short.size, dtype=np.uint64)
            for length in sorted_unique(per_text[short]):
                chosen = per_text[short] == length
                short_hash[chosen] = partial_by_len[length - 1][text_start[short[chosen]]]
            counts[short] = 1
            position = np.concatenate((full_index, text_start[short]))
            hashes = np.concatenate((hashes, short_hash))[np.argsort(position, kind="stable")]
        return _splitmix64(hashes) & _MASK32, counts

    # -- signatures ---------------------------------------------------------------------------
    def signatures(self, texts: Sequence[str]) -> np.ndarray:
        """MinHash signatures ``[n, num_perm]`` uint32; a text without words gets all ``0xFFFFFFFF``."""
        return self.sign(texts, with_sets=False)[0]

    def _batches(self, texts: Sequence[str], size: int | None = None):
        """``(first, last)`` ranges of whole texts of about ``size`` (default ``batch_bytes``) characters (at least
        one text)."""
        size = size or self.batch_bytes
        ends = np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)))
        first = 0
        while first < len(texts):
            base = ends[first - 1] if first else 0
            last = max(int(np.searchsorted(ends, base + size, side="right")), first + 1)
            yield first, last
            first = last

    def sign(self, texts: Sequence[str], with_sets: bool = True, signatures: bool = True
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(signatures [n, num_perm], shingle_values, shingle_offsets)``: also each text's shingle
        hashes, ``shingle_values[shingle_offsets[i]:shingle_offsets[i+1]]`` (32-bit, unsorted, with
        repeats; empty arrays when ``with_sets`` is false), for exact Jaccard verification of
        candidate pairs. Only candidates need their sets, so deduplication waits until then.
        ``signatures=False`` skips the MinHash (an empty ``[0, num_perm]`` array) for callers that need the sets only."""
        out = np.empty((len(texts) if signatures else 0, self.num_perm), dtype=np.uint32)
        set_parts: list[np.ndarray] = []
        set_sizes = np.zeros(len(texts), dtype=np.int64)
        for first, last in self._batches(texts):
            shingles, counts = self.shingle_hashes(texts[first:last])
            if signatures:
                out[first:last] = self.signatures_from_shingles(shingles, counts)
            if with_sets:
                set_parts.append(shingles.astype(np.uint32))
                set_sizes[first:last] = counts
        values = np.concatenate(set_parts) if set_parts else np.zeros(0, np.uint32)
        offsets = np.concatenate(([0], np.cumsum(set_sizes))).astype(np.int64)
        return out, values, offsets

    def sign_by_length(self, texts: Sequence[str], long_words: int, overlap_from: int, with_sets: bool = True
                       ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Length-aware shingles in two lanes: ``{"chars": ..., "words": ...}``, each ``(members,
        signatures, shingle_values, shingle_offsets)`` as ``sign`` returns them for the texts
        ``members`` (indices into ``texts``). Texts of fewer than ``long_words`` words get character
        shingles (lane ``chars``), texts of at least ``overlap_from`` words word shingles (lane
        ``words``); the words are cut and hashed once per batch for both the count and the shingles."""
        parts: dict[str, list] = {"chars": [], "words": []}
        # Words in batches of twice batch_bytes (measured: 10% faster on long texts, fewer numpy calls a text); the
        # short texts' characters in batch_bytes, where the per-byte temporaries of char_shingle_hashes stay cached.
        for first, last in self._batches(texts, 2 * self.batch_bytes):
            words, per_text = self.word_hashes(texts[first:last])
            wide = per_text >= overlap_from
            if wide.any():
                shingles, counts = self._word_shingles(words, per_text)
                if not wide.all():
                    shingles, counts = shingles[np.repeat(wide, counts)], counts[wide]
                parts["words"].append((first + np.flatnonzero(wide), shingles, counts))
            narrow = first + np.flatnonzero(per_text < long_words)
            short_texts = [texts[i] for i in narrow]
            for start, end in self._batches(short_texts):
                hashes, counts = self.char_shingle_hashes(short_texts[start:end])
                parts["chars"].append((narrow[start:end], _splitmix64(hashes) & _MASK32, counts))
        out = {}
        for lane, pieces in parts.items():
            members = np.concatenate([m for m, _, _ in pieces]) if pieces else np.zeros(0, np.int64)
            signatures = (np.concatenate([self.signatures_from_shingles(h, c) for _, h, c in pieces]) if pieces
                          else np.zeros((0, self.num_perm), np.uint32))  # fmt: skip
            sizes = np.concatenate([c for _, _, c in pieces]) if pieces and with_sets else np.zeros(0, np.int64)
            values = (np.concatenate([h.astype(np.uint32) for _, h, _ in pieces]) if pieces and with_sets
                      else np.zeros(0, np.uint32))  # fmt: skip
            out[lane] = members, signatures, values, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        return out

    def shingle_sets(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(shingle_values, shingle_offsets)`` as ``sign`` returns them, without the signatures."""
        _, values, offsets = self.sign(texts, signatures=False)
        return values, offsets

    def signatures_from_shingles(self, shingles: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """One-permutation MinHash with optimal densification: ``[n, num_perm]`` uint32.

        One seeded 64-bit hash per shingle (not one per shingle and permutation): its high 32 bits pick
        one of ``num_perm`` bins, its low 32 bits are the value, and each bin keeps the minimum value
        of the text's shingles that fall in it (one ``np.minimum.at`` over the batch). An empty bin
        copies the first non-empty bin of its fixed borrowing order (``_borrow``), so every entry of
        two texts' signatures agrees with probability equal to their Jaccard similarity.
        """
        n, bins = counts.size, self.num_perm
        out = np.full(n * bins, _EMPTY, dtype=np.uint32)
        if shingles.size == 0:
            return out.reshape(n, bins)
        mixed = _splitmix64(shingles.astype(np.uint64) ^ self._bin_key)
        owner = np.repeat(np.arange(n, dtype=np.int64) * bins, counts)
        owner += (((mixed >> np.uint64(32)) * np.uint64(bins)) >> np.uint64(32)).astype(np.int64)
        np.minimum.at(out, owner, (mixed & _MASK32).astype(np.uint32))
        filled = np.zeros(n * bins, dtype=bool)
        filled[owner] = True
        # Empty bins of texts with at least one shingle, as (text·bins, bin); borrowed from `out`'s
        # filled entries only, which no round changes.
        empty = np.flatnonzero(~filled.reshape(n, bins) & (counts > 0)[:, None])
        row, column = empty - empty % bins, empty % bins
        for step in range(1, bins):
            if empty.size == 0:
                break
            source = row + self._borrow[column, step]
            hit = filled[source]
            out[empty[hit]] = out[source[hit]]
            empty, row, column = empty[~hit], row[~hit], column[~hit]
        return out.reshape(n, bins)


def exact_jaccard(pairs: np.ndarray, shingle_set_of, chunk_values: int = 1 << 21) -> np.ndarray:
    """Exact Jaccard of each pair from the texts' 32-bit shingle hashes (``shingle_set_of(i)``, repeats allowed).

    ``shingle_set_of`` may also have ``many(rows) -> (values, sizes)``: the sets of the sorted ``rows`` concatenated.
    Vectorised over pairs: each text's set is deduplicated once; then, chunk by chunk, the two sets
    of every pair are laid side by side under a ``pair << 32 | value`` key, sorted, and equal
    neighbours counted, which is ``|A ∩ B|`` (each set has no repeats).
    """
    out = np.empty(pairs.shape[0], dtype=np.float64)
    if pairs.shape[0] == 0:
        return out
    rows, local = np.unique(pairs, return_inverse=True)
    local = local.reshape(pairs.shape)
    # Every row's set, deduplicated in one sort under a ``row << 32 | value`` key (values are 32-bit). A source
    # with ``many(rows)`` (``dedup.ShingleSets``) gives them all at once, without a Python call per row.
    many = getattr(shingle_set_of, "many", None)
    if many is not None:
        concatenated, raw_sizes = many(rows)
    else:
        raw = [np.asarray(shingle_set_of(int(row)), dtype=np.uint32) for row in rows]
        raw_sizes = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
        concatenated = np.concatenate(raw)
    keys = np.repeat(np.arange(len(rows), dtype=np.uint64) << np.uint64(32), raw_sizes)
    keys |= concatenated.astype(np.uint64)
    keys.sort()  # a plain sort: np.unique hashes first, several times slower here
    keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
    sizes = np.bincount((keys >> np.uint64(32)).astype(np.int64), minlength=len(rows))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    values = keys & _MASK32
    per_pair = sizes[local[:, 0]] + sizes[local[:, 1]]
    first = 0
    while first < pairs.shape[0]:
        last = int(np.searchsorted(np.cumsum(per_pair[first:]), chunk_values, side="right")) + first
        last = max(last, first + 1)
        chunk = local[first:last]
        sides = np.concatenate((chunk[:, 0], chunk[:, 1]))
        owner = np.concatenate((np.arange(last - first), np.arange(last - first)))
        lengths = sizes[sides]
        offsets = np.repeat(starts[sides] - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        gathered = values[np.arange(lengths.sum()) + offsets]
        keys = (np.repeat(owner, lengths).astype(np.uint64) << np.uint64(32)) | gathered
        keys.sort(kind="stable")  # two sorted runs (every pair's first sets, then its second): a merge, 3x faster
        equal = keys[1:] == keys[:-1]
        shared = np.bincount((keys[1:][equal] >> np.uint64(32)).astype(np.int64), minlength=last - first)
        union = per_pair[first:last] - shared
        out[first:last] = np.where(union > 0, shared / np.maximum(union, 1), 0.0)
        first = last
    return out


# -- LSH banding, verification and clustering (the global half, run in the parent) -------------
def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit key per (text, band): ``[n, bands]``; equal keys mean the band's rows all agree."""
    if signatures.shape[1] < bands * rows:
        raise ValueError(f"signatures have {signatures.shape[1]} values; bands × rows needs {bands * rows}")
    cut = signatures[:, : bands * rows].reshape(signatures.shape[0], bands, rows)
    mult = _splitmix64(np.arange(1, rows + 1, dtype=np.uint64)) | np.uint64(1)
    keys = np.zeros(cut.shape[:2], dtype=np.uint64)
    term = np.empty_like(keys)
    for r in range(rows):  # keys = splitmix64(keys ^ row · mult), in place: a third faster than fresh arrays
        np.multiply(cut[:, :, r], mult[r], out=term, casting="unsafe")  # uint32 → uint64, then the product
        keys ^= term
        _splitmix64_inplace(keys, term)
    return keys


def _splitmix64_inplace(values: np.ndarray, scratch: np.ndarray) -> None:
    """``values[:] = _splitmix64(values)`` without a temporary array per step (``scratch``: same shape, overwritten)."""
    values += np.uint64(0x9E3779B97F4A7C15)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        np.right_shift(values, np.uint64(shift), out=scratch)
        values ^= scratch
        values *= np.uint64(mult)
    np.right_shift(values, np.uint64(31), out=scratch)
    values ^= scratch


def _shared_keys(keys: np.ndarray) -> np.ndarray:
    """Positions of the keys that occur more than once, grouped by key, ascending within a group: what a stable
    argsort of all the keys gives for them. Most keys of a band are unique: an unstable argsort of all of them
    and a stable order of the shared ones only take 60 % of the time of a stable argsort of all."""
    order = np.argsort(keys)
    ordered = keys[order]
    same = ordered[1:] == ordered[:-1]
    shared = np.zeros(keys.size, dtype=bool)
    shared[1:] |= same
    shared[:-1] |= same
    positions = order[shared]
    return positions[np.lexsort((positions, keys[positions]))]  # by key, then by position


def lsh_candidate_pairs(
    signatures: np.ndarray, bands: int, rows: int, max_bucket: int = 64, valid: np.ndarray | None = None
) -> np.ndarray:
    """Unique candidate pairs ``[m, 2]`` (``i < j``) that agree on all rows of at least one band.

    A bucket larger than ``max_bucket`` (boilerplate shared by many texts) contributes a star of
    pairs to its first member instead of all ``g²/2`` pairs, bounding the work; clustering still
    joins the whole bucket. ``valid`` (bool ``[n]``) excludes texts from banding (e.g. empty ones).
    """
    n = signatures.shape[0]
    index = np.arange(n) if valid is None else np.flatnonzero(valid)
    if index.size < 2:
        return np.zeros((0, 2), dtype=np.int64)
    keys = np.ascontiguousarray(band_keys(signatures[index], bands, rows).T)  # a band's keys side by side
    pieces = []
    for band in range(bands):
        order = _shared_keys(keys[band])
        sorted_keys = keys[band, order]
        boundary = np.flatnonzero(np.diff(sorted_keys)) + 1
        starts = np.concatenate(([0], boundary))
        sizes = np.diff(np.concatenate((starts, [order.size])))
        for size in sorted_unique(sizes[sizes > 1]):
            group_starts = starts[sizes == size]
            members = order[group_starts[:, None] + np.arange(size)[None, :]]  # [groups, size]
            if size <= max_bucket:
                left, right = np.triu_indices(size, k=1)
            else:
                left, right = np.zeros(size - 1, dtype=np.int64), np.arange(1, size)
            pieces.append(np.stack((members[:, left].ravel(), members[:, right].ravel()), axis=1))
    if not pieces:
        return np.zeros((0, 2), dtype=np.int64)
    pairs = index[np.concatenate(pieces)]
    pairs.sort(axis=1)
    return unique_pairs(pairs, n)


def signature_agreement(signatures: np.ndarray, pairs: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Fraction of equal signature entries per pair: the MinHash estimate of Jaccard similarity."""
    out = np.empty(pairs.shape[0], dtype=np.float64)
    for lo in range(0, pairs.shape[0], chunk):
        part = pairs[lo : lo + chunk]
        out[lo : lo + chunk] = (signatures[part[:, 0]] == signatures[part[:, 1]]).mean(axis=1)
    return out


def connected_components(n: int, pairs: np.ndarray) -> np.ndarray:
    """Label of each node = the smallest node index in its component (min-label propagation).

    Each round pushes the smaller label across every edge, then jumps pointers (``label[label]``),
    so the number of rounds grows with the logarithm of the component diameter.
    """
    labels = np.arange(n, dtype=np.int64)
    if pairs.size == 0:
        return labels
    left, right = pairs[:, 0], pairs[:, 1]
    while True:
        smaller = np.minimum(labels[left], labels[right])
        updated = labels.copy()
        np.minimum.at(updated, left, smaller)
        np.minimum.at(updated, right, smaller)
        while True:
            jumped = updated[updated]
            if np.array_equal(jumped, updated):
                break
            updated = jumped
        if np.array_equal(updated, labels):
            return labels
        labels = updated


def near_duplicate_clusters(
    signatures: np.ndarray,
    bands: int,
    rows: int,
    threshold: float,
    verify: str = "estimate",
    shingle_set_of=None,
    valid: np.ndarray | None = None,
    max_bucket: int = 64,
    keep_pair=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster texts into near-duplicate groups. Returns ``(labels [n], verified_pairs [m, 2])``.

    ``labels[i]`` is the smallest index in ``i``'s cluster (so ``labels[i] == i`` marks the
    representative, the first occurrence). Candidate pairs are kept when their Jaccard similarity
    reaches ``threshold``: ``verify="exact"`` computes it from the shingle sets (``shingle_set_of``),
    ``"estimate"`` uses the signature agreement, ``"none"`` keeps every LSH candidate.
    ``keep_pair(pairs) -> bool mask``, when given, is a further check every pair must pass (run first).
    """
    pairs = lsh_candidate_pairs(signatures, bands, rows, max_bucket=max_bucket, valid=valid)
    if keep_pair is not None and pairs.size:  # first: a cheap check on small sets thins the candidates
        pairs = pairs[keep_pair(pairs)]
    if pairs.size and verify == "exact":
        if shingle_set_of is None:
            raise ValueError("verify='exact' needs shingle_set_of")
        pairs = pairs[exact_jaccard(pairs, shingle_set_of) >= threshold]
    elif pairs.size and verify == "estimate":
        pairs = pairs[signature_agreement(signatures, pairs) >= threshold]
    elif verify not in ("exact", "estimate", "none"):
        raise ValueError(f"verify must be exact, estimate or none (got {verify!r})")
    return connected_components(signatures.shape[0], pairs), pairs
