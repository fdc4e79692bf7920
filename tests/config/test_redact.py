"""What leaves the machine for W&B and MLflow: secret fields and URL passwords masked, everything else as is."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import BaseModel

from posttrain.config import load_config
from posttrain.config.recipes import SFTRecipe
from posttrain.config.redact import REDACTED, is_secret, mask_url_password, public_dump
from posttrain.config.registry import RECIPES, load_builtin_recipes

GOOD = {"recipe": "sft", "output_dir": "runs/x", "model": {"path": "m"}, "data": {"train": "train.jsonl"},
        "train": {"lr": 1e-4, "batch_size": 4}}
WEBHOOK = "https://hooks.slack.com/services/T000/B000/s3cr3tT0ken"
TRACKING = "https://bob:hunter2@mlflow.example.com:5000/"


def test_the_webhook_and_a_url_password_are_masked_and_nothing_else_changes():
    config = load_config(SFTRecipe, data={**GOOD, "alerts": {"webhook": WEBHOOK},
                                          "metrics": {"mlflow": {"tracking_uri": TRACKING, "experiment": "e"}}})
    public, full = public_dump(config), config.model_dump(mode="json")
    text = json.dumps(public)
    assert "s3cr3tT0ken" not in text and "hunter2" not in text
    assert public["alerts"]["webhook"] == REDACTED
    assert public["metrics"]["mlflow"]["tracking_uri"] == f"https://bob:{REDACTED}@mlflow.example.com:5000/"
    for dump in (public, full):
        del dump["alerts"]["webhook"], dump["metrics"]["mlflow"]["tracking_uri"]
    assert public == full
    assert config.alerts.webhook == WEBHOOK  # the run itself still posts to the real URL


def test_an_unset_secret_stays_null():
    assert public_dump(load_config(SFTRecipe, data=GOOD))["alerts"]["webhook"] is None


@pytest.mark.parametrize("text", ["s3://bucket/prefix", "https://bob@host/x", "runs/x@2", "git@github.com:a/b",
                                  "http://[::1", "plain text with an @ sign", ""])
def test_text_without_a_url_password_is_unchanged(text):
    assert mask_url_password(text) == text


def test_a_password_with_an_at_sign_is_masked_whole():
    assert mask_url_password("postgresql://u:p@ss@db:5432/x") == f"postgresql://u:{REDACTED}@db:5432/x"


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _fields(arg, f"{prefix}{name}.")


def test_every_field_named_like_a_credential_is_marked_secret():
    """A guard for fields added later: a webhook, password, secret or API key must carry the SECRET mark."""
    load_builtin_recipes()
    words = {"webhook", "password", "secret", "apikey", "credentials"}
    names = {"api_key", "auth_token", "access_token", "hf_token"}
    found = {}
    for spec in RECIPES.values():
        for path, field in _fields(spec.schema):
            name = path.rsplit(".", 1)[-1].lower()
            if words & set(name.split("_")) or name in names:
                found[f"{spec.name}:{path}"] = is_secret(field)
    assert found and all(found.values()), found  # alerts.webhook at least, in every recipe
