"""Set-up and clean-up shared by the training recipes: ``setup → train → export → cleanup``."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from posttrain import dist
from posttrain.config.loader import dump_config
from posttrain.config.recipes import TrainingRecipe
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.logprobs import TokenLogprobModel
from posttrain.models.tiny import count_parameters
from posttrain.train.checkpoint import export_hf, full_model_state_dict
from posttrain.train.health import Alerts, HealthGuard
from posttrain.train.loop import LoopSettings
from posttrain.train.parallelize import parallelize


def config_hash(config: TrainingRecipe) -> str:
    text = json.dumps(config.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def say(message: str) -> None:
    """Print on rank 0 only (stderr, so stdout stays clean for machine-readable output)."""
    if dist.is_main():
        print(f"[posttrain] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    config: TrainingRecipe
    output_dir: Path
    config_hash: str


def start_run(config: TrainingRecipe) -> Run:
    dist.init_distributed()
    seed = config.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    output_dir = Path(config.output_dir)
    if dist.is_main():
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, output_dir / "config.yaml")
    dist.barrier()
    return Run(config, output_dir, config_hash(config))


def load_policy(config: TrainingRecipe) -> tuple[TokenLogprobModel, torch.nn.Module, object]:
    """Load tokenizer and model, wrap for chunked log-probs, apply AC + FSDP. Returns (root, lm, tokenizer)."""
    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    lm = load_model(config.model.path, config.model.dtype, config.model.attn_implementation, config.model.trust_remote_code)
    lm.config.use_cache = False
    root = TokenLogprobModel(lm, chunk_size=config.train.loss_chunk_size)
    applied = parallelize(
        root,
        lm,
        fsdp=config.train.fsdp,
        precision=config.train.precision,
        cpu_offload=config.train.cpu_offload,
        activation_checkpointing=config.train.activation_checkpointing,
        ac_every=config.train.ac_every,
    )
    say(f"model {config.model.path}: {count_parameters(lm) / 1e6:.2f}M parameters; {applied}")
    return root, lm, tokenizer


def loop_settings(run: Run, root: torch.nn.Module, lm: torch.nn.Module) -> LoopSettings:
    config = run.config
    train, health = config.train, config.health
    uses_fsdp = dist.world_size() > 1 or train.fsdp == "on"
    return LoopSettings(
        output_dir=run.output_dir,
        batch_size=train.batch_size,
        grad_accum=train.grad_accum,
        lr=train.lr,
        lr_schedule=train.lr_schedule,
        warmup_steps=train.warmup_steps,
        min_lr_ratio=train.min_lr_ratio,
        weight_decay=train.weight_decay,
        betas=train.betas,
        max_grad_norm=train.max_grad_norm,
        save_every=train.save_every,
        keep_last=train.keep_last,
        log_every=train.log_every,
        autocast_bf16=train.precision == "bf16" and not uses_fsdp,
        params_for_mfu=count_parameters(lm, exclude_embeddings=True),
        peak_flops=train.peak_flops,
        config_hash=run.config_hash,
        health=HealthGuard(
            spike_zscore=health.spike_zscore,
            window=health.window,
            min_history=health.min_history,
            max_consecutive=health.max_consecutive,
            enabled=health.enabled,
        ),
        alerts=Alerts(run.output_dir / "alerts.jsonl", config.alerts.webhook, config.alerts.timeout_s),
        max_rollbacks=health.max_rollbacks,
        nan_steps=frozenset(config.debug.nan_steps),
        spike_steps=frozenset(config.debug.spike_steps),
        spike_factor=config.debug.spike_factor,
        crash_at_step=config.debug.crash_at_step,
        tensorboard=config.metrics.tensorboard,
    )


def export_final(run: Run, root: torch.nn.Module, lm: torch.nn.Module, tokenizer) -> Path:
    """Gather the full weights (a collective) and write ``output_dir/final`` in HF format on rank 0."""
    state = full_model_state_dict(root)
    final = run.output_dir / "final"
    if dist.is_main():
        lm_state = {key.removeprefix("lm."): value for key, value in state.items() if key.startswith("lm.")}
        export_hf(lm, lm_state, tokenizer, final)
        say(f"exported {final} (HF format)")
    dist.barrier()
    return final
