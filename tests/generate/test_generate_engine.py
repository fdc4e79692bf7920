"""The HF backend on a tiny random model: batching never changes results, seeds repeat, stop strings and
EOS end sequences, n samples per prompt, chat prompts get the template."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from tokenizers import processors

from posttrain.data.records import Message
from posttrain.data.tokenize import IGNORE_INDEX, tokenize_prompt_completion
from posttrain.generate import HFBackend, SamplingParams, get_backend, render_prompt
from posttrain.models.load import load_model, load_tokenizer
from tests.conftest import CHAT_TEXTS

PROMPTS = [
    "What is 12 plus 30?",
    "Hi",
    "Sort 3, 1, 2 to get",
    "The quick brown fox jumps over the lazy dog. Which is larger, 17 or 71?",
    [Message(role="user", content="Reverse the word hello")],
    [Message(role="system", content="Be brief."), Message(role="user", content="Count the letters in banana")],
]


@pytest.fixture(scope="module")
def backend(tiny_model_dir, tiny_tokenizer):
    return HFBackend(load_model(tiny_model_dir), tiny_tokenizer)


def _ids(results):
    return [[c.token_ids for c in row] for row in results]


def test_greedy_batched_equals_one_by_one(backend):
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    batched = backend.generate(PROMPTS, params, batch_size=len(PROMPTS), progress=False)
    alone = [backend.generate([p], params, batch_size=1, progress=False)[0] for p in PROMPTS]
    assert _ids(batched) == _ids(alone)
    assert [r[0].text for r in batched] == [r[0].text for r in alone]
    assert all(len(r[0].token_ids) == 20 and r[0].finish_reason == "length" for r in batched)


def test_greedy_matches_a_plain_forward_pass(backend, tiny_tokenizer):
    """The cached, padded decode must pick what an uncached full forward pass picks at every step."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt = PROMPTS[3]
    out = backend.generate([PROMPTS[1], prompt], params, batch_size=2, progress=False)[1][0]
    ids = list(tiny_tokenizer(prompt)["input_ids"])
    with torch.no_grad():
        for token in out.token_ids:
            logits = backend.model(input_ids=torch.tensor([ids])).logits[0, -1]
            assert int(logits.argmax()) == token
            ids.append(token)


def test_sampling_repeats_per_seed_and_ignores_batch_size(backend):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=12, seed=7)
    first = backend.generate(PROMPTS, params, batch_size=4, progress=False)
    again = backend.generate(PROMPTS, params, batch_size=1, progress=False)
    assert _ids(first) == _ids(again)
    other_seed = backend.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 8}), batch_size=4,
                                  progress=False)
    assert _ids(first) != _ids(other_seed)


def test_n_samples_per_prompt_are_distinct(backend):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=1)
    results = backend.generate(PROMPTS[:2], params, batch_size=8, progress=False)
    assert [len(row) for row in results] == [4, 4]
    for row in results:
        assert len({tuple(c.token_ids) for c in row}) > 1


def test_stop_string_cuts_text_and_ends_early(backend):
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    full = backend.generate([PROMPTS[0]], params, progress=False)[0][0]
    # an ASCII run from the middle of the greedy text (byte-level BPE can emit partial UTF-8 elsewhere)
    runs = [m for m in re.finditer(r"[A-Za-z]{2,}", full.text) if m.start() > 0]
    assert runs, f"no ASCII word in {full.text!r}"
    stop = runs[0].group(0)[:2]
    cut = full.text.find(stop)
    stopped = backend.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=40, stop=[stop]),
                               progress=False)[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stop not in stopped.text
    assert len(stopped.token_ids) < len(full.token_ids)
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]


def test_eos_ends_a_sequence(tiny_model_dir, tiny_tokenizer):
    model = load_model(tiny_model_dir)
    backend = HFBackend(model, tiny_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    free = backend.generate([PROMPTS[0]], params, progress=False)[0][0]
    # Give EOS the same output row as the 4th greedy token: EOS's lower id wins the tie at that step at the latest.
    eos = tiny_tokenizer.eos_token_id
    target = free.token_ids[3]
    assert eos < target
    with torch.no_grad():
        model.lm_head.weight[eos] = model.lm_head.weight[target]
    ended = backend.generate([PROMPTS[0]], params, progress=False)[0][0]
    assert ended.finish_reason == "eos"
    assert ended.token_ids[-1] == eos and len(ended.token_ids) <= 4
    assert tiny_tokenizer.eos_token not in ended.text


def test_chat_prompts_use_the_template(backend, tiny_tokenizer):
    chat = [Message(role="user", content="Reverse the word hello")]
    text = render_prompt(tiny_tokenizer, chat)
    assert text.endswith("<|assistant|>\n") and "Reverse the word hello" in text
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    as_chat = backend.generate([chat], params, progress=False)
    as_dicts = backend.generate([[{"role": "user", "content": "Reverse the word hello"}]], params, progress=False)
    as_text = backend.generate([text], params, progress=False)
    assert _ids(as_chat) == _ids(as_text) == _ids(as_dicts)


def test_training_mode_is_restored(tiny_model_dir, tiny_tokenizer):
    model = load_model(tiny_model_dir)
    model.train()
    HFBackend(model, tiny_tokenizer).generate(["Hi"], SamplingParams(max_new_tokens=2), progress=False)
    assert model.training


def test_bad_params_are_rejected():
    for bad in ({"n": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1}, {"max_new_tokens": 0}, {"stop": [""]}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_get_backend(tiny_model_dir, tiny_tokenizer):
    assert isinstance(get_backend("hf", model_path=tiny_model_dir), HFBackend)
    assert isinstance(get_backend("hf", tiny_model_dir), HFBackend)
    with pytest.raises(ValueError, match="tokenizer"):
        get_backend("hf", load_model(tiny_model_dir))
    with pytest.raises(ValueError, match="unknown generation backend"):
        get_backend("tgi", model_path=tiny_model_dir)


def test_vllm_backend_without_an_engine_python_says_how_to_install_one(tiny_model_dir, tmp_path, monkeypatch):
    from posttrain.generate.vllm_server import EngineSetupError

    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(EngineSetupError, match=r"POSTTRAIN_VLLM_PYTHON=.*not an executable Python.*make vllm-env"):
        get_backend("vllm", model_path=tiny_model_dir)


@pytest.mark.parametrize("implicit_bos", [False, True], ids=["template-bos", "tokenizer-bos"])
def test_chat_prompt_is_sampled_from_the_ids_training_puts_before_the_completion(tiny_model_dir, tiny_tokenizer,
                                                                                  implicit_bos):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    if implicit_bos:  # the template no longer writes BOS; the tokenizer adds it to plain text
        tokenizer.chat_template = tokenizer.chat_template.replace("{{ bos_token }}", "")
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    model = load_model(tiny_model_dir)
    seen = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["input_ids"]), with_kwargs=True)
    chat = [Message(role="system", content="Be brief."), Message(role="user", content="Reverse the word hello")]
    HFBackend(model, tokenizer).generate([chat], SamplingParams(temperature=0.0, max_new_tokens=2), progress=False)
    hook.remove()
    trained = tokenize_prompt_completion(chat, [Message(role="assistant", content="olleh")], tokenizer, 10**6)
    first = next(i for i, label in enumerate(trained.labels) if label != IGNORE_INDEX)
    assert seen[0][0].tolist() == trained.input_ids[:first]
    assert seen[0][0].tolist().count(tokenizer.bos_token_id) == 1


def test_template_end_of_turn_token_ends_a_sequence_when_it_is_not_eos(tmp_path):
    from posttrain.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "phi", texts=CHAT_TEXTS, vocab_size=400, extra_special_tokens=("<|end|>",))
    tokenizer = load_tokenizer(str(path))
    tokenizer.chat_template = (  # Phi-3 style: turns end with <|end|>; EOS only after the last message
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert end != tokenizer.eos_token_id
    model = load_model(str(path))
    backend = HFBackend(model, tokenizer)
    prompt, params = [Message(role="user", content="What is 12 plus 30?")], SamplingParams(temperature=0.0,
                                                                                           max_new_tokens=12)
    free = backend.generate([prompt], params, progress=False)[0][0]
    target = free.token_ids[3]
    assert end < target and end not in free.token_ids[:4]  # on a tie, the lower id wins the argmax
    with torch.no_grad():
        model.lm_head.weight[end] = model.lm_head.weight[target]
    ended = backend.generate([prompt], params, progress=False)[0][0]
    assert ended.finish_reason == "eos" and ended.token_ids[-1] == end and len(ended.token_ids) <= 4
