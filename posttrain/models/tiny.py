"""Tiny-model factory: a small Llama-architecture model (or a mixture of experts: ``arch="qwen3_moe"`` or
``"deepseek_v3"``, ``posttrain.models.moe``) with seeded random weights and a byte-level BPE tokenizer trained on
given texts, saved in HF format and loadable by plain ``transformers``.

No hub is reachable in tests or in the embedded default, so every model posttrain trains on a laptop
starts here (or from a checkpoint this factory produced).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|begin_of_text|>", "<|eot|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# A ChatML-like template. Each turn is "<|role|>\n{content}<|eot|>\n". No {% generation %} markers:
# posttrain computes assistant loss masks without them (posttrain.data.tokenize).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|eot|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog. What is 12 plus 30? The answer is 42.",
    "Write a list of three fruits: apple, banana, cherry. Reverse the word 'hello': olleh.",
    "Question: which number is larger, 17 or 71? Answer: 71. Sort 3, 1, 2 to get 1, 2, 3.",
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, split_digits: bool = True,
                    extra_special_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` with chat special tokens and a chat template.

    ``split_digits`` keeps every digit its own token (as Llama and PaLM do), so numbers are digit
    sequences rather than one opaque token per number — arithmetic becomes learnable digit by digit.
    ``extra_special_tokens`` (e.g. ``"<|end|>"``, ``"<|im_start|>"``) come after the built-in ones, for
    models whose chat template needs other control tokens.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([byte_level, pre_tokenizers.Digits(individual_digits=True)])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, *ROLE_TOKENS, *extra_special_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[*ROLE_TOKENS, *extra_special_tokens],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_llama_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
    )


def build_tiny_model(
    output_dir: str | Path,
    texts: Iterable[str] = DEFAULT_TEXTS,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    extra_special_tokens: Sequence[str] = (),
    tie_word_embeddings: bool = False,
    model_vocab_size: int | None = None,
    init_device: str | torch.device = "cpu",
    save_dtype: torch.dtype | None = None,
    arch: str = "llama",
    experts: int = 8,
    experts_per_token: int = 2,
    shared_experts: int = 0,
) -> Path:
    """Build, seed and save a tiny Llama model plus tokenizer in HF format; return the directory.

    ``arch`` ``qwen3_moe`` or ``deepseek_v3`` builds a mixture of experts instead: ``experts`` routed experts per
    MoE layer, ``experts_per_token`` of them chosen per token, ``shared_experts`` always-on ones (DeepSeek-V3
    only); see ``posttrain.models.moe.tiny_moe_config``.

    The same factory builds benchmark-sized Llamas (benchmarks/gpu.py): ``model_vocab_size`` gives the
    embedding and output head more rows than the tokenizer has tokens (Llama-3's 128,256 with a small
    tokenizer: the extra rows are never looked up but cost their full share of the head's matmul);
    ``init_device`` draws the random weights there (a GPU initialises 8B parameters in seconds, a host
    in minutes) and ``save_dtype`` casts them before saving (bf16 halves the file). The random draw
    depends on the device, so the same seed gives different weights on CPU and GPU.
    """
    output_dir = Path(output_dir)
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, extra_special_tokens=extra_special_tokens)
    if model_vocab_size is not None and model_vocab_size < len(tokenizer):
        raise ValueError(f"model_vocab_size={model_vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    shape = dict(
        vocab_size=model_vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        config = tiny_llama_config(**shape, intermediate_size=intermediate_size)
    else:
        from posttrain.models.moe import tiny_moe_config

        config = tiny_moe_config(arch, **shape, experts=experts, experts_per_token=experts_per_token,
                                 shared_experts=shared_experts)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device(init_device):
            # the dense model as it always was (its seeded weights are what earlier runs and tests saw)
            model = LlamaForCausalLM(config) if arch == "llama" else AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(generator_state)
    if save_dtype is not None:
        model = model.to(save_dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    output_dir.mkdir(parents=True, exist_ok=True)
    # Imported here: building a model needs no training stack.
    from posttrain.progress import quiet_hf_progress

    quiet_hf_progress()  # no carriage-return "Writing model shards" bar in a log
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def count_parameters(model: torch.nn.Module, exclude_embeddings: bool = False) -> int:
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        embed = model.get_input_embeddings()
        total -= embed.weight.numel()
    return total
