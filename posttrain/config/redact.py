"""What a run's config looks like to a third party: secrets out.

The resolved config goes to W&B (the run config) and MLflow (params), services often shared with a whole
team or hosted outside the cluster. A field whose value is a credential is marked in its schema with
``json_schema_extra=SECRET`` and is sent as ``REDACTED``; a password inside any URL's userinfo
(``https://user:password@host``) is masked wherever it appears. The run's own ``config.yaml`` keeps the
real values: it lives beside the checkpoints it resumes."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel

SECRET = {"secret": True}
REDACTED = "<redacted>"


def is_secret(field) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("secret") is True


def mask_url_password(text: str) -> str:
    """``scheme://user:password@host/…`` with the password replaced; anything else unchanged."""
    if "@" not in text or "://" not in text:
        return text
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:  # not a URL after all (e.g. an unclosed IPv6 bracket)
        return text
    if not password:
        return text
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))


def _public(value: Any, dumped: Any) -> Any:
    """``dumped`` (the JSON dump of ``value``) with secret fields and URL passwords masked, walking both."""
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        return {key: (REDACTED if key in fields and is_secret(fields[key]) and item is not None
                      else _public(getattr(value, key, None), item))
                for key, item in dumped.items()}
    if isinstance(dumped, dict):
        inner = value if isinstance(value, dict) else {}
        return {key: _public(inner.get(key), item) for key, item in dumped.items()}
    if isinstance(dumped, list):
        inner = value if isinstance(value, (list, tuple)) and len(value) == len(dumped) else [None] * len(dumped)
        return [_public(v, item) for v, item in zip(inner, dumped, strict=True)]
    if isinstance(dumped, str):
        return mask_url_password(dumped)
    return dumped


def public_dump(config: BaseModel) -> dict[str, Any]:
    """``config.model_dump(mode="json")`` fit to leave the machine: secret fields and URL passwords masked."""
    return _public(config, config.model_dump(mode="json"))
