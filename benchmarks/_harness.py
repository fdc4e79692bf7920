"""What the framework-vs-framework benchmarks share: the tiny model, one process per run, turn-taking.

Each run is its own child process (so its peak RSS, ``ru_maxrss`` from ``os.wait4``, is its own,
imports included), started by re-running the benchmark script with ``--child FRAMEWORK --spec FILE``.
The parent drives every live child one optimizer step at a time through two pipes (``StepGate`` in
the child, ``Child`` / ``drive`` here), so other jobs on a shared machine slow all runs alike; a
step's time runs from the parent's "go" to the child's report at the end of its optimizer step.

Scripts import this module as ``_harness`` (it sits beside them; ``python benchmarks/x.py`` puts
``benchmarks/`` on ``sys.path``, tests and ``revisions.py`` add it).
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# ----------------------------------------------------------------------------- inputs


def build_bench_model(model_dir: Path, texts: Iterable[str], seed: int = 0) -> Path:
    """The benchmarks' ~5M-parameter Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 688, vocab 4096).

    Its BPE tokenizer is trained on ``texts`` plus a pretraining corpus and number runs: the task
    texts alone stop near 3.2k merges, the number runs fill the 4096-token vocabulary.
    """
    from posttrain.models.tiny import build_tiny_model
    from posttrain.tasks.corpus import pretrain_corpus

    corpus = list(texts) + pretrain_corpus(2000, seed)
    corpus += [" ".join(str(i) for i in range(start, start + 100)) for start in range(0, 10000, 100)]
    return build_tiny_model(
        model_dir, texts=corpus, vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4,
        num_kv_heads=2, intermediate_size=688, max_position_embeddings=2048, seed=seed,
    )


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]


def synthetic_words(n: int, seed: int) -> list[str]:
    """``n`` distinct made-up words of 1-3 syllables (sorted), the vocabulary of the synthetic texts below."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    return sorted(words)


class SyntheticText:
    """Seeded word salad of a given length: only the token counts matter to a throughput benchmark."""

    def __init__(self, seed: int, vocabulary: int = 3000):
        self.words, self.rng = synthetic_words(vocabulary, seed), random.Random(seed)

    def __call__(self, n_words: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(n_words))

    def corpus(self, n_texts: int, words: int = 60) -> list[str]:
        """Texts to train the tokenizer on."""
        return [self(words) + "." for _ in range(n_texts)]


def write_synthetic_pairs(path: Path, text: SyntheticText, pairs: int, prompt_words: int | tuple[int, int],
                          response_words: int | tuple[int, int]) -> Path:
    """Conversational preference pairs; a ``(low, high)`` length is drawn uniformly per pair."""

    def draw(n: int | tuple[int, int]) -> int:
        return n if isinstance(n, int) else text.rng.randint(*n)

    with open(path, "w") as handle:
        for _ in range(pairs):
            handle.write(json.dumps({
                "prompt": [{"role": "user", "content": text(draw(prompt_words)) + "?"}],
                "chosen": [{"role": "assistant", "content": text(draw(response_words)) + "."}],
                "rejected": [{"role": "assistant", "content": text(draw(response_words)) + "."}],
                "rationale": "synthetic benchmark pair",
            }) + "\n")
    return path


def write_synthetic_chats(path: Path, text: SyntheticText, chats: int, user_words: tuple[int, int],
                          assistant_words: tuple[int, int]) -> Path:
    """Single-turn SFT chats (``messages``) whose lengths are drawn uniformly per chat."""
    with open(path, "w") as handle:
        for i in range(chats):
            handle.write(json.dumps({"id": f"chat-{i:06d}", "messages": [
                {"role": "user", "content": text(text.rng.randint(*user_words)) + "?"},
                {"role": "assistant", "content": text(text.rng.randint(*assistant_words)) + "."},
            ]}) + "\n")
    return path


def bench_inputs(args, build: Callable[[Path], tuple[Path, Path]]) -> tuple[Path, Path, Path]:
    """``(work_dir, model_dir, data_path)``: ``--model`` and ``--data`` when given (both or neither), else what
    ``build(work_dir)`` builds (and caches) under ``--work-dir``."""
    if bool(args.model) != bool(args.data):
        raise SystemExit("give both --model and --data, or neither (then both are built under --work-dir)")
    work_dir = Path(args.work_dir).resolve()
    if args.model:
        return work_dir, Path(args.model).resolve(), Path(args.data).resolve()
    return work_dir, *build(work_dir)


def count_model_parameters(model_dir: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # counting needs shapes, not weights
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


# ----------------------------------------------------------------------------- children


def _stamp() -> tuple[float, float]:
    """(wall clock, CPU seconds of this process)."""
    return time.perf_counter(), time.process_time()


class StepGate:
    """Child side of the turn-taking: report, then block until the parent says "go" (see ``drive``)."""

    def __init__(self, go_fd: int, done_fd: int):
        self.go_fd, self.done_fd = go_fd, done_fd
        self.spans: list[tuple[tuple[float, float], tuple[float, float]]] = []
        self._start = _stamp()

    def _report_and_wait(self, message: bytes) -> None:
        os.write(self.done_fd, message)
        if os.read(self.go_fd, 1) != b"g":
            raise RuntimeError("the benchmark driver went away")
        self._start = _stamp()

    def ready(self) -> None:
        self._report_and_wait(b"r")

    def step_done(self) -> None:
        self.spans.append((self._start, _stamp()))
        self._report_and_wait(b"d")

    def wall_times(self) -> list[float]:
        return [end[0] - start[0] for start, end in self.spans]

    def cpu_times(self) -> list[float]:
        return [end[1] - start[1] for start, end in self.spans]


def child_main(spec_path: str, runners: dict[str, Callable[[dict], dict]], framework: str) -> int:
    """Child entry point: read the spec, run ``runners[framework](spec)``, write its figures where the parent reads them."""
    spec = json.loads(Path(spec_path).read_text())
    figures = runners[framework](spec)
    Path(spec["result_path"]).write_text(json.dumps(figures))
    return 0


# ----------------------------------------------------------------------------- parent


class Child:
    """One framework run in its own process (``script --child FRAMEWORK --spec FILE``), driven step by step."""

    def __init__(self, script: str | Path, framework: str, spec: dict, work_dir: Path, tag: str,
                 describe: Callable[[dict], str] | None = None, env: dict[str, str] | None = None,
                 sample_tree_rss: bool = False):
        self.framework, self.tag, self.describe = framework, tag, describe
        self.bench = Path(script).stem
        self.run_dir = work_dir / "runs" / tag
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        go_read, self.go_write = os.pipe()
        self.done_read, done_write = os.pipe()
        spec = {
            **spec,
            "out_dir": str(self.run_dir / "out"),
            "result_path": str(self.run_dir / "result.json"),
            "gate_fds": [go_read, done_write],
        }
        spec_path = self.run_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        threads = str(spec["threads"])
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1", **(env or {})}
        self.log = open(self.run_dir / "child.log", "w")  # noqa: SIM115 - closed in finish()
        self.process = subprocess.Popen(
            [sys.executable, str(script), "--child", framework, "--spec", str(spec_path)],
            stdout=self.log, stderr=self.log, env=env, pass_fds=(go_read, done_write),
        )
        os.close(go_read)
        os.close(done_write)  # so that a dead child reads as end-of-file here
        self.tree_rss = TreeRSS(self.process.pid) if sample_tree_rss else None

    def expect(self, message: bytes) -> None:
        got = os.read(self.done_read, 1)
        if got != message:
            self.process.wait()
            raise RuntimeError(
                f"{self.tag} stopped (exit code {self.process.returncode}); log {self.run_dir / 'child.log'}:\n"
                + (self.run_dir / "child.log").read_text()[-3000:]
            )

    def go(self) -> None:
        os.write(self.go_write, b"g")

    def finish(self) -> dict:
        """Wait for the process; return its figures plus its own peak RSS (``ru_maxrss`` from ``wait4``)."""
        _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.log.close()
        os.close(self.go_write)
        os.close(self.done_read)
        if self.process.returncode != 0:
            tail = (self.run_dir / "child.log").read_text()[-3000:]
            raise RuntimeError(f"{self.tag} failed with exit code {self.process.returncode}:\n{tail}")
        figures = json.loads((self.run_dir / "result.json").read_text())
        figures["peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux reports KiB
        if self.tree_rss is not None:
            figures["tree_peak_rss_mb"] = self.tree_rss.stop()
        detail = self.describe(figures) if self.describe else f"median step {figures['median_step_s']:.3f}s"
        print(f"[{self.bench}] {self.tag}: {detail}, peak RSS {figures['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
        return figures


class TreeRSS:
    """Peak of the summed RSS of a process and all its descendants (e.g. reward worker pools), sampled.

    ``ru_maxrss`` is one process's own peak: helper processes a run starts are not in it. A thread
    polls the tree every ``interval_s`` (so a peak shorter than that can be missed; the figure is a
    lower bound) until ``stop()``, which returns the peak in MB.
    """

    def __init__(self, pid: int, interval_s: float = 0.05):
        import psutil

        self._root, self._interval, self.peak_bytes = psutil.Process(pid), interval_s, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        while not self._done.is_set():
            total = 0
            try:
                for process in [self._root, *self._root.children(recursive=True)]:
                    try:
                        total += process.memory_info().rss
                    except psutil.Error:  # a helper that just exited
                        pass
            except psutil.Error:  # the run itself has exited
                return
            self.peak_bytes = max(self.peak_bytes, total)
            self._done.wait(self._interval)

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak_bytes / 2**20


def drive(children: list[Child], total_steps: int) -> list[dict]:
    """Let every child set up, then run one optimizer step in each in turn; return their figures."""
    try:
        for child in children:
            child.expect(b"r")
        for step in range(total_steps):
            for child in children if step % 2 == 0 else children[::-1]:
                child.go()
                child.expect(b"d")
        for child in children:
            child.go()  # past the last step: let each finish (export, exit) on its own
        return [child.finish() for child in children]
    finally:
        for child in children:
            if child.process.returncode is None and child.process.poll() is None:
                child.process.kill()


def paired_speed_ratio(ours: list[dict], theirs: list[dict], work_key: str) -> float:
    """Median over interleaved rounds of (our work/s in the round) / (their work/s in the same round).

    Each run's figures hold ``step_times_s`` and, under ``work_key``, the work each timed step did.
    Step ``i`` of every run is taken within the same few seconds, so each round's ratio compares the
    two under the same machine load; the median over rounds keeps a disturbed round from deciding.
    """
    ratios = [
        (o_work / o_time) / (t_work / t_time)
        for o_run, t_run in zip(ours, theirs, strict=True)
        for o_work, o_time, t_work, t_time in zip(
            o_run[work_key], o_run["step_times_s"], t_run[work_key], t_run["step_times_s"], strict=True
        )
    ]
    return round(statistics.median(ratios), 3)


def machine(threads: int, load_at_start: float) -> dict:
    import torch
    import transformers
    import trl

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), platform.processor())
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": threads,
        # Other jobs on the same cores slow every run; the load average says how busy the machine was.
        "load_avg_1m_start_end": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
    }


def trl_trainer_args(spec: dict) -> dict:
    """The ``TrainingArguments`` both TRL baselines share: constant lr, AdamW, clip 1.0, fp32 on CPU, no
    gradient checkpointing (TRL's configs default to it and to bf16; posttrain's baselines use neither),
    no saving, a log line per step."""
    return {
        "max_steps": spec["warmup_steps"] + spec["steps"], "learning_rate": spec["lr"],
        "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0, "adam_beta1": 0.9,
        "adam_beta2": 0.999, "max_grad_norm": 1.0, "optim": "adamw_torch", "gradient_checkpointing": False,
        "bf16": False, "use_cpu": True, "report_to": "none", "save_strategy": "no", "logging_steps": 1,
        "dataloader_num_workers": 0, "seed": 0, "disable_tqdm": True,
    }


def gated_callback(gate: StepGate):
    """A TRL ``TrainerCallback`` that takes turns through ``gate``: ready at train start, done at each step end."""
    from transformers import TrainerCallback

    class Gated(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ARG002 - Trainer callback signature
            gate.ready()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ARG002 - Trainer callback signature
            gate.step_done()

    return Gated()


def gate_posttrain_loop(gate: StepGate) -> None:
    """Make posttrain's loop take turns through ``gate``: ready when it builds its MetricsSink (right before
    the first step), done each time it logs a step (at the step's end)."""
    from posttrain.train import metrics

    original_init, original_log = metrics.MetricsSink.__init__, metrics.MetricsSink.log

    def gated_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        gate.ready()

    def gated_log(self, record, advance=True, **kwargs):
        original_log(self, record, advance, **kwargs)
        if advance:
            gate.step_done()

    metrics.MetricsSink.__init__, metrics.MetricsSink.log = gated_init, gated_log

