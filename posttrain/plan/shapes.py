"""Model shapes for the planner: Llama-3 presets, a 1T dense config, or any HF ``config.json``.

Parameter counts are those of a Llama-style decoder (RMSNorm, GQA attention without biases, SwiGLU MLP with
three matrices); they reproduce the published sizes (8.03B, 70.6B, 405.9B, checked in tests/plan).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from posttrain.algorithms.registry import UnknownNameError
from posttrain.config.loader import ConfigError


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def kv_fraction(self) -> float:
        """Width of K (or V) over the hidden size: num_kv_heads·head_dim / h (1 without GQA)."""
        return self.num_kv_heads * self.dim_per_head / self.hidden_size

    def block_params(self) -> int:
        """One decoder block: Wq, Wo (h × heads·d), Wk, Wv (h × kv·d), three MLP matrices (3·h·i), two norms."""
        h, d = self.hidden_size, self.dim_per_head
        attention = 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d
        return attention + 3 * h * self.intermediate_size + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """Blocks + embedding + output head (absent when tied) + final norm."""
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.num_layers * self.block_params() + self.embedding_params() + head + self.hidden_size

    def largest_unit_params(self) -> int:
        """The largest FSDP unit gathered at once: one block, or the embedding / output head if bigger."""
        return max(self.block_params(), self.embedding_params())

    def to_dict(self) -> dict:
        return {**asdict(self), "total_params": self.total_params(), "block_params": self.block_params()}


PRESETS: dict[str, ModelShape] = {
    # Shapes as published in Meta's Llama 3 / 3.1 config.json files (vocab 128,256, untied, GQA with 8 KV heads).
    "llama3-8b": ModelShape("llama3-8b", 4096, 14336, 32, 32, 8, 128256),
    "llama3-70b": ModelShape("llama3-70b", 8192, 28672, 80, 64, 8, 128256),
    "llama3-405b": ModelShape("llama3-405b", 16384, 53248, 126, 128, 8, 128256),
    # Our 1T dense config (no MoE): Llama-3 proportions scaled up. h = 24,576, i = 3.5·h = 86,016, 128 layers,
    # 192 heads of 128 (16 KV heads), vocab 128,256, untied: 0.98T parameters.
    "dense-1t": ModelShape("dense-1t", 24576, 86016, 128, 192, 16, 128256),
}

_HF_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def load_shape(model: str) -> ModelShape:
    """A preset name, or a path to an HF ``config.json`` (or a directory holding one); ConfigError otherwise."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        guess = difflib.get_close_matches(model, list(PRESETS), n=1, cutoff=0.5)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        raise UnknownNameError(f"--model {model!r} is neither a preset nor a config.json path; {hint}"
                               f"presets: {', '.join(PRESETS)}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError([f"--model {model}: cannot read it as JSON ({err})"]) from err
    missing = [key for key in _HF_KEYS if key not in config]
    if missing:
        raise ConfigError([f"--model {path}: config.json lacks {', '.join(missing)}"])
    return ModelShape(
        name=str(path),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(config.get("head_dim") or 0),
    )
