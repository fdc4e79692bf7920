"""Chat templates in the shape of popular model families, and a local tokenizer that knows their tokens.

Each family's template is written once, **with** ``{% generation %}`` markers (what transformers needs for
``return_assistant_tokens_mask``); ``Family.plain`` is the same template with the markers removed, which
is what posttrain must handle. The markers follow one rule in every family, the rule posttrain applies:

    a marker covers what the model writes for its turn — the content as the template renders it (with a
    reasoning block when the template shows one) and the end-of-turn token that stops it — and nothing
    the template writes around it: not the role header or generation prompt, not the newline between
    turns, not a tail appended after the last message (Phi-3's EOS).

Real templates disagree here (some put the ``\\n`` after ``<|im_end|>`` inside the marker, some leave the
end token out); the end-of-turn token is in because a model that never learns to emit it never stops,
and the whitespace after it is out because generation stops at the token, so the model never writes it.

The templates are simplified to the parts that matter for masks, but keep each family's quirks: the
default system prompt (Qwen2.5, Llama-2), the system text injected into every chat (Llama-3.1's dates),
system folded into the first user turn (Gemma, Mistral, Llama-2), ``trim``/``strip`` of content, BOS
written by the template or added by the tokenizer (Phi-3 here), a tail after the last message (Phi-3),
and past reasoning stripped from history (Qwen3).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<think>", "</think>",
)

# Llama-3 / Qwen2 pre-tokenisation: newline runs stay one piece ("\n\n" before the content is one token
# whether or not text follows), as in the real tokenizers of these families.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = (
    "You are a helpful assistant. What is 12 plus 30? The answer is 42. Reverse the word hello: olleh.",
    "Let me think step by step. First add the tens, then the ones. Sort 3, 1, 2 to get 1, 2, 3.",
    "Which is larger, 17 or 71? 71 is larger. Name three fruits: apple, banana, cherry.\nThanks!\nBye.",
)


@dataclass(frozen=True)
class Family:
    name: str
    marked: str  # the template with {% generation %} markers
    bos: str | None
    eos: str
    end_of_turn: str  # what posttrain must find as the end-of-turn text
    tail: str = ""  # what it must find appended after the last message
    implicit_bos: bool = False  # the tokenizer adds BOS to plain text; the template does not render it
    rewrites_history: bool = False  # past assistant turns render differently (Qwen3 strips reasoning)
    default_system: str | None = None  # text the template injects when the chat has no system message

    @property
    def plain(self) -> str:
        """The same template without the markers (what most real templates look like)."""
        return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", self.marked)


LLAMA3 = Family(
    "llama3",
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    bos="<|begin_of_text|>", eos="<|end_of_text|>", end_of_turn="<|eot_id|>",
    default_system="Cutting Knowledge Date: December 2023",
)

QWEN25 = Family(
    "qwen2.5",
    "{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% elif not (m['role'] == 'system' and loop.first) %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    bos=None, eos="<|im_end|>", end_of_turn="<|im_end|>",
    default_system="You are Qwen, created by Alibaba Cloud.",
)

# Qwen3: reasoning ("<think>…</think>" in the content) is shown only for assistant turns after the last
# user message; the last message always gets a (possibly empty) think block.
QWEN3 = Family(
    "qwen3",
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% set content = m['content'] %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{% else %}{{ content }}{% endif %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    bos=None, eos="<|im_end|>", end_of_turn="<|im_end|>", rewrites_history=True,
)

PHI3 = Family(
    "phi3",
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}"
    "{% generation %}{{ m['content'] + '<|end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}",
    bos="<s>", eos="<|endoftext|>", end_of_turn="<|end|>", tail="<|endoftext|>", implicit_bos=True,
)

MISTRAL = Family(
    "mistral",
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + (system if loop.first else '') + m['content'] + ' [/INST]' }}"
    "{% else %}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}",
    bos="<s>", eos="</s>", end_of_turn="</s>",
)

GEMMA = Family(
    "gemma",
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<end_of_turn>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ (first_user_prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    bos="<bos>", eos="<eos>", end_of_turn="<end_of_turn>",
)

ZEPHYR = Family(
    "zephyr",
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    bos=None, eos="</s>", end_of_turn="</s>",
)

LLAMA2 = Family(
    "llama2",
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = 'You are a helpful, respectful and honest assistant.' %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + m['content'] %}"
    "{% else %}{% set content = m['content'] %}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{% generation %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}",
    bos="<s>", eos="</s>", end_of_turn=" </s>",
    default_system="You are a helpful, respectful and honest assistant.",
)

FAMILIES = {family.name: family for family in (LLAMA3, QWEN25, QWEN3, PHI3, MISTRAL, GEMMA, ZEPHYR, LLAMA2)}


@cache
def _base_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(CORPUS), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[1:]))


def family_tokenizer(family: Family, marked: bool = False) -> PreTrainedTokenizerFast:
    """A fresh tokenizer with the family's BOS/EOS and template (``marked``: the one with markers)."""
    tokenizer = copy.deepcopy(_base_tokenizer())
    tokenizer.eos_token = family.eos
    if family.bos is not None:
        tokenizer.bos_token = family.bos
    if family.implicit_bos:
        bos_id = tokenizer.convert_tokens_to_ids(family.bos)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A $B", special_tokens=[(family.bos, bos_id)])
    tokenizer.chat_template = family.marked if marked else family.plain
    return tokenizer


def _chat(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


CHATS = {
    "single": _chat(("user", "What is 12 plus 30?"), ("assistant", "The answer is 42.")),
    "single+system": _chat(("system", "Be brief."), ("user", "Reverse the word hello."), ("assistant", "olleh")),
    "multi": _chat(("user", "What is 12 plus 30?"), ("assistant", "42."), ("user", "And 17 or 71, which is larger?"),
                   ("assistant", "71 is larger.\nBye."), ("user", "Sort 3, 1, 2."), ("assistant", "1, 2, 3")),
    "multi+system": _chat(("system", "You answer in one line."), ("user", "Name three fruits."),
                          ("assistant", "apple, banana, cherry"), ("user", "Thanks!"), ("assistant", "You are welcome.")),
    "reasoning": _chat(("user", "What is 12 plus 30?"),
                       ("assistant", "<think>\nAdd the tens, then the ones.\n</think>\n\nThe answer is 42."),
                       ("user", "Which is larger, 17 or 71?"),
                       ("assistant", "<think>\nCompare the tens digits.\n</think>\n\n71 is larger.")),
}
