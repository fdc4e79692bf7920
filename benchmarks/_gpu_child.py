"""The subprocess side of benchmarks/gpu.py: the matmul peak, one posttrain row, one TRL row.

Each writes its figures to ``spec["result_path"]`` after its last timed step and leaves at once
(``os._exit``), so no row spends its budget on an export or a final save.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import gpu

IGNORE_INDEX = -100


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_peak(spec: dict) -> dict:
    """Median TFLOP/s of ``repeats`` timed n³ bf16 matmuls on random data, after three warm-ups."""
    import torch

    n, device = spec["size"], "cuda" if torch.cuda.is_available() else "cpu"
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(spec["repeats"]):
        _sync()
        start = time.perf_counter()
        a @ b
        _sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"status": "ok", "device": device, "size": n, "repeats": spec["repeats"], "median_s": median,
            "tflops": round(2 * n**3 / median / 1e12, 4),
            "note": None if device == "cuda" else "cpu: no GPU here, not a peak claim"}


class StepClock:
    """Ends of optimizer steps (after a device sync), the work each step did, and the row's figures at the end."""

    def __init__(self, spec: dict):
        self.spec, self.ends, self.tokens, self.flops, self.extra = spec, [time.perf_counter()], [], [], {}
        self.total = spec["warmup"] + spec["steps"]

    def step_done(self, tokens: float, flops: float) -> None:
        _sync()
        self.ends.append(time.perf_counter())
        self.tokens.append(tokens)
        self.flops.append(flops)
        if len(self.tokens) == self.total:
            self.finish()

    def finish(self) -> None:
        import torch

        w = self.spec["warmup"]
        times = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)][w:]
        median = statistics.median(times)
        tokens, flops = statistics.fmean(self.tokens[w:]), statistics.fmean(self.flops[w:])
        cuda = torch.cuda.is_available()
        figures = {
            "status": "ok", "median_step_s": round(median, 4), "step_times_s": [round(t, 4) for t in times],
            "tokens_per_step": round(tokens, 1), "tokens_per_s": round(tokens / median, 1),
            "flops_per_step": flops,
            "mfu": round(gpu.mfu(flops, median, self.spec["peak_flops"]), 4) if self.spec["peak_flops"] else None,
            "peak_memory_gib": round((torch.cuda.max_memory_allocated() if cuda else 0) / gpu.GIB, 3),
            "peak_reserved_gib": round((torch.cuda.max_memory_reserved() if cuda else 0) / gpu.GIB, 3),
            "memory_device": "cuda" if cuda else "cpu (no device memory measured)",
            **self.extra,
        }
        Path(self.spec["result_path"]).write_text(json.dumps(figures))
        os._exit(0)  # skip export and final saves: the row's figures are written


def _shape(model_dir: str) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    n = gpu.flop_params(hidden, config["intermediate_size"], config["num_hidden_layers"], heads,
                        config["num_key_value_heads"], config["vocab_size"], head_dim)
    return {"n": n, "layers": config["num_hidden_layers"], "width": heads * head_dim}


def batch_work(batch: dict, pad_id: int | None) -> tuple[int, int]:
    """(real tokens, attention pairs) of a packed SFT batch: segments from the position ids; a padded batch
    without them (attention mask only) counts each row as one causal segment."""
    ids = batch["input_ids"].tolist()
    if "position_ids" in batch:
        lengths = [s for row, pos in zip(ids, batch["position_ids"].tolist(), strict=True)
                   for s in gpu.segments_from_positions(pos, row, pad_id)]
    else:
        lengths = [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]
    return sum(lengths), gpu.causal_segment_pairs(lengths)


# ----------------------------------------------------------------------------- posttrain


def posttrain_config(spec: dict) -> dict:
    train = {
        "batch_size": spec["batch_size"], "global_batch_size": spec["global_batch"], "max_length": spec["max_length"],
        "max_steps": spec["warmup"] + spec["steps"] + 1, "lr": 1e-5, "lr_schedule": "constant", "warmup_steps": 0,
        "precision": "bf16", "activation_checkpointing": spec["ac"], "compile": spec["compile"],
        "activation_offload": spec["activation_offload"], "seed": 0,
    }
    if spec["cpu_offload"]:
        train.update(cpu_offload=True, fsdp="on")
    model = {"path": spec["model"], "dtype": spec["dtype"]}
    if spec["attn"]:
        model["attn_implementation"] = spec["attn"]
    if spec["liger"]:
        model["liger"] = True
    config = {"recipe": spec["recipe"], "output_dir": spec["out_dir"], "model": model, "train": train,
              "metrics": {"tensorboard": False}, "health": {"enabled": False}}
    if spec["recipe"] == "sft":
        config["data"] = {"train": spec["data"], "packing": True, "curriculum": "none", "shuffle": False}
    else:
        config["data"] = {"train": spec["data"], "shuffle": False}
        # A throughput row trains once over just enough synthetic pairs for its steps (a few in --smoke);
        # dpo.min_pairs guards the quality of real runs, not what a measurement needs.
        config["dpo"] = {"reference_cache_dir": str(Path(spec["out_dir"]) / "ref_cache"),
                         "reference_batch_size": spec["batch_size"], "min_pairs": 1}
    return config


def _check_config(config: dict):
    """The recipe's typed config, or the reason it rejects this row (model.liger / varlen not in this posttrain yet)."""
    from posttrain.config.loader import ConfigError, load_config
    from posttrain.config.registry import RECIPES, load_builtin_recipes

    load_builtin_recipes()
    try:
        return load_config(RECIPES[config["recipe"]].schema, data=config), None
    except ConfigError as exc:
        return None, f"posttrain's config rejects this row: {exc}"


def run_posttrain(spec: dict) -> dict | None:
    """``posttrain sft|dpo`` on the row's config, every collated micro-batch counted, the loop's step ends timed."""
    import torch
    import yaml

    from posttrain.cli import main as cli_main
    from posttrain.train import metrics

    config = {**posttrain_config(spec)}
    validated, reason = _check_config(config)
    if validated is None:
        return {"status": "skipped", "reason": reason}
    if spec["liger"]:  # the run would stop at setup with this one line (no package, no CUDA): say it, skipped
        from posttrain.models.liger import LigerSetupError, check_liger

        try:
            check_liger(validated.model.path, validated.model.trust_remote_code, validated.train.recompute_mlp,
                        torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        except LigerSetupError as exc:
            return {"status": "skipped", "reason": str(exc)}
    if spec["cpu_offload"]:  # FSDP2 on one rank needs a process group: a 1-process torchrun's environment
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    from posttrain.models.load import load_tokenizer

    pad = load_tokenizer(spec["model"]).pad_token_id
    shape, clock = _shape(spec["model"]), StepClock(spec)
    clock.extra.update(resolved_attn_implementation=validated.model.attn_implementation, flop_params=shape["n"])
    pending: list[tuple[int, int, int]] = []  # (tokens the loop counts, tokens reported, attention pairs)
    counting = {"on": True}

    if spec["recipe"] == "sft":
        import posttrain.train.sft as module

        original = module.collate_packed

        def collate(rows):
            batch = original(rows)
            if counting["on"]:
                tokens, pairs = batch_work(batch, pad)
                pending.append((tokens, tokens, pairs))
            return batch

        module.collate_packed = collate
    else:
        import posttrain.train.dpo as module

        original, reference = module.collate_pairs, module.reference_logps

        def collate(pairs_in, pad_id, prefix_sharing):
            batch = original(pairs_in, pad_id, prefix_sharing)
            if counting["on"]:
                computed = sum(p.row_tokens(prefix_sharing) for p in pairs_in)
                both = sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in pairs_in)
                if prefix_sharing:
                    att = sum(gpu.prefix_shared_pairs(p.shared, len(p.chosen.input_ids) - p.shared,
                                                      len(p.rejected.input_ids) - p.shared) for p in pairs_in)
                else:
                    att = gpu.causal_segment_pairs([len(p.chosen.input_ids) for p in pairs_in]
                                                   + [len(p.rejected.input_ids) for p in pairs_in])
                pending.append((computed, both, att))
            return batch

        def timed_reference(*a, **k):  # the real pass, timed; its collates are not training work
            counting["on"], start = False, time.perf_counter()
            try:
                return reference(*a, **k)
            finally:
                counting["on"] = True
                clock.extra["reference_pass_s"] = round(time.perf_counter() - start, 2)

        module.collate_pairs, module.reference_logps = collate, timed_reference

    original_init, original_log = metrics.MetricsSink.__init__, metrics.MetricsSink.log

    def init(self, *a, **k):
        original_init(self, *a, **k)
        clock.ends = [time.perf_counter()]

    def log(self, record, advance=True, **kwargs):
        original_log(self, record, advance, **kwargs)
        if advance and "step_time_s" in record:
            step_tokens = round(record["tokens_per_s"] * record["step_time_s"])
            reported = att = taken = 0
            while pending and taken < step_tokens:  # the micro-batches of this step, in collate order
                computed, both, pairs = pending.pop(0)
                taken, reported, att = taken + computed, reported + both, att + pairs
            clock.extra["token_match"] = clock.extra.get("token_match", True) and taken == step_tokens
            clock.step_done(reported, gpu.step_flops(shape["n"], shape["layers"], shape["width"], taken, att))

    metrics.MetricsSink.__init__, metrics.MetricsSink.log = init, log
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.yaml").write_text(yaml.safe_dump(config))
    code = cli_main([spec["recipe"], "--config", str(out / "bench.yaml")])
    return {"status": "failed", "reason": f"posttrain {spec['recipe']} exited with {code} before the last timed step"}


# ----------------------------------------------------------------------------- TRL


def _trl_args(spec: dict) -> dict:
    import torch
    from _harness import trl_trainer_args

    cuda = torch.cuda.is_available()
    args = trl_trainer_args({"warmup_steps": spec["warmup"], "steps": spec["steps"] + 1, "lr": 1e-5})
    args.update(bf16=True, use_cpu=not cuda, optim="adamw_torch_fused" if cuda else "adamw_torch",
                gradient_checkpointing=spec["ac"] != "none", per_device_train_batch_size=spec["batch_size"],
                gradient_accumulation_steps=spec["global_batch"] // spec["batch_size"], use_liger_kernel=spec["liger"])
    if spec["ac"] != "none":
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    return args


def _trl_callback(clock: StepClock, work: list):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.ends = [time.perf_counter()]

        def on_step_end(self, *a, **k):
            tokens, flops = work.pop(0) if work else (0, 0.0)
            clock.step_done(tokens, flops)

    return Clock()


def run_trl(spec: dict) -> dict | None:
    """TRL's trainer on the same model, data, batch, precision (bf16 autocast over fp32 weights) and AC."""
    try:
        import trl  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - "where TRL installs": the row says why it did not run
        return {"status": "skipped", "reason": f"trl does not import: {type(exc).__name__}: {exc}"}
    import torch
    from transformers import AutoModelForCausalLM

    shape, clock = _shape(spec["model"]), StepClock(spec)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    accumulation = spec["global_batch"] // spec["batch_size"]
    work: list = []
    if spec["recipe"] == "sft":
        from datasets import Dataset
        from sft_throughput import tokenized_chats
        from trl import SFTConfig, SFTTrainer

        examples, tokenizer = tokenized_chats(spec["model"], spec["data"], spec["max_length"])
        dataset = Dataset.from_dict({"input_ids": [e.input_ids for e in examples], "labels": [e.labels for e in examples]})
        config = SFTConfig(output_dir=spec["out_dir"], packing=True, max_length=spec["max_length"], **_trl_args(spec))
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[_trl_callback(clock, work)])
        collate, micro = trainer.data_collator, []

        def counting(features):
            batch = collate(features)
            micro.append(batch_work(batch, tokenizer.pad_token_id))
            if len(micro) == accumulation:  # one optimizer step's micro-batches (no workers, no eval)
                t, p = sum(m[0] for m in micro), sum(m[1] for m in micro)
                work.append((t, gpu.step_flops(shape["n"], shape["layers"], shape["width"], t, p)))
                micro.clear()
            return batch

        trainer.data_collator = counting
    else:
        from datasets import load_dataset
        from transformers import AutoTokenizer
        from trl import DPOConfig, DPOTrainer

        tokenizer = AutoTokenizer.from_pretrained(spec["model"])
        dataset = load_dataset("json", data_files=spec["data"], split="train").remove_columns(["rationale"])
        config = DPOConfig(output_dir=spec["out_dir"], max_length=spec["max_length"], precompute_ref_log_probs=True,
                           precompute_ref_batch_size=spec["batch_size"], **_trl_args(spec))
        trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[_trl_callback(clock, work)])
        # TRL runs prompt+chosen and prompt+rejected as two sequences: tokens and pairs per pair from its own data.
        rows = trainer.train_dataset
        lengths = [(len(r["prompt_ids"]) + len(r["chosen_ids"]), len(r["prompt_ids"]) + len(r["rejected_ids"])) for r in rows]
        tokens = statistics.fmean(a + b for a, b in lengths) * spec["global_batch"]
        pairs = statistics.fmean(gpu.causal_segment_pairs([a, b]) for a, b in lengths) * spec["global_batch"]
        work.extend([(tokens, gpu.step_flops(shape["n"], shape["layers"], shape["width"], tokens, pairs))]
                    * (spec["warmup"] + spec["steps"] + 1))
        clock.extra["work_per_step"] = "mean over the data set (TRL's batches are not counted one by one)"
    trainer.train()
    return {"status": "failed", "reason": "TRL's trainer stopped before the last timed step"}


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if spec["kind"] == "peak":
        result = measure_peak(spec)
    elif spec["framework"] == "trl":
        result = run_trl(spec)
    else:
        result = run_posttrain(spec)
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0
