"""LoRA and QLoRA adapters through peft: applied once, in ``posttrain.train.runner.build_policy``.

``model.lora`` (``posttrain.config.sections.LoraConfig``) turns every training recipe (SFT, DPO, RM, and
any later one that builds its policy with ``build_policy``) into adapter training:

- ``apply_lora`` wraps the HF model in a peft ``PeftModel`` *before* ``parallelize`` (so MLP recompute,
  activation checkpointing and FSDP2 see the adapter layers). Each adapted linear layer computes
  ``W x + (alpha / r) · B A dropout(x)`` with ``W`` frozen, ``A`` [r × in] Kaiming-uniform and ``B``
  [out × r] zero at the start, so step 0 is exactly the base model (Hu et al. 2021, "LoRA").
  Only ``A`` and ``B`` train — and, for a reward model, its score head (peft's ``SEQ_CLS`` task puts
  the head in ``modules_to_save``: a freshly initialised head has to learn its whole weight, a low-rank
  update of a random matrix would not do). The loop builds its optimizer from the parameters with
  ``requires_grad``, so it holds only these.
- ``quantize: 4bit`` is QLoRA (Dettmers et al. 2023): the frozen base is loaded as 4-bit NF4 with double
  quantisation through bitsandbytes, computing in ``model.dtype``; the adapters stay in float32.
  ``check_4bit_support`` tries a real quantise/dequantise round trip on the device first, so a platform
  bitsandbytes cannot serve fails at start with one line. QLoRA runs in one process: FSDP2 does not
  shard bitsandbytes' packed 4-bit weights.
- ``experts: true`` (mixture-of-experts models only) also adapts each MoE layer's routed experts: the stacked
  ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]`` are ``nn.Parameter``s, not linear
  layers, so they go to peft as ``target_parameters`` (peft's ``ParamWrapper``: a rank-r pair per expert, added
  to the stacked weight for the forward; merges like a linear adapter). The router stays frozen.
- ``resolve_targets``: peft >= 0.19 on transformers 5 rewrites a config for MoE models whose layout changed since
  transformers 4 (``qwen3_moe``, ``deepseek_v3``, …) so that adapters trained on the old layout still load: it
  reads ``all-linear`` and the names ``gate``/``gate_proj``/``up_proj``/``down_proj`` as the old per-expert linear
  layers and router, and targets the fused experts and the router weight instead, at rank 2r for ``gate_up_proj``
  (warning ``rank_pattern keys did not match any targeted module``). So ``all-linear`` silently adapted the
  experts and the router and dropped DeepSeek-V3's dense MLP and shared-expert adapters. posttrain hands peft a
  config that rewrite leaves unchanged (a fixed point, checked), so what trains is what the config says, and
  ``PeftModel.from_pretrained`` (which rewrites again) reads the exported adapter back as it was trained.
- ``adapter_disabled(root)``: the frozen base, for a reference model that costs no second copy (DPO's
  reference log-probs; GRPO's KL term).
- ``export_adapter_and_merged``: ``output_dir/adapter`` (peft format: ``PeftModel.from_pretrained``) and
  ``output_dir/final`` (the adapter merged into the base, plain HF: ``AutoModelForCausalLM``), so every
  stage that reads ``final`` (eval, sample, the flywheel) works unchanged. The merge is done on rank 0
  into a fresh full-precision load of ``model.path``; with QLoRA that is the original base, not its
  4-bit copy (the usual QLoRA practice: the merged model is full precision).
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from posttrain import dist

ADAPTER_DIR = "adapter"
PEFT_MISSING = "model.lora needs peft: pip install 'posttrain[lora]'"
BNB_MISSING = "model.lora.quantize=4bit needs bitsandbytes: pip install 'posttrain[qlora]'"


class LoraSetupError(RuntimeError):
    """``model.lora`` cannot be set up as asked (peft or bitsandbytes missing, 4-bit unsupported on this
    platform or under FSDP, no module matches ``target_modules``, ``experts`` on a dense model); the one-line
    message says what to do."""


# What bitsandbytes logs on import on a CPU with AVX512-BF16 when the `kernels` package (a fused 4-bit matmul) is
# missing. peft imports bitsandbytes whenever it is installed, so every CPU LoRA run printed it; it concerns 4-bit
# layers only. With quantize: 4bit, check_4bit_support imports bitsandbytes first and the note stands.
BNB_CPU_KERNEL_NOTE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _WithoutCpuKernelNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(BNB_CPU_KERNEL_NOTE)


def _peft():
    note = _WithoutCpuKernelNote()
    bnb_cpu = logging.getLogger("bitsandbytes.backends.cpu.ops")
    bnb_cpu.addFilter(note)  # only while peft imports: a later 4-bit load keeps every bitsandbytes message
    try:
        import peft
    except ImportError:
        raise LoraSetupError(PEFT_MISSING) from None
    finally:
        bnb_cpu.removeFilter(note)
    return peft


def is_lora(module: torch.nn.Module) -> bool:
    """``module`` is a peft model (checked without importing peft when nothing imported it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def find_lora(root: torch.nn.Module) -> torch.nn.Module | None:
    """The peft model inside a recipe's root module (``root.lm``), or None for full fine-tuning."""
    lm = getattr(root, "lm", root)
    return lm if is_lora(lm) else None


def check_4bit_support(device: torch.device | str) -> None:
    """Raise ``LoraSetupError`` (one line) unless bitsandbytes can quantise to NF4 on ``device``."""
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf
    except ImportError:
        raise LoraSetupError(BNB_MISSING) from None
    except Exception as exc:  # noqa: BLE001 - a broken native library raises anything on import
        raise LoraSetupError(f"model.lora.quantize=4bit: bitsandbytes does not load here "
                                      f"({type(exc).__name__}: {exc}); use model.lora.quantize=none") from None
    probe = torch.linspace(-1.0, 1.0, 4096, device=device).reshape(64, 64)
    try:
        packed, state = bnbf.quantize_4bit(probe, quant_type="nf4")
        error = (bnbf.dequantize_4bit(packed, state, quant_type="nf4").float() - probe).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - each backend fails its own way
        raise LoraSetupError(
            f"model.lora.quantize=4bit: bitsandbytes {bitsandbytes.__version__} cannot quantise to 4 bits on "
            f"{torch.device(device).type} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "use model.lora.quantize=none"
        ) from None
    if not error < 0.2:  # NF4 of values in [-1, 1] is off by at most half a code step (~0.1)
        raise LoraSetupError(f"model.lora.quantize=4bit: bitsandbytes {bitsandbytes.__version__} on "
                                      f"{torch.device(device).type} round-trips NF4 with error {error:.3g}; "
                                      "use model.lora.quantize=none")


def quantization_config(lora, dtype: torch.dtype, device: torch.device | str):
    """The ``BitsAndBytesConfig`` for ``model.lora.quantize=4bit`` (after checking the platform), else None."""
    if lora is None or lora.quantize == "none":
        return None
    check_4bit_support(device)
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def expert_parameters(lm: torch.nn.Module) -> list[str]:
    """peft ``target_parameters`` naming every MoE layer's stacked routed-expert weights (``experts.gate_up_proj``,
    ``experts.down_proj``: module leaf name and parameter, which peft matches as a suffix); empty for a dense model.
    Shared experts and DeepSeek-V3's dense MLP are ``nn.Linear`` layers (``all-linear``'s business), not these."""
    from posttrain.train.expert_parallel import EXPERT_WEIGHTS, experts_modules

    found = {id(module) for module in experts_modules(lm)}
    leaves = sorted({name.rpartition(".")[2] for name, module in lm.named_modules() if id(module) in found})
    return [f"{leaf}.{weight}" for leaf in leaves for weight in EXPERT_WEIGHTS]


def _rewritten(config, lm: torch.nn.Module):
    """What peft's transformers-4 compatibility rewrite makes of ``config`` on ``lm`` (a copy), or None where this
    peft has no such rewrite. peft applies it inside ``get_peft_model`` and ``PeftModel.from_pretrained``."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # peft before the rewrite existed: configs are taken as given
        return None
    probe = copy.deepcopy(config)
    convert_peft_config_for_transformers(probe, model=lm, conversions=None)
    return probe


def _targets(config) -> tuple[object, set[str], dict, dict]:
    modules = config.target_modules
    return (modules if isinstance(modules, str) else set(modules or ()), set(config.target_parameters or ()),
            dict(config.rank_pattern or {}), dict(config.alpha_pattern or {}))


def resolve_targets(config, lm: torch.nn.Module, asked) -> None:
    """Make peft's ``config`` a fixed point of peft's transformers-4 rewrite on ``lm`` (module docstring), in place.

    ``all-linear`` becomes the leaf names of ``lm``'s linear layers, less those the rewrite would turn into expert
    or router targets (DeepSeek-V3's dense MLP and shared experts share the routed experts' old names, so no
    module list can keep them apart: they stay frozen). A list or regex the rewrite would change is refused:
    ``LoraSetupError`` naming what to remove. ``asked`` is the user's ``target_modules``, for the message.
    """
    rewritten = _rewritten(config, lm)
    if rewritten is None or _targets(rewritten) == _targets(config):
        return
    kind = lm.config.model_type
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

        linear = _maybe_include_all_linear_layers(copy.deepcopy(config), lm).target_modules
        config.target_modules = {name.rpartition(".")[2] for name in linear}
        rewritten = _rewritten(config, lm)
        config.target_modules = set(rewritten.target_modules)  # the names peft keeps as modules
        if not config.target_modules:
            raise LoraSetupError(f"model.lora.target_modules=all-linear: {kind} has no linear layer peft would adapt "
                                 "as one; set model.lora.experts=true to adapt the routed experts")
        if _targets(_rewritten(config, lm)) == _targets(config):
            return
    raise LoraSetupError(
        f"model.lora.target_modules={asked!r}: on a {kind} model peft {_peft().__version__} reads "
        f"{sorted(_targets(config)[0] - _targets(rewritten)[0]) or 'them'} as transformers-4 names of the fused "
        "experts and the router and would adapt those instead; leave them out (model.lora.experts=true adapts the "
        "routed experts)")


def apply_lora(lm: torch.nn.Module, lora, task: str = "CAUSAL_LM") -> torch.nn.Module:
    """Wrap ``lm`` in a peft model with ``lora``'s adapters; everything but the adapters is frozen.

    ``task``: ``CAUSAL_LM``, or ``SEQ_CLS`` for a reward model (its ``score`` head trains in full, through
    ``modules_to_save``). ``lora.experts`` adds the routed experts' stacked weights (``LoraSetupError`` on a
    model without them).
    """
    peft = _peft()
    parameters = expert_parameters(lm) if lora.experts else []
    if lora.experts and not parameters:
        raise LoraSetupError(f"model.lora.experts is set but this {lm.config.model_type} model has no routed experts "
                             "(no stacked gate_up_proj/down_proj): remove model.lora.experts for a dense model")
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
        target_parameters=parameters or None,
        task_type=task, modules_to_save=["score"] if task == "SEQ_CLS" else None,
    )
    resolve_targets(config, lm, lora.target_modules)
    try:
        with warnings.catch_warnings():  # peft asks transformers a question transformers 5 renamed
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
            return peft.get_peft_model(lm, config)
    except ValueError as exc:  # e.g. "Target modules {...} not found in the base model"
        raise LoraSetupError(f"model.lora.target_modules={lora.target_modules!r}: {exc}") from None


def check_lora_model(model_config) -> None:
    """``model.lora.experts`` against ``model.path``'s config (``config.json`` only, no weights), before any run
    state is written: on a dense model it is ``LoraSetupError``, never a silently ignored switch."""
    lora = model_config.lora
    if lora is None or not lora.experts:
        return
    from transformers import AutoConfig

    from posttrain.models.moe import num_experts

    hf = AutoConfig.from_pretrained(model_config.path, trust_remote_code=model_config.trust_remote_code)
    if num_experts(hf) is None:
        raise LoraSetupError(f"model.lora.experts is set but {model_config.path} is a dense {hf.model_type} model "
                             "(no routed experts): remove model.lora.experts, or point model.path at a "
                             "mixture-of-experts model")


def held_values(param: torch.Tensor) -> int:
    """How many values ``param`` holds: its ``numel()``, or for a bitsandbytes 4-bit weight (two values packed
    per byte) the shape it was quantized from."""
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else param.numel()


def parameter_counts(lm: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters; 4-bit weights count as the values they hold, not their bytes."""
    if is_lora(lm):
        return lm.get_nb_trainable_parameters()
    params = list(lm.parameters())
    return sum(held_values(p) for p in params if p.requires_grad), sum(held_values(p) for p in params)


def describe(lora, trainable: int, total: int, lm: torch.nn.Module | None = None) -> str:
    """One line for the run's start: what trains, out of how much. With the peft model ``lm`` of a
    mixture-of-experts model, ``all-linear`` is spelled out (``resolve_targets`` may leave names out there)."""
    if lora is None:
        return f"{total / 1e6:.2f}M parameters, all trainable (full fine-tuning)"
    base = "4-bit NF4 base (QLoRA)" if lora.quantize == "4bit" else "frozen base"
    targets = f"{lora.target_modules}"
    config = lm.peft_config[lm.active_adapter] if lm is not None and is_lora(lm) else None
    if config is not None and expert_parameters(lm) and isinstance(lora.target_modules, str):
        targets += f" ({', '.join(sorted(config.target_modules))})"
    if lora.experts:
        targets += " and the routed experts (gate_up_proj, down_proj)"
    return (f"{total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable ({100 * trainable / total:.2f}%): "
            f"LoRA r={lora.r} alpha={lora.alpha:g} on {targets}, {base}")


@contextmanager
def adapter_disabled(root: torch.nn.Module):
    """Inside, ``root`` computes with its adapters off: the frozen base model (a no-op without LoRA)."""
    lm = find_lora(root)
    if lm is None:
        yield root
        return
    with lm.disable_adapter():
        yield root


def export_adapter_and_merged(root: torch.nn.Module, tokenizer, output_dir: Path, load_base) -> Path:
    """Write ``output_dir/adapter`` (peft) and ``output_dir/final`` (merged, plain HF); return ``final``.

    A collective: every rank gathers the trainable weights (adapters, and a reward model's head); rank 0
    loads a fresh full-precision base with ``load_base()``, puts them into it and writes both.
    """
    from posttrain.progress import quiet_hf_progress
    from posttrain.train.checkpoint import export_hf, full_model_state_dict

    lm = find_lora(root)
    state = full_model_state_dict(root, trainable_only=True)
    final, adapter_dir = output_dir / "final", output_dir / ADAPTER_DIR
    if dist.is_main():
        peft = _peft()
        quiet_hf_progress()
        trained = {key.removeprefix("lm."): value for key, value in state.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
            model = peft.get_peft_model(load_base(), copy.deepcopy(lm.peft_config[lm.active_adapter]))
        result = model.load_state_dict(trained, strict=False)
        expected = {name for name, p in model.named_parameters() if p.requires_grad}
        if result.unexpected_keys or expected - trained.keys():
            raise RuntimeError(f"LoRA export: the trained weights do not fit a fresh adapter (unexpected "
                               f"{result.unexpected_keys[:3]}, missing {sorted(expected - trained.keys())[:3]})")
        model.save_pretrained(adapter_dir, safe_serialization=True)
        merged = model.merge_and_unload()
        export_hf(merged, merged.state_dict(), tokenizer, final)
    dist.barrier()
    return final
