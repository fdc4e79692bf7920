"""Config sections shared by the training recipes (SFT, pretrain, DPO, reward model)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.loader import StrictModel
from posttrain.config.redact import SECRET


class LoraConfig(StrictModel):
    """``model.lora``: train low-rank adapters (peft) on a frozen base instead of every weight (docs/lora.md)."""

    r: int = Field(default=16, ge=1, description="LoRA rank: each adapted weight W gets W + (alpha / r)·B·A, A [r × in].")
    alpha: float = Field(default=32.0, gt=0, description="LoRA scale numerator: the update is scaled by alpha / r.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input (training only).")
    target_modules: str | list[str] = Field(
        default="all-linear",
        description="Module names to adapt (e.g. [q_proj, v_proj]), or all-linear: every linear layer but the "
        "output head.",
    )
    quantize: Literal["none", "4bit"] = Field(
        default="none",
        description="4bit: QLoRA, the frozen base loaded in 4-bit NF4 through bitsandbytes (one process only; "
        "pip install 'posttrain[qlora]').",
    )
    experts: bool = Field(
        default=False,
        description="Mixture-of-experts models only: also adapt each MoE layer's routed experts (the stacked "
        "experts.gate_up_proj and experts.down_proj weights, a rank-r pair per expert, through peft's "
        "target_parameters). Needs dropout 0 and parallel.expert 1; the router stays frozen (docs/moe.md).",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value):
        if not value:
            raise ValueError("model.lora.target_modules is empty: name the modules to adapt, or all-linear")
        return value

    @model_validator(mode="after")
    def _experts_without_dropout(self) -> LoraConfig:
        # peft adds an expert adapter's B·A to the stacked weight itself: there is no adapter input to drop out,
        # and peft refuses the combination (one dropout setting covers every target).
        if self.experts and self.dropout > 0:
            raise ValueError(f"model.lora.experts needs model.lora.dropout=0 (it is {self.dropout:g}): the expert "
                             "adapters are added to the stacked expert weights, so no adapter input exists to drop out")
        return self


class MoeConfig(StrictModel):
    """``model.moe``: router losses and balance of a mixture-of-experts model (docs/moe.md). Set on a dense
    model it is an error, never ignored. Expert load is logged for every MoE model, with or without it."""

    aux_loss_weight: float = Field(
        default=0.0, ge=0.0,
        description="Weight of the load-balancing loss in the form the architecture defines (qwen3_moe: Switch's "
        "E·Σ f_i·P_i; deepseek_v3: the sequence-wise Σ f_i·P_i), per sequence, averaged over MoE layers.",
    )
    z_loss_weight: float = Field(
        default=0.0, ge=0.0, description="Weight of the router z-loss (ST-MoE): mean (logsumexp of router logits)²."
    )
    bias_update_rate: float = Field(
        default=0.0, ge=0.0,
        description="DeepSeek-V3's auxiliary-loss-free balancing: after each update every router's selection bias "
        "moves by this much towards balance, b_i += rate·sign(mean load - load_i) (routers with a bias only).",
    )


class ModelConfig(StrictModel):
    path: str = Field(description="Local HF-format directory (or a hub id when the network allows).")
    dtype: Literal["float32", "bfloat16"] = "float32"
    attn_implementation: Literal["auto", "sdpa", "eager", "varlen"] = Field(
        default="auto",
        description="auto: varlen where torch's variable-length Flash Attention runs (a CUDA device, bf16 "
        "compute), else sdpa. varlen: packed rows attend example by example from their boundaries, with no "
        "dense block-diagonal mask (posttrain.models.attention); other batches as sdpa.",
    )
    trust_remote_code: bool = False
    lora: LoraConfig | None = Field(
        default=None,
        description="Train LoRA adapters through peft instead of the whole model (null: full fine-tuning). "
        "Export: output_dir/final is the merged model, output_dir/adapter the peft adapter.",
    )
    liger: bool = Field(
        default=False,
        description="Liger's Triton kernels (pip install 'posttrain[liger]'; CUDA only): RMSNorm, SwiGLU and RoPE "
        "in the policy (Llama, Mistral, Qwen2, Qwen3), and for SFT/pretrain loss a fused linear cross-entropy "
        "head instead of posttrain's chunked one (docs/liger.md).",
    )
    moe: MoeConfig | None = Field(
        default=None,
        description="Router losses and balance of a mixture-of-experts model (null: none; docs/moe.md).",
    )


class DataConfig(StrictModel):
    train: str | None = Field(
        default=None, description="Training data: .jsonl, .parquet or a saved HF dataset, or a directory or glob of "
        "shard files read in name order; a local path or a URL (s3://bucket/data/train-*.parquet).")
    eval: str | None = Field(default=None, description="Held-out data, in any form data.train takes.")
    format: Literal["auto", "messages", "sharegpt", "alpaca", "preference", "preference_conversational", "rl"] = "auto"
    on_error: Literal["raise", "quarantine"] = "raise"
    quarantine_path: str | None = Field(
        default=None, description="Where quarantined records go; default: <output_dir>/quarantine.jsonl (uploaded "
        "with the run's other files when output_dir is remote)."
    )
    packing: bool = False
    truncation_side: Literal["right", "left"] = "right"
    curriculum: Literal["none", "tiered", "tiered_strict", "competence"] = Field(
        default="none", description="Order of the data: none (a seeded shuffle per epoch); tiered (each epoch tier 1 "
        "→ 2 → 3; data with no `tier` at all falls back to none's shuffle with one warning); tiered_strict (tiered, "
        "and untiered data is an error); competence (paced easy to hard by tier, then difficulty).",
    )
    competence_start: float = Field(default=0.25, gt=0.0, le=1.0, description="c(0) for competence pacing.")
    competence_steps: int | None = Field(
        default=None, ge=1, description="Steps until c(t) reaches 1; default: half of the run."
    )
    shuffle: bool = True
    # The same default as posttrain.data.lines.MAX_RECORD_BYTES (not imported: it would load fsspec for --help).
    max_record_bytes: int = Field(
        default=64 * 2**20, ge=1, description="Longest JSON line read as a record, in bytes (default 64 MiB). A "
        "longer line is skipped to its end without being held in memory and counted as a bad record (quarantined "
        "with the reason under on_error: quarantine, else the read stops naming its line).",
    )


class TrainConfig(StrictModel):
    global_batch_size: int | None = Field(
        default=None, ge=1,
        description="Units (examples, packed rows or pairs) per optimizer step over all ranks; each rank takes "
        "global_batch_size / ranks of them in micro-batches of batch_size. Fixed across restarts, so a run "
        "resumes on any number of ranks at the exact data position. Default: batch_size.",
    )
    batch_size: int = Field(
        default=8, ge=1, description="Micro-batch: units per forward on one rank (the rest is accumulated)."
    )
    max_length: int = Field(default=512, ge=8)
    epochs: float | None = Field(default=None, gt=0, description="Passes over the data (default 1 without max_steps).")
    max_steps: int | None = Field(default=None, ge=1, description="Optimizer steps; set this or epochs, not both.")
    lr: float = Field(default=2e-5, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    seed: int = 0
    save_every: int | None = Field(default=None, ge=1, description="Checkpoint every N optimizer steps.")
    resume: Literal["auto", "never", "must", "force"] = Field(
        default="auto",
        description="auto: resume from the newest valid checkpoint in output_dir when there is one; must: refuse to "
        "start without one; never: move the previous run into output_dir/previous-<time>/ and start from step 0; "
        "force (--force-resume): like auto, also from a checkpoint whose run identity cannot be read (its files "
        "are still checked against the manifest).",
    )
    keep_last: int = Field(default=2, ge=1)
    eval_every: int | None = Field(
        default=None, ge=1, description="Evaluate on data.eval every N steps (and always at the end)."
    )
    precision: Literal["fp32", "bf16"] = "fp32"
    cpu_offload: bool = Field(
        default=False, description="FSDP2 keeps parameters, gradients and optimizer state in host memory "
        "(pinned where an accelerator exists); needs FSDP.",
    )
    activation_offload: bool = Field(
        default=False, description="Tensors saved for backward wait in host memory between forward and backward "
        "(with activation checkpointing: only the checkpointed blocks' inputs). Same numbers, less device memory, "
        "more host traffic.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every: int = Field(default=2, ge=1, description="Selective checkpointing: every k-th block.")
    recompute_mlp: bool = Field(
        default=False,
        description="Gated MLPs recompute act(gate)*up and the down projection in backward: two fewer "
        "[tokens, intermediate] tensors kept per block for ~3% more compute.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each decoder block (after activation checkpointing, before FSDP2). The first "
        "steps pay the compile time; on GPU it fuses the block's elementwise work.",
    )
    fsdp: Literal["auto", "on", "off"] = Field(
        default="auto", description="auto: shard with FSDP2 when world size > 1."
    )
    log_every: int = Field(
        default=1, ge=1,
        description="Send every k-th step record (and the last) to the trackers (TensorBoard, W&B, MLflow) and the "
        "Prometheus exporter, and refresh the progress line's figures. metrics.jsonl keeps every step.",
    )
    peak_flops: float | None = Field(
        default=None, gt=0, description="Peak FLOP/s per device for MFU; default: a guess from the device."
    )
    loss_chunk_size: int = Field(default=1024, ge=1, description="Tokens per output-head chunk.")

    @model_validator(mode="before")
    @classmethod
    def _one_epoch_by_default(cls, data):
        if isinstance(data, dict) and "grad_accum" in data:
            raise ValueError(
                "train.grad_accum is derived now: set train.global_batch_size (units per optimizer step over all "
                "ranks) and train.batch_size (the micro-batch); accumulation = global / (ranks × batch_size)"
            )
        if isinstance(data, dict) and "epochs" not in data and data.get("max_steps") is None:
            data = {**data, "epochs": 1.0}  # neither given: one pass over the data
        return data

    @field_validator("fsdp", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        # YAML 1.1 reads a bare on/off as a boolean.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set train.epochs or train.max_steps")
        if self.epochs is not None and self.max_steps is not None:
            raise ValueError(
                f"train.epochs={self.epochs:g} and train.max_steps={self.max_steps} are both set; max_steps would "
                "silently win. Keep one (train.epochs=null to train for max_steps)"
            )
        if self.cpu_offload and self.fsdp == "off":
            raise ValueError("train.cpu_offload needs FSDP; set train.fsdp=auto or on")
        return self

    @property
    def global_batch(self) -> int:
        return self.global_batch_size or self.batch_size


class HealthConfig(StrictModel):
    enabled: bool = True
    spike_ratio: float = Field(
        default=10.0, gt=1.0,
        description="A loss or gradient norm above this many times the largest of the last `window` good steps is a "
        "spike (Megatron-LM's test), from the second step on.",
    )
    window: int = Field(default=64, ge=1, description="Good steps whose largest loss / grad norm a step is compared with.")
    max_consecutive: int = Field(default=3, ge=1, description="Bad steps in a row before rolling back.")
    max_rollbacks: int = Field(default=5, ge=0)
    skip_steps: list[int] = Field(
        default_factory=list,
        description="Optimizer steps whose batches are never trained on (e.g. batches an earlier run found bad).",
    )
    stall_timeout_s: float | None = Field(
        default=1800.0, gt=0,
        description="A rank with no progress (no step, evaluation or checkpoint save begun) for this long writes "
        "its stacks to a 'stalled' alert and exits 75 so the launcher restarts the group from the newest "
        "checkpoint (docs/stalls.md). Above the longest single step, evaluation or save; null: off.",
    )


    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
        replaced = {"spike_zscore", "min_history"} & set(data) if isinstance(data, dict) else set()
        if replaced:
            raise ValueError(
                f"health.{sorted(replaced)[0]} is gone: the spike test is now a ratio to the largest of the last "
                "health.window good steps, from the second step on; set health.spike_ratio (default 10) instead"
            )
        return data


class AlertsConfig(StrictModel):
    webhook: str | None = Field(default=None, json_schema_extra=SECRET, description=(
        "POST each alert as JSON to this URL. A credential (Slack's and most others carry the token in the "
        "URL): trackers receive it redacted."))
    timeout_s: float = 5.0


class StoreConfig(StrictModel):
    """``store``: how a run talks to a remote ``output_dir`` (``s3://…``; docs/cloud.md). Unused for a local one."""

    local_dir: str | None = Field(
        default=None,
        description="Local mirror of a remote output_dir: checkpoints are written here first, then uploaded. "
        "Default: $XDG_CACHE_HOME/posttrain/runs/<name>-<hash of the URL>.",
    )
    upload: Literal["background", "blocking", "direct"] = Field(
        default="background",
        description="background: a checkpoint is saved to local_dir, then uploads while training goes on (one "
        "upload in flight; the next save waits for it); blocking: the step waits for the upload; direct: DCP "
        "writes into the store itself (no local copy; for small local disks), verified before the commit.",
    )
    backoff_s: float = Field(default=1.0, gt=0, description="First retry delay after a failed store call; doubles up to 30 s.")
    max_outage_s: float = Field(
        default=600.0, gt=0,
        description="A store failing for this long stops the run: alert, exit 75 (resumable). Shorter outages "
        "are retried while training goes on.",
    )
    signing_key: str | None = Field(
        default=None,
        description="Where the key that signs checkpoint manifests is: env:VAR (e.g. from a Kubernetes Secret) or "
        "file:/path (a mounted Secret); never the key itself. Every manifest written gets an HMAC-SHA256, and a "
        "resume refuses (exit 2) a manifest without a valid one. Local and remote output_dir alike.",
    )

    @field_validator("signing_key")
    @classmethod
    def _key_location(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith(("env:", "file:")) and len(value.split(":", 1)[1]) > 0):
            raise ValueError("give where the key is, env:VAR or file:/path; a key written into the config would be "
                             "copied into config.yaml and every tracker")
        return value


class DebugConfig(StrictModel):
    """Fault-injection drills: prove that alerts, skips and rollbacks work before a real incident."""

    nan_steps: list[int] = Field(default_factory=list, description="Make the loss NaN at these steps.")
    spike_steps: list[int] = Field(default_factory=list, description="Multiply the loss at these steps.")
    spike_factor: float = Field(default=1000.0, gt=1.0)
    crash_at_step: int | None = Field(
        default=None, ge=0, description="SIGKILL the rank(s) after this step's update (a node-loss drill)."
    )
    crash_rank: int | None = Field(
        default=None, ge=0, description="Only this rank is killed by crash_at_step (default: every rank)."
    )
    hang_at_step: int | None = Field(
        default=None, ge=0,
        description="The rank(s) sleep for ever at the start of this step, before its collectives (a stall drill "
        "for health.stall_timeout_s). Drills fire only in the first attempt of a torchrun-restarted run.",
    )
    hang_rank: int | None = Field(
        default=None, ge=0, description="Only this rank hangs at hang_at_step (default: every rank)."
    )
    log_unit_ids: bool = Field(
        default=False, description="Write the ids of the units each rank trains on per step to units.jsonl."
    )


class WandbConfig(StrictModel):
    """``metrics.wandb``: log every step record and the resolved config to Weights & Biases (rank 0)."""

    project: str
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = Field(
        default="online", description="offline: write the run under dir for a later `wandb sync`."
    )
    dir: str | None = Field(default=None, description="Where W&B keeps its files; default: output_dir.")


class MlflowConfig(StrictModel):
    """``metrics.mlflow``: log every step record and the resolved config (as params) to MLflow (rank 0)."""

    tracking_uri: str = Field(description="e.g. http://mlflow:5000, or file:///path/mlruns for a local store.")
    experiment: str = Field(description="Experiment name; created when it does not exist.")
    run_name: str | None = None


class MetricsConfig(StrictModel):
    """Where the per-step records go besides metrics.jsonl (docs/metrics.md)."""

    tensorboard: bool = Field(default=True, description="Also write TensorBoard events when it is installed.")
    prometheus_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Serve Prometheus /metrics on this port from rank 0 (0: any free port, printed at start; "
        "null: off). pip install 'posttrain[prometheus]'.",
    )
    prometheus_addr: str = Field(default="0.0.0.0", description="Address the /metrics server binds.")
    prometheus_linger_s: float = Field(
        default=0.0, ge=0.0,
        description="When the run ends, keep serving until one scrape has fetched the final values, at most "
        "this many seconds (a short run otherwise ends between two scrapes).",
    )
    allreduce_probe_every: int = Field(
        default=50, ge=1, description="Time a small all-reduce every N steps (posttrain_allreduce_latency_seconds)."
    )
    wandb: WandbConfig | None = Field(default=None, description="Weights & Biases (null: off).")
    mlflow: MlflowConfig | None = Field(default=None, description="MLflow (null: off).")


class ParallelConfig(StrictModel):
    """``parallel``: how a mixture-of-experts model's experts are split over the ranks (docs/moe.md). The dense
    parts are always sharded with FSDP2 (``train.fsdp``)."""

    expert: int = Field(
        default=1, ge=1,
        description="Expert parallelism: each MoE layer's experts sharded over this many ranks (an EP group), "
        "tokens sent to their experts with all-to-all. Must divide the number of ranks and the experts per layer; "
        "1: off. A checkpoint resumes at any value (DCP reshards the experts).",
    )
