"""Model shapes for the planner: dense (Llama-3) and mixture-of-experts (DeepSeek-V3, Kimi K2) presets, or any HF
``config.json`` (Llama-style, ``qwen3_moe``, ``deepseek_v3``).

Parameter counts are those of the decoder HF transformers builds: RMSNorm, attention without biases (GQA, with
Qwen3's per-head q/k norms where the config has them, or DeepSeek's multi-head latent attention, MLA), SwiGLU MLPs
of three matrices, and in MoE layers a router (E × h), E routed experts and S shared experts of
``moe_intermediate_size``. They reproduce the published sizes, checked in tests/plan: Llama 3.1 8.03B / 70.6B /
405.9B; DeepSeek-V3 671.0B total (the 14B multi-token-prediction module is not in the HF model and is not
counted); Kimi K2 1.026T ("1T", "1.04T" in Moonshot's material).

**Total vs active.** ``total_params`` is every parameter (what memory, optimizer state and checkpoints hold).
``active_params`` is what one token's forward computes with, counted the way DeepSeek ("37B activated") and
Moonshot ("32B activated") count it: k of the E routed experts in each MoE layer, and no input embedding (a
lookup reads one row; the output head is a matmul and counts). ``flop_params`` is the N of the planner's
6·N·T FLOPs: total minus the experts a token does not use — for a dense model exactly ``total_params``, as the
planner counted before MoE (the embedding included, a convention kept so dense plans are unchanged).
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
    intermediate_size: int  # dense MLP layers (all layers of a dense model)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_heads
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of Q and K (2·head_dim parameters per layer)
    # Mixture of experts (0 experts: dense). ``moe_layers`` of the ``num_layers`` have a routed MLP.
    num_experts: int = 0  # routed experts per MoE layer, E
    experts_per_token: int = 0  # k
    shared_experts: int = 0  # S, always-on experts of moe_intermediate_size (DeepSeek: one MLP S·i wide)
    moe_intermediate_size: int = 0
    moe_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): used when kv_lora_rank > 0.
    q_lora_rank: int = 0  # 0: Q projected straight from h
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.moe_layers > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    # Widths of what attention computes (per token), used by the parameter, activation and FLOP counts.
    @property
    def q_width(self) -> int:
        """Q: heads · (nope + rope) with MLA, heads · head_dim otherwise."""
        if self.is_mla:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_heads * self.dim_per_head

    @property
    def k_width(self) -> int:
        """K: MLA decompresses a K per head (as wide as Q); GQA has kv_heads · head_dim."""
        return self.q_width if self.is_mla else self.num_kv_heads * self.dim_per_head

    @property
    def v_width(self) -> int:
        return self.num_heads * self.v_head_dim if self.is_mla else self.num_kv_heads * self.dim_per_head

    @property
    def o_width(self) -> int:
        """The attention output, the output projection's input: heads · v_head_dim (MLA) or heads · head_dim."""
        return self.num_heads * self.v_head_dim if self.is_mla else self.num_heads * self.dim_per_head

    @property
    def kv_fraction(self) -> float:
        """Width of K (or V) over the hidden size: num_kv_heads·head_dim / h (1 without GQA)."""
        return self.num_kv_heads * self.dim_per_head / self.hidden_size

    def attention_params(self) -> int:
        """GQA: Wq, Wo (h × heads·d), Wk, Wv (h × kv·d) [+ q/k norms, 2·d]. MLA: W_qa (h × q_lora) + its norm +
        W_qb (q_lora × heads·(nope+rope)) [or h × heads·(nope+rope) without q_lora], W_kva (h × (kv_lora + rope)) +
        its norm + W_kvb (kv_lora × heads·(nope + v)), Wo (heads·v × h)."""
        h = self.hidden_size
        if not self.is_mla:
            d = self.dim_per_head
            norms = 2 * d if self.qk_norm else 0
            return 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d + norms
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.q_width
        else:
            q = h * self.q_width
        kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + self.o_width * h

    def expert_params(self) -> int:
        """One routed expert: three matrices h × moe_intermediate (SwiGLU)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def block_params(self) -> int:
        """One dense decoder block: attention, three MLP matrices (3·h·i), two norms."""
        h = self.hidden_size
        return self.attention_params() + 3 * h * self.intermediate_size + 2 * h

    def moe_block_dense_params(self) -> int:
        """The parts of an MoE block outside the routed experts: attention, router (E × h), shared experts, norms.
        FSDP shards these over every GPU; expert parallelism leaves them alone."""
        h = self.hidden_size
        return self.attention_params() + self.num_experts * h + self.shared_experts * self.expert_params() + 2 * h

    def moe_block_expert_params(self) -> int:
        """The routed experts of one MoE block: E · 3·h·i_moe (what expert parallelism shards)."""
        return self.num_experts * self.expert_params()

    def moe_block_params(self) -> int:
        return self.moe_block_dense_params() + self.moe_block_expert_params()

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def routed_expert_params(self) -> int:
        """All routed experts of the model (0 for a dense one)."""
        return self.moe_layers * self.moe_block_expert_params() if self.is_moe else 0

    def total_params(self) -> int:
        """Blocks + embedding + output head (absent when tied) + final norm."""
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        blocks = self.dense_layers * self.block_params()
        if self.is_moe:
            blocks += self.moe_layers * self.moe_block_params()
        return blocks + self.embedding_params() + head + self.hidden_size

    def inactive_expert_params(self) -> int:
        """Routed experts one token does not use: (E − k) experts in each MoE layer."""
        if not self.is_moe:
            return 0
        return self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params()

    def flop_params(self) -> int:
        """N of 6·N·T: total minus the unused experts (= total_params for a dense model; module docstring)."""
        return self.total_params() - self.inactive_expert_params()

    def active_params(self) -> int:
        """Activated parameters per token as DeepSeek and Moonshot count them: no input embedding, k experts."""
        embedding = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.flop_params() - embedding

    def largest_unit_params(self) -> int:
        """The largest FSDP unit: one block, or the embedding / output head if bigger (every expert of an MoE block;
        under expert parallelism a GPU gathers fewer: ``posttrain.plan.memory.gathered_unit_params``)."""
        units = [self.embedding_params()]
        if self.dense_layers:
            units.append(self.block_params())
        if self.is_moe:
            units.append(self.moe_block_params())
        return max(units)

    def to_dict(self) -> dict:
        extra = {"total_params": self.total_params(), "block_params": self.block_params()}
        if self.is_moe:
            extra.update(active_params=self.active_params(), flop_params=self.flop_params(),
                         routed_expert_params=self.routed_expert_params(), moe_block_params=self.moe_block_params())
        return {**asdict(self), **extra}


def _deepseek_like(name: str, heads: int, experts: int, dense_layers: int, vocab: int) -> ModelShape:
    """DeepSeek-V3's published config.json shape (Kimi K2 reuses it with other head, expert, dense, vocab counts):
    h 7,168, 61 layers, MLA (q_lora 1,536, kv_lora 512, rope 64, nope 128, v 128), 8 routed experts per token + 1
    shared of 2,048, dense MLP 18,432 in the first layers, untied."""
    return ModelShape(name, 7168, 18432, 61, heads, heads, vocab, num_experts=experts, experts_per_token=8,
                      shared_experts=1, moe_intermediate_size=2048, moe_layers=61 - dense_layers, q_lora_rank=1536,
                      kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


PRESETS: dict[str, ModelShape] = {
    # Shapes as published in Meta's Llama 3 / 3.1 config.json files (vocab 128,256, untied, GQA with 8 KV heads).
    "llama3-8b": ModelShape("llama3-8b", 4096, 14336, 32, 32, 8, 128256),
    "llama3-70b": ModelShape("llama3-70b", 8192, 28672, 80, 64, 8, 128256),
    "llama3-405b": ModelShape("llama3-405b", 16384, 53248, 126, 128, 8, 128256),
    # Our 1T dense config (no MoE): Llama-3 proportions scaled up. h = 24,576, i = 3.5·h = 86,016, 128 layers,
    # 192 heads of 128 (16 KV heads), vocab 128,256, untied: 0.98T parameters. Nobody trains a dense 1T: the
    # trillion-parameter case people post-train is kimi-k2 below.
    "dense-1t": ModelShape("dense-1t", 24576, 86016, 128, 192, 16, 128256),
    # deepseek-ai/DeepSeek-V3 config.json: 128 heads, 256 routed experts, first_k_dense_replace 3, vocab 129,280.
    # 671.0B total, 36.6B active (published: 671B / 37B).
    "deepseek-v3": _deepseek_like("deepseek-v3", heads=128, experts=256, dense_layers=3, vocab=129280),
    # moonshotai/Kimi-K2-Instruct config.json: 64 heads, 384 routed experts, first_k_dense_replace 1, vocab 163,840.
    # 1,026.4B total, 31.7B active (published: 1T / 1.04T total, 32B activated).
    "kimi-k2": _deepseek_like("kimi-k2", heads=64, experts=384, dense_layers=1, vocab=163840),
}

_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _moe_fields(config: dict, path: Path) -> dict:
    """The MoE part of an HF config: qwen3_moe / qwen2_moe (``num_experts``, ``mlp_only_layers``,
    ``decoder_sparse_step``) or deepseek_v3 / kimi_k2 (``n_routed_experts``, ``n_shared_experts``,
    ``first_k_dense_replace``, ``moe_layer_freq``); {} for a dense config."""
    experts = int(config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts == 0:
        return {}
    missing = [key for key in ("num_experts_per_tok", "moe_intermediate_size") if not config.get(key)]
    if missing:
        raise ConfigError([f"--model {path}: an MoE config.json ({experts} experts) lacks {', '.join(missing)}"])
    layers = int(config["num_hidden_layers"])
    if "n_routed_experts" in config:  # DeepSeek: layer i is MoE when i >= first_k_dense_replace and i % freq == 0
        first, freq = int(config.get("first_k_dense_replace") or 0), int(config.get("moe_layer_freq") or 1)
        moe = sum(1 for i in range(layers) if i >= first and i % freq == 0)
        shared = int(config.get("n_shared_experts") or 0)
    else:  # Qwen MoE, as Qwen3MoeDecoderLayer decides: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        only, step = set(config.get("mlp_only_layers") or ()), int(config.get("decoder_sparse_step") or 1)
        moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
        shared = 0  # qwen3_moe has none; qwen2_moe's shared expert has its own width (not modelled)
        if config.get("shared_expert_intermediate_size"):
            raise ConfigError([f"--model {path}: a shared expert of shared_expert_intermediate_size (qwen2_moe) is "
                               "not modelled; the planner reads qwen3_moe and deepseek_v3 MoE configs"])
    return {"num_experts": experts, "experts_per_token": int(config["num_experts_per_tok"]),
            "shared_experts": shared, "moe_intermediate_size": int(config["moe_intermediate_size"]),
            "moe_layers": moe}


def _mla_fields(config: dict) -> dict:
    if not config.get("kv_lora_rank"):
        return {}
    return {"q_lora_rank": int(config.get("q_lora_rank") or 0), "kv_lora_rank": int(config["kv_lora_rank"]),
            "qk_rope_head_dim": int(config["qk_rope_head_dim"]), "qk_nope_head_dim": int(config["qk_nope_head_dim"]),
            "v_head_dim": int(config["v_head_dim"])}


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
    if isinstance(config.get("text_config"), dict):  # multimodal wrappers (Kimi K2.5 style) keep the LM here
        config = config["text_config"]
    moe = _moe_fields(config, path)
    needed = _HF_KEYS + (("intermediate_size",) if not moe or moe["moe_layers"] < config["num_hidden_layers"] else ())
    missing = [key for key in needed if key not in config]
    if missing:
        raise ConfigError([f"--model {path}: config.json lacks {', '.join(missing)}"])
    qk_norm = config.get("model_type") in ("qwen3", "qwen3_moe")  # Qwen3 attention normalises each Q, K head
    return ModelShape(
        name=str(path),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config.get("intermediate_size") or 0),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(config.get("head_dim") or 0),
        qk_norm=qk_norm,
        **moe,
        **_mla_fields(config),
    )
