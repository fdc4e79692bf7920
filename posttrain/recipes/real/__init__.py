"""Recipes for real small hub models (Qwen3-0.6B, Llama-3.2-1B), each with the figure another framework published
for the same setup (docs/recipes_real.md), and ``gsm8k``, the one data set among them posttrain cannot read as the
hub ships it. Run a recipe by name: ``posttrain sft --config real/qwen3_0.6b_sft``."""
