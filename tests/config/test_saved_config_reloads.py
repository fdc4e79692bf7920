"""The resolved config a run saves (``dump_config``: every default written out, ``config.yaml`` in its output
directory) loads again as the same config — for every packaged recipe, and for the modes whose mode-only keys
are refused when *changed* (a saved GRPO config holds the verifier term's default ``batch_size`` and the hf
engine's default ``overlap``; both used to stop the reload)."""

from __future__ import annotations

import pytest
import yaml

from posttrain.config.loader import ConfigError, dump_config, load_config
from posttrain.flywheel.overrides import recipe_schema
from posttrain.recipes import packaged_recipes

RECIPES = packaged_recipes()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_saved_config_loads_again_as_itself(name, tmp_path):
    kind = yaml.safe_load(RECIPES[name].read_text())["recipe"]
    schema = recipe_schema(kind)
    config = load_config(schema, str(RECIPES[name]), [])
    dump_config(config, tmp_path / "config.yaml")
    again = load_config(schema, str(tmp_path / "config.yaml"), [])
    assert again.model_dump(mode="json") == config.model_dump(mode="json")


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.overlap=false", "rollout.overlap is for rollout.engine=vllm"),
    ("rollout.sync_method=broadcast", "rollout.sync_method is for rollout.engine=vllm"),
])
def test_a_mode_only_key_changed_from_its_default_is_still_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(recipe_schema("grpo"), str(RECIPES["grpo_tiny"]), [override])
