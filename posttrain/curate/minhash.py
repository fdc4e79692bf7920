"""Vectorised MinHash signatures and LSH banding, in numpy, for near-duplicate detection.

The work is split so that the expensive, embarrassingly parallel half (shingling and signatures)
runs per shard in worker processes, and the cheap global half (banding, candidate verification,
clustering) runs once in the parent on compact ``uint32`` arrays:

1. ``word_hashes``: every text is lower-cased and cut into words at ASCII whitespace and
   punctuation; each word gets a polynomial hash, computed for all the bytes of a batch of texts
   at once from one prefix sum (no Python loop over words).
2. ``shingle_hashes``: overlapping ``k``-word shingles (default 5) are combined from word hashes;
   texts shorter than ``k`` words get one shingle of all their words.
3. ``minhash_signatures``: for all shingles and all ``num_perm`` hash functions at once, as one
   broadcast matrix operation per chunk, then a segmented minimum per text (``np.minimum.reduceat``).
   Broder, "On the resemblance and containment of documents" (1997): for a random hash ``h``,
   ``P[min h(A) = min h(B)] = |A ∩ B| / |A ∪ B|`` (Jaccard), so the fraction of equal signature
   entries estimates Jaccard similarity.
4. ``lsh_candidate_pairs``: the signature is cut into ``bands × rows``; two texts are candidates
   when all rows of any band agree, which happens with probability ``1 - (1 - s^r)^b`` at Jaccard
   ``s`` (Leskovec, Rajaraman & Ullman, *Mining of Massive Datasets*, ch. 3.4). Default 14 × 8 puts
   the S-curve's steep part around 0.72, so pairs at Jaccard ≥ 0.8 are found with probability ≥ 0.92.
5. Verification keeps candidates whose Jaccard similarity reaches the threshold, removing the
   chance collisions banding lets through: exactly, from each text's set of shingle hashes
   (``exact_jaccard``; the default), or from the signature agreement (``signature_agreement``, a
   MinHash estimate with standard deviation ``sqrt(J(1-J)/num_perm)``, about 0.04 at 112
   permutations). ``connected_components`` groups the verified pairs into duplicate clusters.

Hash family. Instead of ``(a·x + b) mod p`` with the Mersenne prime ``p = 2^61 - 1`` (which needs a
128-bit product to be exact), we use Dietzfelbinger's multiply-add-shift scheme
``h_{a,b}(x) = ((a·x + b) mod 2^64) >> 32`` for 32-bit ``x`` and random 64-bit ``a`` (odd), ``b``:
a 2-independent family (Dietzfelbinger 1996, "Universal hashing and k-wise independent random
variables via integer arithmetic without primes") whose ``mod 2^64`` is free in ``uint64``
arithmetic. Because ``>> 32`` is monotone, the minimum is taken over the full 64-bit values and
shifted once per text, saving a pass over the ``[shingles, num_perm]`` matrix.
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


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijective mixer that spreads every input bit over all output bits."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _random_uint64(rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, np.iinfo(np.uint64).max, size=shape, dtype=np.uint64, endpoint=True)


class MinHasher:
    """Signatures of ``num_perm`` hash functions over ``shingle_size``-word shingles; seeded, picklable.

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
        chunk_shingles: int = 2048,
    ):
        if num_perm < 1 or shingle_size < 1:
            raise ValueError("num_perm and shingle_size must be ≥ 1")
        self.num_perm, self.shingle_size, self.seed = num_perm, shingle_size, seed
        self.batch_bytes, self.chunk_shingles = batch_bytes, chunk_shingles
        rng = np.random.default_rng(seed)
        self._base = _random_uint64(rng, (1,))[0] | np.uint64(1)  # odd, so invertible mod 2^64
        self._base_inverse = np.uint64(pow(int(self._base), -1, 1 << 64))
        self._shingle_mult = _random_uint64(rng, (shingle_size,)) | np.uint64(1)
        self._a = _random_uint64(rng, (num_perm,)) | np.uint64(1)
        self._b = _random_uint64(rng, (num_perm,))
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
        data = np.frombuffer(b" ".join(encoded), dtype=np.uint8)
        if data.size == 0:
            return np.zeros(0, np.uint64), np.zeros(len(texts), np.int64)
        is_word = _IS_WORD_BYTE[data]
        edges = np.diff(is_word.view(np.int8), prepend=np.int8(0), append=np.int8(0))
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        self._ensure_powers(data.size)
        prefix = np.empty(data.size + 1, dtype=np.uint64)
        prefix[0] = 0
        np.multiply(data, self._powers[: data.size], out=prefix[1:])
        prefix[1:] += self._powers[: data.size]  # byte value + 1, so a zero byte still counts
        prefix[1:][~is_word] = 0
        np.add.accumulate(prefix, out=prefix)
        hashes = _splitmix64((prefix[ends] - prefix[starts]) * self._inverse_powers[starts])
        # Which text each word belongs to: texts are joined with one separator byte.
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) + 1
        owner = np.searchsorted(np.cumsum(lengths), starts, side="right")
        words_per_text = np.bincount(owner, minlength=len(texts)).astype(np.int64)
        return hashes, words_per_text

    def shingle_hashes(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """32-bit hashes of ``k``-word shingles: ``(hashes [S] uint64 < 2^32, shingles_per_text [n])``."""
        words, per_text = self.word_hashes(texts)
        k = self.shingle_size
        n_words = words.size
        text_start = np.concatenate(([0], np.cumsum(per_text)[:-1])).astype(np.int64)
        # partial[m][i] = Σ_{j<m} words[i+j] · mult_j, built up one word of context at a time.
        combined = words * self._shingle_mult[0]
        partial_by_len = [combined.copy()] if k > 1 else []
        for j in range(1, k):
            if j < n_words:
                combined[: n_words - j] += words[j:] * self._shingle_mult[j]
            if j < k - 1:
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
        short = np.flatnonzero((per_text > 0) & (per_text < k))
        if short.size:
            short_hash = np.empty(short.size, dtype=np.uint64)
            for length in np.unique(per_text[short]):
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

    def sign(self, texts: Sequence[str], with_sets: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(signatures [n, num_perm], shingle_values, shingle_offsets)``: also each text's shingle
        hashes, ``shingle_values[shingle_offsets[i]:shingle_offsets[i+1]]`` (32-bit, unsorted, with
        repeats; empty arrays when ``with_sets`` is false), for exact Jaccard verification of
        candidate pairs. Only candidates need their sets, so deduplication waits until then."""
        out = np.empty((len(texts), self.num_perm), dtype=np.uint32)
        set_parts: list[np.ndarray] = []
        set_sizes = np.zeros(len(texts), dtype=np.int64)
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        ends = np.cumsum(lengths)
        first = 0
        while first < len(texts):
            # Whole texts until about batch_bytes characters (always at least one text).
            base = ends[first - 1] if first else 0
            last = max(int(np.searchsorted(ends, base + self.batch_bytes, side="right")), first + 1)
            shingles, counts = self.shingle_hashes(texts[first:last])
            out[first:last] = self.signatures_from_shingles(shingles, counts)
            if with_sets:
                set_parts.append(shingles.astype(np.uint32))
                set_sizes[first:last] = counts
            first = last
        values = np.concatenate(set_parts) if set_parts else np.zeros(0, np.uint32)
        offsets = np.concatenate(([0], np.cumsum(set_sizes))).astype(np.int64)
        return out, values, offsets

    def signatures_from_shingles(self, shingles: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Min over shingles of ``(a·x + b) mod 2^64``, shifted to 32 bits: ``[n, num_perm]`` uint32."""
        n = counts.size
        out = np.full((n, self.num_perm), _EMPTY, dtype=np.uint32)
        nonempty = np.flatnonzero(counts > 0)
        if nonempty.size == 0:
            return out
        bounds = np.concatenate(([0], np.cumsum(counts[nonempty])))
        buffer = np.empty((max(self.chunk_shingles, int(counts.max())), self.num_perm), dtype=np.uint64)
        first = 0
        while first < nonempty.size:
            # Whole texts until the chunk is full (always at least one text).
            last = int(np.searchsorted(bounds, bounds[first] + self.chunk_shingles, side="right")) - 1
            last = max(last, first + 1)
            lo, hi = bounds[first], bounds[last]
            rows = buffer[: hi - lo]
            np.multiply(shingles[lo:hi, None], self._a[None, :], out=rows)
            rows += self._b
            mins = np.minimum.reduceat(rows, bounds[first:last] - lo, axis=0)
            out[nonempty[first:last]] = (mins >> np.uint64(32)).astype(np.uint32)
            first = last
        return out


def exact_jaccard(pairs: np.ndarray, shingle_set_of) -> np.ndarray:
    """Exact Jaccard of each pair from the texts' shingle hashes (``shingle_set_of(i)``, repeats allowed)."""
    out = np.empty(pairs.shape[0], dtype=np.float64)
    unique: dict[int, np.ndarray] = {}
    for position, (i, j) in enumerate(pairs):
        for k in (int(i), int(j)):
            if k not in unique:
                unique[k] = np.unique(shingle_set_of(k))
        a, b = unique[int(i)], unique[int(j)]
        shared = np.intersect1d(a, b, assume_unique=True).size
        union = a.size + b.size - shared
        out[position] = shared / union if union else 0.0
    return out


# -- LSH banding, verification and clustering (the global half, run in the parent) -------------
def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit key per (text, band): ``[n, bands]``; equal keys mean the band's rows all agree."""
    if signatures.shape[1] < bands * rows:
        raise ValueError(f"signatures have {signatures.shape[1]} values; bands × rows needs {bands * rows}")
    cut = signatures[:, : bands * rows].reshape(signatures.shape[0], bands, rows).astype(np.uint64)
    mult = _splitmix64(np.arange(1, rows + 1, dtype=np.uint64)) | np.uint64(1)
    keys = np.zeros(cut.shape[:2], dtype=np.uint64)
    for r in range(rows):
        keys = _splitmix64(keys ^ (cut[:, :, r] * mult[r]))
    return keys


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
    keys = band_keys(signatures[index], bands, rows)
    pieces = []
    for band in range(bands):
        order = np.argsort(keys[:, band], kind="stable")
        sorted_keys = keys[order, band]
        boundary = np.flatnonzero(np.diff(sorted_keys)) + 1
        starts = np.concatenate(([0], boundary))
        sizes = np.diff(np.concatenate((starts, [order.size])))
        for size in np.unique(sizes[sizes > 1]):
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
    return np.unique(pairs, axis=0)


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
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster texts into near-duplicate groups. Returns ``(labels [n], verified_pairs [m, 2])``.

    ``labels[i]`` is the smallest index in ``i``'s cluster (so ``labels[i] == i`` marks the
    representative, the first occurrence). Candidate pairs are kept when their Jaccard similarity
    reaches ``threshold``: ``verify="exact"`` computes it from the shingle sets (``shingle_set_of``),
    ``"estimate"`` uses the signature agreement, ``"none"`` keeps every LSH candidate.
    """
    pairs = lsh_candidate_pairs(signatures, bands, rows, max_bucket=max_bucket, valid=valid)
    if pairs.size and verify == "exact":
        if shingle_set_of is None:
            raise ValueError("verify='exact' needs shingle_set_of")
        pairs = pairs[exact_jaccard(pairs, shingle_set_of) >= threshold]
    elif pairs.size and verify == "estimate":
        pairs = pairs[signature_agreement(signatures, pairs) >= threshold]
    elif verify not in ("exact", "estimate", "none"):
        raise ValueError(f"verify must be exact, estimate or none (got {verify!r})")
    return connected_components(signatures.shape[0], pairs), pairs
