"""Credential-looking values hidden before a config is logged or dumped (the package's one redaction: the
metrics logger applies it again to what it writes, config.json and W&B)."""

from __future__ import annotations

import copy
import re
from typing import Any

from ml_collections import ConfigDict

REDACTED = "***redacted***"


def to_dict(cfg: Any) -> dict:
    """A plain nested dict copy of a ConfigDict or dict."""
    return cfg.to_dict() if isinstance(cfg, ConfigDict) else copy.deepcopy(dict(cfg))


def _is_secret_key(key: str) -> bool:
    """api_key / apikey / secret / password anywhere in the name, or `token` as its last word (not tokenizer);
    camelCase names count as snake_case (authToken = auth_token)."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(key)).lower().replace("-", "_").split("_")
    joined = "_".join(words)
    return ("api_key" in joined or "apikey" in words or "secret" in joined or "password" in joined
            or "passwd" in words or words[-1] == "token")


# Values shaped like real credentials (OpenAI / HF / GitHub / Slack / AWS) are hidden under any key.
_SECRET_VALUE = re.compile(r"^(sk-|hf_|ghp_|gho_|github_pat_|xox[abp]-|AKIA)[A-Za-z0-9_\-]{16,}$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def _redact_value(key: str, value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _redact_value(k, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redact_value(key, v) for v in value)
    if not isinstance(value, str) or not value:
        return value
    if _SECRET_VALUE.match(value):
        return REDACTED
    if _is_secret_key(key):
        # Names of environment variables (api_key_env = "BRIGHTDATA_API_KEY") are not secrets; anything else is.
        is_env_name = key.lower().endswith("_env") and _ENV_NAME.match(value)
        return value if is_env_name else REDACTED
    return value


def redact(cfg: ConfigDict | dict) -> dict:
    """A plain nested dict of the config for dumps and logs, with credential-looking values replaced.

    The package's one redaction: the metrics logger applies it again to what it writes (config.json, W&B)."""
    return {k: _redact_value(k, v) for k, v in to_dict(cfg).items()}

