"""Set-up and clean-up shared by the training recipes: ``setup → train → export → cleanup``.

Every recipe builds its policy with ``build_policy`` (tokenizer, model, the root module that computes
what its loss needs, MLP recompute + activation checkpointing + FSDP through ``parallelize``), its
batch geometry with ``batch_geometry``, the loop's settings with ``loop_settings``, and ends with
``export_final`` and ``finish`` (the one-screen summary).

``model.liger`` (``posttrain.models.liger``: Liger's RMSNorm, SwiGLU and RoPE kernels on the policy only) is
checked and applied here too, before LoRA.

``model.moe`` is checked against the model's config in ``start_run`` (a dense model with it set is an error
before any run state is written), and ``loop_settings`` gives the loop the policy's router hooks
(``posttrain.train.router``): the router losses of every recipe are added in the loop, not here.

``model.lora`` is applied here and only here (``build_policy``, through ``posttrain.models.lora``), so every
recipe that builds its policy this way trains adapters when it is set, and ``export_final`` writes the
adapter and the merged model.
"""

from __future__ import annotations

import errno
import random
import sys
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain import dist
from posttrain.config.loader import dump_config
from posttrain.config.recipes import TrainingRecipe
from posttrain.config.redact import public_dump
from posttrain.models.attention import attention_for
from posttrain.models.liger import apply_kernels, check_liger
from posttrain.models.load import DTYPES, check_model_path, load_model, load_tokenizer
from posttrain.models.lora import (
    LoraSetupError,
    apply_lora,
    check_lora_model,
    describe,
    export_adapter_and_merged,
    parameter_counts,
    quantization_config,
)
from posttrain.store import RunStore
from posttrain.store.lock import RunLock, lock_run, release_held
from posttrain.store.manifest import CheckpointTrust, load_signing_key
from posttrain.store.run_store import CHECKPOINTS
from posttrain.telemetry.trackers import check_trackers
from posttrain.train.checkpoint import CheckpointInfo, DiskFullError, export_hf, full_model_state_dict
from posttrain.train.health import Alerts, HealthGuard
from posttrain.train.identity import (
    FINISHED,
    RUN_FILES,
    ResumePlan,
    RunIdentity,
    plan_resume,
    write_finished,
)
from posttrain.train.loop import Evaluate, LoopSettings
from posttrain.train.metrics import train_flops_per_token
from posttrain.train.parallelize import parallelize, uses_fsdp
from posttrain.train.router import check_moe_model, routing_for
from posttrain.train.source import BatchGeometry
from posttrain.train.watchdog import drill_step


def say(message: str) -> None:
    """Print on rank 0 only (stderr, so stdout stays clean for machine-readable output)."""
    if dist.is_main():
        print(f"[posttrain] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    config: TrainingRecipe
    output_dir: Path  # where the run writes: output_dir itself, or the local mirror of a remote one
    identity: RunIdentity
    plan: ResumePlan
    store: RunStore
    attempt: str = ""  # this start's id, the same on every rank (names the upload markers of its checkpoints)
    lock: RunLock | None = None  # rank 0: one run per output_dir, held until the recipe ends (posttrain.store.lock)

    @property
    def finished(self) -> bool:
        """The run in ``output_dir`` already finished: the recipe has nothing to do."""
        return self.plan.finished is not None


def open_store(config: TrainingRecipe) -> RunStore:
    """The run's store, with what its checkpoints are checked against (``store.signing_key``, ``train.max_steps``)."""
    store = config.store
    trust = CheckpointTrust(load_signing_key(store.signing_key), config.train.max_steps)
    return RunStore(config.output_dir, store.local_dir, store.backoff_s, store.max_outage_s, trust=trust)


def _plan_on_main(config: TrainingRecipe, store: RunStore, identity: RunIdentity):
    """Rank 0: bring a remote run's state down (or move it aside), decide the resume, write ``config.yaml``."""
    moved, fetched = None, None
    if store.remote and config.train.resume == "never":
        moved = store.move_previous()
        store.clear_local()
    elif store.remote:
        fetched = store.sync_down()
    skipped: list[tuple[str, str]] = list(store.skipped)
    plan = plan_resume(store.local, identity, config.train.resume, export_exists=store.exists if store.remote else None,
                       latest=(lambda: CheckpointInfo.at(store.local / CHECKPOINTS, *fetched) if fetched else None) if store.remote else None,
                       trust=store.trust, skipped=lambda where, why: skipped.append((where, why)))
    plan.skipped = skipped
    if moved:
        plan.message = f"train.resume=never: the previous run was moved to {moved}"
    if plan.finished is None:
        try:
            dump_config(config, store.local / "config.yaml")
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return DiskFullError(errno.ENOSPC, f"no space left on the device for {store.local}: free space and rerun")
        store.push(("config.yaml",))
    return plan


def start_run(config: TrainingRecipe, check_data: Callable[[TrainingRecipe], None] | None = None) -> Run:
    """Process group, seeds, the run store, the resume decision and the resolved ``config.yaml``.

    Nothing is written (no directory, lock or ``config.yaml``) before ``model.path`` is found loadable
    (``check_model_path``: on disk, or on the hub or in its cache, within seconds) and ``check_data(config)``,
    the recipe's look at its data files, has passed.

    The resume decision (``posttrain.train.identity.plan_resume``) is made once on rank 0, before any data
    is read, and shared with every rank; a refused resume raises ``ResumeError``. With a remote
    ``output_dir`` rank 0 first brings the run's small files and newest valid checkpoint into the local
    mirror (``posttrain.store``); on other nodes, the first process fetches that checkpoint too. The config is
    not changed after ``config.yaml`` is written.
    """
    check_model_path(config.model.path)  # a mistyped path or an unreachable hub id fails here, before any run state
    check_moe_model(config.model)  # so does model.moe on a model that cannot use it (a dense one)
    check_lora_model(config.model)  # and model.lora.experts on a dense model
    dist.init_distributed()
    if config.model.liger:  # so do kernels that cannot run here, on every rank, before any data or weight is read
        check_liger(config.model.path, config.model.trust_remote_code, config.train.recompute_mlp, dist.device())
    if check_data is not None:
        check_data(config)  # and so does data that cannot train
    seed = config.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    store = open_store(config)
    plan: ResumePlan | Exception | None = None
    identity, attempt, lock = None, "", None
    if dist.is_main():
        attempt = uuid.uuid4().hex[:12]
        try:
            # inside the try: hashing the data (remote data included) can fail on rank 0 alone, and the other
            # ranks would then wait in the broadcast below for ever
            identity = RunIdentity.of(config)
            release_held()  # a process trains one run at a time: an earlier run's lock here is over
            # Makes the directory; another run in it, or a directory that cannot be written, is exit 2.
            lock = lock_run(store)
            for note in lock.notes:
                say(note)
            plan = _plan_on_main(config, store, identity)
            lock.refresh()  # train.resume=never moved the store's objects, the lease too, aside
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, not only here (no rank may hang)
            plan = exc
    identity, plan, attempt = dist.broadcast_object((identity, plan, attempt))
    if isinstance(plan, Exception):
        dist.destroy()
        raise plan
    if store.remote and plan.checkpoint is not None:
        if dist.local_rank() == 0 and not dist.is_main():  # another node: its own disk, its own mirror
            store.fetch_checkpoint(plan.checkpoint.step, plan.checkpoint.manifest)
        plan.checkpoint = CheckpointInfo.at(store.local / CHECKPOINTS, plan.checkpoint.step,
                                            plan.checkpoint.manifest)
    dist.barrier()
    where = store.url if store.remote else str(store.local)
    if plan.finished is not None:
        say(f"{where} holds a finished run ({plan.finished['steps']} steps, exported to "
            f"{where}/{plan.finished['export'] or 'final'}): nothing to do. To train again, use a new "
            "output_dir or train.resume=never")
    elif plan.message:
        say(plan.message)
    if store.remote and dist.is_main():
        say(f"run store {store.url} (local mirror {store.local})")
    return Run(config, store.local, identity, plan, store, attempt, lock)


def peek_data(config: TrainingRecipe, kind: str, names: tuple[str, str] = ("training set", "eval set")) -> dict[str, Any]:
    """``start_run``'s look at a recipe's data, before the run writes anything or loads the model: each local file
    (``data.train``, ``data.eval``) read as far as ``peek_records`` judges it — its first bad record under
    ``data.on_error: raise`` raises here — and a file read whole must be usable (``ReadReport.check_usable``).
    Returns the peeks of the files read whole, by path, for recipe-specific checks (SFT's curriculum). A longer
    or remote file is judged by the full read, before the model loads."""
    from posttrain.data.io import peek_records

    data, whole = config.data, {}
    for path in (data.train, getattr(data, "eval", None)):
        peek = peek_records(path, kind, data.format, data.on_error, data.max_record_bytes) if path else None
        if peek is None or not peek.complete:
            continue
        peek.report.check_usable(names[0] if path == data.train else names[1])  # the full read's words
        whole[path] = peek
    return whole


def batch_geometry(config: TrainingRecipe) -> BatchGeometry:
    """``train.global_batch_size`` over this run's ranks (a clear error when it does not split)."""
    train = config.train
    world = dist.world_size()
    if world > 1 and "global_batch_size" not in train.model_fields_set:
        warnings.warn(
            f"train.global_batch_size is not set: the global batch is train.batch_size={train.batch_size}, split "
            f"over {world} ranks; set train.global_batch_size explicitly to keep it fixed across restarts",
            stacklevel=2,
        )
    geometry = BatchGeometry.derive(train.global_batch, train.batch_size, world)
    if geometry.micro_batch < train.batch_size:
        warnings.warn(
            f"train.batch_size={train.batch_size} is more than each rank's share of the global batch "
            f"(train.global_batch_size={train.global_batch} over {world} rank(s) = {geometry.per_rank}); the "
            f"micro-batch is {geometry.micro_batch}. Raise train.global_batch_size for bigger steps",
            stacklevel=2,
        )
    return geometry


def base_quantization(config: TrainingRecipe):
    """The ``BitsAndBytesConfig`` a loader passes to ``from_pretrained`` for QLoRA (None otherwise)."""
    lora = config.model.lora
    if lora is None or lora.quantize == "none":
        return None
    return quantization_config(lora, DTYPES[config.model.dtype], dist.device())


def load_causal_lm(config: TrainingRecipe, tokenizer) -> torch.nn.Module:  # noqa: ARG001 - loader signature
    model = config.model
    quantization = base_quantization(config)
    device = dist.device() if quantization is not None else "cpu"
    attention = attention_for(model, config.train.precision)
    return load_model(model.path, model.dtype, attention, model.trust_remote_code, device, quantization)


def build_policy(
    config: TrainingRecipe,
    wrap: Callable[[torch.nn.Module], torch.nn.Module],
    load_lm: Callable[[TrainingRecipe, object], torch.nn.Module] = load_causal_lm,
    lora_task: str = "CAUSAL_LM",
) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """Load tokenizer and model, add LoRA adapters (``model.lora``), wrap the model in the root module the
    loss calls, then ``parallelize``.

    ``wrap(lm)`` builds the root (``TokenLogprobModel`` for SFT, ``PairLogprobModel`` for DPO,
    ``RewardModel`` for RM); ``load_lm`` loads the HF model (a causal LM by default); ``lora_task`` is
    peft's task (``SEQ_CLS`` also trains a reward model's score head). Returns ``(root, lm, tokenizer)``;
    ``root.lm`` is the HF model — a peft ``PeftModel`` around it with LoRA — for export and generation.
    """
    train, lora = config.train, config.model.lora
    if lora is not None and lora.quantize != "none" and uses_fsdp(train.fsdp):
        raise LoraSetupError("model.lora.quantize=4bit runs in one process: FSDP2 does not shard bitsandbytes' "
                             "4-bit weights; run on one rank with train.fsdp=off, or set model.lora.quantize=none")
    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    lm = load_lm(config, tokenizer)
    lm.config.use_cache = False
    if config.model.liger:  # on the base model, before peft wraps its projections
        say(apply_kernels(lm))
    if lora is not None:
        lm = apply_lora(lm, lora, lora_task)
    trainable, total = parameter_counts(lm)
    root = wrap(lm)
    applied = parallelize(
        root, lm, fsdp=train.fsdp, precision=train.precision, cpu_offload=train.cpu_offload,
        activation_checkpointing=train.activation_checkpointing, ac_every=train.ac_every,
        recompute_mlp=train.recompute_mlp, compile=train.compile, expert=config.parallel.expert,
    )
    say(f"model {config.model.path}: {describe(lora, trainable, total, lm)}; {applied}")
    return root, lm, tokenizer


def loop_settings(run: Run, lm: torch.nn.Module, evaluate: Evaluate | None = None) -> LoopSettings:
    config = run.config
    check_trackers(config.metrics)  # a missing tracker package fails here, on every rank, before any step
    train, health, debug = config.train, config.health, config.debug
    alerts = Alerts(run.output_dir / "alerts.jsonl", config.alerts.webhook, config.alerts.timeout_s)
    for where, why in run.plan.skipped:  # recorded by rank 0 (emit)
        alerts.emit("checkpoint_skipped", checkpoint=where, reason=why,
                    message=f"checkpoint {where} was not resumed from: {why}; an older one was used")
    return LoopSettings(
        output_dir=run.output_dir,
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
        precision=train.precision,
        sharded=uses_fsdp(train.fsdp),
        activation_offload=train.activation_offload,
        flops_per_token=train_flops_per_token(lm),
        peak_flops=train.peak_flops,
        identity=run.identity.to_dict(),
        resume_from=run.plan.checkpoint,
        store=run.store,
        attempt=run.attempt,
        upload=config.store.upload,
        health=HealthGuard(
            spike_ratio=health.spike_ratio,
            window=health.window,
            max_consecutive=health.max_consecutive,
            enabled=health.enabled,
        ),
        alerts=alerts,
        max_rollbacks=health.max_rollbacks,
        skip_steps=frozenset(health.skip_steps),
        eval_every=train.eval_every,
        evaluate=evaluate,
        nan_steps=frozenset(debug.nan_steps),
        spike_steps=frozenset(debug.spike_steps),
        spike_factor=debug.spike_factor,
        crash_at_step=drill_step(debug.crash_at_step, debug.crash_rank),
        hang_at_step=drill_step(debug.hang_at_step, debug.hang_rank),
        stall_timeout_s=health.stall_timeout_s,
        log_unit_ids=debug.log_unit_ids,
        tensorboard=config.metrics.tensorboard,
        telemetry=config.metrics,
        run_config=public_dump(config),  # secrets stay out of W&B and MLflow
        routing=routing_for(lm, config.model),  # an MoE policy: router losses, balance, expert load (docs/moe.md)
    )


def export_final(run: Run, root: torch.nn.Module, lm: torch.nn.Module, tokenizer,
                 load_lm: Callable[[TrainingRecipe, object], torch.nn.Module] = load_causal_lm) -> Path:
    """Gather the full weights (a collective) and write ``output_dir/final`` in HF format on rank 0.

    With ``model.lora``: ``output_dir/adapter`` (peft) and ``output_dir/final`` (the adapter merged into a
    full-precision base that ``load_lm`` loads on rank 0; ``posttrain.models.lora``).
    """
    lora = run.config.model.lora
    if lora is not None:
        unquantized = run.config.model_copy(deep=True)
        unquantized.model.lora.quantize = "none"
        return export_adapter_and_merged(root, tokenizer, run.output_dir, lambda: load_lm(unquantized, tokenizer))
    state = full_model_state_dict(root)
    final = run.output_dir / "final"
    if dist.is_main():
        lm_state = {key.removeprefix("lm."): value for key, value in state.items() if key.startswith("lm.")}
        export_hf(lm, lm_state, tokenizer, final)
    dist.barrier()
    return final


def finish(name: str, run: Run, settings: LoopSettings, export: Path | None) -> None:
    """Mark the run finished (a rerun says so instead of exporting again) and print the one-screen summary."""
    settings.summary.export = str(export) if export is not None else None
    if dist.is_main():
        write_finished(run.output_dir, run.identity, settings.summary.steps, export)
        # A remote store gets the run's files, finished.json last: a run is finished only once all is there.
        run.store.push([name for name in RUN_FILES if name not in ("checkpoints", FINISHED)]
                       + sorted(p.name for p in run.output_dir.glob("quarantine*.jsonl")) + [FINISHED])
        if run.store.remote:
            settings.summary.export = f"{run.store.url}/{Path(export).name}" if export is not None else None
    for line in settings.summary.lines(name):
        say(line)
