"""Reference log-probs computed once, cached on disk, and the reference model freed before training.

DPO-family losses compare the policy with a frozen reference on the *same* pairs every epoch, so the
reference's summed response log-probs are a fixed function of (reference weights, tokenised pairs).
``reference_logps`` computes them in one no-grad pass before training, writes them to a cache
directory (``dpo.reference_cache_dir``; default ``$XDG_CACHE_HOME/posttrain/reference`` — i.e.
``~/.cache/posttrain/reference`` — or ``<output_dir>/ref_cache`` when that is not writable; never into
the user's data folder) as ``<data name>.<key>.safetensors``, and reuses the file on the next run with
the same key, from any output directory. The reference model lives only inside ``compute_reference_logps``: it is deleted and
garbage-collected before the function returns, so it is never resident during training.

The cache key is a SHA-256 over: the reference model directory's files (names and contents), the data
file's bytes, the tokenised pairs (every token id and label, so tokenizer, chat template, max_length
and truncation are covered), and the settings that change the numbers (dtype, attention kernel,
precision, batch layout). Any change gives a new key, hence a fresh pass; old files are left for the
user to delete.

Several ranks: each rank loads the full reference and computes every ``world``-th pair (a one-off, no
sharding of the reference); the results are summed across ranks (each pair is filled by exactly one
rank, the others contribute exact zeros) and rank 0 writes the file. A reference that does not fit
one device unsharded is not supported by this pass; use ``dpo.reference=live`` or a smaller reference.

With LoRA (``model.lora``) there is no reference model to load: the policy with its adapters disabled
*is* the base (``posttrain.models.lora.adapter_disabled``), so the pass runs through the policy itself —
sharded like it, every rank running the same number of forwards (FSDP's gathers are collectives). Its
numbers equal the separately loaded base's; its cache entries are kept apart all the same
(``ReferenceSpec.source``), since a bf16 policy under FSDP rounds differently from an autocast reference.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from posttrain import dist
from posttrain.cache import cache_dir, stat_cached_digest
from posttrain.data.storage import source_fingerprint
from posttrain.models.load import load_model
from posttrain.models.lora import adapter_disabled
from posttrain.progress import progress
from posttrain.train.evaluation import reshard
from posttrain.train.pairs import PairLogprobModel, TokenizedPair, collate_pairs, model_inputs, split_pairs
from posttrain.train.precision import autocast

CACHE_VERSION = 1
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".pt", ".model", ".txt")


@dataclass(frozen=True)
class ReferenceSpec:
    """How the reference is run: everything here changes the numbers, so all of it is in the cache key."""

    path: str
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    precision: str = "fp32"
    prefix_sharing: bool = True
    batch_size: int = 16
    chunk_size: int = 1024
    source: str = "model"  # "model": loaded from ``path``; "policy-adapter-disabled": the LoRA policy's base

    def key_fields(self) -> dict:
        fields = {
            "dtype": self.dtype, "attn": self.attn_implementation, "precision": self.precision,
            "prefix_sharing": self.prefix_sharing, "version": CACHE_VERSION,
        }
        if self.source != "model":  # keys of the separately loaded reference stay as they were
            fields["source"] = self.source
        return fields


def _hash_stream(digest, handle) -> None:
    for block in iter(lambda: handle.read(1 << 20), b""):
        digest.update(block)


def model_digest(model_path: str) -> str:
    """SHA-256 over the weight and config files of a local model directory (a hub id hashes as its name)."""
    root = Path(model_path)
    if not root.is_dir():
        return hashlib.sha256(f"hub:{model_path}".encode()).hexdigest()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _MODEL_FILE_SUFFIXES)

    def read_all() -> str:
        digest = hashlib.sha256()
        for path in files:
            digest.update(str(path.relative_to(root)).encode())
            with open(path, "rb") as handle:
                _hash_stream(digest, handle)
        return digest.hexdigest()

    # Unchanged files are not read again (a 70B model is 140 GB): posttrain.cache's rule.
    return stat_cached_digest("model-files", files, read_all)


def pairs_digest(pairs: list[TokenizedPair]) -> str:
    """SHA-256 over every pair's token ids and labels, in order."""
    digest = hashlib.sha256()
    for pair in pairs:
        for example in (pair.chosen, pair.rejected):
            digest.update(np.asarray(example.input_ids, dtype=np.int64).tobytes())
            digest.update(np.asarray(example.labels, dtype=np.int64).tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def cache_key(spec: ReferenceSpec, data_path: str, pairs: list[TokenizedPair]) -> str:
    parts = {
        "model": model_digest(spec.path),
        "data": source_fingerprint(data_path)["digest"],  # a file, a shard set or a saved dataset, local or s3://
        "pairs": pairs_digest(pairs),
        "settings": spec.key_fields(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def default_cache_dir(output_dir: str | Path) -> Path:
    """``$XDG_CACHE_HOME/posttrain/reference`` (``~/.cache/…``), or ``<output_dir>/ref_cache`` when not writable."""
    base = cache_dir("reference")
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        return Path(output_dir) / "ref_cache"
    return base if os.access(base, os.W_OK) else Path(output_dir) / "ref_cache"


def cache_file(cache_dir: Path, data_path: str, key: str) -> Path:
    name = Path(data_path.rstrip("/")).name or "data"
    return cache_dir / f"{name}.{key[:24]}.safetensors"


def _manifest_of(path: Path) -> Path:
    return path.with_name(path.name + ".manifest.json")


def _read_cache(path: Path, key: str, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cached log-probs when the file is the one written for ``key`` and its bytes match its manifest.

    A file without a manifest, or whose SHA-256 differs from the manifest's (overwritten, truncated, bit
    rot), is not trusted: the pass is recomputed, with a warning.
    """
    if not path.exists():
        return None
    from safetensors import safe_open

    manifest_path = _manifest_of(path)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if manifest.get("sha256") != actual or manifest.get("key") != key:
        warnings.warn(f"reference cache {path} does not match its manifest "
                      f"({'missing' if not manifest else 'checksum or key differs'}); recomputing it", stacklevel=3)
        return None
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    if meta.get("key") != key or meta.get("pairs") != str(count):
        return None
    tensors = load_file(str(path))
    return tensors["chosen"], tensors["rejected"]


def _write_cache(path: Path, key: str, chosen: torch.Tensor, rejected: torch.Tensor, spec: ReferenceSpec,
                 data_path: str) -> None:
    """The log-probs file, then its manifest (SHA-256 of the file) last: a reader trusts only a complete pair."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp{os.getpid()}")
    meta = {"key": key, "pairs": str(chosen.numel()), "reference": spec.path, "data": data_path,
            "settings": json.dumps(spec.key_fields(), sort_keys=True)}
    save_file({"chosen": chosen.contiguous(), "rejected": rejected.contiguous()}, str(staging), metadata=meta)
    manifest = {"key": key, "sha256": hashlib.sha256(staging.read_bytes()).hexdigest(), "file": path.name}
    _manifest_of(path).unlink(missing_ok=True)
    os.replace(staging, path)  # atomic: a reader never sees half a file
    manifest_staging = _manifest_of(path).with_suffix(f".tmp{os.getpid()}")
    manifest_staging.write_text(json.dumps(manifest, indent=1))
    os.replace(manifest_staging, _manifest_of(path))


def compute_reference_logps(
    spec: ReferenceSpec, pairs: list[TokenizedPair], pad_token_id: int, desc: str = "reference log-probs",
    policy: torch.nn.Module | None = None, sharded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One no-grad pass of the reference over ``pairs``: ``([N] chosen, [N] rejected)`` float32 sums.

    Pairs are batched longest first (less padding); this rank computes every ``world``-th of them.
    The reference model is freed before returning. ``policy``: a LoRA policy's root (``PairLogprobModel``,
    FSDP-sharded when ``sharded``) whose adapter-disabled base is the reference; no model is loaded.
    """
    world, rank = dist.world_size(), dist.rank()
    chosen = torch.zeros(len(pairs), dtype=torch.float32)
    rejected = torch.zeros(len(pairs), dtype=torch.float32)
    order = sorted(range(len(pairs)), key=lambda i: -pairs[i].row_tokens(spec.prefix_sharing))[rank::world]
    batches = [order[i : i + spec.batch_size] for i in range(0, len(order), spec.batch_size)]
    if policy is not None:
        # Every rank runs as many forwards as the busiest one (FSDP's gathers are collectives); a rank with
        # no batch left runs a dummy one and keeps nothing from it.
        most = math.ceil(math.ceil(len(pairs) / world) / spec.batch_size)
        batches += [[] for _ in range(most - len(batches))]
        _reference_pass(policy, spec, pairs, pad_token_id, batches, chosen, rejected, desc, sharded)
    else:
        lm = load_model(spec.path, spec.dtype, spec.attn_implementation, spec.trust_remote_code, device=dist.device())
        lm.config.use_cache = False
        lm.eval().requires_grad_(False)
        root = PairLogprobModel(lm, chunk_size=spec.chunk_size)
        try:
            # The reference is never sharded: it computes in bf16 under autocast when the run is bf16.
            _reference_pass(root, spec, pairs, pad_token_id, batches, chosen, rejected, desc, sharded=False)
        finally:
            # The reference must not stay resident while the policy trains.
            del root, lm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    packed = torch.stack([chosen, rejected]).to(dist.device())
    dist.all_reduce_sum(packed)
    packed = packed.cpu()
    return packed[0].clone(), packed[1].clone()


def _reference_pass(root: torch.nn.Module, spec: ReferenceSpec, pairs: list[TokenizedPair], pad_token_id: int,
                    batches: list[list[int]], chosen: torch.Tensor, rejected: torch.Tensor, desc: str,
                    sharded: bool) -> None:
    """Fill ``chosen[i]`` / ``rejected[i]`` for the pairs of ``batches`` (an empty batch: a dummy forward)."""
    was_training = root.training
    root.eval()
    try:
        with torch.no_grad(), autocast(spec.precision, sharded), adapter_disabled(root):
            for indices in progress(batches, desc=desc, unit="batch", disable=not dist.is_main()):
                batch = collate_pairs([pairs[i] for i in indices or [0]], pad_token_id, spec.prefix_sharing)
                values_c, values_r = split_pairs(root(**model_inputs(batch)).float().cpu())
                if indices:
                    chosen[indices] = values_c
                    rejected[indices] = values_r
    finally:
        root.train(was_training)
    reshard(root)  # forwards without backward leave FSDP's root unsharded; the optimizer must see the shards


@dataclass
class ReferenceResult:
    chosen: torch.Tensor
    rejected: torch.Tensor
    path: Path
    reused: bool


def reference_logps(
    spec: ReferenceSpec, pairs: list[TokenizedPair], pad_token_id: int, data_path: str, cache_dir: Path,
    desc: str = "reference log-probs", policy: torch.nn.Module | None = None, sharded: bool = False,
) -> ReferenceResult:
    """Cached reference log-probs for ``pairs`` of ``data_path``: read the cache, or compute and write it."""
    key = dist.broadcast_object(cache_key(spec, data_path, pairs) if dist.is_main() else None)
    path = cache_file(cache_dir, data_path, key)
    cached = _read_cache(path, key, len(pairs)) if dist.is_main() else None
    reused = bool(dist.broadcast_object(cached is not None))
    if reused:
        if cached is None:  # the other ranks read the file rank 0 validated
            tensors = load_file(str(path))
            cached = tensors["chosen"], tensors["rejected"]
        return ReferenceResult(cached[0], cached[1], path, True)
    chosen, rejected = compute_reference_logps(spec, pairs, pad_token_id, desc, policy, sharded)
    if dist.is_main():
        _write_cache(path, key, chosen, rejected, spec, data_path)
    dist.barrier()
    return ReferenceResult(chosen, rejected, path, False)
